"""Messages between the Python ZMQ client and the front (DEALER -> ROUTER).

One msgpack message per frame. The client sends :class:`ClientGenerate` (and
:class:`ClientAbort` when it stops reading a stream); the front answers each
request, under the client's own ``rid``, with ``TextBatch`` frames of one
``TextOutput`` each (every delta when streaming, one merged output otherwise)
or one ``RequestError``. The output whose ``finish_reason`` is set is the last.
"""

from __future__ import annotations

import msgspec

from radixmux.protocol import ChatMessage, RequestError, SamplingParams, TextBatch
from radixmux.runtime.models_api import ModelChange


class ClientGenerate(msgspec.Struct, tag="client_generate", frozen=True):
    """A generation request; exactly one of prompt / input_ids / messages."""

    rid: str  # chosen by the client, unique among its requests in flight
    model: str | None = None  # optional when the server serves one model
    prompt: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stop: list[str] = msgspec.field(default_factory=list)
    stream: bool = True
    skip_special_tokens: bool = True
    api_key: str | None = None  # checked when the server runs with --api-key


class ClientAbort(msgspec.Struct, tag="client_abort", frozen=True):
    """The client no longer wants ``rid`` (frees its KV at once)."""

    rid: str


class ClientModelChange(msgspec.Struct, tag="client_model_change", frozen=True):
    """Load, unload or reload a model, as ``POST /models``, ``DELETE
    /models/{name}`` and ``POST /models/{name}/reload`` do over HTTP."""

    rid: str
    op: str  # "load" | "unload" | "reload"
    name: str | None = None  # required for unload and reload
    source: str | None = None  # required for load
    dtype: str | None = None
    priority: float = 1.0
    replicas: int = 1
    timeout: float | None = None  # unload / reload: fail what still runs after this
    api_key: str | None = None


class ClientModelChanged(msgspec.Struct, tag="client_model_changed", frozen=True):
    """The answer to a ``ClientModelChange`` that succeeded."""

    rid: str
    change: ModelChange


ClientInbox = ClientGenerate | ClientAbort | ClientModelChange
ClientReply = TextBatch | RequestError | ClientModelChanged
