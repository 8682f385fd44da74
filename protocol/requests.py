"""A request's way through the runtime: accepted at the front, tokenized, scheduled,
its outputs as token ids then text; rejections and aborts; the tokenizer service."""

from __future__ import annotations

import msgspec

from radixmux.protocol.types import ChatMessage, SamplingParams, TokenLogprob, ToolSpec


class GenerateRequest(msgspec.Struct, tag="generate", frozen=True):
    """A request as the front accepted it (text, ids or chat messages)."""

    rid: str
    model: str
    params: SamplingParams
    prompt: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stream: bool = False
    skip_special_tokens: bool = True
    arrival: float = 0.0  # time.time() when the front received it
    # The matched stop string stays at the end of the text (SGLang's
    # no_stop_trim, vLLM's include_stop_str_in_output); the front applies it.
    keep_stop_string: bool = False
    # Chat: how the template ends the prompt (transformers' apply_chat_template).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Chat with tool_choice "auto": the tools the template renders.
    tools: list[ToolSpec] | None = None


class TokenizedRequest(msgspec.Struct, tag="tokenized", frozen=True):
    """A request ready to schedule: prompt ids (packed int32) and sampling."""

    rid: str
    model: str
    input_ids: bytes
    params: SamplingParams
    stop: list[str] = msgspec.field(default_factory=list)
    skip_special_tokens: bool = True
    arrival: float = 0.0


class AbortRequest(msgspec.Struct, tag="abort", frozen=True):
    """Stop a request now and free its KV (client gone, stop string, timeout).

    ``early``: the front had no reply for it yet, so the request may still be
    in a tokenizer worker; the scheduler remembers the abort for a while and
    drops the request if it arrives later.
    """

    rid: str
    reason: str = "abort"
    early: bool = False


class RequestError(msgspec.Struct, tag="error", frozen=True):
    """A request that ends in an error before or during generation.

    ``status`` is the HTTP status the front answers with; ``param`` names the
    offending field where there is one.
    """

    rid: str
    status: int
    message: str
    param: str | None = None




class RequestOutput(msgspec.Struct, frozen=True):
    """What one scheduler step produced for one request.

    ``finish_reason``: ``"stop"`` (EOS / stop token), ``"length"``, ``"abort"``
    or ``"error"`` (then ``error`` and ``status`` say why), None while running.
    ``stop`` and ``skip_special_tokens`` are set on a request's first output so
    the detokenizer learns them.
    """

    rid: str
    model: str
    new_token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    status: int = 200
    stop: list[str] | None = None
    skip_special_tokens: bool = True
    # Seconds from arrival at the front to first admission into a batch; on
    # the request's first output only (None before admission or unknown).
    queue_time: float | None = None
    # With prompt logprobs asked for: on the first output, one per prompt
    # token from the asked start (the prompt's first token has logprob None).
    prompt_logprobs: list[TokenLogprob] | None = None


class TokenBatch(msgspec.Struct, tag="tokens", frozen=True):
    outputs: list[RequestOutput]


class TextOutput(msgspec.Struct, frozen=True):
    """A text delta for one request (what the front streams)."""

    rid: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None = None
    matched_stop: str | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    status: int = 200
    queue_time: float | None = None  # as in RequestOutput: first output only
    prompt_logprobs: list[TokenLogprob] | None = None  # as in RequestOutput


class TextBatch(msgspec.Struct, tag="text", frozen=True):
    outputs: list[TextOutput]


# ---- tokenizer service (/tokenize, /detokenize) ---------------------------------
class TokenizeRequest(msgspec.Struct, tag="tokenize", frozen=True):
    """Front to a tokenizer worker: a prompt's ids as generation would see them
    (``messages`` through the chat template), without generating."""

    req_id: str
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: as generation does for that form
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, tag="detokenize", frozen=True):
    """Front to a tokenizer worker: token ids back to text."""

    req_id: str
    model: str
    tokens: list[int]


class TokenizerReply(msgspec.Struct, tag="tokenizer_reply", frozen=True):
    """A tokenizer worker's answer; ``status`` >= 400 carries an error naming ``param``."""

    req_id: str
    status: int = 200
    tokens: list[int] = msgspec.field(default_factory=list)
    token_strs: list[str] | None = None
    text: str | None = None
    error: str | None = None
    param: str | None = None
