"""The front process: HTTP (OpenAI + SGLang-native + operations) and the ZMQ client socket.

Started by the launcher as ``python -m radixmux.runtime.front.server '<ProcessContext JSON>'``.
One asyncio (uvloop) event loop runs uvicorn, the reader of downstream replies
and the ZMQ-client server; the process reports ready once uvicorn listens and
exits with code 0 on SIGTERM / SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket as pysocket
from collections.abc import Awaitable, Callable

import uvicorn
import uvloop
import zmq

from radixmux import protocol
from radixmux.common.process import ProcessContext, report, run_process
from radixmux.runtime.front.api import warmup
from radixmux.runtime.front.app import build_app
from radixmux.runtime.front.state import Front
from radixmux.runtime.front.zmq_server import ClientServer
from radixmux.runtime.warmup_file import SERVING_NAME

log = logging.getLogger("radixmux.front")


class _Server(uvicorn.Server):
    """uvicorn without its signal capture: the front installs its own handlers so
    that a SIGTERM ends the process cleanly (exit 0) instead of being re-raised."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


def _listen(host: str, port: int) -> pysocket.socket:
    """Bind the HTTP socket up front so a busy port fails start-up with a clear error."""
    family = pysocket.AF_INET6 if ":" in host else pysocket.AF_INET
    sock = pysocket.socket(family, pysocket.SOCK_STREAM)
    sock.setsockopt(pysocket.SOL_SOCKET, pysocket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"front cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _report_serving(zctx: zmq.Context, ctx: ProcessContext) -> Callable[[], Awaitable[bool]]:
    """The hook run once every process is ready: tell the launcher the front
    now serves, so its start returns only when a first request is answered
    (not with 503 "starting" while the front has yet to read ServerReady)."""

    async def run() -> bool:
        report(zctx, ctx.endpoints, protocol.ProcessReady(SERVING_NAME, os.getpid()))
        return True

    return run


async def serve(ctx: ProcessContext, zctx: zmq.Context) -> int:
    front = Front(ctx, zctx)
    clients = ClientServer(zctx, front)
    if ctx.args.warmup is not None:  # run before /health turns 200
        front.hub.before_ready = warmup.at_start(front, zctx)
    else:
        front.hub.before_ready = _report_serving(zctx, ctx)
    sock = _listen(ctx.args.host, ctx.args.port)
    config = uvicorn.Config(
        build_app(front),
        log_config=None,
        log_level=ctx.args.log_level.lower(),
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=3,
    )
    server = _Server(config)

    def stop(sig: signal.Signals) -> None:
        log.info("%s: shutting down", sig.name)
        front.hub.fail_all(503, "the server is shutting down")
        server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # The launcher starts children with SIGINT ignored (Ctrl-C reaches the
        # whole group; it stops them in order itself): keep it that way.
        if signal.getsignal(sig) is not signal.SIG_IGN:
            loop.add_signal_handler(sig, stop, sig)
    readers = [
        asyncio.create_task(front.hub.run(), name="front-reader"),
        asyncio.create_task(clients.run(), name="zmq-client-server"),
        asyncio.create_task(front.on_demand.run_idle_unloads(), name="idle-unloads"),
    ]
    http = asyncio.create_task(server.serve(sockets=[sock]), name="uvicorn")
    try:
        while not server.started:
            if http.done():
                http.result()
                raise RuntimeError("uvicorn stopped during start-up")
            await asyncio.sleep(0.01)
        report(zctx, ctx.endpoints, protocol.ProcessReady(ctx.name, os.getpid()))
        log.info(
            "serving http://%s:%d models=%s zmq=%s",
            ctx.args.host,
            ctx.args.port,
            sorted(front.served),
            ctx.endpoints.client,
        )
        await http
    finally:
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        front.hub.close()
        clients.router.close(linger=0)
    return 0


def main(ctx: ProcessContext, zctx: zmq.Context) -> int:
    return uvloop.run(serve(ctx, zctx))


if __name__ == "__main__":
    run_process(main)
