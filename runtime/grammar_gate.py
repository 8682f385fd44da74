"""Constrained requests wait here, in a tokenizer worker, until their grammar
has compiled for the model's tokenizer.

A request whose constraint compiles goes on to the scheduler; one that is
invalid, or takes longer than ``--grammar-compile-timeout``, is answered with
a 400 naming its field. The worker's loop never waits on a compile: a grammar
already compiled (the usual case: schemas repeat) passes straight through,
the rest are held on this gate's own thread and sockets, so requests behind
a slow schema are tokenized and scheduled as usual.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from radixmux import protocol
from radixmux.common.grammar import GrammarCompiler, GrammarError
from radixmux.common.ipc import Endpoints, socket

log = logging.getLogger("radixmux.tokenizer")

TABLES_S = 120.0  # most a tokenizer's grammar tables may take to build (262k tokens: ~1 s)


@dataclass
class _Held:
    request: protocol.TokenizedRequest
    compile: concurrent.futures.Future
    compiler: GrammarCompiler
    submitted: float

    def deadline(self, timeout: float) -> float:
        """When it is out of time: ``timeout`` after it was submitted or after
        the tokenizer's tables were built (a one-off that is not the grammar's
        cost), whichever is later; the tables themselves get ``TABLES_S``."""
        ready = self.compiler.tables_ready_at
        if ready is None:
            return self.submitted + TABLES_S
        return max(self.submitted, ready) + timeout


def verdict(
    request: protocol.TokenizedRequest, fut: concurrent.futures.Future, timeout: float
) -> msgspec.Struct:
    """What to send for a request whose compile is done (or out of time): the
    request itself, or the ``RequestError`` that refuses it."""
    c = request.params.constraint
    assert c is not None
    try:
        fut.result(timeout=0)
    except GrammarError as exc:
        return protocol.RequestError(request.rid, 400, exc.message, exc.field or None)
    except concurrent.futures.TimeoutError:
        what = c.field or c.kind
        message = f"{what}: took longer than {timeout:g} s to compile (--grammar-compile-timeout)"
        return protocol.RequestError(request.rid, 400, message, c.field or None)
    except Exception as exc:  # an xgrammar bug fails this request, not the worker
        log.exception("rid=%s grammar compile failed", request.rid)
        return protocol.RequestError(request.rid, 500, f"grammar compile failed: {exc}")
    return request


class GrammarGate:
    """Holds constrained requests until their grammars compiled (see the module)."""

    def __init__(self, zctx: zmq.Context, endpoints: Endpoints, timeout: float) -> None:
        self.timeout = timeout
        self._zctx = zctx
        self._endpoints = endpoints
        self._inbox: queue.Queue[_Held | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(
        self, compiler: GrammarCompiler, request: protocol.TokenizedRequest
    ) -> msgspec.Struct | None:
        """Start ``request``'s compile. Returns what to send now when it is
        already done (a cached grammar), else ``None``: the gate sends it later."""
        c = request.params.constraint
        assert c is not None
        fut = compiler.start(c)
        if fut.done():
            return verdict(request, fut, self.timeout)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="grammar-gate", daemon=True)
            self._thread.start()
        held = _Held(request, fut, compiler, time.monotonic())
        fut.add_done_callback(lambda _: self._inbox.put(None))  # wakes the gate
        self._inbox.put(held)
        return None

    def _run(self) -> None:
        to_scheduler = socket(self._zctx, zmq.PUSH, self._endpoints.scheduler, bind=False)
        to_front = socket(self._zctx, zmq.PUSH, self._endpoints.front, bind=False)
        held: list[_Held] = []
        while True:
            # The tables' build can end while waiting: look again at least every second.
            wait = min((h.deadline(self.timeout) for h in held), default=None)
            try:
                item = self._inbox.get(
                    timeout=None if wait is None else min(1.0, max(0.0, wait - time.monotonic()))
                )
                if item is not None:
                    held.append(item)
            except queue.Empty:
                pass
            now = time.monotonic()
            due = [h for h in held if h.compile.done() or now >= h.deadline(self.timeout)]
            for h in due:
                held.remove(h)
                out = verdict(h.request, h.compile, self.timeout)
                if isinstance(out, protocol.RequestError):
                    log.info("rid=%s rejected %d: %s", out.rid, out.status, out.message)
                    to_front.send(protocol.encode(out))
                else:
                    to_scheduler.send(protocol.encode(out))
