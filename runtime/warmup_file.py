"""A warm-up's form (``POST /cache/warmup``'s body) and ``--warmup FILE``, one per line.

The file holds JSON lines; blank lines and lines starting with ``#`` are
skipped. The launcher reads it before it starts anything, so a bad line fails
the start at once; the front runs the lines when every process is up, before
``/health`` turns 200 (``front/api/warmup.py``), and reports the outcome to
the launcher under :data:`STARTUP_NAME`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from radixmux.runtime.api_error import APIError, decode_body
from radixmux.runtime.chat_input import ChatMessageIn

MAX_PREFIXES = 64  # per warm-up body, as for a batch of prompts
FORMS = ("prompts", "messages", "token_ids")
# The name under which the front reports start-up warm-ups to the launcher.
STARTUP_NAME = "warmup"
# ... and, without them, that it has taken ServerReady in and serves.
SERVING_NAME = "serving"


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

    @property
    def form(self) -> str:
        """The one of :data:`FORMS` this warm-up is given in (after :meth:`check`)."""
        return next(f for f in FORMS if getattr(self, f) is not None)


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
