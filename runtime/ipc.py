"""ZeroMQ plumbing: the private runtime directory, endpoints and sockets.

All sockets are ``ipc://`` files in one directory created with mode 0700, so
no other user can connect to a runtime's internals. Who binds what:

================  ==========  ===============================================
endpoint          bound by    connected by
================  ==========  ===============================================
``launcher``      launcher    every process (PUSH ProcessReady/Failed)
``tokenizer``     front       tokenizer workers (PULL; PUSH round-robins)
``scheduler``     scheduler   tokenizer workers, front, launcher (PUSH)
``runners``       scheduler   runners (ROUTER/DEALER, identity = runner id)
``detokenizer``   detokenizer scheduler (PUSH)
``front``         front       tokenizer workers, scheduler, detokenizer (PUSH)
``models``        launcher    tokenizer workers (SUB: the table of loaded models)
``client``        front       the Python ZMQ client (ROUTER/DEALER)
================  ==========  ===============================================
"""

from __future__ import annotations

import os
import shutil
import tempfile

import msgspec
import zmq


class Endpoints(msgspec.Struct, frozen=True):
    """Addresses of every socket of one runtime."""

    runtime_dir: str
    launcher: str
    tokenizer: str
    scheduler: str
    runners: str
    detokenizer: str
    front: str
    models: str
    client: str

    @classmethod
    def in_dir(cls, runtime_dir: str, client: str | None = None) -> Endpoints:
        def ipc(name: str) -> str:
            return f"ipc://{os.path.join(runtime_dir, name)}"

        return cls(
            runtime_dir=runtime_dir,
            launcher=ipc("launcher"),
            tokenizer=ipc("tokenizer"),
            scheduler=ipc("scheduler"),
            runners=ipc("runners"),
            detokenizer=ipc("detokenizer"),
            front=ipc("front"),
            models=ipc("models"),
            client=client or ipc("client"),
        )


def make_runtime_dir(path: str | None = None) -> str:
    """Create the private (0700) directory that holds the runtime's sockets."""
    if path is None:
        return tempfile.mkdtemp(prefix="radixmux-")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def remove_runtime_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
    """A socket bound or connected to ``endpoint``; LINGER is short so exits never hang."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 500)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock
