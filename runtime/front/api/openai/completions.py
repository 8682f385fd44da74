"""OpenAI ``/v1/completions``: its request and response, the internal
requests a body becomes (one per prompt, ``n`` or ``best_of`` samples each),
and the per-request formatter (streaming calls ``chunks`` per output and
``tail`` after the last; non-streaming calls ``full`` with every output).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from radixmux import protocol
from radixmux.runtime.api_error import APIError
from radixmux.runtime.front.api import extensions
from radixmux.runtime.front.api.common import (
    MAX_N,
    MAX_PROMPTS,
    check_input_ids,
    refuse_unsupported,
)
from radixmux.runtime.front.api.openai.base import (
    UNSUPPORTED_SHARED,
    SamplingFields,
    Usage,
    finish_reason,
    generate_request,
    n_choices,
    or_default,
    sampling_params,
    token_name,
    top_alternatives,
    usage_of,
)
from radixmux.runtime.front.api.structured import ResponseFormat, openai_constraint
from radixmux.runtime.front.hub import InFlight

# OpenAI's documented default for /v1/completions.
COMPLETION_DEFAULT_MAX_TOKENS = 16


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None  # as vLLM takes it here too
    # Extensions of this endpoint alone (see extensions.COMPLETION).
    json_schema: Any = None


UNSUPPORTED_COMPLETION = {
    **UNSUPPORTED_SHARED,
    "suffix": ("",),
    **extensions.neutral_only(extensions.COMPLETION),
}


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(msgspec.Struct):
    """A completion, or one streamed chunk of it (OpenAI uses one shape for both)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


def best_of(req: CompletionRequest) -> int:
    """How many samples per prompt to draw (``best_of``, at least ``n``); the
    ``n`` with the highest mean token logprob are returned."""
    n = n_choices(req)
    if req.best_of is None:
        return n
    if not n <= req.best_of <= MAX_N:
        raise APIError(400, f"'best_of' must be in [n, {MAX_N}] (n = {n})", "best_of")
    return req.best_of


def completion_request(
    req: CompletionRequest, rid: str, model: protocol.ServedModel, arrival: float
) -> list[protocol.GenerateRequest]:
    """The tokenizer's requests for a /v1/completions body, one per prompt."""
    refuse_unsupported(req, UNSUPPORTED_COMPLETION)
    ranked = best_of(req) > n_choices(req)
    if ranked and req.stream:
        raise APIError(
            400, "'best_of' > 'n' cannot stream (choices are ranked at the end)", "best_of"
        )
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise APIError(400, "'logprobs' must be in [0, 20]", "logprobs")
    max_tokens = or_default(req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS)
    constraint = openai_constraint(req)
    params = sampling_params(req, max_tokens, model.info, req.logprobs, constraint)
    if req.echo and req.logprobs is not None:  # the echoed prompt's logprobs too
        params = msgspec.structs.replace(params, prompt_logprobs_start=0)
    if ranked:  # ranking needs every sample's logprobs, shown or not
        params = msgspec.structs.replace(params, logprobs=True)
    return [
        generate_request(req, rid, model, params, arrival, prompt=text, input_ids=ids)
        for text, ids in _prompts(req.prompt, model.info.vocab_size)
    ]


def _prompts(prompt: str | list[Any], vocab_size: int) -> list[tuple[str | None, list[int] | None]]:
    """The prompts of a completions body as (text, ids) pairs: a string, a list of
    token ids, or a batch of either (a list of strings or of id lists)."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt or not all(isinstance(p, (str, list)) for p in prompt):
        return [(None, check_input_ids(prompt, vocab_size, "prompt"))]
    if len(prompt) > MAX_PROMPTS:
        raise APIError(400, f"'prompt' batches hold at most {MAX_PROMPTS} prompts", "prompt")
    out: list[tuple[str | None, list[int] | None]] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            if not p:
                raise APIError(400, f"'prompt[{i}]' is empty", f"prompt[{i}]")
            out.append((p, None))
        else:
            out.append((None, check_input_ids(p, vocab_size, f"prompt[{i}]")))
    return out


def completion_logprobs(lps: list[protocol.TokenLogprob], offset: int) -> CompletionLogprobs:
    """Logprobs of a completion; ``text_offset`` is each token's character offset
    in the choice's text, ``offset`` being the text before these tokens."""
    names = [token_name(lp.token_id, lp.text) for lp in lps]
    offsets = []
    for name in names:
        offsets.append(offset)
        offset += len(name)
    return CompletionLogprobs(
        tokens=names,
        token_logprobs=[lp.logprob for lp in lps],
        top_logprobs=[
            None if lp.logprob is None else {name: v for name, v, _ in top_alternatives(lp)}
            for lp in lps
        ],
        text_offset=offsets,
    )


class CompletionFormat:
    """``/v1/completions`` (``n`` choices per prompt)."""

    def __init__(
        self,
        rid: str,
        model: str,
        logprobs: bool,
        include_usage: bool,
        n: int = 1,
        echo: list[str] | None = None,
        best_of: int | None = None,
    ) -> None:
        self.id = f"cmpl-{rid}"
        self.n = n
        self.best_of = best_of or n  # samples drawn per prompt (the best n are returned)
        self.echo = echo  # ``echo``: each prompt's text, put before its choices' text
        self.echoed: set[int] = set()  # streamed choices whose prompt is sent
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.offsets: dict[int, int] = {}  # choice -> text streamed so far

    def _lps(self, outs: list[protocol.TextOutput], offset: int) -> CompletionLogprobs | None:
        if not self.logprobs:
            return None
        # With echo, the first output carries the prompt's logprobs: they come first.
        lps = [lp for o in outs for lp in (o.prompt_logprobs or []) + (o.logprobs or [])]
        return completion_logprobs(lps, offset)

    def _response(self, choices: list[CompletionChoice], usage=None) -> CompletionResponse:
        return CompletionResponse(self.id, self.created, self.model, choices, usage)

    def _prompt(self, prompt: int) -> str:
        """Prompt ``prompt``'s text when echoing it, else nothing."""
        return self.echo[prompt] if self.echo else ""

    def chunks(self, out: protocol.TextOutput, gen: InFlight, index: int) -> list[msgspec.Struct]:
        reason = finish_reason(gen)
        text = out.text
        if self.echo and index not in self.echoed:
            self.echoed.add(index)
            text = self._prompt(index // self.n) + text
        if not text and not out.logprobs and not out.prompt_logprobs and reason is None:
            return []
        offset = self.offsets.get(index, 0)
        lps = self._lps([out], offset)
        self.offsets[index] = offset + len(text)
        return [self._response([CompletionChoice(index, text, lps, reason)])]

    def tail(self, gens: list[InFlight]) -> list[msgspec.Struct]:
        return [self._response([], usage_of(gens, self.n))] if self.include_usage else []

    def full(
        self, outputs: list[list[protocol.TextOutput]], gens: list[InFlight]
    ) -> msgspec.Struct:
        picked = self._best(outputs)
        choices = [
            CompletionChoice(
                i,
                self._prompt(k // self.best_of) + "".join(o.text for o in outputs[k]),
                self._lps(outputs[k], 0),
                finish_reason(gens[k]),
            )
            for i, k in enumerate(picked)
        ]
        return self._response(choices, usage_of(gens, self.best_of))  # every sample is billed

    def _best(self, outputs: list[list[protocol.TextOutput]]) -> list[int]:
        """The samples to answer with, in choice order: all of them, or with
        ``best_of`` > ``n`` each prompt's ``n`` of highest mean token logprob."""
        if self.best_of == self.n:
            return list(range(len(outputs)))
        picked = []
        for first in range(0, len(outputs), self.best_of):
            samples = range(first, first + self.best_of)
            picked += sorted(samples, key=lambda k: -_mean_logprob(outputs[k]))[: self.n]
        return picked


def _mean_logprob(outs: list[protocol.TextOutput]) -> float:
    lps = [lp.logprob for o in outs for lp in o.logprobs or [] if lp.logprob is not None]
    return sum(lps) / len(lps) if lps else float("-inf")
