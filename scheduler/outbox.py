"""The scheduler's one outbox: every message it sends goes through here.

Four destinations: a runner (by runner id, over the ROUTER socket), the
detokenizer, the front and the launcher. ``SocketOutbox`` sends over ZeroMQ;
a test gives the scheduler an object with the same four methods that records
what was sent instead.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
import zmq

from radixmux import protocol
from radixmux.common.ipc import socket
from radixmux.common.process import ProcessContext


class Outbox(Protocol):
    """Where the scheduler's messages go."""

    def to_runner(self, runner_id: str, msg: protocol.RunnerRequest) -> None: ...

    def to_detokenizer(self, msg: protocol.TokenBatch | protocol.ModelRemoved) -> None: ...

    def to_front(self, msg: msgspec.Struct) -> None: ...

    def to_launcher(self, msg: protocol.ModelAdded | protocol.ModelRemoved) -> None: ...


class SocketOutbox:
    """The outbox over the process's sockets (the runner socket is shared
    with the loop, which receives the runners' replies on it)."""

    def __init__(self, ctx: ProcessContext, zctx: zmq.Context, runner_sock: zmq.Socket) -> None:
        ep = ctx.endpoints
        self.runner_sock = runner_sock
        self.detok = socket(zctx, zmq.PUSH, ep.detokenizer, bind=False)
        self.front = socket(zctx, zmq.PUSH, ep.front, bind=False)
        self.launcher = socket(zctx, zmq.PUSH, ep.launcher, bind=False)

    def to_runner(self, runner_id: str, msg: protocol.RunnerRequest) -> None:
        self.runner_sock.send_multipart([runner_id.encode(), protocol.encode(msg)])

    def to_detokenizer(self, msg: protocol.TokenBatch | protocol.ModelRemoved) -> None:
        self.detok.send(protocol.encode(msg))

    def to_front(self, msg: msgspec.Struct) -> None:
        self.front.send(protocol.encode(msg))

    def to_launcher(self, msg: protocol.ModelAdded | protocol.ModelRemoved) -> None:
        self.launcher.send(protocol.encode(msg))
