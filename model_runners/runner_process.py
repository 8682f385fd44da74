"""The runner process: one model, the shared arena, a ZeroMQ loop.

Hand-shake (one DEALER socket in the runner, connected to the scheduler's
ROUTER at ``endpoint``, identity ``runner_id``; one msgpack frame per message):

1. the runner loads the model and maps the arena, then sends ``Ready`` (with
   ``ModelInfo``: layout, fingerprints, limits) or ``Failed`` and exits;
2. the scheduler sends ``ForwardBatch``; the runner replies ``ForwardResult``
   (``error`` set for a malformed or failing batch; the process survives);
3. ``Shutdown`` ends the loop; so does the death of the parent process.

The loop blocks in ``zmq.Poller.poll`` (woken by a message, or once a second
to check the parent), so an idle runner costs no CPU.

Run as ``python -m radixmux.model_runners.runner_process '<RunnerConfig JSON>'``
or start with :func:`spawn_runner`.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import TYPE_CHECKING

import msgspec

from radixmux.common.cpu import cpu_cores
from radixmux.common.heap import trim_heap
from radixmux.common.os_process import PARENT_GONE, child_command, die_with_parent, exit_now
from radixmux.common.zygote import Zygote, ZygoteChild, ZygoteUnavailable
from radixmux.memory.arena import ArenaSpec
from radixmux.memory.layout import BlockGeometry

if TYPE_CHECKING:
    import torch

    from radixmux.memory.arena import KVArena

log = logging.getLogger("radixmux.runner")

RUNNER_MODULE = "radixmux.model_runners.runner_process"
PARENT_CHECK_MS = 1000


class RunnerConfig(msgspec.Struct, frozen=True):
    """Everything a runner process needs; ``threads = 0`` means the CPU cores
    divided evenly among ``num_runners`` runners."""

    model: str
    arena: ArenaSpec
    endpoint: str
    runner_id: str
    name: str | None = None
    dtype: str = "float32"
    kv_dtype: str | None = None  # --kv-cache-dtype, resolved (None: the model's dtype)
    device: str = "cpu"
    page_size: int = 1
    threads: int = 0
    num_runners: int = 1
    attention_backend: str = "auto"
    grammar_compile_timeout: float = 10.0  # --grammar-compile-timeout
    jump_forward: bool = False  # --enable-jump-forward
    fuse_ops: bool = True  # fused RMSNorm / gated MLP / rotary kernels (fused_ops.py)
    onednn_copy: bool = False  # --linear-onednn-copy (packed_linear.py)
    deterministic: bool = False  # --deterministic (batch_invariance.py)
    # Most tokens one batch can hold (chunked prefill + running requests):
    # the packed linear layers are warmed up for every row count up to it
    # before Ready (0: no warm-up).
    max_batch_tokens: int = 0
    # Most sequences one batch can hold (--max-running-requests): the rows the
    # output projection sees (0: as many as max_batch_tokens).
    max_batch_sequences: int = 0


def default_threads(num_runners: int) -> int:
    """CPU cores divided among runners (at least one each).

    Oversubscribing collapses throughput on CPU: two threads per process under
    contention were measured 37x slower than one on a 576x1536 linear layer.
    """
    return max(1, cpu_cores() // max(1, num_runners))


def serve(config: RunnerConfig) -> int:
    """Run the runner loop until shutdown; returns the process exit code."""
    parent = os.getppid()
    # Linux: the kernel kills the runner when the parent exits (spawn_runner
    # asks for it before the first import; this covers a runner started by
    # hand). The poll loop's getppid check covers other systems.
    die_with_parent()
    import torch
    import zmq

    from radixmux import protocol

    # SIGTERM (from a launcher) unwinds through the finally below, so the
    # socket is closed, not abandoned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(PARENT_GONE if os.getppid() != parent else 0))
    threads = config.threads or default_threads(config.num_runners)
    torch.set_num_threads(threads)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, config.runner_id.encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(config.endpoint)
    encoder = msgspec.msgpack.Encoder()
    try:
        from radixmux.memory.arena import KVArena
        from radixmux.model_runners.loader import load_model
        from radixmux.model_runners.model_runner import ModelRunner

        loaded = load_model(
            config.model,
            config.dtype,
            config.device,
            name=config.name,
            kv_dtype=config.kv_dtype,
            fuse_ops=config.fuse_ops,
            onednn_copy=config.onednn_copy,
            deterministic=config.deterministic,
        )
        arena = KVArena.attach(config.arena)
        geometry = BlockGeometry(loaded.info.layout, config.arena.block_bytes, config.page_size)
        runner = ModelRunner(
            loaded,
            arena.view(geometry),
            config.attention_backend,
            grammar_compile_timeout=config.grammar_compile_timeout,
            jump_forward=config.jump_forward,
            deterministic=config.deterministic,
            view_for=functools.partial(_group_view, arena, geometry),
        )
        t0 = time.perf_counter()
        arena.populate()  # no page faults on K/V writes while serving
        if config.max_batch_tokens:
            from radixmux.model_runners.packed_linear import warm_up

            warm_up(loaded.model, config.max_batch_tokens, config.max_batch_sequences or None)
        # Loading, converting and packing freed far more than they kept, in
        # the middle of the heap: give those pages back before serving.
        trim_heap()
        load_seconds = loaded.load_seconds + time.perf_counter() - t0
    except Exception as exc:
        sock.send(encoder.encode(protocol.Failed(f"{type(exc).__name__}: {exc}", os.getpid())))
        sock.close()
        ctx.term()
        return 1
    sock.send(encoder.encode(protocol.Ready(runner.info, os.getpid(), load_seconds, threads)))

    try:
        return _loop(sock, runner, parent)
    finally:
        sock.close()
        ctx.term()


def _loop(sock, runner, parent: int) -> int:
    import torch
    import zmq

    from radixmux import protocol

    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(protocol.RunnerRequest)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    ran = False  # a batch ran since the heap was last trimmed
    while True:
        if not poller.poll(PARENT_CHECK_MS):
            if os.getppid() != parent:
                return PARENT_GONE
            if ran:
                # Idle for a second: a prefill's freed activations stay in the
                # heap (tens of MB after a 1,500-token prompt) until given back.
                trim_heap()
                ran = False
            continue
        raw = sock.recv()
        try:
            msg = decoder.decode(raw)
        except msgspec.DecodeError as exc:
            sock.send(encoder.encode(protocol.ForwardResult(-1, error=f"malformed message: {exc}")))
            continue
        if isinstance(msg, protocol.Shutdown):
            return 0
        if msg.threads > 0 and msg.threads != torch.get_num_threads():
            torch.set_num_threads(msg.threads)
        ran = True
        try:
            result = runner.forward(msg)
        except Exception as exc:  # a bug or an odd batch must not kill the model
            tb = traceback.format_exc(limit=3)
            result = protocol.ForwardResult(
                msg.batch_id, error=f"{type(exc).__name__}: {exc}\n{tb}"
            )
        sock.send(encoder.encode(result))


def spawn_runner(
    config: RunnerConfig, zygote: Zygote | None = None, **popen: object
) -> subprocess.Popen | ZygoteChild:
    """Start a runner process for ``config``: forked from ``zygote`` when one
    is given and can fork, else a new process, the caller's child. Either way
    it dies with its parent from its first instruction on."""
    payload = msgspec.json.encode(config).decode()
    if zygote is not None:
        try:
            return zygote.fork(RUNNER_MODULE, [payload], config.runner_id)
        except ZygoteUnavailable as exc:
            log.warning("%s; runner %s starts as a new process", exc, config.runner_id)
    return subprocess.Popen(child_command(RUNNER_MODULE, payload), **popen)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: one argument, the RunnerConfig as JSON."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: runner_process '<RunnerConfig JSON>'", file=sys.stderr)
        return 2
    try:
        config = msgspec.json.decode(argv[0], type=RunnerConfig)
    except msgspec.DecodeError as exc:
        print(f"error: bad runner config: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    code = serve(config)
    if code == PARENT_GONE:
        print(
            f"runner {config.runner_id}: parent died after {time.perf_counter() - t0:.0f}s",
            file=sys.stderr,
        )
    return code


def _group_view(arena: KVArena, geometry: BlockGeometry, num_layers: int) -> torch.Tensor:
    """The arena seen with ``num_layers`` of the model's layers per slot (a layer group)."""
    layout = msgspec.structs.replace(geometry.layout, num_layers=num_layers)
    return arena.view(BlockGeometry(layout, geometry.block_bytes, geometry.page_size))


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as exc:  # SIGTERM unwinds the loop as SystemExit
        code = exc.code if isinstance(exc.code, int) else 1
    exit_now(code)
