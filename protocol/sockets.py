"""One message union per receiving socket: what each process's inbox decodes."""

from __future__ import annotations

from radixmux.protocol.control import (
    ControlReply,
    ControlRequest,
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
    TextBatch,
    TokenBatch,
    TokenizedRequest,
    TokenizeRequest,
    TokenizerReply,
)

TokenizerInbox = GenerateRequest | TokenizeRequest | DetokenizeRequest | ShutdownProcess
TokenizerBroadcast = ModelTable
SchedulerInbox = (
    TokenizedRequest
    | AbortRequest
    | ControlRequest
    | RunnerDied
    | ShutdownProcess
    | AddModel
    | RemoveModel
    | WarmupRequest
)
DetokenizerInbox = TokenBatch | ModelTable | ModelRemoved | ShutdownProcess
FrontInbox = (
    TextBatch
    | RequestError
    | ControlReply
    | TokenizerReply
    | ServerReady
    | ModelCommandReply
    | WarmupReply
)
LauncherInbox = (
    ProcessReady | ProcessFailed | ModelCommand | ModelAdded | ModelRemoved | ModelTableApplied
)

