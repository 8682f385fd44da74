"""Test harness for the front: a real front process, with the test playing its peers.

:class:`Peers` binds / connects real ZeroMQ sockets where the launcher,
tokenizer workers, scheduler and detokenizer would, and answers in a thread
by a per-test *script* (what the pipeline sends back for each request), so
the front is exercised over real sockets and real HTTP without the rest of
the runtime.
"""

from __future__ import annotations

import contextlib
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import zmq

from bench.server_process import free_port
from radixmux import protocol
from radixmux.common.ipc import Endpoints, make_runtime_dir, remove_runtime_dir
from radixmux.common.process import ProcessContext, spawn
from radixmux.common.server_args import ServerArgs
from radixmux.memory.layout import KVLayout
from radixmux.protocol import ModelArg, ModelInfo

VOCAB = 1000
# What a script yields: a message to push to the front, or seconds to wait first.
Step = protocol.TextBatch | protocol.RequestError | float
Script = Callable[[protocol.GenerateRequest], Iterator[Step]]


def served_model(
    name: str, chat_template: bool = True, context: int = 2048
) -> protocol.ServedModel:
    info = ModelInfo(
        name=name,
        architecture="LlamaForCausalLM",
        layout=KVLayout(2, 2, 16),
        context_length=context,
        sliding_windows=[None, None],
        vocab_size=VOCAB,
        eos_token_ids=[2],
        tokenizer_fingerprint="tok",
        kv_share_key=f"weights-{name}",
        has_chat_template=chat_template,
        dtype="float32",
        device="cpu",
    )
    return protocol.ServedModel(name, f"/models/{name}", info)


def out(req: protocol.GenerateRequest, i: int, text: str, **kw: Any) -> protocol.TextBatch:
    """One TextOutput for ``req``'s ``i``-th token (token id 100 + i)."""
    prompt = len(req.input_ids) if req.input_ids else len((req.prompt or "x").split())
    lps = None
    if req.params.logprobs:
        top = [(100 + i, -0.25), (7, -2.0)][: req.params.top_logprobs]
        lps = [protocol.TokenLogprob(100 + i, -0.25, top)]
    fields = dict(
        rid=req.rid,
        text=text,
        token_ids=[100 + i],
        prompt_tokens=prompt,
        completion_tokens=i + 1,
        cached_tokens=1,
        logprobs=lps,
    )
    fields.update(kw)
    return protocol.TextBatch([protocol.TextOutput(**fields)])


def words(delay: float = 0.0) -> Script:
    """Generates "w0 w1 ..." up to max_new_tokens (finish "length"), one token per output.

    A stop string found in the text ends the output there with ``matched_stop``
    and finish "stop", as the detokenizer does; then, like a scheduler that has
    not heard yet, it keeps sending tokens until aborted.
    """

    def script(req: protocol.GenerateRequest) -> Iterator[Step]:
        n = req.params.max_new_tokens
        text = ""
        stopped = False
        for i in range(n):
            if delay:
                yield delay
            word = f"w{i} "
            hit = next((s for s in req.stop if s in text + word), None)
            if hit is not None and not stopped:
                stopped = True
                cut = (text + word).index(hit)
                piece = (text + word)[len(text) : cut]
                yield out(req, i, piece, matched_stop=hit, finish_reason="stop")
                continue
            text += word
            yield out(
                req, i, "" if stopped else word, finish_reason="length" if i == n - 1 else None
            )

    return script


def fail(status: int, message: str, param: str | None = None) -> Script:
    def script(req: protocol.GenerateRequest) -> Iterator[Step]:
        yield protocol.RequestError(req.rid, status, message, param)

    return script


def stats(models: list[str], down: dict[str, str] | None = None) -> protocol.SchedulerStats:
    down = down or {}
    return protocol.SchedulerStats(
        models=[
            protocol.ModelStatus(
                name=m,
                up=m not in down,
                state="down" if m in down else "serving",
                error=down.get(m),
                waiting=3,
                running=2,
                replicas_up=0 if m in down else 1,
                cache_hits=5,
                cache_misses=5,
                tokens_queried=100,
                tokens_matched=40,
                cached_tokens=64,
                arena_bytes=4096,
                evicted_for_tokens=30,
                kv_allocated_tokens=120,
            )
            for m in models
        ],
        evicted_tokens={"capacity": 12},
        arena_total_bytes=1 << 20,
        arena_free_bytes=1 << 19,
        arena_fragmented_bytes=128,
        tree_nodes=9,
        steps=77,
    )


class Peers(threading.Thread):
    """Plays launcher, tokenizer, scheduler and detokenizer over real sockets."""

    def __init__(self, endpoints: Endpoints, models: list[str]) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.launcher = self._sock(zmq.PULL, endpoints.launcher, bind=True)
        self.tok = self._sock(zmq.PULL, endpoints.tokenizer, bind=False)
        self.sched = self._sock(zmq.PULL, endpoints.scheduler, bind=True)
        self.front = self._sock(zmq.PUSH, endpoints.front, bind=False)
        self.script: Script = words()
        self.stats: protocol.SchedulerStats | None = stats(models)
        self.control_ok = True
        self.requests: queue.Queue[protocol.GenerateRequest] = queue.Queue()
        self.aborts: queue.Queue[protocol.AbortRequest] = queue.Queue()
        self.controls: queue.Queue[protocol.ControlRequest] = queue.Queue()
        self.say_ready = threading.Event()  # set: tell the front every process is up
        self._halt = threading.Event()

    def _sock(self, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(endpoint) if bind else s.connect(endpoint)
        return s

    def ready(self, timeout: float = 20.0) -> protocol.ProcessReady | protocol.ProcessFailed:
        if not self.launcher.poll(int(timeout * 1000)):
            raise TimeoutError("the front never reported")
        return msgspec.msgpack.decode(self.launcher.recv(), type=protocol.LauncherInbox)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.tok, zmq.POLLIN)
        poller.register(self.sched, zmq.POLLIN)
        launcher_dec = protocol.decoder(protocol.LauncherInbox)
        tok_dec = protocol.decoder(protocol.TokenizerInbox)
        sched_dec = protocol.decoder(protocol.SchedulerInbox)
        active: dict[str, tuple[float, Iterator[Step]]] = {}
        told_ready = False
        while not self._halt.is_set():
            if self.say_ready.is_set() and not told_ready:
                self.front.send(protocol.encode(protocol.ServerReady()))
                told_ready = True
                poller.register(self.launcher, zmq.POLLIN)  # ready() has read the front's report
            now = time.monotonic()
            wait = min([due - now for due, _ in active.values()] + [0.05])
            for sock, _ in poller.poll(max(0, int(wait * 1000))):
                if sock is self.launcher:
                    cmd = launcher_dec.decode(self.launcher.recv())
                    if isinstance(cmd, protocol.ModelCommand):
                        self.front.send(protocol.encode(model_command_reply(cmd)))
                    continue
                if sock is self.tok:
                    req = tok_dec.decode(self.tok.recv())
                    if isinstance(req, protocol.TokenizeRequest | protocol.DetokenizeRequest):
                        self.front.send(protocol.encode(tokenizer_reply(req)))
                        continue
                    self.requests.put(req)
                    active[req.rid] = (time.monotonic(), self.script(req))
                else:
                    msg = sched_dec.decode(self.sched.recv())
                    if isinstance(msg, protocol.AbortRequest):
                        self.aborts.put(msg)
                        active.pop(msg.rid, None)  # a scheduler stops the request
                    elif isinstance(msg, protocol.WarmupRequest):  # every prefix cached at once
                        self.front.send(protocol.encode(warmup_reply(msg)))
                    elif isinstance(msg, protocol.ControlRequest):
                        self.controls.put(msg)
                        if self.stats is not None:  # None: an unresponsive scheduler
                            reply = protocol.ControlReply(
                                msg.req_id, self.control_ok, "done", self.stats
                            )
                            self.front.send(protocol.encode(reply))
            for rid, (due, steps) in list(active.items()):
                if due > time.monotonic():
                    continue
                step = next(steps, None)
                if step is None:
                    del active[rid]
                elif isinstance(step, float):
                    active[rid] = (time.monotonic() + step, steps)
                else:
                    self.front.send(protocol.encode(step))

    def close(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self.ctx.destroy(linger=0)


def model_command_reply(cmd: protocol.ModelCommand) -> protocol.ModelCommandReply:
    """The launcher's answer to a model change: it always succeeds here."""
    if cmd.op != "load":
        return protocol.ModelCommandReply(cmd.req_id, 200, "unloaded")
    model = msgspec.structs.replace(served_model(cmd.served), version=cmd.version)
    return protocol.ModelCommandReply(cmd.req_id, 200, "loaded", model)


def warmup_reply(msg: protocol.WarmupRequest) -> protocol.WarmupReply:
    """A scheduler's answer to a warm-up: each prefix computed, cached, pinned if asked."""
    sizes = [len(protocol.unpack_ids(p)) for p in msg.prefixes]
    items = [protocol.WarmedPrefix(n, n, n, n if msg.pin else 0) for n in sizes]
    return protocol.WarmupReply(msg.req_id, items=items)


def tokenizer_reply(
    req: protocol.TokenizeRequest | protocol.DetokenizeRequest,
) -> protocol.TokenizerReply:
    """A worker's answer in this harness's toy vocabulary: token 100 + i per word."""
    if isinstance(req, protocol.DetokenizeRequest):
        return protocol.TokenizerReply(req.req_id, text=" ".join(f"w{t}" for t in req.tokens))
    text = req.prompt or " ".join(m.content for m in req.messages or [])
    return protocol.TokenizerReply(req.req_id, tokens=[100 + i for i, _ in enumerate(text.split())])


class RunningFront:
    """A front process and its peers; ``url`` is where it serves HTTP."""

    def __init__(self, served: list[protocol.ServedModel], **args: Any) -> None:
        self.dir = make_runtime_dir()
        self.endpoints = Endpoints.in_dir(self.dir)
        self.port = free_port()
        server_args = ServerArgs(
            models=[ModelArg(m.folder, m.name) for m in served], port=self.port, **args
        )
        self.peers = Peers(self.endpoints, [m.name for m in served])
        self.peers.start()
        ctx = ProcessContext("front", server_args, self.endpoints, served)
        self.proc: subprocess.Popen = spawn("radixmux.runtime.front.server", ctx)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_announced(self, timeout: float = 20.0) -> None:
        """Wait until the front has heard that the server is up."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=5).json().get("status") != "starting":
                    return
            assert time.monotonic() < deadline, "the front never left 'starting'"
            time.sleep(0.05)

    def stop(self) -> int | None:
        """SIGTERM the front; its exit code (None if it had to be killed). Idempotent."""
        if self.proc.returncode is not None:
            return self.proc.returncode
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = None
        self.peers.close()
        remove_runtime_dir(self.dir)
        return code


@contextlib.contextmanager
def running_front(
    served: list[protocol.ServedModel], announce: bool = True, **args: Any
) -> Iterator[RunningFront]:
    """A front whose peers, once it reports ready, tell it the server is up
    (``announce=False``: they never do, so it keeps answering "starting")."""
    front = RunningFront(served, **args)
    try:
        ready = front.peers.ready()
        assert isinstance(ready, protocol.ProcessReady), ready
        if announce:
            front.peers.say_ready.set()
            front.wait_announced()
        yield front
    finally:
        front.stop()


@contextlib.contextmanager
def chat_and_base_front(**args: Any) -> Iterator[RunningFront]:
    """The usual test front: a model with a chat template (``chat``) and one
    without (``base``), peers answering with :func:`words`."""
    models = [served_model("chat"), served_model("base", chat_template=False)]
    with running_front(models, **args) as front:
        front.peers.script = words()
        front.peers.stats = stats(["chat", "base"])
        yield front
