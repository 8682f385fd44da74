"""What a finished batch means for its requests: outputs and prompt logprobs.

``Scheduler.apply_result`` advances each request of a batch by its runner's
``ForwardResult``; the helpers here turn a request's progress into the
``RequestOutput`` the detokenizer gets, and keep the prompt logprobs a
prefill chunk scored until the request's first output carries them.
"""

from __future__ import annotations

import logging

from radixmux import protocol
from radixmux.scheduler.batch_builder import ScheduledBatch
from radixmux.scheduler.request import Req

log = logging.getLogger("radixmux.scheduler")

# What a client sees when the server failed on its request; details go to the log.
INTERNAL_ERROR = "internal error while serving this request (the server log has details)"


def describe_step(batch: ScheduledBatch, result: protocol.ForwardResult) -> str:
    """One step's composition and cost (``--log-level debug``), to see where time goes."""
    decodes = [r for r, n in zip(batch.reqs, batch.chunks, strict=True) if n == 1]
    chunks = [(r, n) for r, n in zip(batch.reqs, batch.chunks, strict=True) if n > 1]
    context = sum(r.kv_len + 1 for r in decodes)
    shared = sum((len(g.members) - 1) * g.prefix_len for g in batch.prefix_groups)
    prefill = ",".join(f"{n}@{r.kv_len}" for r, n in chunks)
    return (
        f"runner={batch.runner_id} batch={batch.batch_id} decodes={len(decodes)} "
        f"decode_context={context} shared_rows={shared} prefill=[{prefill}] "
        f"forward_ms={result.forward_ms:.1f} sample_ms={result.sample_ms:.1f} "
        f"threads={result.threads}"
    )


def keep_prompt_logprobs(req: Req, first: int, out: protocol.SeqOutput) -> None:
    """A chunk starting at position ``first`` scored the prompt tokens
    after each of its positions (kept by position: a chunk computed again
    after a retraction overwrites the same ones)."""
    lps = out.prompt_logprobs or []
    tops = out.prompt_top_logprobs or [None] * len(lps)
    for k, (lp, top) in enumerate(zip(lps, tops, strict=True)):
        pos = first + 1 + k
        req.prompt_logprobs[pos] = protocol.TokenLogprob(int(req.input_ids[pos]), lp, top)


def prompt_logprobs(req: Req) -> list[protocol.TokenLogprob]:
    """The prompt's logprobs from the asked start on (the first token's is None)."""
    start = req.params.prompt_logprobs_start
    found = [req.prompt_logprobs.get(pos) for pos in range(start, len(req.input_ids))]
    missing = sum(lp is None for lp in found) - (start == 0)
    if missing:  # a bug, not the client's: say so, send what there is
        log.error("rid=%s: %d prompt logprobs missing", req.rid, missing)
    req.prompt_logprobs = {}
    ids = req.input_ids[start:].tolist()
    return [lp or protocol.TokenLogprob(t, None) for lp, t in zip(found, ids, strict=True)]


def request_output(
    req: Req,
    new: list[int],
    finish: str | None,
    logprobs: list[protocol.TokenLogprob] | None = None,
    error: str | None = None,
    status: int = 200,
) -> protocol.RequestOutput:
    """The detokenizer's next output for ``req``; its first one also carries
    the stop strings, queue time and (if asked) the prompt's logprobs."""
    first = not req.announced
    want_prompt = first and req.params.prompt_logprobs_start >= 0 and status == 200
    req.announced = True
    return protocol.RequestOutput(
        rid=req.rid,
        model=req.model,
        new_token_ids=new,
        prompt_tokens=len(req.input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        finish_reason=finish,
        logprobs=logprobs,
        error=error,
        status=status,
        stop=req.stop if first else None,
        skip_special_tokens=req.skip_special_tokens,
        queue_time=req.queue_time if first else None,
        prompt_logprobs=prompt_logprobs(req) if want_prompt else None,
    )
