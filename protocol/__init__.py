"""Every message our processes exchange, and the types they carry.

Layering (docs/design.md): ``memory/`` <- this package <- ``common/`` <-
``model_runners/`` and ``scheduler/`` <- ``runtime/``. It imports nothing of ours
but ``memory.layout``. One module per conversation:

* ``types``      what every process carries: ``ModelArg``, ``ModelInfo``,
                 ``ServedModel``, ``SamplingParams``, ``ChatMessage``, ``TokenLogprob``
* ``runner``     scheduler <-> runner: ``ForwardBatch`` in, ``ForwardResult`` out
* ``requests``   a request's way: front -> tokenizer -> scheduler -> detokenizer -> front
* ``control``    the front's operations on the scheduler, warm-ups
* ``views``      what the scheduler reports (stats, dashboard)
* ``lifecycle``  processes and models coming and going
* ``sockets``    one message union per receiving socket
* ``codec``      msgpack encoding; token ids as packed int32 bytes

Data flow::

    front --GenerateRequest--> tokenizer worker --TokenizedRequest--> scheduler
    scheduler --ForwardBatch--> runner --ForwardResult--> scheduler
    scheduler --TokenBatch--> detokenizer --TextBatch--> front
    tokenizer worker / scheduler --RequestError--> front   (rejected requests)
    front --AbortRequest / ControlRequest--> scheduler --ControlReply--> front
    every process --ProcessReady / ProcessFailed--> launcher
    launcher --RunnerDied / ShutdownProcess--> scheduler

Every message is a tagged ``msgspec.Struct``; one socket carries a union of
them, decoded with :func:`decoder`. K/V never travel: they live in the arena.
Everything is re-exported here, so call sites write ``protocol.ForwardBatch``.
"""

from __future__ import annotations

from radixmux.protocol.codec import (
    BIAS_RECORD,
    decoder,
    encode,
    pack_bias,
    pack_ids,
    unpack_bias,
    unpack_ids,
)
from radixmux.protocol.control import (
    ControlReply,
    ControlRequest,
    WarmedPrefix,
    WarmupReply,
    WarmupRequest,
)
from radixmux.protocol.lifecycle import (
    AddModel,
    ModelAdded,
    ModelCommand,
    ModelCommandReply,
    ModelRemoved,
    ModelTable,
    ModelTableApplied,
    ProcessFailed,
    ProcessReady,
    RemoveModel,
    RunnerDied,
    ServerReady,
    ShutdownProcess,
)
from radixmux.protocol.requests import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    RequestError,
    RequestOutput,
    TextBatch,
    TextOutput,
    TokenBatch,
    TokenizedRequest,
    TokenizeRequest,
    TokenizerReply,
)
from radixmux.protocol.runner import (
    Failed,
    ForwardBatch,
    ForwardResult,
    PrefixGroup,
    Ready,
    RunnerReply,
    RunnerRequest,
    SeqInput,
    SeqOutput,
    Shutdown,
)
from radixmux.protocol.sockets import (
    DetokenizerInbox,
    FrontInbox,
    LauncherInbox,
    SchedulerInbox,
    TokenizerBroadcast,
    TokenizerInbox,
)
from radixmux.protocol.types import (
    ChatMessage,
    Constraint,
    ModelArg,
    ModelInfo,
    RunnerId,
    SamplingParams,
    ServedModel,
    TokenLogprob,
    ToolSpec,
    instance_name,
    runner_ids,
    served_name,
)
from radixmux.protocol.views import (
    ArenaMap,
    ArenaPool,
    DashboardSnapshot,
    DiskTierStats,
    LayerGroupStatus,
    ModelStatus,
    PrefixHolderView,
    SchedulerStats,
    SharedPrefixView,
)

__all__ = [
    "BIAS_RECORD",
    "AbortRequest",
    "AddModel",
    "ArenaMap",
    "ArenaPool",
    "ChatMessage",
    "Constraint",
    "ControlReply",
    "ControlRequest",
    "DashboardSnapshot",
    "DetokenizeRequest",
    "DetokenizerInbox",
    "DiskTierStats",
    "Failed",
    "ForwardBatch",
    "ForwardResult",
    "FrontInbox",
    "GenerateRequest",
    "LauncherInbox",
    "LayerGroupStatus",
    "ModelAdded",
    "ModelArg",
    "ModelCommand",
    "ModelCommandReply",
    "ModelInfo",
    "ModelRemoved",
    "ModelStatus",
    "ModelTable",
    "ModelTableApplied",
    "PrefixGroup",
    "PrefixHolderView",
    "ProcessFailed",
    "ProcessReady",
    "Ready",
    "RemoveModel",
    "RequestError",
    "RequestOutput",
    "RunnerDied",
    "RunnerId",
    "RunnerReply",
    "RunnerRequest",
    "SamplingParams",
    "SchedulerInbox",
    "SchedulerStats",
    "SeqInput",
    "SeqOutput",
    "ServedModel",
    "ServerReady",
    "SharedPrefixView",
    "Shutdown",
    "ShutdownProcess",
    "TextBatch",
    "TextOutput",
    "TokenBatch",
    "TokenLogprob",
    "TokenizeRequest",
    "TokenizedRequest",
    "TokenizerBroadcast",
    "TokenizerInbox",
    "TokenizerReply",
    "ToolSpec",
    "WarmedPrefix",
    "WarmupReply",
    "WarmupRequest",
    "decoder",
    "encode",
    "instance_name",
    "pack_bias",
    "pack_ids",
    "runner_ids",
    "served_name",
    "unpack_bias",
    "unpack_ids",
]
