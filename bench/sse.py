"""The servers' Server-Sent Events streams, read the one way every bench client reads them.

OpenAI completions and chat chunks, SGLang ``/generate`` events and plain
answers of all three APIs: where an event's payload is, its text and its
finish reason.
"""

from __future__ import annotations

import json
from typing import Any

DONE = "[DONE]"  # the payload that ends a stream
SSE_DONE: dict[str, Any] = {}  # ``sse_message``'s answer at ``[DONE]`` (compared by identity)


def sse_data(line: str) -> str | None:
    """The payload of one SSE line (``data: X`` gives ``X``); None for any other line."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def sse_message(line: str) -> dict[str, Any] | None:
    """The JSON message of one SSE line; ``SSE_DONE`` at ``[DONE]``; None for a
    line that carries no data. A payload that is not JSON raises ValueError."""
    data = sse_data(line)
    if data is None:
        return None
    return SSE_DONE if data == DONE else json.loads(data)


def event_text(msg: Any) -> str:
    """The text of a response or stream event (``/generate`` streams carry it cumulative)."""
    if not isinstance(msg, dict):
        return ""
    if "meta_info" in msg:
        return str(msg.get("text") or "")
    choices = msg.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:
        return c.get("text") or ""
    holder = c.get("message") or c.get("delta") or {}
    return holder.get("content") or ""


def finish_reason(msg: Any) -> str | None:
    """The finish reason of a response or stream event in any of the three APIs."""
    if not isinstance(msg, dict):
        return None
    meta = msg.get("meta_info")
    if isinstance(meta, dict):  # SGLang /generate
        finish = meta.get("finish_reason")
        return finish.get("type") if isinstance(finish, dict) else None
    choices = msg.get("choices") or []
    return choices[0].get("finish_reason") if choices and isinstance(choices[0], dict) else None
