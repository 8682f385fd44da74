"""Models at run time: the launcher's side of load and unload.

The front decides *what* changes (which served name, which version, when an
instance is drained) and sends one ``ModelCommand`` at a time; this module
does the process work, step by step, without ever blocking the launcher's
supervision loop:

load
    1. resolve the source (fetching an embedded model, with progress in the
       log) and estimate its memory in a thread; admit it only if that fits
       (``admission``: else a 507 before any process starts);
    2. start the instance's runners and tell the scheduler (``AddModel``); it
       registers the instance in the tree and arena once every runner is ready
       (``ModelAdded``);
    3. publish the new model table; every tokenizer worker and the
       detokenizer load its tokenizer and say so (``ModelTableApplied``);
    4. answer the front, which lists the model from then on.
unload
    1. the scheduler stops the instance's runners and drops its cache entries
       (``RemoveModel`` -> ``ModelRemoved``); its blocks are free at once;
    2. publish the table without it, wait for the runner processes to exit,
       answer the front.

A load that fails at any step (unknown source, a runner that dies or cannot
load, a tokenizer that cannot load) or is not done within
``--model-load-timeout`` is undone: its runners are killed, the scheduler
forgets it (``RemoveModel`` cancels a pending instance, or removes one whose
``ModelAdded`` crossed it), the arena is untouched, and the front gets the
reason once nothing is left, so the same load can be asked again at once. The
front asks for the unload of an instance whose load it stopped waiting for:
that cancels the load the same way (no instance is ever loaded that the front
does not serve).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from radixmux import protocol
from radixmux.protocol import ModelArg
from radixmux.runtime import admission
from radixmux.runtime.model_sources import LaunchError, resolve_source

if TYPE_CHECKING:
    from radixmux.runtime.launcher import Child, Launcher

log = logging.getLogger("radixmux.launcher")

TABLE_RESEND_S = 1.0  # a subscriber that joined late gets the table again
TABLE_TIMEOUT_S = 120.0  # tokenizers load in seconds; give up on a stuck one
RUNNER_EXIT_S = 10.0  # after the scheduler's Shutdown, then SIGKILL


@dataclass
class _Load:
    cmd: protocol.ModelCommand
    deadline: float  # --model-load-timeout from the command
    arg: ModelArg | None = None  # resolved: local folder, concrete dtype; runners started
    need: admission.LoadNeed | None = None
    runner_ids: list[str] = field(default_factory=list)
    served: protocol.ServedModel | None = None
    table_version: int = 0
    sent_table_at: float = 0.0
    resent_table_at: float = 0.0  # once a second at most: a busy subscriber is not flooded

    @property
    def last_sent(self) -> float:
        return max(self.sent_table_at, self.resent_table_at)


@dataclass
class _Unload:
    cmd: protocol.ModelCommand | None  # answered once done (None: nobody to answer)
    status: int = 200  # the answer: a failed load's error once it is undone
    message: str = "unloaded"
    freed_tokens: int = 0
    removed: bool = False
    removed_at: float = 0.0


class ModelLifecycle:
    """Loads and unloads instances for the launcher (see the module docstring)."""

    def __init__(self, launcher: Launcher, served: list[protocol.ServedModel]) -> None:
        self.launcher = launcher
        self.table: dict[str, protocol.ServedModel] = {m.instance: m for m in served}
        self.version = 0
        self.loads: dict[str, _Load] = {}
        self.unloads: dict[str, _Unload] = {}
        self.retiring: dict[str, str] = {}  # runner id -> instance being removed
        # (load command's req_id, (resolved arg, need) or the error): a req_id,
        # not a name, so a cancelled load's late result never feeds a new one.
        self._resolved: queue.Queue[tuple[str, tuple[ModelArg, admission.LoadNeed] | str]] = (
            queue.Queue()
        )
        self._applied: dict[str, int] = {}  # process name -> table version it holds
        # instance -> one runner's need: memory a runner waiting to restart takes back.
        self._runner_need: dict[str, int] = {}
        for m in launcher.args.models:
            try:
                need = admission.estimate(m.source, m.dtype or launcher.args.dtype, 1)
                self._runner_need[m.name] = need.per_runner_bytes
            except (OSError, ValueError):
                pass  # its runners are up already; only their restarts go uncounted

    # ---- commands from the front --------------------------------------------------
    def command(self, cmd: protocol.ModelCommand) -> None:
        name = cmd.model.name
        if cmd.op == "unload" and name in self.loads:
            log.warning("model %s: load cancelled by the front", name)
            self._fail(name, 503, f"the load of {name!r} was cancelled", by=cmd)
            return
        if cmd.op == "load":
            if name in self.table or name in self.loads or name in self.unloads:
                busy = "being unloaded" if name in self.unloads else "already loaded"
                self._reply(cmd, 409, f"model instance {name!r} is {busy}")
                return
            if self.launcher.args.kv_partition == "static":
                self._reply(cmd, 400, "models cannot change with --kv-partition static")
                return
            deadline = time.monotonic() + self.launcher.args.model_load_timeout
            self.loads[name] = _Load(cmd, deadline)
            log.info("model %s: loading %s", name, cmd.model.source)
            threading.Thread(target=self._resolve, args=(cmd,), daemon=True).start()
        elif cmd.op == "unload":
            if name not in self.table or name in self.unloads:
                self._reply(cmd, 404, f"model instance {name!r} is not loaded")
                return
            log.info("model %s: unloading", name)
            self._start_unload(name, _Unload(cmd))
        else:
            self._reply(cmd, 400, f"unknown model command {cmd.op!r}")

    def _resolve(self, cmd: protocol.ModelCommand) -> None:
        """Thread: fetch/resolve the source, estimate its memory; the loop picks
        the result up."""
        from radixmux.common.cpu import resolve_dtype

        arg = cmd.model
        try:
            dtype, why = resolve_dtype(arg.dtype or self.launcher.args.dtype)
            source = resolve_source(arg.source)
            need = admission.estimate(source, dtype, arg.replicas)
        except LaunchError as exc:
            self._resolved.put((cmd.req_id, str(exc)))
            return
        except Exception as exc:  # never lose the answer to the front
            self._resolved.put((cmd.req_id, f"{type(exc).__name__}: {exc}"))
            return
        log.info("model %s: dtype %s (%s)", arg.name, dtype, why)
        resolved = msgspec.structs.replace(arg, source=source, dtype=dtype)
        self._resolved.put((cmd.req_id, (resolved, need)))

    # ---- the loop ------------------------------------------------------------------
    def poll(self) -> None:
        """Advance every load and unload (called from the launcher's loop)."""
        while True:
            try:
                req_id, result = self._resolved.get_nowait()
            except queue.Empty:
                break
            load = next((ld for ld in self.loads.values() if ld.cmd.req_id == req_id), None)
            if load is None:
                continue  # cancelled meanwhile
            name = load.cmd.model.name
            if isinstance(result, str):
                self._fail(name, 400, result)
                continue
            arg, need = result
            refused = self._refusal(load, arg, need)
            if refused is not None:
                self._fail(name, 507, refused)
            else:
                self._start_runners(load, arg)
        now = time.monotonic()
        for name, load in list(self.loads.items()):
            if now > load.deadline:
                timeout = self.launcher.args.model_load_timeout
                self._fail(
                    name,
                    504,
                    f"model {name!r} did not load within {timeout:g} s "
                    "(--model-load-timeout); the load is cancelled",
                )
                continue
            if load.served is None:
                continue
            if now - load.sent_table_at > TABLE_TIMEOUT_S:
                self._fail(name, 500, "tokenizers not loaded in time (see the server log)")
            elif now - load.last_sent > TABLE_RESEND_S and not self._table_applied(load):
                load.resent_table_at = now
                self._publish(resend=True)
        for name, unload in list(self.unloads.items()):
            if not unload.removed:
                continue
            alive = self._runners_of(name)
            if alive and now - unload.removed_at > RUNNER_EXIT_S:
                log.warning(
                    "model %s: runners still up %.0f s after shutdown; killing", name, RUNNER_EXIT_S
                )
                for child in alive:
                    child.proc.kill()
            if not alive:
                self._unloaded(name, unload)

    def _refusal(self, load: _Load, arg: ModelArg, need: admission.LoadNeed) -> str | None:
        """Why ``load`` does not fit in memory now (the 507 message), or None."""
        load.need = need
        # Memory other loads and restarting runners will take, beyond what they hold now.
        promised = sum(
            ld.need.total_bytes for ld in self.loads.values() if ld.need and ld is not load
        )
        for rid in self.launcher.restarts_due():
            promised += self._runner_need.get(rid.rpartition("#")[0], 0)
        args, arena = self.launcher.args, self.launcher.arena
        state = admission.memory_state(
            arena.path if arena else None,
            arena.total_bytes if arena else args.kv_cache_bytes,
            args.memory_reserve_bytes,
            promised,
        )
        if state is None:
            log.warning("model %s: memory cannot be measured here; admitted unchecked", arg.name)
            return None
        why = admission.refusal(load.cmd.served or arg.name, need, arg.dtype or args.dtype, state)
        log.info(
            "model %s: needs about %d MiB, %d MiB free%s",
            arg.name,
            need.total_bytes >> 20,
            state.free_bytes >> 20,
            "; refused" if why else "",
        )
        return why

    def _start_runners(self, load: _Load, arg: ModelArg) -> None:
        load.arg = arg
        assert load.need is not None
        self._runner_need[arg.name] = load.need.per_runner_bytes
        launcher = self.launcher
        load.runner_ids = protocol.runner_ids(arg)
        total = launcher.num_runners + arg.replicas
        for rid in load.runner_ids:
            launcher.add_runner_config(rid, arg, total)
            launcher.start_runner(rid)
        cmd = load.cmd
        launcher.send_scheduler(protocol.AddModel(arg, cmd.served or arg.name, cmd.version))

    # ---- replies from the scheduler and the tokenizer processes ---------------------
    def added(self, msg: protocol.ModelAdded) -> None:
        load = self.loads.get(msg.name)
        if load is None:
            return
        if msg.served is None:
            self._fail(msg.name, 400, msg.error or "the model could not be loaded")
            return
        load.served = msg.served
        self.table[msg.name] = msg.served
        load.table_version = self._publish()
        load.sent_table_at = time.monotonic()

    def applied(self, msg: protocol.ModelTableApplied) -> None:
        self._applied[msg.name] = max(self._applied.get(msg.name, 0), msg.version)
        for name, load in list(self.loads.items()):
            if load.served is None:
                continue
            if msg.error is not None and msg.version >= load.table_version:
                self._fail(name, 500, f"{msg.name} could not load the tokenizer: {msg.error}")
            elif self._table_applied(load):
                del self.loads[name]
                log.info("model %s: serving as %s", name, load.served.name)
                self._reply(load.cmd, 200, "loaded", model=load.served)

    def removed(self, msg: protocol.ModelRemoved) -> None:
        unload = self.unloads.get(msg.name)
        if unload is None:
            return
        unload.removed = True
        unload.removed_at = time.monotonic()
        unload.freed_tokens = msg.freed_tokens
        if self.table.pop(msg.name, None) is not None:
            self._publish()

    def runner_exited(self, child: Child, code: int) -> bool:
        """Whether this exit is the lifecycle's (expected, or a failed load)."""
        rid = child.runner_id
        if rid in self.retiring:
            del self.retiring[rid]
            self.launcher.forget_runner(rid)
            return True
        for name, load in self.loads.items():
            if rid in load.runner_ids:
                self.launcher.forget_runner(rid)
                self._fail(name, 500, f"runner {rid} exited with code {code} while loading")
                return True
        return False

    # ---- helpers ----------------------------------------------------------------------
    def _table_applied(self, load: _Load) -> bool:
        return all(self._applied.get(n, 0) >= load.table_version for n in self._subscribers())

    def _subscribers(self) -> list[str]:
        workers = self.launcher.args.tokenizer_workers
        return ["detokenizer", *(f"tokenizer-{i}" for i in range(workers))]

    def _publish(self, resend: bool = False) -> int:
        """Send the current table to the tokenizer processes; returns its version."""
        if not resend:
            self.version += 1
        table = protocol.ModelTable(self.version, list(self.table.values()))
        self.launcher.publish_table(table)
        return self.version

    def _fail(
        self, name: str, status: int, message: str, by: protocol.ModelCommand | None = None
    ) -> None:
        """Undo a load: its runners, its scheduler registration, its table entry;
        answer once that is done (``by``: the unload that cancelled it)."""
        load = self.loads.pop(name)
        log.error("model %s: load failed: %s", name, message)
        if load.arg is None and by is None:  # nothing started yet: nothing to undo
            self._reply(load.cmd, status, message)
            return
        if by is not None:
            self._reply(load.cmd, status, message)  # no longer awaited by the front
            unload = _Unload(by)
        else:
            unload = _Unload(load.cmd, status, message)
        self._start_unload(name, unload)
        for child in self._runners_of(name):
            child.proc.kill()

    def _start_unload(self, name: str, unload: _Unload) -> None:
        self.unloads[name] = unload
        for rid in self.launcher.runner_ids_of(name):
            self.retiring[rid] = name
        self.launcher.send_scheduler(protocol.RemoveModel(name))

    def _unloaded(self, name: str, unload: _Unload) -> None:
        del self.unloads[name]
        for rid in [r for r, n in self.retiring.items() if n == name]:
            del self.retiring[rid]
        self.launcher.forget_instance(name)
        self._runner_need.pop(name, None)
        log.info("model %s: unloaded (%d cached tokens freed)", name, unload.freed_tokens)
        if unload.cmd is not None:
            self._reply(unload.cmd, unload.status, unload.message, freed_tokens=unload.freed_tokens)

    def _runners_of(self, name: str) -> list[Child]:
        ids = set(self.launcher.runner_ids_of(name))
        return [c for c in self.launcher.children if c.runner_id in ids and c.proc.poll() is None]

    def _reply(
        self,
        cmd: protocol.ModelCommand,
        status: int,
        message: str,
        model: protocol.ServedModel | None = None,
        freed_tokens: int = 0,
    ) -> None:
        self.launcher.send_front(
            protocol.ModelCommandReply(cmd.req_id, status, message, model, freed_tokens)
        )
