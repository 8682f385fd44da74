"""What every runtime process shares: its start-up context, logging, lifecycle.

The launcher starts each process as ``python -m radixmux.runtime.<module>
'<ProcessContext JSON>'`` (through ``os_process.child_command``). A process
sets up logging, does its start-up work, then reports ``ProcessReady`` (or
``ProcessFailed`` with the reason) to the launcher's socket. Processes die
with their parent (Linux PDEATHSIG, asked for before any import), so a
killed launcher never leaves orphans behind, not even during start-up.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator

import msgspec
import zmq

from radixmux import protocol
from radixmux.common.ipc import Endpoints, socket
from radixmux.common.os_process import child_command, die_with_parent, exit_now
from radixmux.common.server_args import ServerArgs
from radixmux.memory.arena import ArenaSpec


class ProcessContext(msgspec.Struct, frozen=True):
    """Everything a runtime process is started with."""

    name: str  # e.g. "scheduler", "tokenizer-0", "front"
    args: ServerArgs
    endpoints: Endpoints
    served: list[protocol.ServedModel] = msgspec.field(default_factory=list)
    arena: ArenaSpec | None = None


def setup_logging(level: str, name: str) -> logging.Logger:
    """One line per event: time, level, process name, message."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s [{name}] %(message)s",
        stream=sys.stderr,
        force=True,
    )
    return logging.getLogger(f"radixmux.{name}")


def report(
    ctx: zmq.Context, endpoints: Endpoints, msg: protocol.ProcessReady | protocol.ProcessFailed
) -> None:
    """Tell the launcher this process is up (or why it is not)."""
    sock = socket(ctx, zmq.PUSH, endpoints.launcher, bind=False)
    sock.send(protocol.encode(msg))
    sock.close(linger=2000)


def inbox_messages(
    sock: zmq.Socket,
    decoder: msgspec.msgpack.Decoder,
    log: logging.Logger,
    also: tuple[zmq.Socket, msgspec.msgpack.Decoder] | None = None,
) -> Iterator[msgspec.Struct]:
    """Decoded messages from a process's inbox (and from ``also``, a second
    socket with its own decoder) until ``ShutdownProcess``.

    A malformed message is logged and dropped: bad bytes must never kill a
    process that serves other requests.
    """
    sources = [(sock, decoder)] if also is None else [(sock, decoder), also]
    poller = zmq.Poller()
    for s, _ in sources:
        poller.register(s, zmq.POLLIN)
    while True:
        ready = dict(poller.poll()) if also is not None else {sock: zmq.POLLIN}
        for s, dec in sources:
            if s not in ready:
                continue
            raw = s.recv()
            try:
                msg = dec.decode(raw)
            except msgspec.DecodeError as exc:
                log.warning("dropped a malformed message (%d bytes): %s", len(raw), exc)
                continue
            if isinstance(msg, protocol.ShutdownProcess):
                log.info("shutdown requested")
                return
            yield msg


def run_process(main: Callable[[ProcessContext, zmq.Context], int]) -> None:
    """Entry point of a runtime process module: decode argv, run ``main``, exit.

    ``main`` reports ready itself once started; an exception before or after
    is reported as ``ProcessFailed`` and ends the process with code 1.
    """
    die_with_parent()
    ctx_msg = msgspec.json.decode(sys.argv[1], type=ProcessContext)
    log = setup_logging(ctx_msg.args.log_level, ctx_msg.name)
    zctx = zmq.Context()
    code = 1
    try:
        code = main(ctx_msg, zctx)
    except KeyboardInterrupt:
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:
        log.error("fatal: %s\n%s", exc, traceback.format_exc())
        report(zctx, ctx_msg.endpoints, protocol.ProcessFailed(ctx_msg.name, os.getpid(), str(exc)))
    finally:
        zctx.destroy(linger=500)
    exit_now(code)


# Processes that load and drop tokenizers as models come and go (the
# tokenizer workers, the detokenizer) allocate Python objects through the C
# heap rather than pymalloc: transformers parses tokenizer.json into Python
# objects, and pymalloc keeps the arenas those leave part-used, where
# malloc_trim (heap.trim_heap) returns free C-heap pages. Six load-and-drop
# cycles of SmolLM2's tokenizer in one process: 75 -> 81-86 MB resident with
# pymalloc, 75-77 MB with the C heap.
TOKENIZER_ENV = {"PYTHONMALLOC": "malloc"}


def spawn(
    module: str, context: ProcessContext, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start the process whose ``main`` module is ``module`` (dotted) with
    ``context``; ``env``: variables set for it on top of this process's."""
    payload = msgspec.json.encode(context).decode()
    return subprocess.Popen(
        child_command(module, payload), env={**os.environ, **env} if env else None
    )
