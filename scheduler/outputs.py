"""A request's outputs for the detokenizer, and its prompt logprobs.

``request_output`` turns a request's progress into the ``RequestOutput`` the
detokenizer gets; a prefill chunk's prompt logprobs are kept by position
until the request's first output carries them.
"""

from __future__ import annotations

import logging

from radixmux import protocol
from radixmux.scheduler.request import Req

log = logging.getLogger("radixmux.scheduler")


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
