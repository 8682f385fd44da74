"""OpenAI's chat message as a client sends it: chat completions, ``/tokenize`` and warm-ups.

Below the HTTP front because a warm-up may hold a conversation and the
launcher reads ``--warmup FILE`` (``warmup_file.py``) before anything starts.
The front checks these and turns them into ``protocol.ChatMessage``
(``front/api/openai.chat_messages``).
"""

from __future__ import annotations

from typing import Any

import msgspec


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    # Declared only to be refused unless neutral (see openai.UNSUPPORTED_MESSAGE).
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None
