"""A request's way in and out of the scheduler: admitted, aborted, ended.

Four verbs, one meaning each:

- ``admit``: a tokenized request passes the checks and joins its model's queue;
- ``refuse``: a request the scheduler does not track (never admitted, or
  already gone) gets a ``RequestError``;
- ``end``: a tracked request leaves, wherever it is (waiting, running,
  loading from disk); its KV goes into the tree when it ended well, is freed
  when it failed; a failure returns the error output, so a batch's outputs
  still go to the detokenizer in one ``TokenBatch``;
- ``fail``: end each of a list of request ids with an error, answered now.

``abort`` is the client's cancel: a request whose slots a batch or a disk
load is writing is marked and ended when that write is done.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, overload

import numpy as np

from radixmux import protocol
from radixmux.scheduler.models import ModelState
from radixmux.scheduler.outputs import request_output
from radixmux.scheduler.request import Req

if TYPE_CHECKING:
    from radixmux.scheduler.scheduler import Scheduler

log = logging.getLogger("radixmux.scheduler")

# An abort that arrives before its request (still being tokenized) is kept this
# long, and at most this many, waiting for the request to show up.
EARLY_ABORT_TTL_S = 600.0
EARLY_ABORT_MAX = 100_000


def admit(sched: Scheduler, msg: protocol.TokenizedRequest) -> None:
    """Queue a request for its model, or refuse it with the reason."""
    if sched.early_aborts.pop(msg.rid, None) is not None:
        sched.aborted_before_arrival += 1
        log.info("rid=%s dropped: aborted before it reached the scheduler", msg.rid)
        return
    ids = protocol.unpack_ids(msg.input_ids).astype(np.int32)
    refusal = _refusal(sched, msg, len(ids))
    if refusal is not None:
        refuse(sched, msg.rid, *refusal)
        return
    req = Req(msg.rid, msg.model, ids, msg.params, msg.stop, msg.skip_special_tokens, msg.arrival)
    sched.requests[req.rid] = req
    sched.models[msg.model].waiting.append(req)
    log.info("rid=%s queued for %s: %d prompt tokens", req.rid, msg.model, len(ids))


def _refusal(
    sched: Scheduler, msg: protocol.TokenizedRequest, prompt: int
) -> tuple[int, str, str | None] | None:
    """Why a request cannot be queued (status, message, parameter), or None."""
    if msg.rid in sched.requests:
        return 400, "a request with this id is already running", "rid"
    model = sched.models.get(msg.model)
    if model is None or msg.model in sched.removing:
        return 404, f"model {msg.model!r} is not served", "model"
    if not model.up:
        why = "restarting" if model.state == "restarting" else "down"
        return 503, f"model {msg.model!r} is {why}: {model.down_reason}", None
    if len(model.waiting) >= sched.args.max_queued_requests:
        return 429, f"model {msg.model!r} has {len(model.waiting)} requests queued", None
    if prompt == 0:
        return 400, "empty prompt", "prompt"
    need = prompt + msg.params.max_new_tokens
    capacity = sched.kv.capacity_slots(model.name)
    if need > capacity:
        return (
            400,
            f"prompt ({prompt}) + max_tokens ({msg.params.max_new_tokens}) needs {need} "
            f"tokens of KV; the arena holds at most {capacity} for {msg.model!r}",
            "max_tokens",
        )
    return None


def refuse(sched: Scheduler, rid: str, status: int, message: str, param: str | None = None) -> None:
    """Answer a request the scheduler does not track with an error."""
    log.info("rid=%s rejected %d: %s", rid, status, message)
    if rid in sched.warmups:  # the front knows the warm-up, not its prefixes' rids
        sched.reply_warmup(sched.warmups.failed(rid, status, message, param))
        return
    sched.outbox.to_front(protocol.RequestError(rid, status, message, param))


@overload
def end(sched: Scheduler, req: Req, error: None = None, status: int = 500) -> None: ...
@overload
def end(sched: Scheduler, req: Req, error: str, status: int = 500) -> protocol.RequestOutput: ...
def end(
    sched: Scheduler, req: Req, error: str | None = None, status: int = 500
) -> protocol.RequestOutput | None:
    """Take a tracked request out wherever it is. Without ``error`` it ended
    well (finished, or aborted after a batch): what it computed goes into the
    tree. With one, its KV is freed and the error output is returned."""
    model = sched.models[req.model]
    if req in model.waiting:
        model.waiting.remove(req)
    if sched.disk is not None and sched.disk.is_loading(req):
        # The load still writes its slots; they go into the tree when it
        # ends, and the request is not queued again.
        req.aborted = "failed" if error is not None else req.aborted or "ended"
    elif req.runner is not None or req.handle is not None or len(req.slots):
        if req.runner is not None:
            runner = sched.runners[req.runner]
            if req in runner.running:
                runner.running.remove(req)
        sched.kv.release(req, keep=error is None)
    sched.requests.pop(req.rid, None)
    if error is None:
        if req.aborted is not None and req.announced:
            # Given up after outputs reached the detokenizer: a final output
            # ends its state there (held otherwise for the server's life,
            # with its model's tokenizer; the front drops this late output).
            sched.send_outputs([request_output(req, [], "abort")])
        return None
    return request_output(req, [], "error", error=error, status=status)


def fail(sched: Scheduler, rids: list[str], status: int, message: str) -> None:
    """End each request with an error, answered now; an untracked one is refused."""
    outputs = []
    for rid in rids:
        req = sched.requests.get(rid)
        try:
            if req is None:
                refuse(sched, rid, status, message)
                continue
            outputs.append(end(sched, req, message, status))
        except Exception:  # state too broken to release cleanly: at least answer
            log.exception("rid=%s could not be released cleanly", rid)
            sched.requests.pop(rid, None)
            refuse(sched, rid, status, message)
    sched.send_outputs(outputs)


def fail_unserved(sched: Scheduler, model: ModelState) -> None:
    """A model with no live runner keeps no request: while it restarts (or
    once the launcher gave up) every request of it, wherever it is
    (waiting, loading from disk, on a lost runner, in a held batch), fails
    now with a 503; new ones are refused at ``admit``. A load still
    writing a failed request's slots frees them when it ends."""
    if model.up:
        return
    rids = [r.rid for r in sched.requests.values() if r.model == model.name]
    if not rids:
        return
    why = f"model {model.name!r} is {model.state}: {model.down_reason}"
    log.error("%s; %d requests failed", why, len(rids))
    fail(sched, rids, 503, why)


def abort(sched: Scheduler, rid: str, reason: str, early: bool = False) -> None:
    """The client gave up on ``rid``: end it now, or when the batch or disk
    load writing its slots is done. ``early``: it may still be in a
    tokenizer worker, so remember it and drop it on arrival."""
    req = sched.requests.get(rid)
    if req is None:
        if early:
            _remember_early_abort(sched, rid)
        return  # else already finished
    req.aborted = reason
    if sched.disk is not None and sched.disk.is_loading(req):
        return  # its slots are being filled: ended after the load
    if req.runner is not None:
        inflight = sched.runners[req.runner].inflight
        if inflight is not None and req in inflight.reqs:
            return  # its slots are being written: ended after the batch
    end(sched, req)
    log.info("rid=%s aborted: %s", rid, reason)


def _remember_early_abort(sched: Scheduler, rid: str) -> None:
    now = time.monotonic()
    aborts = sched.early_aborts
    while aborts and (len(aborts) >= EARLY_ABORT_MAX or next(iter(aborts.values())) < now):
        aborts.popitem(last=False)
    aborts[rid] = now + EARLY_ABORT_TTL_S
