"""Messages between the Python ZMQ client and the front (DEALER -> ROUTER), and the
model-change bodies and answer that the HTTP API shares with them.

One msgpack message per frame. The client sends :class:`ClientGenerate` (and
:class:`ClientAbort` when it stops reading a stream); the front answers each
request, under the client's own ``rid``, with ``TextBatch`` frames of one
``TextOutput`` each (every delta when streaming, one merged output otherwise)
or one ``RequestError``. The output whose ``finish_reason`` is set is the last.
A :class:`ClientModelChange` is answered by a :class:`ClientModelChanged`
holding the same :class:`ModelChange` that ``POST /models``, ``DELETE
/models/{name}`` and ``POST /models/{name}/reload`` answer with; those routes
take :class:`LoadModelBody` and :class:`ReloadModelBody`. They live here, not
in the front, so that the client never imports the front.
"""

from __future__ import annotations

import msgspec

from radixmux import protocol
from radixmux.protocol import ChatMessage, RequestError, SamplingParams, TextBatch


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


# ---- model changes (HTTP and ZMQ alike) ------------------------------------------
class LoadModelBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /models``: the ``--model`` flag's fields."""

    source: str
    name: str | None = None  # default: the source's last path part
    dtype: str | None = None  # default: --dtype
    priority: float = 1.0
    replicas: int = 1
    load: str = "start"  # or "on_demand": register only; its first request loads it
    keep_alive: float | None = None  # on demand: idle seconds before unload (--idle-unload-seconds)


class ReloadModelBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /models/{name}/reload``: a new version of a served name."""

    source: str | None = None  # default: the current version's folder (new weights there)
    dtype: str | None = None  # default: the current version's


class ModelCard(msgspec.Struct):
    """OpenAI's model object, plus what a multi-model client needs to route by:
    the context length (vLLM's ``max_model_len``), which models share one
    tokenizer (``tokenizer_group``: same ids for the same text) and which share
    KV (``kv_share_key``: same weights, so one cached prefix serves both)."""

    id: str
    created: int
    owned_by: str
    root: str
    max_model_len: int
    architecture: str
    dtype: str
    tokenizer_group: str
    kv_share_key: str
    object: str = "model"
    version: int = 1  # radixmux: counts reloads of this name (POST /models/{name}/reload)
    state: str = "loaded"  # radixmux: loaded, loading, registered (on demand) or failed


def model_card(m: protocol.ServedModel, created: int) -> ModelCard:
    """``m``'s card (``GET /v1/models``, a model change's answer)."""
    info = m.info
    return ModelCard(
        id=m.name,
        created=created,
        owned_by="radixmux",
        root=m.folder,
        max_model_len=info.context_length,
        architecture=info.architecture,
        dtype=info.dtype,
        tokenizer_group=info.tokenizer_fingerprint,
        kv_share_key=info.kv_share_key,
        version=m.version,
    )


class ModelChange(msgspec.Struct):
    """What a load, unload or reload did."""

    name: str
    version: int
    message: str
    seconds: float
    model: ModelCard | None = None  # after a load or reload
    freed_tokens: int = 0  # cached tokens the old or unloaded instance gave back
    aborted: int = 0  # requests still running at ?timeout=, failed with a 503
    ok: bool = True


class ClientModelChanged(msgspec.Struct, tag="client_model_changed", frozen=True):
    """The answer to a ``ClientModelChange`` that succeeded."""

    rid: str
    change: ModelChange


ClientInbox = ClientGenerate | ClientAbort | ClientModelChange
ClientReply = TextBatch | RequestError | ClientModelChanged
