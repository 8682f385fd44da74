"""The tokenizer worker as a real process, its peers played over real ZeroMQ sockets.

The test binds what the front and scheduler bind (the tokenizer PUSH, the
front and scheduler PULLs, the launcher PULL) and checks what the worker sends.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from bench.tiny_models import make_tiny_model_dir
from radixmux import protocol
from radixmux.common.ipc import Endpoints, make_runtime_dir, remove_runtime_dir
from radixmux.common.process import ProcessContext, spawn
from radixmux.common.server_args import ServerArgs
from radixmux.memory.layout import KVLayout
from radixmux.protocol import ModelArg, ModelInfo

CONTEXT = 64


def served_model(name: str, folder: Path, context: int = CONTEXT) -> protocol.ServedModel:
    """A ServedModel as the scheduler would announce it for a tiny model folder."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    info = ModelInfo(
        name=name,
        architecture="LlamaForCausalLM",
        layout=KVLayout(2, 2, 16),
        context_length=context,
        sliding_windows=[None, None],
        vocab_size=len(tok),
        eos_token_ids=[tok.eos_token_id],
        tokenizer_fingerprint="",
        kv_share_key=name,
        has_chat_template=bool(tok.chat_template),
        dtype="float32",
        device="cpu",
    )
    return protocol.ServedModel(name, str(folder), info)


class Peers:
    """The worker's peers: sockets the test binds, and the worker process."""

    def __init__(self, tmp: Path, served: list[protocol.ServedModel], **flags: object) -> None:
        self.dir = make_runtime_dir(str(tmp / "rt"))
        self.eps = Endpoints.in_dir(self.dir)
        self.zctx = zmq.Context()
        self.launcher = self._bind(zmq.PULL, self.eps.launcher)
        self.tokenizer = self._bind(zmq.PUSH, self.eps.tokenizer)
        self.scheduler = self._bind(zmq.PULL, self.eps.scheduler)
        self.front = self._bind(zmq.PULL, self.eps.front)
        args = ServerArgs(models=[ModelArg(m.folder, m.name) for m in served], **flags)
        self.proc = spawn(
            "radixmux.runtime.tokenizer_worker",
            ProcessContext("tokenizer-0", args, self.eps, served=served),
        )

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket:
        sock = self.zctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        return sock

    def recv(self, sock: zmq.Socket, union: object, timeout: float = 30.0) -> object:
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError("no message")
        return protocol.decoder(union).decode(sock.recv())

    def send(
        self, req: protocol.GenerateRequest
    ) -> protocol.TokenizedRequest | protocol.RequestError:
        """One request in; whatever comes out (to the scheduler or to the front)."""
        self.tokenizer.send(protocol.encode(req))
        poller = zmq.Poller()
        poller.register(self.scheduler, zmq.POLLIN)
        poller.register(self.front, zmq.POLLIN)
        events = dict(poller.poll(10_000))
        if self.scheduler in events:
            return protocol.decoder(protocol.SchedulerInbox).decode(self.scheduler.recv())
        if self.front in events:
            return protocol.decoder(protocol.FrontInbox).decode(self.front.recv())
        raise TimeoutError(f"no answer for {req.rid}")

    def close(self) -> int:
        self.proc.terminate()
        try:
            code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.zctx.destroy(linger=0)
        remove_runtime_dir(self.dir)
        return code


@contextlib.contextmanager
def workers(*setups: tuple[Path, list[protocol.ServedModel], dict]) -> Iterator[list[Peers]]:
    """Start several workers at once (their start-ups overlap), wait until all are ready."""
    started = [Peers(tmp, served, **flags) for tmp, served, flags in setups]
    try:
        for peers in started:
            ready = peers.recv(peers.launcher, protocol.LauncherInbox, timeout=60)
            assert isinstance(ready, protocol.ProcessReady), ready
            assert ready.name == "tokenizer-0" and ready.pid == peers.proc.pid
        yield started
    finally:
        for peers in started:
            peers.close()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok_models")
    return {
        "chat": make_tiny_model_dir(root / "chat", chat_template=True),
        "base": make_tiny_model_dir(root / "base", chat_template=False),
    }


@pytest.fixture(scope="module")
def tok(folders):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folders["chat"])


TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture(scope="module")
def both(folders, tmp_path_factory) -> Iterator[list[Peers]]:
    """A worker for both models, and one for the base model with --chat-template."""
    served = [served_model("chat", folders["chat"]), served_model("base", folders["base"])]
    tmp = tmp_path_factory.mktemp("tokw")
    (tmp / "t.jinja").write_text(TEMPLATE)
    flagged = [served_model("base", folders["base"])]
    setups = [
        (tmp / "a", served, {}),
        (tmp / "b", flagged, {"chat_template": str(tmp / "t.jinja")}),
    ]
    (tmp / "a").mkdir()
    (tmp / "b").mkdir()
    with workers(*setups) as started:
        yield started


@pytest.fixture(scope="module")
def peers(both) -> Peers:
    return both[0]


def gen(
    rid: str, model: str = "chat", max_tokens: int = 8, **kw: object
) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(
        rid, model, protocol.SamplingParams(max_new_tokens=max_tokens), **kw
    )


@pytest.mark.timeout(60)
def test_prompt_text_carries_everything(peers, tok):
    req = gen(
        "r1", prompt="Hello, world 世界", stop=["\n"], skip_special_tokens=False, arrival=12.5
    )
    out = peers.send(req)
    assert isinstance(out, protocol.TokenizedRequest)
    assert protocol.unpack_ids(out.input_ids).tolist() == tok("Hello, world 世界").input_ids
    assert (out.rid, out.model, out.stop, out.skip_special_tokens, out.arrival) == (
        "r1",
        "chat",
        ["\n"],
        False,
        12.5,
    )
    assert out.params == req.params


@pytest.mark.timeout(60)
def test_input_ids_validated(peers, tok):
    out = peers.send(gen("r2", input_ids=[1, 2, 3]))
    assert isinstance(out, protocol.TokenizedRequest)
    assert protocol.unpack_ids(out.input_ids).tolist() == [1, 2, 3]
    for bad in ([5, len(tok)], [-1]):
        err = peers.send(gen("r3", input_ids=bad))
        assert isinstance(err, protocol.RequestError)
        assert (err.status, err.param) == (400, "input_ids")
        assert "input_ids" in err.message and str(bad[-1]) in err.message


@pytest.mark.timeout(60)
def test_chat_messages_use_template(peers, tok):
    msgs = [{"role": "user", "content": "hi there"}]
    out = peers.send(gen("c1", messages=[protocol.ChatMessage(**m) for m in msgs]))
    assert isinstance(out, protocol.TokenizedRequest)
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert (
        protocol.unpack_ids(out.input_ids).tolist() == tok(text, add_special_tokens=False).input_ids
    )


@pytest.mark.timeout(60)
def test_chat_to_base_model_is_400(peers):
    err = peers.send(gen("c2", model="base", messages=[protocol.ChatMessage("user", "hi")]))
    assert isinstance(err, protocol.RequestError) and err.status == 400
    assert "no chat template" in err.message and "--chat-template" in err.message
    # The same model still takes plain prompts.
    assert isinstance(peers.send(gen("c3", model="base", prompt="hi")), protocol.TokenizedRequest)


@pytest.mark.timeout(60)
def test_bad_requests(peers):
    err = peers.send(gen("e1", prompt=""))
    assert (err.status, err.param) == (400, "prompt")
    err = peers.send(gen("e2", input_ids=[]))
    assert err.status == 400 and "empty" in err.message
    err = peers.send(gen("e3"))
    assert err.status == 400 and "exactly one" in err.message
    err = peers.send(gen("e4", prompt="a", input_ids=[1]))
    assert err.status == 400 and "exactly one" in err.message
    err = peers.send(gen("e5", model="nope", prompt="hi"))
    assert err.status == 404 and "chat" in err.message and "base" in err.message


@pytest.mark.timeout(60)
def test_context_length_check(peers):
    ok = peers.send(gen("l1", input_ids=[1] * 10, max_tokens=CONTEXT - 10))
    assert isinstance(ok, protocol.TokenizedRequest)
    err = peers.send(gen("l2", input_ids=[1] * 10, max_tokens=CONTEXT - 9))
    assert isinstance(err, protocol.RequestError)
    assert (err.status, err.param) == (400, "max_tokens")
    assert f"{CONTEXT + 1}" in err.message and f"{CONTEXT}" in err.message


@pytest.mark.timeout(60)
def test_garbage_does_not_kill_worker(peers):
    peers.tokenizer.send(b"\x00not msgpack")
    peers.tokenizer.send(msgspec.msgpack.encode({"type": "generate", "rid": 1}))
    assert isinstance(peers.send(gen("g1", prompt="still alive")), protocol.TokenizedRequest)
    assert peers.proc.poll() is None


@pytest.mark.timeout(60)
def test_chat_template_flag_and_clean_exit(both, folders):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folders["base"])
    p = both[1]
    out = p.send(gen("t1", model="base", messages=[protocol.ChatMessage("user", "yo")]))
    assert isinstance(out, protocol.TokenizedRequest)
    expect = tok("[user] yo\n[assistant] ", add_special_tokens=False).input_ids
    assert protocol.unpack_ids(out.input_ids).tolist() == expect
    t0 = time.time()
    assert p.close() == 0  # SIGTERM is a clean stop
    assert time.time() - t0 < 5
