"""vLLM's ``/tokenize`` and ``/detokenize``: request and response schemas and conversion.

The front holds no tokenizer, so both go to a tokenizer worker (the one that
tokenizes generation requests), and ``/tokenize`` returns exactly the ids a
generation request with the same prompt or messages would be served with.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from radixmux import protocol
from radixmux.runtime.api_error import APIError
from radixmux.runtime.chat_input import ChatMessageIn
from radixmux.runtime.front.api.common import check_input_ids, json_response
from radixmux.runtime.front.api.openai.chat import chat_messages
from radixmux.runtime.front.hub import new_rid
from radixmux.runtime.front.openapi import Endpoint, Handler
from radixmux.runtime.front.state import Front


class TokenizeBody(msgspec.Struct, kw_only=True):
    """``POST /tokenize``: a text prompt, or chat messages rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    # None: as generation does (text gets the tokenizer's special tokens, chat
    # only what its template writes).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeBody(msgspec.Struct, kw_only=True):
    """``POST /detokenize``: token ids back to text."""

    tokens: list[int]
    model: str | None = None


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def tokenize_request(
    body: TokenizeBody, req_id: str, model: protocol.ServedModel, template_flag: bool
) -> protocol.TokenizeRequest:
    """The tokenizer worker's request for a ``/tokenize`` body (checked here first)."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of 'prompt' or 'messages'", "prompt")
    messages = None
    if body.messages is not None:
        messages = chat_messages(body.messages, model, template_flag)
    elif not body.prompt:
        raise APIError(400, "'prompt' must not be empty", "prompt")
    return protocol.TokenizeRequest(
        req_id=req_id,
        model=model.instance,
        prompt=body.prompt,
        messages=messages,
        add_special_tokens=body.add_special_tokens,
        add_generation_prompt=body.add_generation_prompt,
        return_token_strs=body.return_token_strs,
    )


def tokenize_response(
    reply: protocol.TokenizerReply, model: protocol.ServedModel
) -> TokenizeResponse:
    return TokenizeResponse(
        len(reply.tokens), model.info.context_length, reply.tokens, reply.token_strs
    )


def detokenize_request(
    body: DetokenizeBody, req_id: str, model: protocol.ServedModel
) -> protocol.DetokenizeRequest:
    """The worker's request for a ``/detokenize`` body (no tokens: the empty text)."""
    if body.tokens:
        check_input_ids(body.tokens, model.info.vocab_size, "tokens")
    return protocol.DetokenizeRequest(req_id, model.instance, body.tokens)


def endpoints(front: Front) -> list[tuple[Endpoint, Handler]]:
    """vLLM's ``/tokenize`` and ``/detokenize``."""

    async def tokenize(request: Request) -> Response:
        req = await front.body(request, TokenizeBody)
        async with front.on_demand.hold(req.model) as model:  # a registered one loads
            tokenize = tokenize_request(req, new_rid(), model, front.chat_template_flag)
            reply = await front.hub.tokenizer_call(tokenize)
        return json_response(tokenize_response(reply, model))

    async def detokenize(request: Request) -> Response:
        req = await front.body(request, DetokenizeBody)
        async with front.on_demand.hold(req.model) as model:
            reply = await front.hub.tokenizer_call(detokenize_request(req, new_rid(), model))
        return json_response(DetokenizeResponse(reply.text or ""))

    return [
        (
            Endpoint(
                "/tokenize",
                "POST",
                "vLLM's tokenize: the ids a generation request would be served with",
                TokenizeBody,
                TokenizeResponse,
            ),
            tokenize,
        ),
        (
            Endpoint(
                "/detokenize",
                "POST",
                "vLLM's detokenize: token ids back to text",
                DetokenizeBody,
                DetokenizeResponse,
            ),
            detokenize,
        ),
    ]
