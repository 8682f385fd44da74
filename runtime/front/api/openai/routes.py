"""The OpenAI routes: completions, chat completions and the model list."""

from __future__ import annotations

import logging
import time

from starlette.requests import Request
from starlette.responses import Response

from radixmux import protocol
from radixmux.runtime.client.messages import ModelCard, model_card
from radixmux.runtime.front.api.common import fan_out, json_response, resolve_model
from radixmux.runtime.front.api.openai.base import ModelList, model_list, n_choices
from radixmux.runtime.front.api.openai.chat import (
    ChatFormat,
    ChatRequest,
    ChatResponse,
    chat_request,
)
from radixmux.runtime.front.api.openai.completions import (
    CompletionFormat,
    CompletionRequest,
    CompletionResponse,
    best_of,
    completion_request,
)
from radixmux.runtime.front.hub import new_rid
from radixmux.runtime.front.openapi import Endpoint, Handler
from radixmux.runtime.front.state import Front
from radixmux.runtime.front.stream import serve_generation

log = logging.getLogger("radixmux.front")


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
        model = await front.model(req.model)
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
        model = await front.model(req.model)
        rid = new_rid()
        gen, plan = chat_request(req, rid, model, time.time(), front.chat_template_flag)
        _log_user(rid, req)
        usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = ChatFormat(rid, model.name, gen.params.logprobs, usage, plan)
        gens = fan_out([gen], n_choices(req))
        return await serve_generation(request, front.hub, gens, fmt, "chat")

    async def list_models(request: Request) -> Response:
        models = model_list(list(front.served.values()), front.started)
        models.data += front.on_demand.cards(front.started)
        return json_response(models)

    async def get_model_card(request: Request) -> Response:
        name = request.path_params["name"]
        if name in front.on_demand.registry:
            return json_response(front.on_demand.card(name, front.started))
        model = resolve_model(front.served, name)
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
        (
            Endpoint(
                "/v1/models",
                "GET",
                "served models, and registered on-demand ones",
                response=ModelList,
            ),
            list_models,
        ),
        (
            Endpoint("/v1/models/{name:path}", "GET", "one served model", response=ModelCard),
            get_model_card,
        ),
    ]
