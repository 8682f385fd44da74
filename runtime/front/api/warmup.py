"""``POST /cache/warmup`` and ``--warmup FILE``: prefill prefixes before traffic needs them.

The front turns the body into token ids (text through a tokenizer worker as a
completion's prompt would be; chat ``messages`` through the chat template as a
chat request's, without the generation prompt, so it is the prefix every
later conversation starting with those messages shares; or ``token_ids`` as
given) and sends one ``WarmupRequest`` to the scheduler, which prefills them
at low priority, caches (and pins, or unpins) them and answers when all are
cached. See ``scheduler/warmup.py`` for priority and pins.

``--warmup FILE`` holds one such body per line (JSON lines; blank lines and
lines starting with ``#`` are skipped). The launcher checks every line before
it starts anything; the front runs them when every process is up, before
``/health`` turns 200, and reports the outcome to the launcher, which fails
the start with the line's error.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import zmq
from starlette.requests import Request
from starlette.responses import Response

from radixmux import protocol
from radixmux.common.process import report
from radixmux.runtime.api_common import (
    APIError,
    check_input_ids,
    decode_body,
    json_response,
    resolve_model,
)
from radixmux.runtime.front_hub import RequestHub, new_rid
from radixmux.runtime.openai_api import ChatMessageIn
from radixmux.runtime.openapi import Body, Endpoint, Handler
from radixmux.runtime.tokenize_api import TokenizeBody, tokenize_request

if TYPE_CHECKING:
    from radixmux.runtime.front import Front

log = logging.getLogger("radixmux.front")

# Warm-ups wait behind real requests, so on a busy server they may take long.
WARMUP_TIMEOUT_S = 600.0
MAX_PREFIXES = 64  # per warm-up body, as for a batch of prompts
FORMS = ("prompts", "messages", "token_ids")
# The name under which the front reports start-up warm-ups to the launcher.
STARTUP_NAME = "warmup"


class WarmupBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /cache/warmup``: exactly one of ``prompts`` (texts), ``messages``
    (one conversation) or ``token_ids`` (prefixes as ids). ``pin`` True keeps
    them from eviction; False (default) releases a pin the same prefix holds."""

    model: str | None = None
    prompts: list[str] | None = None
    messages: list[ChatMessageIn] | None = None
    token_ids: list[list[int]] | None = None
    pin: bool = False

    def check(self) -> None:
        """What can be checked without a tokenizer (APIError naming the field)."""
        given = [f for f in FORMS if getattr(self, f) is not None]
        if len(given) != 1:
            raise APIError(400, f"send exactly one of {', '.join(FORMS)}", "prompts")
        form = given[0]
        items = getattr(self, form)
        if not items:
            raise APIError(400, f"'{form}' must not be empty", form)
        if form != "messages" and len(items) > MAX_PREFIXES:
            raise APIError(400, f"at most {MAX_PREFIXES} prefixes per warm-up", form)
        if form == "prompts" and not all(items):
            raise APIError(400, "'prompts' must not hold an empty prompt", "prompts")


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
                _form(body),
            )
    return ids


def _form(body: WarmupBody) -> str:
    return next(f for f in FORMS if getattr(body, f) is not None)


async def warm(front: Front, body: WarmupBody, starting: bool = False) -> WarmupResponse:
    """Run one warm-up to the end (APIError on a refusal or failure)."""
    model = resolve_model(front.served, body.model)
    template = front.args.chat_template is not None
    ids = await prefix_ids(front.hub, body, model, template, starting)
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


def endpoints(front: Front, body: Body) -> list[tuple[Endpoint, Handler]]:
    """The warm-up route, for the front's route table and OpenAPI document."""

    async def warmup(request: Request) -> Response:
        req = await body(request, WarmupBody)
        assert isinstance(req, WarmupBody)
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


# ---- --warmup FILE -----------------------------------------------------------------
def load_warmup_file(path: str, models: Sequence[str]) -> list[tuple[int, WarmupBody]]:
    """Every warm-up of ``path`` with its line number; ValueError naming the
    first bad line (unreadable JSON, unknown field or model, no prefix)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--warmup {path}: {exc.strerror}") from None
    bodies = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            body = decode_body(line.encode(), WarmupBody)
            body.check()
            if body.model is not None and body.model not in models:
                raise APIError(400, f"model {body.model!r} is not served", "model")
        except APIError as exc:
            raise ValueError(f"--warmup {path} line {n}: {exc.message}") from None
        bodies.append((n, body))
    if not bodies:
        raise ValueError(f"--warmup {path}: no warm-up in the file")
    return bodies


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
