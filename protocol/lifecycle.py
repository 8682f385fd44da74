"""Processes and models coming and going: ready / failed reports to the launcher,
runner deaths, shutdown, models loaded and unloaded at run time."""

from __future__ import annotations

import msgspec

from radixmux.protocol.types import ModelArg, ServedModel


class ProcessReady(msgspec.Struct, tag="process_ready", frozen=True):
    """A process is up; the scheduler's carries the served models."""

    name: str
    pid: int
    models: list[ServedModel] = msgspec.field(default_factory=list)


class ProcessFailed(msgspec.Struct, tag="process_failed", frozen=True):
    name: str
    pid: int
    error: str


class RunnerDied(msgspec.Struct, tag="runner_died", frozen=True):
    """The launcher saw a runner process exit; its requests fail (or move to a
    live replica). ``restarting``: a new process is on its way (it sends
    ``Ready`` when up); False when the launcher gave up on it."""

    runner_id: str
    exitcode: int
    restarting: bool = False


class ServerReady(msgspec.Struct, tag="server_ready", frozen=True):
    """Launcher to front: every process is up; stop answering "starting"."""


class ShutdownProcess(msgspec.Struct, tag="shutdown_process", frozen=True):
    """Ask a process to exit cleanly."""


# ---- models at run time ------------------------------------------------------------
class ModelCommand(msgspec.Struct, tag="model_command", frozen=True):
    """Front to launcher: ``load`` an instance (``model.name`` is the instance
    name; ``served`` and ``version`` what the front lists it as) or ``unload``
    one (only ``model.name`` is read). The front has drained an instance
    before it asks for its unload."""

    req_id: str
    op: str
    model: ModelArg
    served: str = ""
    version: int = 1


class ModelCommandReply(msgspec.Struct, tag="model_reply", frozen=True):
    """Launcher to front: a ``ModelCommand`` done (``status`` 200, ``model``
    set for a load) or failed (``status`` >= 400, ``message`` says why)."""

    req_id: str
    status: int
    message: str = ""
    model: ServedModel | None = None
    freed_tokens: int = 0


class ModelTable(msgspec.Struct, tag="model_table", frozen=True):
    """Launcher to tokenizer workers and detokenizer: every instance now
    loaded. A tokenizer worker loads and drops tokenizers to match; the
    detokenizer only adds (it drops an instance on the scheduler's
    ``ModelRemoved``, which reaches it after that instance's last outputs)."""

    version: int
    models: list[ServedModel]


class ModelTableApplied(msgspec.Struct, tag="table_applied", frozen=True):
    """A process holds the tokenizers of ``ModelTable`` ``version`` (or says why not)."""

    name: str
    version: int
    error: str | None = None


class AddModel(msgspec.Struct, tag="add_model", frozen=True):
    """Launcher to scheduler: runners for ``model`` (instance name) are
    starting; register it once they are all ready."""

    model: ModelArg
    served: str
    version: int = 1


class ModelAdded(msgspec.Struct, tag="model_added", frozen=True):
    """Scheduler to launcher: an ``AddModel`` is serving (``served``) or failed (``error``)."""

    name: str
    served: ServedModel | None = None
    error: str | None = None


class RemoveModel(msgspec.Struct, tag="remove_model", frozen=True):
    """Launcher to scheduler: stop an instance's runners and drop its cache
    entries (also cancels an ``AddModel`` still waiting for its runners)."""

    name: str


class ModelRemoved(msgspec.Struct, tag="model_removed", frozen=True):
    """Scheduler to launcher and detokenizer: an instance is gone; its
    blocks are back in the arena."""

    name: str
    freed_tokens: int = 0
