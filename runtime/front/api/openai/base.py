"""What both OpenAI endpoints share: the sampling fields, the usage block,
token names in logprobs, and the internal request they become.

Requests decode straight into Structs. Nothing a client sends is silently
ignored: a field outside the OpenAI API (and SGLang's and vLLM's extensions,
``api/extensions.py``) is a 400 naming it, as OpenAI answers; a field this
server does not implement is declared and refused with a 400 unless it holds
its neutral value (``UNSUPPORTED_*``). Sampling defaults follow OpenAI
(temperature 1, top_p 1); greedy is ``temperature=0``.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from radixmux import protocol
from radixmux.protocol import ModelInfo, SamplingParams
from radixmux.runtime.api_error import APIError
from radixmux.runtime.client.messages import ModelCard, model_card
from radixmux.runtime.front.api import extensions
from radixmux.runtime.front.api.common import (
    check_metadata,
    check_n,
    check_name,
    check_sampling,
    logit_bias,
    stop_list,
)
from radixmux.runtime.front.hub import InFlight


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = False


class SamplingFields(extensions.OpenAIExtensions, kw_only=True, forbid_unknown_fields=True):
    """Fields both endpoints share (None: not sent, take the default); SGLang's
    and vLLM's extensions (``top_k``, ``ignore_eos``, ...) come with the base."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Accepted with no effect on the answer: who asks (logged with the request
    # id) and hints about how OpenAI's own service should store or route it.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # every prompt is prefix-cached anyway
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    logit_bias: dict[str, float] | None = None


# Fields of the API that this server does not implement, and the values that
# ask for nothing (None always does): anything else is a 400 naming the field.
UNSUPPORTED_SHARED: dict[str, tuple[Any, ...]] = {
    "service_tier": ("auto", "default"),
}


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


def sampling_params(
    req: SamplingFields,
    max_tokens: int,
    info: ModelInfo,
    logprobs: int | None,
    constraint: protocol.Constraint | None = None,
) -> SamplingParams:
    """Checked runner sampling parameters from an OpenAI request (``constraint``:
    its structured output, see ``api/structured.py``)."""
    n_choices(req)
    for tag in ("user", "safety_identifier", "prompt_cache_key"):
        check_name(getattr(req, tag), tag)
    check_metadata(req.metadata)
    top_k = req.top_k if req.top_k is not None else 0
    if top_k < -1:
        raise APIError(400, "'top_k' must be >= 0, or -1 to disable", "top_k")
    params = SamplingParams(
        temperature=or_default(req.temperature, 1.0),
        top_k=max(top_k, 0),
        top_p=or_default(req.top_p, 1.0),
        min_p=or_default(req.min_p, 0.0),
        repetition_penalty=or_default(req.repetition_penalty, 1.0),
        frequency_penalty=or_default(req.frequency_penalty, 0.0),
        presence_penalty=or_default(req.presence_penalty, 0.0),
        seed=req.seed,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        max_new_tokens=max_tokens,
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
        logit_bias=logit_bias(req.logit_bias, "logit_bias"),
        constraint=constraint,
    )
    check_sampling(params, info)
    return params


def n_choices(req: SamplingFields) -> int:
    """How many choices the request asks for (``n``, checked)."""
    return check_n(req.n, "n")


def or_default(value: Any, default: Any) -> Any:
    return default if value is None else value


def generate_request(
    req: SamplingFields,
    rid: str,
    model: protocol.ServedModel,
    params: SamplingParams,
    arrival: float,
    **prompt: Any,
) -> protocol.GenerateRequest:
    """The GenerateRequest for one prompt (``prompt``, ``input_ids`` or ``messages``)."""
    return protocol.GenerateRequest(
        rid=rid,
        model=model.instance,
        params=params,
        stop=stop_list(req.stop),
        stream=bool(req.stream),
        skip_special_tokens=or_default(req.skip_special_tokens, True),
        arrival=arrival,
        keep_stop_string=bool(req.no_stop_trim or req.include_stop_str_in_output),
        **prompt,
    )


def usage(lasts: list[protocol.TextOutput | None], n: int = 1) -> Usage:
    """Token counts from each choice's finished (or latest) output, ``n`` choices
    per prompt: each prompt once (its choices share it), the completions summed."""
    firsts = [out for out in lasts[::n] if out]
    prompt = sum(out.prompt_tokens for out in firsts)
    cached = sum(out.cached_tokens for out in firsts)
    completion = sum(out.completion_tokens for out in lasts if out)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))


def usage_of(gens: list[InFlight], n: int = 1) -> Usage:
    return usage([g.last for g in gens], n)


def finish_reason(gen: InFlight) -> str | None:
    return gen.finish_reason if gen.done else None


def token_name(token_id: int, text: str | None) -> str:
    """A token in logprobs: its text as the detokenizer named it, else by id
    (vLLM's ``token_id:N`` form)."""
    return text if text is not None else f"token_id:{token_id}"


def token_bytes(text: str | None) -> list[int] | None:
    """A token's UTF-8 bytes; None where it is only part of a character (its
    text is then U+FFFD, which stands for bytes it does not show)."""
    if text is None or "\ufffd" in text:
        return None
    return list(text.encode())


def top_alternatives(lp: protocol.TokenLogprob) -> list[tuple[str, float, str | None]]:
    """(name, logprob, text) of each top alternative."""
    texts: list[str | None] = list(lp.top_text or [None] * len(lp.top or []))
    return [(token_name(t, x), v, x) for (t, v), x in zip(lp.top or [], texts, strict=True)]


def model_list(served: list[protocol.ServedModel], created: int | None = None) -> ModelList:
    created = int(time.time()) if created is None else created
    return ModelList([model_card(m, created) for m in served])
