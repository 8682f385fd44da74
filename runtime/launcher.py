"""The launcher: start every runtime process in order, watch them, stop them all.

Start order (each step waits for the ready messages it needs):

1. resolve every ``--model`` source to a local folder (fetching short names);
2. create the private runtime dir and the KV arena (first removing those that
   launchers killed with SIGKILL left behind), and bind the launcher inbox;
3. start the scheduler and one runner per model replica; wait for the
   scheduler's ``ProcessReady`` (it waits for every runner's ``Ready``), which
   carries the served models;
4. start the detokenizer, the tokenizer workers and the front; wait for each.

A process that reports ``ProcessFailed`` or exits during start-up stops the
launch with a ``LaunchError`` naming it and why; everything already started is
stopped first. Once the runners have reported ready, a runner that exits (now
or while serving) is reported to the scheduler (``RunnerDied``: its requests
fail or move to a replica, the other models keep serving) and restarted after
a backoff, at most ``MAX_RESTARTS`` times in ``RESTART_WINDOW_S`` (then it
stays down, and ``/health`` and the log say so). A core process that exits
ends the server. When every process is ready the front is told
(``ServerReady``); until then it answers "starting". ``stop()`` shuts down in reverse data-flow
order (front, tokenizer workers, scheduler and runners, detokenizer) and leaves
no process, socket or arena file behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket as pysocket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import zmq

from radixmux import protocol
from radixmux.common.ipc import Endpoints, make_runtime_dir, remove_runtime_dir, socket
from radixmux.common.owner import arena_file_name, remove_stale_arenas
from radixmux.common.process import TOKENIZER_ENV, ProcessContext, spawn
from radixmux.common.server_args import KV_CACHE_DTYPES, ServerArgs
from radixmux.common.zygote import Zygote, ZygoteChild
from radixmux.memory.arena import ArenaSpec, KVArena
from radixmux.protocol import ModelArg
from radixmux.runtime import admission
from radixmux.runtime.model_lifecycle import ModelLifecycle
from radixmux.runtime.model_sources import LaunchError, resolve_models
from radixmux.runtime.warmup_file import SERVING_NAME, STARTUP_NAME, load_warmup_file

if TYPE_CHECKING:
    from radixmux.model_runners.runner_process import RunnerConfig

log = logging.getLogger("radixmux.launcher")

# The module each runtime process runs (by the part of its name before "-"):
# started by name, so the launcher imports none of them.
PROCESS_MODULES = {
    "scheduler": "radixmux.scheduler.scheduler",
    "detokenizer": "radixmux.runtime.detokenizer",
    "tokenizer": "radixmux.runtime.tokenizer_worker",
    "front": "radixmux.runtime.front.server",
}

SCHEDULER_READY_TIMEOUT_S = 900.0  # runners load weights (and may convert) first
READY_TIMEOUT_S = 120.0
WARMUP_READY_TIMEOUT_S = 900.0  # --warmup FILE: prefills before the server reports ready
POLL_MS = 250  # monitoring cadence: no busy loop
FAILED_GRACE_S = 2.0  # after a child exits, how long to wait for the reason it reports
GRACEFUL_S = 10.0  # ShutdownProcess / SIGTERM, then this long before escalating
KILL_WAIT_S = 3.0
# Runner supervision: restart a dead runner after a growing pause, and give up
# on one that keeps dying (a crash loop would only burn CPU).
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
MAX_RESTARTS = 10
RESTART_WINDOW_S = 600.0


@dataclass
class Child:
    """One started process."""

    name: str  # "scheduler", "runner smollm2#0", "tokenizer-0", ...
    proc: subprocess.Popen | ZygoteChild
    runner_id: str | None = None  # set for runners: their death is not fatal


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with pysocket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Launcher:
    """Starts, monitors and stops one runtime (see the module docstring)."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.endpoints: Endpoints | None = None
        self.served: list[protocol.ServedModel] = []
        self.children: list[Child] = []
        self.exit_code = 0
        self._arena: KVArena | None = None
        self._runtime_dir: str | None = None
        self._made_runtime_parent = False  # --runtime-dir did not exist: we made it
        self._zctx: zmq.Context | None = None
        self._inbox: zmq.Socket | None = None
        self._to_scheduler: zmq.Socket | None = None
        self._to_detokenizer: zmq.Socket | None = None
        self._to_front: zmq.Socket | None = None
        self._models_pub: zmq.Socket | None = None
        self.lifecycle: ModelLifecycle | None = None
        self._runner_configs: dict[str, RunnerConfig] = {}
        # Runners fork from it (common/zygote.py) with --runner-start zygote.
        self.zygote = Zygote() if args.runner_start == "zygote" else None
        self._restarts: dict[str, list[float]] = {}  # runner id -> restart times
        self._due: dict[str, float] = {}  # runner id -> when to start it again
        self._ready: dict[str, protocol.ProcessReady] = {}
        self._stop_requested = threading.Event()
        self._started = False
        self._stopped = False

    # ---- start -------------------------------------------------------------------
    def start(self) -> None:
        """Start everything; return once all processes are ready, else raise ``LaunchError``."""
        try:
            self._start()
        except BaseException:
            self.stop()  # KeyboardInterrupt during start-up cleans up too
            raise

    def _start(self) -> None:
        t0 = time.monotonic()
        if self.zygote is not None:  # its imports overlap everything up to the runners
            try:
                with _children_ignore_sigint():
                    self.zygote.start()
            except OSError as exc:
                log.warning("zygote: %s; runners start as new processes", exc)
                self.zygote = None
        args = resolve_models(self.args)
        for warning in admission.startup_warnings(args):
            log.warning("%s", warning)
        if args.chat_template is not None and not os.path.isfile(args.chat_template):
            raise LaunchError(f"--chat-template {args.chat_template}: no such file")
        if args.warmup is not None:  # a bad line fails now, before anything starts
            try:
                load_warmup_file(args.warmup, [m.name for m in args.models])
            except ValueError as exc:
                raise LaunchError(str(exc)) from None
        if args.port == 0:  # pick the port here, so everyone (and the banner) knows it
            args = msgspec.structs.replace(args, port=free_port(args.host))
        self.args = args
        self._made_runtime_parent = args.runtime_dir is not None and not os.path.isdir(
            args.runtime_dir
        )
        try:
            self._runtime_dir = make_runtime_dir(args.runtime_dir)
        except OSError as exc:
            raise LaunchError(f"--runtime-dir {args.runtime_dir}: {exc}") from None
        eps = self.endpoints = Endpoints.in_dir(self._runtime_dir, args.zmq_endpoint)
        try:
            remove_stale_arenas()
            self._arena = KVArena.create(
                args.kv_cache_bytes // args.kv_block_bytes,
                args.kv_block_bytes,
                name=arena_file_name(),
            )
        except (ValueError, OSError) as exc:
            raise LaunchError(
                f"KV arena: {exc} (check --kv-cache-bytes / --kv-block-bytes)"
            ) from None
        self._zctx = zmq.Context()
        self._inbox = socket(self._zctx, zmq.PULL, eps.launcher, bind=True)
        self._to_scheduler = socket(self._zctx, zmq.PUSH, eps.scheduler, bind=False)
        self._to_detokenizer = socket(self._zctx, zmq.PUSH, eps.detokenizer, bind=False)
        self._to_front = socket(self._zctx, zmq.PUSH, eps.front, bind=False)
        self._models_pub = socket(self._zctx, zmq.PUB, eps.models, bind=True)
        spec = self._arena.spec
        log.info(
            "runtime dir %s, arena %s (%d MiB)",
            self._runtime_dir,
            spec.path,
            spec.total_bytes >> 20,
        )

        self._spawn(
            PROCESS_MODULES["scheduler"], ProcessContext("scheduler", args, eps, arena=spec)
        )
        self._spawn_runners()
        self._wait_ready(["scheduler"], SCHEDULER_READY_TIMEOUT_S)
        self.served = self._ready["scheduler"].models

        names = ["detokenizer", *(f"tokenizer-{i}" for i in range(args.tokenizer_workers)), "front"]
        for name in names:
            kind = name.partition("-")[0]
            self._spawn(
                PROCESS_MODULES[kind],
                ProcessContext(name, args, eps, served=self.served, arena=spec),
                name,
                TOKENIZER_ENV if kind in ("detokenizer", "tokenizer") else None,
            )
        self._wait_ready(names, READY_TIMEOUT_S)
        self.lifecycle = ModelLifecycle(self, self.served)
        self._to_front.send(protocol.encode(protocol.ServerReady()))
        # The front reports back once it serves (after --warmup FILE's lines,
        # if any): a request sent when start() returns is never told "starting".
        if args.warmup is not None:
            self._wait_ready([STARTUP_NAME], WARMUP_READY_TIMEOUT_S)
        else:
            self._wait_ready([SERVING_NAME], READY_TIMEOUT_S)
        self._started = True
        log.info("all %d processes ready in %.1fs", len(self.children), time.monotonic() - t0)

    def _spawn(
        self,
        module: str,
        ctx: ProcessContext,
        name: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        name = name or ctx.name
        with _children_ignore_sigint():
            proc = spawn(module, ctx, env)
        self.children.append(Child(name, proc))
        log.info("started %s (pid %d)", name, self.children[-1].proc.pid)

    def _spawn_runners(self) -> None:
        total = sum(m.replicas for m in self.args.models)
        for m in self.args.models:
            for rid in protocol.runner_ids(m):
                self.add_runner_config(rid, m, total)
                self.start_runner(rid)

    def add_runner_config(self, rid: str, m: ModelArg, num_runners: int) -> None:
        """How runner ``rid`` of model ``m`` (source resolved) is started, and
        restarted; ``num_runners`` share the cores until the scheduler says otherwise."""
        from radixmux.model_runners.runner_process import RunnerConfig

        args = self.args
        self._runner_configs[rid] = RunnerConfig(
            model=m.source,
            arena=self._arena.spec,
            endpoint=self.endpoints.runners,
            runner_id=rid,
            name=m.name,
            dtype=m.dtype or args.dtype,  # concrete: resolved before
            kv_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype],
            device=args.device,
            page_size=args.page_size,
            threads=args.runner_threads,
            num_runners=num_runners,
            attention_backend=args.attention_backend,
            grammar_compile_timeout=args.grammar_compile_timeout,
            jump_forward=args.enable_jump_forward,
            fuse_ops=not args.disable_fused_ops,
            onednn_copy=args.linear_onednn_copy,
            deterministic=args.deterministic,
            # A step's budget counts its decodes (batch_builder): it holds at
            # most the chunk size, or only decodes when more requests run.
            max_batch_tokens=max(args.chunked_prefill_size, args.max_running_requests),
            max_batch_sequences=args.max_running_requests,
        )

    def start_runner(self, rid: str) -> None:
        from radixmux.model_runners.runner_process import spawn_runner

        config = self._runner_configs[rid]
        with _children_ignore_sigint():
            proc = spawn_runner(config, self.zygote)
        self.children.append(Child(f"runner {rid}", proc, runner_id=rid))
        log.info("started runner %s (pid %d) for %s", rid, proc.pid, config.model)

    @property
    def num_runners(self) -> int:
        return len(self._runner_configs)

    @property
    def arena(self) -> ArenaSpec | None:
        return self._arena.spec if self._arena is not None else None

    def restarts_due(self) -> list[str]:
        """Runners waiting out their restart backoff: they take their memory back."""
        return list(self._due)

    def runner_ids_of(self, instance: str) -> list[str]:
        """The runner ids a model instance has (configured, whether up or not)."""
        ids = {rid: protocol.RunnerId.parse(rid) for rid in self._runner_configs}
        return [rid for rid, parsed in ids.items() if parsed and parsed.model == instance]

    def forget_runner(self, rid: str) -> None:
        """A runner that is gone for good: no config, no restart."""
        self._runner_configs.pop(rid, None)
        self._due.pop(rid, None)
        self._restarts.pop(rid, None)

    def forget_instance(self, instance: str) -> None:
        for rid in self.runner_ids_of(instance):
            self.forget_runner(rid)
        self.served = [m for m in self.served if m.instance != instance]

    def send_scheduler(self, msg: msgspec.Struct) -> None:
        self._to_scheduler.send(protocol.encode(msg))

    def send_front(self, msg: msgspec.Struct) -> None:
        self._to_front.send(protocol.encode(msg))

    def publish_table(self, table: protocol.ModelTable) -> None:
        """The model table to every tokenizer worker (PUB) and the detokenizer."""
        data = protocol.encode(table)
        self._models_pub.send(data)
        self._to_detokenizer.send(data)
        self.served = list(table.models)

    def _runner_exited(self, child: Child, code: int) -> None:
        """Report a runner's death to the scheduler and plan its restart."""
        rid = child.runner_id
        assert rid is not None
        self.children.remove(child)
        if self.lifecycle is not None and self.lifecycle.runner_exited(child, code):
            log.info("%s exited with code %d (its model is unloaded)", child.name, code)
            return
        self._restart_or_give_up(rid, f"{child.name} exited with code {code}", code)

    def _restart_or_give_up(self, rid: str, what: str, code: int) -> None:
        """Plan a lost runner's restart after its backoff, or give up on one
        that keeps dying; either way the scheduler is told (``RunnerDied``)."""
        now = time.monotonic()
        recent = [t for t in self._restarts.get(rid, []) if now - t < RESTART_WINDOW_S]
        restarting = len(recent) < MAX_RESTARTS and not self._stop_requested.is_set()
        if restarting:
            delay = RESTART_BACKOFF_S[min(len(recent), len(RESTART_BACKOFF_S) - 1)]
            self._due[rid] = now + delay
            self._restarts[rid] = [*recent, now]
            log.error("%s; restarting it in %.0f s", what, delay)
        else:
            log.error(
                "%s; not restarting it (%d restarts in the last %.0f s)",
                what,
                len(recent),
                RESTART_WINDOW_S,
            )
        with contextlib.suppress(zmq.ZMQError):
            msg = protocol.RunnerDied(rid, code, restarting)
            self._to_scheduler.send(protocol.encode(msg), zmq.NOBLOCK)

    def _supervise_runners(self) -> None:
        """Notice dead runners and start the ones whose backoff has passed."""
        for child in list(self.children):
            code = child.proc.poll()
            if child.runner_id is not None and code is not None:
                self._runner_exited(child, code)
        now = time.monotonic()
        for rid, due in list(self._due.items()):
            if due <= now:
                del self._due[rid]
                try:
                    self.start_runner(rid)
                except OSError as exc:  # no process at all (fork, memory): a death too
                    self._restart_or_give_up(rid, f"runner {rid} could not start: {exc}", -1)

    def _wait_ready(self, names: list[str], timeout: float) -> None:
        """Wait for ``ProcessReady`` from each of ``names``; fail fast on any failure."""
        deadline = time.monotonic() + timeout
        while any(n not in self._ready for n in names):
            if time.monotonic() > deadline:
                missing = [n for n in names if n not in self._ready]
                raise LaunchError(f"{', '.join(missing)} not ready after {timeout:.0f}s")
            self._receive(POLL_MS)
            if "scheduler" in self._ready:
                # The runners have been ready: a death now is an ordinary
                # runner death (restarted), not a failed start.
                self._supervise_runners()
            dead = next((c for c in self.children if c.proc.poll() is not None), None)
            if dead is not None:
                # The process (or the scheduler, for a runner) usually reports
                # why just before the exit: give that message a moment to land.
                end = time.monotonic() + FAILED_GRACE_S
                while time.monotonic() < end:
                    self._receive(100)
                raise LaunchError(
                    f"{dead.name} exited with code {dead.proc.returncode} during start-up"
                )

    def _receive(self, timeout_ms: int) -> None:
        """Handle launcher messages arriving within ``timeout_ms``."""
        if not self._inbox.poll(timeout_ms):
            return
        decoder = protocol.decoder(protocol.LauncherInbox)
        while True:
            try:
                msg = decoder.decode(self._inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            except msgspec.DecodeError as exc:
                log.warning("dropped a malformed launcher message: %s", exc)
                continue
            if self.lifecycle is not None and self._lifecycle_message(msg):
                continue
            if isinstance(msg, protocol.ModelCommand):  # not started yet: the front is not ready
                continue
            if isinstance(msg, protocol.ProcessFailed):
                if self._started or self._stopped:
                    log.error("%s (pid %d) failed: %s", msg.name, msg.pid, msg.error)
                    continue
                raise LaunchError(f"{msg.name} failed to start: {msg.error}")
            log.info("%s ready (pid %d)", msg.name, msg.pid)
            self._ready[msg.name] = msg

    def _lifecycle_message(self, msg: msgspec.Struct) -> bool:
        lc = self.lifecycle
        assert lc is not None
        if isinstance(msg, protocol.ModelCommand):
            lc.command(msg)
        elif isinstance(msg, protocol.ModelAdded):
            lc.added(msg)
        elif isinstance(msg, protocol.ModelRemoved):
            lc.removed(msg)
        elif isinstance(msg, protocol.ModelTableApplied):
            lc.applied(msg)
        else:
            return False
        return True

    # ---- serve -------------------------------------------------------------------
    def request_stop(self) -> None:
        """Make ``wait()`` return (safe from signal handlers and other threads)."""
        self._stop_requested.set()

    def wait(self) -> int:
        """Monitor the processes until ``request_stop()`` or a core process dies.

        Returns the exit code for the server: 0 when asked to stop, 1 when a
        core process died.
        """
        while not self._stop_requested.is_set():
            try:
                self._receive(POLL_MS)
            except LaunchError as exc:  # a late failure report: logged, the exit decides
                log.error("%s", exc)
            self._supervise_runners()
            if self.lifecycle is not None:
                self.lifecycle.poll()
            for child in list(self.children):
                # Runners are supervised above; one the lifecycle killed just
                # now must not read as a core process's death.
                code = child.proc.poll() if child.runner_id is None else None
                if code is None:
                    continue
                if self._stop_requested.is_set():
                    return 0  # e.g. Ctrl-C reached the front too: not a failure
                log.error("core process %s exited with code %d; shutting down", child.name, code)
                self.exit_code = 1
                return 1
        return 0

    # ---- stop --------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every process in order and remove the arena and runtime dir (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self._due.clear()  # no runner restarts from here on
        t0 = time.monotonic()
        by_kind = {
            "front": [c for c in self.children if c.name == "front"],
            "tokenizers": [c for c in self.children if c.name.startswith("tokenizer-")],
            "scheduler": [c for c in self.children if c.name == "scheduler"],
            "runners": [c for c in self.children if c.runner_id is not None],
            "detokenizer": [c for c in self.children if c.name == "detokenizer"],
        }
        if not self._started:
            # Nothing is serving yet and a starting process may not read its
            # inbox: stop everything at once.
            self._terminate(self.children)
        # A live scheduler shuts its runners down itself; SIGTERM is the fallback.
        scheduler_up = any(c.proc.poll() is None for c in by_kind["scheduler"])
        stages = [
            (by_kind["front"] + by_kind["tokenizers"], lambda cs: self._terminate(cs)),
            (by_kind["scheduler"], lambda cs: self._shutdown(self._to_scheduler, cs)),
            (by_kind["runners"], lambda cs: self._terminate(cs, graceful=scheduler_up)),
            (by_kind["detokenizer"], lambda cs: self._shutdown(self._to_detokenizer, cs)),
            (self.children, lambda cs: self._terminate(cs)),  # anything left
        ]
        for children, stop_them in stages:
            alive = [c for c in children if c.proc.poll() is None]
            if alive:
                t_stage = time.monotonic()
                stop_them(alive)
                codes = ", ".join(f"{c.name}={c.proc.returncode}" for c in alive)
                log.info("stopped %s in %.1fs", codes, time.monotonic() - t_stage)
        if self.zygote is not None:  # after the runners: they would die with it
            self.zygote.close()
        self._cleanup()
        log.info("stopped in %.1fs", time.monotonic() - t0)

    def _shutdown(self, sock: zmq.Socket | None, children: list[Child]) -> None:
        """``ShutdownProcess`` to a process with an inbox, then escalate if it lingers."""
        alive = [c for c in children if c.proc.poll() is None]
        if not alive:
            return
        if sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.send(protocol.encode(protocol.ShutdownProcess()), zmq.NOBLOCK)
            _wait_all(alive, GRACEFUL_S)
        self._terminate(alive)

    def _terminate(self, children: list[Child], graceful: bool = False) -> None:
        """SIGTERM (after waiting, when ``graceful``), wait, SIGKILL stragglers."""
        alive = [c for c in children if c.proc.poll() is None]
        if graceful:
            alive = _wait_all(alive, GRACEFUL_S)
        for c in alive:
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(signal.SIGTERM)
        for c in _wait_all(alive, GRACEFUL_S):
            log.warning("%s ignored SIGTERM; killing it", c.name)
            with contextlib.suppress(ProcessLookupError):
                c.proc.kill()
        _wait_all(alive, KILL_WAIT_S)

    def _cleanup(self) -> None:
        socks = (self._inbox, self._to_scheduler, self._to_detokenizer, self._to_front)
        for sock in (*socks, self._models_pub):
            if sock is not None:
                sock.close(linger=0)
        if self._zctx is not None:
            self._zctx.destroy(linger=0)
        if self._arena is not None:
            self._arena.destroy()
        eps = self.endpoints
        if eps is not None and eps.client.startswith("ipc://"):
            # A --zmq-endpoint outside the runtime dir would otherwise outlive us.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(eps.client[len("ipc://") :])
        if self._runtime_dir is not None:
            remove_runtime_dir(self._runtime_dir)  # our own subdirectory, never the user's
            if self._made_runtime_parent:
                with contextlib.suppress(OSError):  # only while empty
                    os.rmdir(self.args.runtime_dir)


@contextlib.contextmanager
def _children_ignore_sigint() -> Iterator[None]:
    """Start children with SIGINT ignored (inherited across exec).

    Ctrl-C signals the whole foreground process group; the launcher alone
    should react, then stop the children in order.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal dispositions can only change on the main thread
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _wait_all(children: list[Child], timeout: float) -> list[Child]:
    """Wait up to ``timeout`` for ``children`` to exit; return those still alive."""
    deadline = time.monotonic() + timeout
    alive = [c for c in children if c.proc.poll() is None]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [c for c in alive if c.proc.poll() is None]
    return alive
