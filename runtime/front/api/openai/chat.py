"""OpenAI ``/v1/chat/completions``: its request and response, the checked
messages the model's chat template gets (``/tokenize`` takes them too), the
internal request a body becomes, and the per-request formatter.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from radixmux import protocol
from radixmux.runtime.api_error import APIError
from radixmux.runtime.chat_input import ChatMessageIn
from radixmux.runtime.front.api import extensions
from radixmux.runtime.front.api.common import (
    MAX_CONTENT_PARTS,
    check_chat_messages,
    check_len,
    refuse_unsupported,
)
from radixmux.runtime.front.api.openai import tools
from radixmux.runtime.front.api.openai.base import (
    UNSUPPORTED_SHARED,
    SamplingFields,
    Usage,
    finish_reason,
    generate_request,
    or_default,
    sampling_params,
    token_bytes,
    token_name,
    top_alternatives,
    usage_of,
)
from radixmux.runtime.front.api.openai.tools import (
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
    ToolDef,
)
from radixmux.runtime.front.api.structured import (
    ResponseFormat,
    one_constraint,
    openai_constraint,
)
from radixmux.runtime.front.hub import InFlight

# Chat has no documented default; a bounded one, because the tokenizer worker
# rejects prompt + max_tokens beyond the context.
CHAT_DEFAULT_MAX_TOKENS = 128


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    store: bool | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Declared only to be refused (see UNSUPPORTED).
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


UNSUPPORTED_CHAT = {
    **UNSUPPORTED_SHARED,
    **extensions.neutral_only(extensions.CHAT),
    "store": (False,),
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
}


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


class ChatMessageOut(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None  # None (null) when the answer is tool calls
    tool_calls: list[ToolCall] | None = None


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
    tool_calls: list[ToolCallDelta] | None = None


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


def chat_request(
    req: ChatRequest, rid: str, model: protocol.ServedModel, arrival: float, template_flag: bool
) -> tuple[protocol.GenerateRequest, tools.ToolPlan]:
    """The tokenizer's request for a /v1/chat/completions body, and what its
    tools ask of the answer."""
    refuse_unsupported(req, UNSUPPORTED_CHAT)
    messages = chat_messages(req.messages, model, template_flag)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = or_default(
        req.max_completion_tokens, or_default(req.max_tokens, CHAT_DEFAULT_MAX_TOKENS)
    )
    plan = tools.plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    found = [c for c in (plan.constraint, openai_constraint(req)) if c is not None]
    params = sampling_params(req, max_tokens, model.info, logprobs, one_constraint(found))
    specs = list(plan.specs) if plan.mode == "auto" else None
    gen = generate_request(
        req, rid, model, params, arrival, messages=messages, tools=specs, **prompt_end(req)
    )
    return gen, plan


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


def chat_logprobs(lps: list[protocol.TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        [
            ChatTokenLogprob(
                token_name(lp.token_id, lp.text),
                lp.logprob,
                [TopLogprob(name, v, token_bytes(text)) for name, v, text in top_alternatives(lp)],
                token_bytes(lp.text),
            )
            for lp in lps
        ]
    )


class ChatFormat:
    """``/v1/chat/completions``. With tools the text of each choice is held
    until it ends, then sent as tool calls (or as content, if it holds none)."""

    def __init__(
        self,
        rid: str,
        model: str,
        logprobs: bool,
        include_usage: bool,
        plan: tools.ToolPlan = tools.NO_TOOLS,
    ) -> None:
        self.id = f"chatcmpl-{rid}"
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.plan = plan
        self.started: set[int] = set()  # choices whose role chunk is sent
        # With tools: each choice's outputs so far (text and logprobs).
        self.held: dict[int, list[protocol.TextOutput]] = {}

    def _chunk(self, index: int, delta: ChatDelta, lps=None, reason=None) -> ChatChunk:
        choices = [ChatChunkChoice(index, delta, lps, reason)]
        return ChatChunk(self.id, self.created, self.model, choices)

    def chunks(self, out: protocol.TextOutput, gen: InFlight, index: int) -> list[msgspec.Struct]:
        found: list[msgspec.Struct] = []
        if index not in self.started:
            # OpenAI's first chunk of a choice announces the role with empty content.
            self.started.add(index)
            found.append(self._chunk(index, ChatDelta(role="assistant", content="")))
        if self.plan.parses_calls:
            self.held.setdefault(index, []).append(out)
            if gen.done:
                held = self.held.pop(index)
                content, calls = tools.read_calls(self.plan, "".join(o.text for o in held))
                deltas = [tools.ToolCallDelta(k, c.id, c.function) for k, c in enumerate(calls)]
                # The held tokens' logprobs come with the delta.
                delta = ChatDelta(content=content, tool_calls=deltas or None)
                found.append(self._chunk(index, delta, self._logprobs(held)))
                found.append(self._chunk(index, ChatDelta(), reason=_reason(gen, calls)))
            return found
        if out.text or out.logprobs:
            lps = chat_logprobs(out.logprobs or []) if self.logprobs else None
            found.append(self._chunk(index, ChatDelta(content=out.text), lps))
        if gen.done:
            found.append(self._chunk(index, ChatDelta(), reason=finish_reason(gen)))
        return found

    def _logprobs(self, outs: list[protocol.TextOutput]) -> ChatLogprobs | None:
        """The logprobs of ``outs`` joined, when the request asks for them."""
        if not self.logprobs:
            return None
        return chat_logprobs([lp for o in outs for lp in o.logprobs or []])

    def tail(self, gens: list[InFlight]) -> list[msgspec.Struct]:
        if not self.include_usage:
            return []
        return [ChatChunk(self.id, self.created, self.model, [], usage_of(gens))]

    def full(
        self, outputs: list[list[protocol.TextOutput]], gens: list[InFlight]
    ) -> msgspec.Struct:
        choices = []
        for i, (outs, gen) in enumerate(zip(outputs, gens, strict=True)):
            text = "".join(o.text for o in outs)
            lps = self._logprobs(outs)
            content: str | None = text
            calls: list[ToolCall] = []
            if self.plan.parses_calls:
                content, calls = tools.read_calls(self.plan, text)
            message = ChatMessageOut("assistant", content, calls or None)
            choices.append(ChatChoice(i, message, lps, _reason(gen, calls)))
        return ChatResponse(self.id, self.created, self.model, choices, usage_of(gens))


def _reason(gen: InFlight, calls: list[ToolCall]) -> str | None:
    """A choice's finish reason: ``tool_calls`` when its answer is tool calls."""
    return "tool_calls" if calls and gen.done else finish_reason(gen)
