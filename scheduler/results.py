"""What a finished batch means for its requests.

``apply_result`` advances each request of a batch by its runner's
``ForwardResult``: a prefill chunk is cached, a sampled token goes out, a
finished or failed request ends. ``describe_step`` is the batch's debug line.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixmux import protocol
from radixmux.scheduler import request_life
from radixmux.scheduler.batch_builder import ScheduledBatch
from radixmux.scheduler.outputs import keep_prompt_logprobs, request_output
from radixmux.scheduler.request import Req

if TYPE_CHECKING:
    from radixmux.scheduler.scheduler import Scheduler

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


def apply_result(
    sched: Scheduler, batch: ScheduledBatch, result: protocol.ForwardResult
) -> list[protocol.RequestOutput]:
    """Advance each request of a finished batch; outputs for the detokenizer."""
    if result.error is not None:
        log.error(
            "runner %s batch %d failed (rids %s): %s",
            batch.runner_id,
            batch.batch_id,
            ",".join(r.rid for r in batch.reqs),
            result.error,
        )
        return [request_life.end(sched, req, INTERNAL_ERROR) for req in batch.reqs]
    if len(result.outputs) != len(batch.reqs):
        raise ValueError(
            f"batch {batch.batch_id}: {len(result.outputs)} outputs for {len(batch.reqs)} seqs"
        )
    outputs: list[protocol.RequestOutput] = []
    for req, n, out in zip(batch.reqs, batch.chunks, result.outputs, strict=True):
        if out.error is not None:
            log.error("rid=%s failed in runner %s: %s", req.rid, batch.runner_id, out.error)
            outputs.append(request_life.end(sched, req, INTERNAL_ERROR))
            continue
        prompt = len(req.input_ids)
        sched.prompt_tokens_computed += max(0, min(req.kv_len + n, prompt) - req.kv_len)
        if out.prompt_logprobs is not None:
            keep_prompt_logprobs(req, req.kv_len, out)
        req.kv_len += n
        if req.aborted:
            request_life.end(sched, req)
            continue
        if out.token_id < 0:
            sched.kv.cache_progress(req)  # a prefill chunk: share it now
            continue
        output = _sampled(sched, req, out)
        outputs.append(output)
        if output.finish_reason:
            request_life.end(sched, req)
        elif n > 1:
            sched.kv.cache_progress(req)
    return outputs


def _sampled(sched: Scheduler, req: Req, out: protocol.SeqOutput) -> protocol.RequestOutput:
    """Take the token a step sampled for ``req``; its output (finished or not)."""
    new = [out.token_id, *(out.forced_ids or ())]  # forced: a grammar's jump-forward
    req.output_ids += new
    finish = out.finish_reason
    if finish is None and req.num_tokens >= sched.models[req.model].info.context_length:
        finish = "length"
    logprobs = None
    if out.logprob is not None:
        logprobs = [protocol.TokenLogprob(out.token_id, out.logprob, out.top_logprobs)]
    if finish:
        log.info(
            "rid=%s finished (%s): %d prompt + %d output tokens, %d cached",
            req.rid,
            finish,
            len(req.input_ids),
            len(req.output_ids),
            req.cached_tokens,
        )
    return request_output(req, new, finish, logprobs=logprobs)
