"""OpenAI-compatible request and response schemas, and their conversion.

Requests decode straight into these Structs (unknown fields are ignored, as
OpenAI clients send many optional ones); :func:`completion_request` and
:func:`chat_request` check them against the served model and build the
:class:`GenerateRequest` the tokenizer workers take. Sampling defaults follow
OpenAI (temperature 1, top_p 1); greedy is ``temperature=0``.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from radixmux.model_runners.protocol import SamplingParams
from radixmux.runtime import protocol as P
from radixmux.runtime.api_common import (
    APIError,
    check_input_ids,
    check_sampling,
    require_chat_template,
    stop_list,
)

# OpenAI's documented default for /v1/completions; chat has none, we pick a bounded one
# because the tokenizer worker rejects prompt + max_tokens beyond the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 128
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


# ---- requests -------------------------------------------------------------------
class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields both endpoints share (None: not sent, take the default)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int | None = None
    ignore_eos: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool | None = True


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool | None = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


# ---- responses ------------------------------------------------------------------
class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
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


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    top_logprobs: list[TopLogprob]
    bytes: list[int] | None = None


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class ChatMessageOut(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    root: str
    max_model_len: int
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


# ---- conversion -----------------------------------------------------------------
def sampling_params(
    req: _SamplingFields, max_tokens: int, vocab_size: int, logprobs: int | None
) -> SamplingParams:
    """Checked runner sampling parameters from an OpenAI request."""
    if req.n not in (None, 1):
        raise APIError(400, "'n' must be 1: only one choice per request is supported", "n")
    top_k = req.top_k if req.top_k is not None else 0
    if top_k < -1:
        raise APIError(400, "'top_k' must be >= 0, or -1 to disable", "top_k")
    params = SamplingParams(
        temperature=_or(req.temperature, 1.0),
        top_k=max(top_k, 0),
        top_p=_or(req.top_p, 1.0),
        min_p=_or(req.min_p, 0.0),
        repetition_penalty=_or(req.repetition_penalty, 1.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        presence_penalty=_or(req.presence_penalty, 0.0),
        seed=req.seed,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        max_new_tokens=max_tokens,
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
    )
    check_sampling(params, vocab_size)
    return params


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def completion_request(
    req: CompletionRequest, rid: str, model: P.ServedModel, arrival: float
) -> P.GenerateRequest:
    """The tokenizer's request for a /v1/completions body."""
    if req.echo:
        raise APIError(400, "'echo' is not supported", "echo")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise APIError(400, "'logprobs' must be in [0, 20]", "logprobs")
    max_tokens = _or(req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS)
    params = sampling_params(req, max_tokens, model.info.vocab_size, req.logprobs)
    prompt: str | None = None
    ids: list[int] | None = None
    if isinstance(req.prompt, str):
        prompt = req.prompt
    elif len(req.prompt) == 1 and isinstance(req.prompt[0], (str, list)):
        # A batch of one ([text] or [[ids]]) is what some clients always send.
        only = req.prompt[0]
        prompt, ids = (only, None) if isinstance(only, str) else (None, only)
    elif req.prompt and all(isinstance(p, (str, list)) for p in req.prompt):
        raise APIError(400, "'prompt' batches are not supported: send one prompt", "prompt")
    else:
        ids = req.prompt
    if ids is not None:
        ids = check_input_ids(ids, model.info.vocab_size, "prompt")
    return P.GenerateRequest(
        rid=rid,
        model=model.name,
        params=params,
        prompt=prompt,
        input_ids=ids,
        stop=stop_list(req.stop),
        stream=bool(req.stream),
        skip_special_tokens=_or(req.skip_special_tokens, True),
        arrival=arrival,
    )


def chat_request(
    req: ChatRequest, rid: str, model: P.ServedModel, arrival: float, template_flag: bool
) -> P.GenerateRequest:
    """The tokenizer's request for a /v1/chat/completions body."""
    require_chat_template(model, template_flag)
    if not req.messages:
        raise APIError(400, "'messages' must not be empty", "messages")
    messages = [_message(m, i) for i, m in enumerate(req.messages)]
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = _or(req.max_completion_tokens, _or(req.max_tokens, CHAT_DEFAULT_MAX_TOKENS))
    params = sampling_params(req, max_tokens, model.info.vocab_size, logprobs)
    return P.GenerateRequest(
        rid=rid,
        model=model.name,
        params=params,
        messages=messages,
        stop=stop_list(req.stop),
        stream=bool(req.stream),
        skip_special_tokens=_or(req.skip_special_tokens, True),
        arrival=arrival,
    )


def _message(m: ChatMessageIn, i: int) -> P.ChatMessage:
    if m.role not in CHAT_ROLES:
        raise APIError(
            400, f"'messages[{i}].role' must be one of {CHAT_ROLES}", f"messages[{i}].role"
        )
    if m.content is None or isinstance(m.content, str):
        return P.ChatMessage(m.role, m.content or "")
    texts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise APIError(
                400,
                f"'messages[{i}].content': only text parts are supported",
                f"messages[{i}].content",
            )
        texts.append(part.text)
    return P.ChatMessage(m.role, "".join(texts))


def usage(out: P.TextOutput | None) -> Usage:
    """Token counts of a finished (or latest) output."""
    prompt = out.prompt_tokens if out else 0
    completion = out.completion_tokens if out else 0
    cached = out.cached_tokens if out else 0
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))


def token_name(token_id: int) -> str:
    """How a token is named in logprobs: the front holds no tokenizer, so by id (vLLM's form)."""
    return f"token_id:{token_id}"


def completion_logprobs(lps: list[P.TokenLogprob], offset: int) -> CompletionLogprobs:
    tops = [{token_name(t): v for t, v in (lp.top or [])} for lp in lps]
    return CompletionLogprobs(
        tokens=[token_name(lp.token_id) for lp in lps],
        token_logprobs=[lp.logprob for lp in lps],
        top_logprobs=tops,
        text_offset=[offset] * len(lps),
    )


def chat_logprobs(lps: list[P.TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        [
            ChatTokenLogprob(
                token_name(lp.token_id),
                lp.logprob,
                [TopLogprob(token_name(t), v) for t, v in (lp.top or [])],
            )
            for lp in lps
        ]
    )


def model_list(served: list[P.ServedModel], created: int | None = None) -> ModelList:
    created = int(time.time()) if created is None else created
    return ModelList(
        [ModelCard(m.name, created, "radixmux", m.folder, m.info.context_length) for m in served]
    )
