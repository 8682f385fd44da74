"""The scheduler process: sole owner of the radix cache and the arena allocator.

One single-threaded loop, blocking in ``zmq.Poller.poll`` (no busy polling),
reacts to two kinds of events:

- inbox messages: tokenized requests, aborts, control operations, runner deaths
  reported by the launcher, shutdown;
- runner replies: ``Ready`` at start-up, then one ``ForwardResult`` per batch.

After each event every idle runner with work gets its next batch, so one slow
runner never holds the others up. Replicas of a model draw from one waiting
queue and share KV (same weights fingerprint, same cache entries).

Run as ``python -m radixmux.scheduler.scheduler '<ProcessContext JSON>'``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections import OrderedDict
from collections.abc import Iterator

import msgspec
import numpy as np
import zmq

from radixmux import protocol
from radixmux.common.cpu import cpu_cores
from radixmux.common.process import ProcessContext, report, run_process
from radixmux.common.server_args import ServerArgs
from radixmux.memory.arena import ArenaSpec
from radixmux.memory.radix_cache import ModelSpec
from radixmux.protocol import ModelArg
from radixmux.scheduler import bootstrap, control
from radixmux.scheduler.batch_builder import ScheduledBatch
from radixmux.scheduler.bootstrap import SchedulerSockets, Startup
from radixmux.scheduler.control import READ_ONLY_OPS, InvariantWalk
from radixmux.scheduler.models import (
    ModelState,
    PendingModel,
    StartupError,
    check_replicas,
    model_spec,
)
from radixmux.scheduler.outbox import Outbox
from radixmux.scheduler.request import Req
from radixmux.scheduler.results import (
    INTERNAL_ERROR,
    describe_step,
    keep_prompt_logprobs,
    request_output,
)
from radixmux.scheduler.runners import HeldBatch, RollCall, RunnerId, RunnerState, runner_ids
from radixmux.scheduler.warmup import WARMUP_PARAMS, Pins, Warmups

log = logging.getLogger("radixmux.scheduler")

# An abort that arrives before its request (still being tokenized) is kept this
# long, and at most this many, waiting for the request to show up.
EARLY_ABORT_TTL_S = 600.0
EARLY_ABORT_MAX = 100_000


class Scheduler:
    """The scheduling loop's state and its reactions to each event (built
    complete from a ``Startup``; every send goes through ``outbox``, so a
    test can drive it in-process with fake runner replies)."""

    def __init__(
        self, args: ServerArgs, arena: ArenaSpec, outbox: Outbox, startup: Startup
    ) -> None:
        self.args = args
        self.arena = arena
        self.outbox = outbox
        self.cache = startup.cache
        self.kv = startup.kv
        self.builder = startup.builder
        self.disk = startup.disk
        self.inbox_decoder = protocol.decoder(protocol.SchedulerInbox)
        self.runner_decoder = protocol.decoder(protocol.RunnerReply)
        self.models: dict[str, ModelState] = {}
        self.runners: dict[str, RunnerState] = {}
        self.requests: dict[str, Req] = {}
        self.cores = cpu_cores()
        self.prompt_tokens_computed = 0
        self.early_aborts: OrderedDict[str, float] = OrderedDict()  # rid -> expiry
        self.aborted_before_arrival = 0
        self.contained_failures = 0
        self.stopping = False
        # Batches built but not sent (by runner id): they would overwrite KV a
        # disk save still reads.
        self.held: dict[str, HeldBatch] = {}
        # Bumped by every event that may change what ``check`` looks at, so a
        # walk's result is known to be current while it has not moved.
        self.version = 0
        self.walk = InvariantWalk()
        self.disk_progress_at = 0.0  # time.monotonic() a disk job last finished
        self.pending: dict[str, PendingModel] = {}  # instances added at run time, loading
        self.removing: set[str] = set()  # instances waiting for their last batch or disk load
        pins = Pins(int(arena.total_bytes * args.max_pinned_fraction))
        pins.cache = self.cache
        self.warmups = Warmups(pins)  # warm-ups in flight and pinned prefixes
        for arg in args.models:  # registered in the cache by ``bootstrap.build``
            self.add_instance(arg, startup.roll, arg.name)

    def register_instance(
        self, arg: ModelArg, spec: ModelSpec, roll: RollCall, served_name: str, version: int = 1
    ) -> protocol.ServedModel:
        """Register one instance whose runners are all ready (raises
        StartupError if they disagree, ValueError if its KV cannot live in the arena)."""
        check_replicas(arg, roll)
        self.cache.register_model(spec)
        return self.add_instance(arg, roll, served_name, version)

    def add_instance(
        self, arg: ModelArg, roll: RollCall, served_name: str, version: int = 1
    ) -> protocol.ServedModel:
        """Start serving an instance already registered in the cache."""
        ids = runner_ids(arg)
        info = roll.infos[ids[0]]
        served = protocol.ServedModel(
            served_name, arg.source, info, arg.replicas, arg.priority, version
        )
        states = [RunnerState(i, arg.name, state="up", pid=roll.pids[i]) for i in ids]
        self.models[arg.name] = ModelState(arg, info, states, served)
        self.runners.update({s.runner_id: s for s in states})
        return served

    # ---- the loop --------------------------------------------------------------------
    def run(self, sockets: SchedulerSockets) -> None:
        """Serve until a ``ShutdownProcess``: react to each event, then dispatch."""
        inbox, runner_sock = sockets.inbox, sockets.runner_sock
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        poller.register(runner_sock, zmq.POLLIN)
        if self.disk is not None:
            poller.register(self.disk.fileno(), zmq.POLLIN)
        while not self.stopping:
            events = dict(poller.poll(1000))
            if self.disk is not None and self.disk.fileno() in events:
                with self._contained("disk tier results", []):
                    self.disk_results()
            if inbox in events:
                while self._poll_once(inbox):
                    raw = inbox.recv()
                    with self._contained("inbox message", self._inbox_rids(raw)):
                        self.handle(self.inbox_decoder.decode(raw))
            if runner_sock in events:
                while self._poll_once(runner_sock):
                    ident, raw = runner_sock.recv_multipart()
                    runner = self.runners.get(ident.decode())
                    rids = (
                        [r.rid for r in runner.inflight.reqs] if runner and runner.inflight else []
                    )
                    with self._contained(f"reply of runner {ident.decode()}", rids):
                        self.on_runner_message(ident.decode(), raw)
            self.after_events()
        if self.disk is not None:
            self.disk.close(flush=True)
        for runner in self.runners.values():
            if runner.up:
                self.outbox.to_runner(runner.runner_id, protocol.Shutdown())

    def after_events(self) -> None:
        """What the loop does after each round of events: kill hung runners,
        finish removals, give idle runners their next batch."""
        self.check_timeouts()
        if self.removing:
            self._finish_removals()
        if not self.stopping:
            self.dispatch()

    def disk_results(self) -> None:
        """Finished disk jobs: loaded requests go back first in their queue;
        batches held for a save are sent once it is done."""
        disk = self.disk
        assert disk is not None, "disk results without a disk tier"
        self.version += 1
        self.disk_progress_at = time.monotonic()
        for req in disk.poll():
            self.kv.release(req, keep=True)  # the loaded pages go into the tree
            model = self.models[req.model]
            if req.aborted is not None or req.rid not in self.requests:
                self._forget(req)  # failed or aborted while it loaded: answered then
            else:
                model.waiting.insert(0, req)
                # A model without a live runner fails its requests when it
                # loses the last one (this one included); never queue on it.
                self._fail_unserved(model)
        for runner_id, held in list(self.held.items()):
            runner = self.runners[runner_id]
            if runner.inflight is not held.batch or not runner.up:
                del self.held[runner_id]  # the runner was lost meanwhile
            elif not self._overwrites_pending_save(held.batch):
                del self.held[runner_id]
                self._send_batch(runner, held.batch)

    @staticmethod
    def _poll_once(sock: zmq.Socket) -> bool:
        return bool(sock.poll(0, zmq.POLLIN))

    # ---- fault containment -----------------------------------------------------------
    @contextlib.contextmanager
    def _contained(self, what: str, rids: list[str]) -> Iterator[None]:
        """Handle one event; if it raises, log it, fail the requests it concerns
        (500, no internals) and keep serving: one bad message never ends the loop."""
        try:
            yield
        except Exception:
            self.contained_failures += 1
            log.exception("error handling %s (rids %s); failing those requests", what, rids)
            self._fail_requests(rids, 500, INTERNAL_ERROR)

    def _inbox_rids(self, raw: bytes) -> list[str]:
        """The request an undecodable or failing inbox message was about, if any."""
        with contextlib.suppress(Exception):
            rid = msgspec.msgpack.decode(raw).get("rid")
            if isinstance(rid, str):
                return [rid]
        return []

    def _fail_requests(self, rids: list[str], status: int, message: str) -> None:
        """End each tracked request with an error; untracked ones get a RequestError."""
        outputs = []
        for rid in rids:
            req = self.requests.get(rid)
            try:
                if req is None:
                    self._reject(rid, status, message)
                    continue
                self._drop(req)
                outputs.append(request_output(req, [], "error", error=message, status=status))
            except Exception:  # state too broken to release cleanly: at least answer
                log.exception("rid=%s could not be released cleanly", rid)
                self.requests.pop(rid, None)
                self._reject(rid, status, message)
        outputs = self._warmup_outputs(outputs)
        if outputs:
            self.outbox.to_detokenizer(protocol.TokenBatch(outputs))

    def _drop(self, req: Req) -> None:
        """Forget a request wherever it is, freeing its KV (nothing is cached)."""
        model = self.models[req.model]
        if req in model.waiting:
            model.waiting.remove(req)
        if self.disk is not None and self.disk.is_loading(req):
            req.aborted = "failed"  # the load still writes its slots: freed when it ends
            self._forget(req)
        elif req.runner is not None or req.handle is not None or len(req.slots):
            self._finish(req, keep=False)
        else:
            self._forget(req)

    def check_timeouts(self) -> None:
        """A runner that has not answered a batch within ``--runner-timeout`` is
        hung: kill it (the launcher restarts it) and fail or move its requests.
        Only what was sent is timed: a batch held for a disk save is the
        disk's wait (``_check_disk_stalls``), never the runner's."""
        limit = self.args.runner_timeout
        now = time.monotonic()
        self._check_disk_stalls(now)
        for runner in self.runners.values():
            if runner.runner_id in self.held:
                continue
            if runner.up and runner.inflight is not None and now - runner.sent_at > limit:
                self.version += 1
                log.error(
                    "runner %s did not answer batch %d within %.0f s; killing it",
                    runner.runner_id,
                    runner.inflight.batch_id,
                    limit,
                )
                if runner.pid is not None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(runner.pid, signal.SIGKILL)
                self.runner_lost(
                    runner, f"runner {runner.runner_id} hung (no answer in {limit:g} s)", True
                )

    def _check_disk_stalls(self, now: float) -> None:
        """A request waiting on the disk tier (its load, or a save its batch
        is held for) while the I/O thread finished no job for
        ``--kv-disk-timeout`` means the disk hangs (a slow one still finishes
        jobs; a broken one fails them with an error). The waiters get a 503
        instead of waiting forever and the tier is turned off: no new disk
        I/O. Blocks a stuck save still reads stay held back (a batch writing
        them waits, then fails the same way): KV is never overwritten under a
        save, so a wrong chunk never reaches the disk."""
        if self.disk is None or (not self.disk.loading and not self.held):
            return
        limit = self.args.kv_disk_timeout
        if now - self.disk_progress_at <= limit:
            return
        loads = [ld.req for ld in self.disk.loading.values() if now - ld.t0 > limit]
        held = [(rid, h) for rid, h in self.held.items() if now - h.since > limit]
        if not loads and not held:
            return
        self.version += 1
        what = "load" if loads else "save"
        self.disk.turn_off(f"a disk {what} made no progress in {limit:g} s (--kv-disk-timeout)")
        why = f"the KV disk tier stalled: no disk {what} finished in {limit:g} s"
        for runner_id, h in held:
            self._unhold(runner_id, h, why)
        # A failed load's slots are freed when (if ever) its job ends.
        self._fail_requests([r.rid for r in loads if r.rid in self.requests], 503, why)

    def _unhold(self, runner_id: str, held: HeldBatch, why: str) -> None:
        """Give up a held batch: the requests that would overwrite a stuck
        save's blocks fail with ``why``, the others wait again (their KV so far
        cached: they resume where they were), an aborted one ends."""
        del self.held[runner_id]
        runner = self.runners[runner_id]
        runner.inflight = None
        waiting = self.models[runner.model].waiting
        blocked: list[str] = []
        again: list[Req] = []
        for req, n in zip(held.batch.reqs, held.batch.chunks, strict=True):
            if req.aborted:
                self._finish(req, keep=True)
            elif self._writes_pending_save(req, n):
                blocked.append(req.rid)
            else:
                again.append(req)
        for req in reversed(again):
            self.builder.requeue(runner, waiting, req)
        self._fail_requests(blocked, 503, why)

    def dispatch(self) -> None:
        """Give every idle runner with work its next batch."""
        threads = self._threads_per_runner()
        for model in self.models.values():
            if model.name in self.removing:
                continue
            for runner in model.runners:
                if not runner.up or runner.inflight is not None:
                    continue
                rids = [r.rid for r in runner.running]
                with (
                    self._contained(f"scheduling for runner {runner.runner_id}", rids),
                    self._real_requests_first(model),
                ):
                    batch = self.builder.schedule_next_batch(
                        runner, model.waiting, admit_cap=self._fair_share_cap(model)
                    )
                    if batch is None:
                        continue
                    self.version += 1
                    runner.inflight = batch
                    if self._overwrites_pending_save(batch):
                        # Not sent, so not timed as the runner's (check_timeouts).
                        self.held[runner.runner_id] = HeldBatch(batch, time.monotonic())
                    else:
                        self._send_batch(runner, batch, threads)

    def _send_batch(self, runner: RunnerState, batch: ScheduledBatch, threads: int = -1) -> None:
        """Send a runner its batch; ``sent_at`` starts its ``--runner-timeout``."""
        if threads < 0:
            threads = self._threads_per_runner()
        runner.sent_at = time.monotonic()
        self.outbox.to_runner(runner.runner_id, batch.to_forward_batch(threads))

    def _overwrites_pending_save(self, batch: ScheduledBatch) -> bool:
        """Whether the batch writes KV into arena blocks a disk save still reads."""
        return any(
            self._writes_pending_save(req, n)
            for req, n in zip(batch.reqs, batch.chunks, strict=True)
        )

    def _writes_pending_save(self, req: Req, n: int) -> bool:
        """Whether computing ``n`` tokens of ``req`` writes blocks a disk save still reads."""
        if self.disk is None:
            return False
        written = req.slots[req.kv_len : req.kv_len + n]
        return self.disk.holds_back(self.cache.pool_of(req.model), written)

    def _threads_per_runner(self) -> int:
        """The cores divided among runners that have work now (0: leave as set).

        Compute follows load as memory does: while one model is idle its
        runner's cores go to the busy ones. A runner mid-batch keeps its count
        until that batch ends, so a newly busy runner briefly shares cores.
        ``--runner-threads N`` fixes every runner at N instead.
        """
        if self.args.runner_threads or len(self.runners) < 2:
            return 0
        busy = sum(
            1
            for m in self.models.values()
            for r in m.runners
            if r.up and (r.inflight is not None or r.running or m.waiting)
        )
        return max(1, self.cores // max(1, busy))

    def _fair_share_cap(self, model: ModelState) -> int | None:
        """Weighted fair share of the arena by priority, in tokens this model
        may still admit while another model has requests waiting (None: no
        bound). The batch builder still lets an idle runner start one request."""
        busy = [m for m in self.models.values() if m.waiting or m.running()]
        if not any(m.waiting for m in busy if m is not model):
            return None
        total_priority = sum(m.arg.priority for m in busy)
        share = self.arena.total_bytes * model.arg.priority / total_priority
        bpt = model.info.layout.bytes_per_token
        used = sum(len(r.slots) for r in model.running()) * bpt
        return max(0, int(share - used) // bpt)

    # ---- inbox -----------------------------------------------------------------------
    def handle(self, msg: object) -> None:
        if not (isinstance(msg, protocol.ControlRequest) and msg.op in READ_ONLY_OPS):
            self.version += 1
        if isinstance(msg, protocol.TokenizedRequest):
            self.enqueue(msg)
        elif isinstance(msg, protocol.AbortRequest):
            self.abort(msg.rid, msg.reason, msg.early)
        elif isinstance(msg, protocol.ControlRequest):
            self.outbox.to_front(control.reply(self, msg))
        elif isinstance(msg, protocol.RunnerDied):
            self.runner_died(msg)
        elif isinstance(msg, protocol.AddModel):
            self.add_model(msg)
        elif isinstance(msg, protocol.RemoveModel):
            self.remove_model(msg.name)
        elif isinstance(msg, protocol.WarmupRequest):
            self.warmup(msg)
        elif isinstance(msg, protocol.ShutdownProcess):
            self.stopping = True

    def _reject(self, rid: str, status: int, message: str, param: str | None = None) -> None:
        log.info("rid=%s rejected %d: %s", rid, status, message)
        if rid in self.warmups:  # the front knows the warm-up, not its prefixes' rids
            self._reply_warmup(self.warmups.failed(rid, status, message, param))
            return
        self.outbox.to_front(protocol.RequestError(rid, status, message, param))

    def enqueue(self, msg: protocol.TokenizedRequest) -> None:
        if self.early_aborts.pop(msg.rid, None) is not None:
            self.aborted_before_arrival += 1
            log.info("rid=%s dropped: aborted before it reached the scheduler", msg.rid)
            return
        if msg.rid in self.requests:
            self._reject(msg.rid, 400, "a request with this id is already running", "rid")
            return
        model = self.models.get(msg.model)
        if model is None or msg.model in self.removing:
            self._reject(msg.rid, 404, f"model {msg.model!r} is not served", "model")
            return
        if not model.up:
            why = "restarting" if model.state == "restarting" else "down"
            self._reject(msg.rid, 503, f"model {msg.model!r} is {why}: {model.down_reason}")
            return
        if len(model.waiting) >= self.args.max_queued_requests:
            self._reject(
                msg.rid, 429, f"model {msg.model!r} has {len(model.waiting)} requests queued"
            )
            return
        ids = protocol.unpack_ids(msg.input_ids).astype(np.int32)
        if len(ids) == 0:
            self._reject(msg.rid, 400, "empty prompt", "prompt")
            return
        need = len(ids) + msg.params.max_new_tokens
        capacity = self._capacity_tokens(model)
        if need > capacity:
            self._reject(
                msg.rid,
                400,
                f"prompt ({len(ids)}) + max_tokens ({msg.params.max_new_tokens}) needs {need} "
                f"tokens of KV; the arena holds at most {capacity} for {msg.model!r}",
                "max_tokens",
            )
            return
        req = Req(
            msg.rid, msg.model, ids, msg.params, msg.stop, msg.skip_special_tokens, msg.arrival
        )
        self.requests[req.rid] = req
        model.waiting.append(req)
        log.info("rid=%s queued for %s: %d prompt tokens", req.rid, msg.model, len(ids))

    def _capacity_tokens(self, model: ModelState) -> int:
        return self.cache.allocator.capacity_slots(self.cache.pool_of(model.name))

    def abort(self, rid: str, reason: str, early: bool = False) -> None:
        req = self.requests.get(rid)
        if req is None:
            if early:  # maybe still in a tokenizer worker: drop it when it comes
                self._remember_early_abort(rid)
            return  # else already finished
        model = self.models[req.model]
        if req in model.waiting:
            model.waiting.remove(req)
            self._forget(req)
        elif self.disk is not None and self.disk.is_loading(req):
            req.aborted = reason  # its slots are being filled: free after the load
            return
        elif req.runner is not None:
            runner = self.runners[req.runner]
            if runner.inflight is not None and req in runner.inflight.reqs:
                req.aborted = reason  # its slots are being written: free after the batch
                return
            self._finish(req, keep=True)
        log.info("rid=%s aborted: %s", rid, reason)

    def _remember_early_abort(self, rid: str) -> None:
        now = time.monotonic()
        aborts = self.early_aborts
        while aborts and (len(aborts) >= EARLY_ABORT_MAX or next(iter(aborts.values())) < now):
            aborts.popitem(last=False)
        aborts[rid] = now + EARLY_ABORT_TTL_S

    def _forget(self, req: Req) -> None:
        self.requests.pop(req.rid, None)

    def _finish(self, req: Req, keep: bool) -> None:
        """Release a running request's KV and drop it."""
        if req.runner is not None:
            runner = self.runners[req.runner]
            if req in runner.running:
                runner.running.remove(req)
        self.kv.release(req, keep=keep)
        self._forget(req)

    def runner_died(self, msg: protocol.RunnerDied) -> None:
        """The launcher saw a runner exit (and restarts it unless it gave up)."""
        runner = self.runners.get(msg.runner_id)
        if runner is None:
            return
        why = f"runner {msg.runner_id} exited with code {msg.exitcode}"
        if runner.up:
            self.runner_lost(runner, why, msg.restarting)
        else:  # already failed over (e.g. killed after a hang): just track the restart
            runner.state = "restarting" if msg.restarting else "down"
            model = self.models[runner.model]
            self._update_down_reason(model, runner.error or why)
            self._fail_unserved(model)
        if not msg.restarting:
            log.error(
                "runner %s will not be restarted: its model has no live runner", runner.runner_id
            )

    def runner_lost(self, runner: RunnerState, why: str, restarting: bool) -> None:
        """Take a dead or hung runner out of service. Its running requests move
        to a live replica of the model (same greedy output: they resume from
        their tokens so far); with no live replica left, every request of the
        model fails with 503 (``_fail_unserved``)."""
        runner.state = "restarting" if restarting else "down"
        runner.error = why
        runner.inflight = None
        self.held.pop(runner.runner_id, None)
        if restarting:
            runner.restarts += 1
        model = self.models[runner.model]
        self._update_down_reason(model, why)
        if model.up:
            running = list(runner.running)
            for req in reversed(running):
                self.builder.requeue(runner, model.waiting, req)
            log.error("%s; %d requests moved to a replica", why, len(running))
        else:
            log.error("%s; model %s has no live runner", why, model.name)
            self._fail_unserved(model)

    def _fail_unserved(self, model: ModelState) -> None:
        """A model with no live runner keeps no request: while it restarts (or
        once the launcher gave up) every request of it, wherever it is
        (waiting, loading from disk, on a lost runner, in a held batch), fails
        now with a 503; new ones are refused at ``enqueue``. A load still
        writing a failed request's slots frees them when it ends."""
        if model.up:
            return
        rids = [r.rid for r in self.requests.values() if r.model == model.name]
        if not rids:
            return
        why = f"model {model.name!r} is {model.state}: {model.down_reason}"
        log.error("%s; %d requests failed", why, len(rids))
        self._fail_requests(rids, 503, why)

    def _update_down_reason(self, model: ModelState, why: str) -> None:
        model.down_reason = None if model.up else why

    def runner_ready(self, runner: RunnerState, msg: protocol.Ready) -> None:
        """A restarted runner is back: its model serves again."""
        model = self.models[runner.model]
        expected = model.info.kv_share_key
        if msg.info.kv_share_key != expected or msg.info.layout != model.info.layout:
            # Its KV would not match what the tree holds for this model.
            log.error("runner %s came back with different weights; not using it", runner.runner_id)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(msg.pid, signal.SIGKILL)
            return
        runner.state = "up"
        runner.pid = msg.pid
        runner.error = None
        self._update_down_reason(model, "")
        log.info(
            "runner %s back in service (pid %d, %.1fs load, restart %d)",
            runner.runner_id,
            msg.pid,
            msg.load_seconds,
            runner.restarts,
        )

    # ---- runner replies ----------------------------------------------------------------
    def on_runner_message(self, runner_id: str, raw: bytes) -> None:
        self.version += 1
        runner = self.runners.get(runner_id)
        msg = self.runner_decoder.decode(raw)
        if runner is None and self._pending_runner(runner_id, msg):
            return
        if runner is not None and isinstance(msg, protocol.Ready) and not runner.up:
            self.runner_ready(runner, msg)
            return
        if runner is not None and isinstance(msg, protocol.Failed):
            log.error("runner %s failed to restart: %s", runner_id, msg.error)
            return  # its exit reaches us as RunnerDied; the launcher decides what next
        if runner is None or not isinstance(msg, protocol.ForwardResult):
            log.warning("unexpected message from runner %s: %s", runner_id, type(msg).__name__)
            return
        batch = runner.inflight
        if batch is None or batch.batch_id != msg.batch_id:
            log.warning("runner %s: result for unknown batch %d", runner_id, msg.batch_id)
            return
        runner.inflight = None
        runner.steps += 1
        runner.busy_s += (msg.forward_ms + msg.sample_ms) / 1e3
        runner.threads = msg.threads
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %s", describe_step(batch, msg))
        outputs = self._warmup_outputs(self.apply_result(batch, msg))
        if outputs:
            self.outbox.to_detokenizer(protocol.TokenBatch(outputs))
        if self.args.check_invariants:
            result = control.walk_invariants(self)
            if result != "ok":  # contained: fails this batch's requests, logged
                raise AssertionError(result)

    describe_step = staticmethod(describe_step)

    def apply_result(
        self, batch: ScheduledBatch, result: protocol.ForwardResult
    ) -> list[protocol.RequestOutput]:
        """Advance each request of a finished batch; outputs for the detokenizer."""
        outputs: list[protocol.RequestOutput] = []
        if result.error is not None:
            log.error(
                "runner %s batch %d failed (rids %s): %s",
                batch.runner_id,
                batch.batch_id,
                ",".join(r.rid for r in batch.reqs),
                result.error,
            )
            for req in batch.reqs:
                self._finish(req, keep=False)
                outputs.append(request_output(req, [], "error", error=INTERNAL_ERROR, status=500))
            return outputs
        if len(result.outputs) != len(batch.reqs):
            raise ValueError(
                f"batch {batch.batch_id}: {len(result.outputs)} outputs for {len(batch.reqs)} seqs"
            )
        for req, n, out in zip(batch.reqs, batch.chunks, result.outputs, strict=True):
            if out.error is not None:
                log.error("rid=%s failed in runner %s: %s", req.rid, batch.runner_id, out.error)
                self._finish(req, keep=False)
                outputs.append(request_output(req, [], "error", error=INTERNAL_ERROR, status=500))
                continue
            prompt = len(req.input_ids)
            self.prompt_tokens_computed += max(0, min(req.kv_len + n, prompt) - req.kv_len)
            if out.prompt_logprobs is not None:
                keep_prompt_logprobs(req, req.kv_len, out)
            req.kv_len += n
            if req.aborted:
                self._finish(req, keep=True)
                continue
            if out.token_id < 0:
                self.kv.cache_progress(req)  # a prefill chunk: share it now
                continue
            req.output_ids.append(out.token_id)
            finish = out.finish_reason
            if finish is None and req.num_tokens >= self.models[req.model].info.context_length:
                finish = "length"
            logprobs = None
            if out.logprob is not None:
                logprobs = [protocol.TokenLogprob(out.token_id, out.logprob, out.top_logprobs)]
            outputs.append(request_output(req, [out.token_id], finish, logprobs=logprobs))
            if finish:
                log.info(
                    "rid=%s finished (%s): %d prompt + %d output tokens, %d cached",
                    req.rid,
                    finish,
                    len(req.input_ids),
                    len(req.output_ids),
                    req.cached_tokens,
                )
                self._finish(req, keep=True)
            elif n > 1:
                self.kv.cache_progress(req)
        return outputs

    # ---- models at run time --------------------------------------------------------------
    def add_model(self, msg: protocol.AddModel) -> None:
        """Runners for a new instance are starting: it is registered when all are ready."""
        name = msg.model.name
        if name in self.models or name in self.pending:
            self.outbox.to_launcher(
                protocol.ModelAdded(name, error=f"model {name!r} is already loaded")
            )
            return
        self.pending[name] = PendingModel(msg, RollCall(set(runner_ids(msg.model))))
        log.info("model %s: waiting for %d runner(s)", name, msg.model.replicas)

    def _pending_runner(self, runner_id: str, msg: object) -> bool:
        """Handle a message from a runner of a loading instance; False if it is not one."""
        rid = RunnerId.parse(runner_id)
        pending = self.pending.get(rid.model) if rid is not None else None
        if pending is None or runner_id not in pending.roll.expected:
            return False
        if not isinstance(msg, protocol.Ready | protocol.Failed):
            return True
        name = pending.add.model.name
        error = pending.roll.answer(runner_id, msg)
        if error is not None:
            del self.pending[name]
            error = f"runner {runner_id} failed to load {pending.add.model.source}: {error}"
            log.error("model %s: %s", name, error)
            self.outbox.to_launcher(protocol.ModelAdded(name, error=error))
        elif pending.roll.complete:
            self._register_pending(pending)
        return True

    def _register_pending(self, pending: PendingModel) -> None:
        add = pending.add
        name = add.model.name
        del self.pending[name]
        info = pending.roll.infos[runner_ids(add.model)[0]]
        try:
            spec = model_spec(add.model, info)
            served = self.register_instance(add.model, spec, pending.roll, add.served, add.version)
        except (StartupError, ValueError) as exc:
            log.error("model %s not added: %s", name, exc)
            self.outbox.to_launcher(protocol.ModelAdded(name, error=str(exc)))
            return
        log.info("model %s serving as %s (version %d)", name, add.served, add.version)
        self.outbox.to_launcher(protocol.ModelAdded(name, served=served))

    def remove_model(self, name: str) -> None:
        """Take an instance out: fail what it still has (the front drained it
        first, so normally nothing), then, once no batch or disk load still
        writes its KV, stop its runners and drop its cache entries."""
        if self.pending.pop(name, None) is not None:
            log.info("model %s: load cancelled", name)
            self.outbox.to_launcher(protocol.ModelRemoved(name))
            return
        model = self.models.get(name)
        if model is None or name in self.removing:
            if model is None:
                self.outbox.to_launcher(protocol.ModelRemoved(name))
            return
        self.removing.add(name)
        why = f"model {model.served.name!r} was unloaded"
        inflight = {
            id(req) for r in model.runners if r.inflight is not None for req in r.inflight.reqs
        }
        for req in [r for r in self.requests.values() if r.model == name]:
            if id(req) in inflight:  # its slots are being written: freed after the batch
                req.aborted = "unloaded"
                self._reject(req.rid, 503, why)
            else:
                self._fail_requests([req.rid], 503, why)
        self._finish_removals()

    def _finish_removals(self) -> None:
        loading = {ld.req.model for ld in self.disk.loading.values()} if self.disk else set()
        for name in list(self.removing):
            model = self.models[name]
            if name in loading or any(r.up and r.inflight is not None for r in model.runners):
                continue
            self.removing.discard(name)
            for runner in model.runners:
                if runner.up:
                    self.outbox.to_runner(runner.runner_id, protocol.Shutdown())
                del self.runners[runner.runner_id]
                self.held.pop(runner.runner_id, None)
            del self.models[name]
            self.warmups.pins.drop(name)
            freed = self.cache.unregister_model(name)
            log.info("model %s removed: %d cached tokens freed", name, freed)
            removed = protocol.ModelRemoved(name, freed)
            self.outbox.to_detokenizer(removed)  # after the instance's last outputs
            self.outbox.to_launcher(removed)

    # ---- warm-up and pins (scheduler/warmup.py) -------------------------------------------
    def warmup(self, msg: protocol.WarmupRequest) -> None:
        """Queue one one-token request per prefix (refused up front when the
        model is unknown or the pins would pass the cap); the front gets one
        ``WarmupReply`` when every prefix is cached."""
        refusal = self.warmups.refusal(msg, self.models)
        if refusal is not None:
            self._reply_warmup(refusal)
            return
        for rid, ids in list(self.warmups.start(msg)):
            self.enqueue(protocol.TokenizedRequest(rid, msg.model, ids, WARMUP_PARAMS))

    def _warmup_outputs(
        self, outputs: list[protocol.RequestOutput]
    ) -> list[protocol.RequestOutput]:
        """Take warm-ups' outputs out (their token is discarded; a finished
        one is pinned if asked and answered to the front); the rest go on."""
        rest = []
        for out in outputs:
            if out.rid not in self.warmups:
                rest.append(out)
            elif out.finish_reason is not None:
                self._reply_warmup(self.warmups.finished(out))
        return rest

    def _reply_warmup(self, reply: protocol.WarmupReply | None) -> None:
        if reply is not None:
            self.outbox.to_front(reply)

    @contextlib.contextmanager
    def _real_requests_first(self, model: ModelState) -> Iterator[None]:
        """Low priority for warm-ups: while a real request of the model waits,
        its warm-ups are out of the queue the batch builder sees (put back
        after it, behind whatever it requeued). Once admitted, a warm-up runs
        like any request."""
        warm = [r for r in model.waiting if r.rid in self.warmups]
        if not warm or len(warm) == len(model.waiting):
            yield
            return
        model.waiting[:] = [r for r in model.waiting if r.rid not in self.warmups]
        try:
            yield
        finally:
            model.waiting.extend(warm)


def main(ctx: ProcessContext, zctx: zmq.Context) -> int:
    """Process entry: wait for the runners, report ready, serve until shut down."""
    args, arena = ctx.args, ctx.arena
    assert arena is not None, "the scheduler needs the arena spec"
    sockets, outbox = bootstrap.open_sockets(ctx, zctx)
    try:
        roll = bootstrap.wait_for_runners(args, sockets)
        sched = Scheduler(args, arena, outbox, bootstrap.build(args, arena, roll))
    except StartupError as exc:
        log.error("%s", exc)
        report(zctx, ctx.endpoints, protocol.ProcessFailed(ctx.name, os.getpid(), str(exc)))
        return 1
    served = [m.served for m in sched.models.values()]
    report(zctx, ctx.endpoints, protocol.ProcessReady(ctx.name, os.getpid(), served))
    log.info("serving %s", ", ".join(f"{m.name} x{m.replicas}" for m in served))
    sched.run(sockets)
    return 0


if __name__ == "__main__":
    run_process(main)
