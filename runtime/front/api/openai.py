"""The OpenAI API: request and response schemas, conversion, formatting, routes.

One module per API under ``front/api/`` (this one, ``native``, ``tokenize``,
``ops``, ``models``, ``warmup``, ``dashboard``): its types, the internal
requests made from them, the per-request formatters (``CompletionFormat``,
``ChatFormat``) and ``endpoints``, the routes the app (``front/app.py``) mounts.

Requests decode straight into these Structs. Nothing a client sends is
silently ignored: a field outside the OpenAI API (and SGLang's and vLLM's
extensions, ``extensions.py``) is a 400 naming it, as OpenAI answers; a field
this server does not implement is declared and refused with a 400 unless it
holds its neutral value (``UNSUPPORTED_*``); :func:`completion_request` and
:func:`chat_request` check them against the served model and build the
:class:`GenerateRequest` the tokenizer workers take. Sampling defaults follow
OpenAI (temperature 1, top_p 1); greedy is ``temperature=0``.

A formatter is made per request: streaming calls ``chunks`` per output and
``tail`` after the last, non-streaming calls ``full`` with every output.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from radixmux import protocol
from radixmux.protocol import ModelInfo, SamplingParams
from radixmux.runtime.api_error import APIError
from radixmux.runtime.chat_input import ChatMessageIn
from radixmux.runtime.client.messages import ModelCard, model_card
from radixmux.runtime.front.api import extensions
from radixmux.runtime.front.api.common import (
    MAX_CONTENT_PARTS,
    MAX_N,
    MAX_PROMPTS,
    check_chat_messages,
    check_input_ids,
    check_len,
    check_metadata,
    check_n,
    check_name,
    check_sampling,
    fan_out,
    json_response,
    logit_bias,
    refuse_unsupported,
    resolve_model,
    stop_list,
)
from radixmux.runtime.front.hub import Generation, new_rid
from radixmux.runtime.front.openapi import Endpoint, Handler
from radixmux.runtime.front.state import Front
from radixmux.runtime.front.stream import serve_generation

log = logging.getLogger("radixmux.front")

# OpenAI's documented default for /v1/completions; chat has none, we pick a bounded one
# because the tokenizer worker rejects prompt + max_tokens beyond the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 128
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


# ---- requests -------------------------------------------------------------------
class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = False


class _SamplingFields(extensions.OpenAIExtensions, kw_only=True, forbid_unknown_fields=True):
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


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    # Extensions of this endpoint alone (see extensions.COMPLETION).
    json_schema: Any = None


class ChatRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    store: bool | None = None
    # Declared only to be refused (see UNSUPPORTED).
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    # Extensions of this endpoint alone (see extensions.CHAT).
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    include_reasoning: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None
    echo: bool | None = None
    return_prompt_token_ids: bool | None = None
    return_meta_info: bool | None = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    use_audio_in_video: bool | None = None
    input_ids: Any = None
    task: Any = None


# Fields of the API that this server does not implement, and the values that
# ask for nothing (None always does): anything else is a 400 naming the field.
UNSUPPORTED_SHARED: dict[str, tuple[Any, ...]] = {
    "service_tier": ("auto", "default"),
}
# A message's fields the chat template is not given (a participant's name,
# tool calls and results): refused rather than dropped from the prompt.
UNSUPPORTED_MESSAGE: dict[str, tuple[Any, ...]] = {
    "name": (),
    "tool_calls": ([],),
    "tool_call_id": (),
    "refusal": (),
    "audio": (),
    "function_call": (),
}
UNSUPPORTED_COMPLETION = {
    **UNSUPPORTED_SHARED,
    "suffix": ("",),
    **extensions.neutral_only(extensions.COMPLETION),
}
UNSUPPORTED_CHAT = {
    **UNSUPPORTED_SHARED,
    **extensions.neutral_only(extensions.CHAT),
    "store": (False,),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),  # means nothing without tools
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
}


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


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


# ---- conversion -----------------------------------------------------------------
def sampling_params(
    req: _SamplingFields, max_tokens: int, info: ModelInfo, logprobs: int | None
) -> SamplingParams:
    """Checked runner sampling parameters from an OpenAI request."""
    n_choices(req)
    for tag in ("user", "safety_identifier", "prompt_cache_key"):
        check_name(getattr(req, tag), tag)
    check_metadata(req.metadata)
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
        logit_bias=logit_bias(req.logit_bias, "logit_bias"),
    )
    check_sampling(params, info)
    return params


def n_choices(req: _SamplingFields) -> int:
    """How many choices the request asks for (``n``, checked)."""
    return check_n(req.n, "n")


def best_of(req: CompletionRequest) -> int:
    """How many samples per prompt to draw (``best_of``, at least ``n``); the
    ``n`` with the highest mean token logprob are returned."""
    n = n_choices(req)
    if req.best_of is None:
        return n
    if not n <= req.best_of <= MAX_N:
        raise APIError(400, f"'best_of' must be in [n, {MAX_N}] (n = {n})", "best_of")
    return req.best_of


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


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
    max_tokens = _or(req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS)
    params = sampling_params(req, max_tokens, model.info, req.logprobs)
    if req.echo and req.logprobs is not None:  # the echoed prompt's logprobs too
        params = msgspec.structs.replace(params, prompt_logprobs_start=0)
    if ranked:  # ranking needs every sample's logprobs, shown or not
        params = msgspec.structs.replace(params, logprobs=True)
    return [
        _generate(req, rid, model, params, arrival, prompt=text, input_ids=ids)
        for text, ids in _prompts(req.prompt, model.info.vocab_size)
    ]


def _generate(
    req: _SamplingFields,
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
        skip_special_tokens=_or(req.skip_special_tokens, True),
        arrival=arrival,
        keep_stop_string=bool(req.no_stop_trim or req.include_stop_str_in_output),
        **prompt,
    )


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


def chat_request(
    req: ChatRequest, rid: str, model: protocol.ServedModel, arrival: float, template_flag: bool
) -> protocol.GenerateRequest:
    """The tokenizer's request for a /v1/chat/completions body."""
    refuse_unsupported(req, UNSUPPORTED_CHAT)
    messages = chat_messages(req.messages, model, template_flag)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = _or(req.max_completion_tokens, _or(req.max_tokens, CHAT_DEFAULT_MAX_TOKENS))
    params = sampling_params(req, max_tokens, model.info, logprobs)
    return _generate(req, rid, model, params, arrival, messages=messages, **prompt_end(req))


def prompt_end(req: ChatRequest) -> dict[str, bool]:
    """How the template ends the prompt: a generation prompt (the default), or
    the last message left open (``continue_final_message``), not both (as vLLM)."""
    cont = bool(req.continue_final_message)
    if cont and req.add_generation_prompt:
        raise APIError(
            400,
            "'continue_final_message' and 'add_generation_prompt' cannot both be true",
            "continue_final_message",
        )
    add = not cont if req.add_generation_prompt is None else req.add_generation_prompt
    return {"add_generation_prompt": add, "continue_final_message": cont}


def chat_messages(
    messages: list[ChatMessageIn], model: protocol.ServedModel, template_flag: bool
) -> list[protocol.ChatMessage]:
    """Checked chat messages for ``model``'s template (chat and /tokenize alike)."""
    check_chat_messages(messages, model, template_flag)
    return [chat_message(m, i) for i, m in enumerate(messages)]


def chat_message(m: ChatMessageIn, i: int) -> protocol.ChatMessage:
    refuse_unsupported(m, UNSUPPORTED_MESSAGE, f"messages[{i}].")
    if m.role not in CHAT_ROLES:
        raise APIError(
            400, f"'messages[{i}].role' must be one of {CHAT_ROLES}", f"messages[{i}].role"
        )
    if m.content is None or isinstance(m.content, str):
        return protocol.ChatMessage(m.role, m.content or "")
    check_len(m.content, MAX_CONTENT_PARTS, f"messages[{i}].content", "parts")
    texts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise APIError(
                400,
                f"'messages[{i}].content': only text parts are supported",
                f"messages[{i}].content",
            )
        texts.append(part.text)
    return protocol.ChatMessage(m.role, "".join(texts))


def usage(lasts: list[protocol.TextOutput | None], n: int = 1) -> Usage:
    """Token counts from each choice's finished (or latest) output, ``n`` choices
    per prompt: each prompt once (its choices share it), the completions summed."""
    firsts = [out for out in lasts[::n] if out]
    prompt = sum(out.prompt_tokens for out in firsts)
    cached = sum(out.cached_tokens for out in firsts)
    completion = sum(out.completion_tokens for out in lasts if out)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))


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


def _tops(lp: protocol.TokenLogprob) -> list[tuple[str, float, str | None]]:
    """(name, logprob, text) of each top alternative."""
    texts: list[str | None] = list(lp.top_text or [None] * len(lp.top or []))
    return [(token_name(t, x), v, x) for (t, v), x in zip(lp.top or [], texts, strict=True)]


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
            None if lp.logprob is None else {name: v for name, v, _ in _tops(lp)} for lp in lps
        ],
        text_offset=offsets,
    )


def chat_logprobs(lps: list[protocol.TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        [
            ChatTokenLogprob(
                token_name(lp.token_id, lp.text),
                lp.logprob,
                [TopLogprob(name, v, token_bytes(text)) for name, v, text in _tops(lp)],
                token_bytes(lp.text),
            )
            for lp in lps
        ]
    )


def model_list(served: list[protocol.ServedModel], created: int | None = None) -> ModelList:
    created = int(time.time()) if created is None else created
    return ModelList([model_card(m, created) for m in served])


# ---- response formatting (one formatter per request) ----------------------------
def _reason(gen: Generation) -> str | None:
    return gen.finish_reason if gen.done else None


def _usage(gens: list[Generation], n: int = 1) -> Usage:
    return usage([g.last for g in gens], n)


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

    def chunks(self, out: protocol.TextOutput, gen: Generation, index: int) -> list[msgspec.Struct]:
        reason = _reason(gen)
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

    def tail(self, gens: list[Generation]) -> list[msgspec.Struct]:
        return [self._response([], _usage(gens, self.n))] if self.include_usage else []

    def full(
        self, outputs: list[list[protocol.TextOutput]], gens: list[Generation]
    ) -> msgspec.Struct:
        picked = self._best(outputs)
        choices = [
            CompletionChoice(
                i,
                self._prompt(k // self.best_of) + "".join(o.text for o in outputs[k]),
                self._lps(outputs[k], 0),
                _reason(gens[k]),
            )
            for i, k in enumerate(picked)
        ]
        return self._response(choices, _usage(gens, self.best_of))  # every sample is billed

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


class ChatFormat:
    """``/v1/chat/completions``."""

    def __init__(self, rid: str, model: str, logprobs: bool, include_usage: bool) -> None:
        self.id = f"chatcmpl-{rid}"
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.started: set[int] = set()  # choices whose role chunk is sent

    def _chunk(self, index: int, delta: ChatDelta, lps=None, reason=None) -> ChatChunk:
        choices = [ChatChunkChoice(index, delta, lps, reason)]
        return ChatChunk(self.id, self.created, self.model, choices)

    def chunks(self, out: protocol.TextOutput, gen: Generation, index: int) -> list[msgspec.Struct]:
        found: list[msgspec.Struct] = []
        if index not in self.started:
            # OpenAI's first chunk of a choice announces the role with empty content.
            self.started.add(index)
            found.append(self._chunk(index, ChatDelta(role="assistant", content="")))
        if out.text or out.logprobs:
            lps = chat_logprobs(out.logprobs or []) if self.logprobs else None
            found.append(self._chunk(index, ChatDelta(content=out.text), lps))
        if gen.done:
            found.append(self._chunk(index, ChatDelta(), reason=_reason(gen)))
        return found

    def tail(self, gens: list[Generation]) -> list[msgspec.Struct]:
        if not self.include_usage:
            return []
        return [ChatChunk(self.id, self.created, self.model, [], _usage(gens))]

    def full(
        self, outputs: list[list[protocol.TextOutput]], gens: list[Generation]
    ) -> msgspec.Struct:
        choices = []
        for i, (outs, gen) in enumerate(zip(outputs, gens, strict=True)):
            text = "".join(o.text for o in outs)
            lps = None
            if self.logprobs:
                lps = chat_logprobs([lp for o in outs for lp in o.logprobs or []])
            message = ChatMessageOut("assistant", text)
            choices.append(ChatChoice(i, message, lps, _reason(gen)))
        return ChatResponse(self.id, self.created, self.model, choices, _usage(gens))


# ---- routes ----------------------------------------------------------------------
def _log_user(rid: str, req: CompletionRequest | ChatRequest) -> None:
    """OpenAI's end-user fields change no answer; the log keeps them with the request id."""
    if req.user or req.safety_identifier:
        log.info("rid=%s user=%r safety_identifier=%r", rid, req.user, req.safety_identifier)


def endpoints(front: Front) -> list[tuple[Endpoint, Handler]]:
    """The OpenAI routes, for the front's route table and OpenAPI document."""

    async def prompt_text(gen: protocol.GenerateRequest) -> str:
        """A prompt as text (``echo``): as sent, or its token ids decoded."""
        if gen.prompt is not None:
            return gen.prompt
        ids = gen.input_ids or []
        reply = await front.hub.tokenizer_call(
            protocol.DetokenizeRequest(new_rid(), gen.model, ids)
        )
        return reply.text or ""

    async def completions(request: Request) -> Response:
        req = await front.body(request, CompletionRequest)
        model = resolve_model(front.served, req.model)
        rid = new_rid()
        prompts = completion_request(req, rid, model, time.time())
        _log_user(rid, req)
        usage = bool(req.stream_options and req.stream_options.include_usage)
        n, samples = n_choices(req), best_of(req)
        echo = [await prompt_text(p) for p in prompts] if req.echo else None
        shown = req.logprobs is not None  # best_of > n asks for logprobs to rank by
        fmt = CompletionFormat(rid, model.name, shown, usage, n, echo, samples)
        gens = fan_out(prompts, samples, "best_of" if samples > n else "n")
        return await serve_generation(request, front.hub, gens, fmt, "completions")

    async def chat(request: Request) -> Response:
        req = await front.body(request, ChatRequest)
        model = resolve_model(front.served, req.model)
        rid = new_rid()
        gen = chat_request(req, rid, model, time.time(), front.chat_template_flag)
        _log_user(rid, req)
        usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = ChatFormat(rid, model.name, gen.params.logprobs, usage)
        gens = fan_out([gen], n_choices(req))
        return await serve_generation(request, front.hub, gens, fmt, "chat")

    async def list_models(request: Request) -> Response:
        return json_response(model_list(list(front.served.values()), front.started))

    async def get_model_card(request: Request) -> Response:
        model = resolve_model(front.served, request.path_params["name"])
        return json_response(model_card(model, front.started))

    return [
        (
            Endpoint(
                "/v1/completions",
                "POST",
                "OpenAI text completion",
                CompletionRequest,
                CompletionResponse,
                streams=True,
            ),
            completions,
        ),
        (
            Endpoint(
                "/v1/chat/completions",
                "POST",
                "OpenAI chat completion (the model's chat template)",
                ChatRequest,
                ChatResponse,
                streams=True,
            ),
            chat,
        ),
        (Endpoint("/v1/models", "GET", "served models", response=ModelList), list_models),
        (
            Endpoint("/v1/models/{name:path}", "GET", "one served model", response=ModelCard),
            get_model_card,
        ),
    ]
