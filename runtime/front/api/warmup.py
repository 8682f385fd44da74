"""``POST /cache/warmup`` and ``--warmup FILE``: prefill prefixes before traffic needs them.

The front turns the body into token ids (text through a tokenizer worker as a
completion's prompt would be; chat ``messages`` through the chat template as a
chat request's, without the generation prompt, so it is the prefix every
later conversation starting with those messages shares; or ``token_ids`` as
given) and sends one ``WarmupRequest`` to the scheduler, which prefills them
at low priority, caches (and pins, or unpins) them and answers when all are
cached. See ``scheduler/warmup.py`` for priority and pins.

``--warmup FILE`` holds one such body per line (the body and the file's
reading are ``runtime/warmup_file.py``'s: the launcher checks every line before
it starts anything). The front runs them when every process is up, before
``/health`` turns 200, and reports the outcome to the launcher, which fails
the start with the line's error.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable

import msgspec
import zmq
from starlette.requests import Request
from starlette.responses import Response

from radixmux import protocol
from radixmux.common.process import report
from radixmux.runtime.api_error import APIError
from radixmux.runtime.front.api.common import check_input_ids, json_response
from radixmux.runtime.front.api.tokenize import TokenizeBody, tokenize_request
from radixmux.runtime.front.hub import RequestHub, new_rid
from radixmux.runtime.front.openapi import Endpoint, Handler
from radixmux.runtime.front.state import Front
from radixmux.runtime.warmup_file import STARTUP_NAME, WarmupBody, load_warmup_file

log = logging.getLogger("radixmux.front")

# Warm-ups wait behind real requests, so on a busy server they may take long.
WARMUP_TIMEOUT_S = 600.0


class WarmupResponse(msgspec.Struct):
    """What was cached: one item per prefix, in order, and the totals."""

    model: str
    pin: bool
    cached_tokens: int
    pinned_tokens: int
    items: list[protocol.WarmedPrefix]


async def prefix_ids(
    hub: RequestHub, body: WarmupBody, model: protocol.ServedModel, template: bool, starting: bool
) -> list[list[int]]:
    """Each prefix's token ids, exactly as a generation request would have them."""
    body.check()
    if body.token_ids is not None:
        ids = [
            check_input_ids(t, model.info.vocab_size, f"token_ids[{i}]")
            for i, t in enumerate(body.token_ids)
        ]
    else:
        forms = (
            [TokenizeBody(messages=body.messages, add_generation_prompt=False)]
            if body.messages is not None
            else [TokenizeBody(prompt=p) for p in body.prompts or []]
        )
        ids = []
        for form in forms:
            req = tokenize_request(form, new_rid(), model, template)
            ids.append((await hub.tokenizer_call(req, starting=starting)).tokens)
    for i, t in enumerate(ids):
        if len(t) >= model.info.context_length:  # one token is generated after it
            raise APIError(
                400,
                f"prefix {i} has {len(t)} tokens; the model's context is "
                f"{model.info.context_length}",
                body.form,
            )
    return ids


async def warm(front: Front, body: WarmupBody, starting: bool = False) -> WarmupResponse:
    """Run one warm-up to the end (APIError on a refusal or failure); a
    registered on-demand model is loaded first, and kept until it is done."""
    async with front.on_demand.hold(body.model) as model:
        ids = await prefix_ids(front.hub, body, model, front.chat_template_flag, starting)
        msg = protocol.WarmupRequest(
            new_rid(), model.instance, [protocol.pack_ids(t) for t in ids], body.pin
        )
        t0 = time.perf_counter()
        reply = await front.hub.warmup(msg, WARMUP_TIMEOUT_S, starting)
        if reply.status >= 400:
            raise APIError(reply.status, reply.message, reply.param)
        log.info(
            "warm-up model=%s prefixes=%d cached=%s pin=%s in %.0f ms",
            model.name,
            len(ids),
            [it.cached_tokens for it in reply.items],
            body.pin,
            (time.perf_counter() - t0) * 1000,
        )
        return WarmupResponse(
            model.name,
            body.pin,
            sum(it.cached_tokens for it in reply.items),
            sum(it.pinned_tokens for it in reply.items),
            reply.items,
        )


def endpoints(front: Front) -> list[tuple[Endpoint, Handler]]:
    """The warm-up route, for the front's route table and OpenAPI document."""

    async def warmup(request: Request) -> Response:
        req = await front.body(request, WarmupBody)
        return json_response(await warm(front, req))

    return [
        (
            Endpoint(
                "/cache/warmup",
                "POST",
                "prefill prefixes at low priority (pin: keep them from eviction)",
                WarmupBody,
                WarmupResponse,
            ),
            warmup,
        )
    ]


def at_start(front: Front, zctx: zmq.Context) -> Callable[[], Awaitable[bool]]:
    """The front's hook for ``--warmup FILE``: run each line, then tell the
    launcher (``ProcessReady`` / ``ProcessFailed`` named ``warmup``)."""
    path = front.args.warmup
    assert path is not None

    async def run() -> bool:
        eps = front.ctx.endpoints
        try:
            bodies = load_warmup_file(path, list(front.served))
            for n, body in bodies:
                try:
                    await warm(front, body, starting=True)
                except APIError as exc:
                    raise ValueError(f"--warmup {path} line {n}: {exc.message}") from None
        except ValueError as exc:
            log.error("%s", exc)
            report(zctx, eps, protocol.ProcessFailed(STARTUP_NAME, os.getpid(), str(exc)))
            return False
        log.info("--warmup %s: %d warm-ups done", path, len(bodies))
        report(zctx, eps, protocol.ProcessReady(STARTUP_NAME, os.getpid()))
        return True

    return run
