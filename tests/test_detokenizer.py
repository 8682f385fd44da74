"""The detokenizer: incremental text in-process, then the real process over ZeroMQ."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from bench.tiny_models import make_tiny_model_dir
from radixmux import protocol
from radixmux.common.ipc import Endpoints, make_runtime_dir, remove_runtime_dir
from radixmux.common.process import ProcessContext, spawn
from radixmux.common.server_args import ServerArgs
from radixmux.memory.layout import KVLayout
from radixmux.protocol import ModelArg, ModelInfo
from radixmux.runtime.detokenizer import STOPPED_TTL_S, Detokenizer, IncrementalText

# Emoji (with a skin-tone modifier) and CJK: byte-level BPE splits each
# character over several tokens, so naive per-token decoding prints U+FFFD.
TEXT = "héllo 👋🏽 世界 你好, naïve café ∑ done"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("detok") / "m")


@pytest.fixture(scope="module")
def tok(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def stream(tok, ids: list[int], stop: list[str] = (), skip: bool = True) -> list[tuple]:
    """Feed ``ids`` one at a time (the last one final); every (delta, matched)."""
    inc = IncrementalText(tok, list(stop), skip)
    steps = [inc.add([i]) for i in ids[:-1]]
    steps.append(inc.add(ids[-1:], final=True))
    return steps


def test_multibyte_streams_without_replacement_chars(tok):
    ids = tok(TEXT).input_ids
    assert "\ufffd" in "".join(tok.decode([i]) for i in ids)  # the naive way breaks
    deltas = [d for d, _ in stream(tok, ids)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == TEXT


def test_random_ids_round_trip(tok):
    import random

    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            deltas = [d for d, _ in stream(tok, ids, skip=skip)]
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_stop_string_spanning_tokens(tok):
    ids = tok("The answer is 42. END of story").input_ids
    steps = stream(tok, ids, stop=["END of", "zzz"])
    matched = [i for i, (_, m) in enumerate(steps) if m]
    assert matched and steps[matched[0]][1] == "END of"
    text = "".join(d for d, _ in steps[: matched[0] + 1])
    assert text == "The answer is 42. "
    # Nothing that could begin the stop string was emitted early.
    assert all("E" not in d for d, _ in steps[: matched[0]])


def test_stop_string_inside_multibyte_text(tok):
    ids = tok("ab 世界 cd").input_ids
    steps = stream(tok, ids, stop=["界 c"])
    assert "".join(d for d, _ in steps[: next(i for i, s in enumerate(steps) if s[1]) + 1]) == (
        "ab 世"
    )


def test_held_tail_released_when_not_a_stop(tok):
    ids = tok("one two three").input_ids
    steps = stream(tok, ids, stop=["two threx"])
    assert not any(m for _, m in steps)
    assert "".join(d for d, _ in steps) == "one two three"


def test_skip_special_tokens(tok):
    ids = tok("hi<|im_end|> there").input_ids
    assert "".join(d for d, _ in stream(tok, ids, skip=True)) == "hi there"
    assert "".join(d for d, _ in stream(tok, ids, skip=False)) == "hi<|im_end|> there"


def out(
    rid: str, ids: list[int], n: int, finish: str | None = None, **kw
) -> protocol.RequestOutput:
    return protocol.RequestOutput(rid, "m", ids, 7, n, 3, finish_reason=finish, **kw)


def served(folder: Path, instance: str) -> protocol.ServedModel:
    """``folder``'s tokenizer served as ``instance`` (``name`` or ``name@vN``)."""
    name, _, version = instance.partition("@v")
    info = ModelInfo(
        name,
        "LlamaForCausalLM",
        KVLayout(2, 2, 16),
        2048,
        [None, None],
        49152,
        [2],
        "",
        "",
        True,
        "float32",
        "cpu",
    )
    return protocol.ServedModel(name, str(folder), info, version=int(version or 1))


def test_a_table_applied_after_an_instance_was_removed_does_not_bring_it_back(folder):
    # Tables are applied on their own thread behind the loop: a resend of the
    # table that listed an instance, still queued when the instance's
    # ModelRemoved arrives, must not load its tokenizer again (nothing would
    # drop it: a leaked tokenizer per such race).
    detok = Detokenizer({})
    h, h2 = served(folder, "h"), served(folder, "h@v2")
    assert h2.instance == "h@v2"
    detok.newest_table = 3
    detok.add_models([h, h2], 3)
    assert set(detok.tokenizers) == {"h", "h@v2"}
    detok.newest_table = 4  # the table without h, queued behind the resend below
    detok.remove_model("h")
    detok.remove_model("h@v2")
    detok.add_models([h, h2], 3)  # the resend
    assert detok.tokenizers == {}
    detok.add_models([], 4)  # the launcher's table after the unload
    assert detok.removed == {}
    detok.add_models([h], 6)  # a later load of the same name is a new instance
    assert set(detok.tokenizers) == {"h"}
    # A request of h that never gets a final output (its model went first) does
    # not keep h's tokenizer: the removal drops its state too.
    detok.process(protocol.TokenBatch([protocol.RequestOutput("r", "h", [5, 6], 7, 2, 3)]))
    assert set(detok.live) == {"r"}
    detok.remove_model("h")
    assert detok.live == {} and detok.tokenizers == {}


def test_state_ends_with_request(tok):
    detok = Detokenizer({"m": tok})
    ids = tok("x y z END w").input_ids
    outs = detok.process(
        protocol.TokenBatch([out("a", ids[:1], 1, stop=["END"]), out("b", ids[:1], 1)])
    )
    assert [o.rid for o in outs] == ["a", "b"] and not detok.stopped
    outs = detok.process(
        protocol.TokenBatch([out("a", ids[1:], len(ids)), out("b", ids[1:2], 2, "length")])
    )
    assert (
        list(detok.stopped) == ["a"]
        and outs[0].finish_reason == "stop"
        and outs[0].matched_stop == "END"
    )
    assert outs[1].finish_reason == "length" and outs[1].matched_stop is None
    assert detok.live == {}
    # Later outputs for a stopped request are dropped; its final one clears it.
    assert detok.process(protocol.TokenBatch([out("a", [5], 9)])) == []
    assert detok.process(protocol.TokenBatch([out("a", [], 9, "abort")])) == []
    assert not detok.stopped
    # Without a final output, a stopped rid is forgotten after a while.
    detok.process(protocol.TokenBatch([out("e", ids, len(ids), stop=["END"])]))
    assert list(detok.stopped) == ["e"]
    detok.stopped["e"] -= STOPPED_TTL_S + 1
    assert detok.process(protocol.TokenBatch([])) == [] and not detok.stopped
    # Errors pass through and end the state; unknown models fail only their request.
    outs = detok.process(
        protocol.TokenBatch([out("c", [], 0, "error", error="runner died", status=503)])
    )
    assert (outs[0].error, outs[0].status, outs[0].finish_reason) == ("runner died", 503, "error")
    bad = protocol.RequestOutput("d", "other", [1], 1, 1, 0)
    outs = detok.process(protocol.TokenBatch([bad]))
    assert outs[0].status == 500 and outs[0].finish_reason == "error"
    assert detok.live == {}


# ---- the real process -----------------------------------------------------------
class Peers:
    """The front (PULL) and the scheduler's PUSH."""

    def __init__(self, tmp: Path, folder: Path) -> None:
        self.dir = make_runtime_dir(str(tmp / "rt"))
        self.eps = Endpoints.in_dir(self.dir)
        self.zctx = zmq.Context()
        self.launcher = self._sock(zmq.PULL, self.eps.launcher, bind=True)
        self.front = self._sock(zmq.PULL, self.eps.front, bind=True)
        self.push = self._sock(zmq.PUSH, self.eps.detokenizer, bind=False)
        args = ServerArgs(models=[ModelArg(str(folder), "m")])
        table = [served(folder, "m")]
        self.proc = spawn(
            "radixmux.runtime.detokenizer", ProcessContext("detokenizer", args, self.eps, table)
        )

    def _sock(self, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
        sock = self.zctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint) if bind else sock.connect(endpoint)
        return sock

    def recv(self, sock: zmq.Socket, union: object, timeout: float = 30.0):
        assert sock.poll(int(timeout * 1000)), "no message"
        return protocol.decoder(union).decode(sock.recv())


@pytest.fixture(scope="module")
def peers(folder, tmp_path_factory) -> Iterator[Peers]:
    p = Peers(tmp_path_factory.mktemp("detokp"), folder)
    try:
        ready = p.recv(p.launcher, protocol.LauncherInbox, timeout=60)
        assert isinstance(ready, protocol.ProcessReady) and ready.name == "detokenizer"
        yield p
    finally:
        p.proc.terminate()
        try:
            p.proc.wait(10)
        except subprocess.TimeoutExpired:
            p.proc.kill()
        p.zctx.destroy(linger=0)
        remove_runtime_dir(p.dir)


@pytest.mark.timeout(60)
def test_process_streams_and_stops(peers, tok):
    ids = tok(TEXT).input_ids
    stop_ids = tok("one 世界 STOP two").input_ids
    texts: dict[str, str] = {"u": "", "s": ""}
    logprobs = [protocol.TokenLogprob(ids[0], -0.5, [(ids[0], -0.5), (ids[1], -1.5)])]
    # The front has no tokenizer: the detokenizer names the logprob tokens.
    name = [tok.decode([i], skip_special_tokens=False) for i in ids[:2]]
    named = [protocol.TokenLogprob(ids[0], -0.5, [(ids[0], -0.5), (ids[1], -1.5)], name[0], name)]
    for i in range(max(len(ids), len(stop_ids))):
        outs = []
        if i < len(ids):
            fin = "length" if i == len(ids) - 1 else None
            outs.append(
                protocol.RequestOutput(
                    "u", "m", [ids[i]], 5, i + 1, 2, fin, logprobs if i == 0 else None
                )
            )
        if i < len(stop_ids):
            outs.append(
                protocol.RequestOutput(
                    "s", "m", [stop_ids[i]], 5, i + 1, 0, stop=["STOP"] if i == 0 else None
                )
            )
        peers.push.send(protocol.encode(protocol.TokenBatch(outs)))
        batch = peers.recv(peers.front, protocol.FrontInbox)
        assert isinstance(batch, protocol.TextBatch)
        for o in batch.outputs:
            assert "\ufffd" not in o.text
            texts[o.rid] += o.text
            if o.rid == "u":
                assert (o.prompt_tokens, o.completion_tokens, o.cached_tokens) == (5, i + 1, 2)
                assert o.logprobs == (named if i == 0 else None)
            if o.rid == "s" and o.finish_reason:
                assert (o.finish_reason, o.matched_stop) == ("stop", "STOP")
    assert texts == {"u": TEXT, "s": "one 世界 "}


@pytest.mark.timeout(60)
def test_process_survives_garbage_and_shuts_down(peers, tok):
    peers.push.send(b"\xffgarbage")
    peers.push.send(
        protocol.encode(
            protocol.TokenBatch([protocol.RequestOutput("z", "m", [42], 1, 1, 0, "stop")])
        )
    )
    batch = peers.recv(peers.front, protocol.FrontInbox)
    assert batch.outputs[0].text == tok.decode([42]) and batch.outputs[0].finish_reason == "stop"
    peers.push.send(protocol.encode(protocol.ShutdownProcess()))
    assert peers.proc.wait(10) == 0
