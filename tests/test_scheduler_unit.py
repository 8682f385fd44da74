"""The scheduler as a plain object: built in-process from fake runner
replies, driven message by message, its sends recorded by a fake outbox.
No process, no socket: each test says what the scheduler must send."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import pytest

from radixmux import protocol
from radixmux.common.server_args import SCHEDULE_POLICIES, ServerArgs
from radixmux.memory.arena import ArenaSpec
from radixmux.memory.layout import KVLayout
from radixmux.protocol import ModelArg, RunnerId, SamplingParams, runner_ids
from radixmux.scheduler import bootstrap, control, supervision
from radixmux.scheduler.policy import POLICIES
from radixmux.scheduler.runners import RollCall
from radixmux.scheduler.scheduler import Scheduler

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8)  # 64 B a token
BLOCK_BYTES = 4096  # 64 slots a block
TOKEN = 7  # what the fake runner samples
# A pid no process has (above the kernel's limit): a kill of it finds nobody.
NO_PID = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


@dataclass
class RecordingOutbox:
    """Records every message the scheduler sends, by destination."""

    runner: list[tuple[str, msgspec.Struct]] = field(default_factory=list)
    detokenizer: list[msgspec.Struct] = field(default_factory=list)
    front: list[msgspec.Struct] = field(default_factory=list)
    launcher: list[msgspec.Struct] = field(default_factory=list)

    def to_runner(self, runner_id: str, msg: protocol.RunnerRequest) -> None:
        self.runner.append((runner_id, msg))

    def to_detokenizer(self, msg: protocol.TokenBatch | protocol.ModelRemoved) -> None:
        self.detokenizer.append(msg)

    def to_front(self, msg: msgspec.Struct) -> None:
        self.front.append(msg)

    def to_launcher(self, msg: protocol.ModelAdded | protocol.ModelRemoved) -> None:
        self.launcher.append(msg)

    def outputs(self, rid: str) -> list[protocol.RequestOutput]:
        return [
            o
            for m in self.detokenizer
            if isinstance(m, protocol.TokenBatch)
            for o in m.outputs
            if o.rid == rid
        ]

    def errors(self, rid: str) -> list[protocol.RequestError]:
        return [m for m in self.front if isinstance(m, protocol.RequestError) and m.rid == rid]

    def batches(self, runner_id: str) -> list[protocol.ForwardBatch]:
        return [
            m for r, m in self.runner if r == runner_id and isinstance(m, protocol.ForwardBatch)
        ]


def model_info(name: str, key: str) -> protocol.ModelInfo:
    return protocol.ModelInfo(
        name=name,
        architecture="fake",
        layout=LAYOUT,
        context_length=4096,
        sliding_windows=[None],
        vocab_size=100,
        eos_token_ids=[0],
        tokenizer_fingerprint="tok",
        kv_share_key=key,
        has_chat_template=False,
        dtype="float32",
        device="cpu",
    )


def ready(name: str, pid: int = NO_PID) -> protocol.Ready:
    """What a runner of instance ``name`` says once loaded (own weights per instance)."""
    return protocol.Ready(model_info(name, f"weights-{name}"), pid, 0.1, 1)


@dataclass
class Harness:
    sched: Scheduler
    out: RecordingOutbox

    def send(self, msg: msgspec.Struct) -> None:
        """A message on the scheduler's inbox, then what the loop does next."""
        self.sched.handle(msg)
        self.sched.after_events()

    def request(
        self, rid: str, model: str = "a", prompt: int = 8, max_tokens: int = 4, start: int = 1
    ) -> None:
        ids = protocol.pack_ids(np.arange(start, start + prompt, dtype=np.int32))
        params = SamplingParams(max_new_tokens=max_tokens)
        self.send(protocol.TokenizedRequest(rid, model, ids, params))

    def reply(self, runner_id: str, msg: msgspec.Struct) -> None:
        """A runner's reply, then what the loop does next."""
        self.sched.on_runner_message(runner_id, protocol.encode(msg))
        self.sched.after_events()

    def inflight(self, runner_id: str) -> protocol.ForwardBatch | None:
        runner = self.sched.runners[runner_id]
        if runner.inflight is None:
            return None
        return self.out.batches(runner_id)[-1]

    def step(self, runner_id: str = "a#0") -> protocol.ForwardBatch:
        """The fake runner computes its batch: samples TOKEN where asked,
        finishing a sequence at its ``max_new_tokens``."""
        batch = self.inflight(runner_id)
        assert batch is not None, f"runner {runner_id} has no batch"
        outs = []
        for seq in batch.seqs:
            if not seq.sample:
                outs.append(protocol.SeqOutput(seq.rid, -1))
                continue
            done = self.sched.requests[seq.rid].params.max_new_tokens
            made = len(self.sched.requests[seq.rid].output_ids) + 1
            outs.append(
                protocol.SeqOutput(seq.rid, TOKEN, finish_reason="length" if made >= done else None)
            )
        self.reply(runner_id, protocol.ForwardResult(batch.batch_id, outs))
        return batch

    def run_until_idle(self, runner_id: str = "a#0", steps: int = 1000) -> None:
        for _ in range(steps):
            if self.inflight(runner_id) is None:
                return
            self.step(runner_id)
        raise AssertionError(f"runner {runner_id} still busy after {steps} steps")

    def assert_clean(self) -> None:
        """The invariant walk passes and nothing is left holding KV or locks."""
        control.check(self.sched)
        stats = control.stats(self.sched)
        assert stats.locks_held == 0 and stats.request_owned_slots == 0
        assert not self.sched.requests


def harness(models: tuple[str, ...] = ("a",), blocks: int = 16, **flags: object) -> Harness:
    args = ServerArgs(models=[ModelArg(f"/models/{m}", m) for m in models], **flags)
    arena = ArenaSpec("/nonexistent-arena", blocks, BLOCK_BYTES)
    roll = RollCall({rid for m in args.models for rid in runner_ids(m)})
    for rid in sorted(roll.expected):
        assert roll.answer(rid, ready(str(RunnerId.parse(rid).model))) is None
    out = RecordingOutbox()
    return Harness(Scheduler(args, arena, out, bootstrap.build(args, arena, roll)), out)


# ---- admission ------------------------------------------------------------------------
def test_queue_full_is_429() -> None:
    h = harness(max_queued_requests=1, max_running_requests=1)
    h.request("r1")  # runs
    h.request("r2")  # waits
    h.request("r3")
    assert [e.status for e in h.out.errors("r3")] == [429]
    assert not h.out.errors("r2") and "r2" in h.sched.requests


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "param"),
    [(0, 4, "prompt"), (8, 5000, "max_tokens")],
)
def test_bad_input_is_400_naming_the_field(prompt: int, max_tokens: int, param: str) -> None:
    h = harness()
    h.request("r", prompt=prompt, max_tokens=max_tokens)
    [err] = h.out.errors("r")
    assert (err.status, err.param) == (400, param)
    assert not h.out.runner
    h.assert_clean()


def test_duplicate_rid_is_400() -> None:
    h = harness()
    h.request("r")
    h.request("r")
    [err] = h.out.errors("r")
    assert (err.status, err.param) == (400, "rid")


def test_unknown_model_is_404() -> None:
    h = harness()
    h.request("r", model="nope")
    [err] = h.out.errors("r")
    assert (err.status, err.param) == (404, "model")


# ---- a request's life ------------------------------------------------------------------
def test_one_request_prefill_then_decode_to_its_end() -> None:
    h = harness()
    h.request("r", prompt=8, max_tokens=3)
    prefill = h.step()
    assert len(protocol.unpack_ids(prefill.seqs[0].new_tokens)) == 8
    h.run_until_idle()
    outs = h.out.outputs("r")
    assert [t for o in outs for t in o.new_token_ids] == [TOKEN] * 3
    assert [o.finish_reason for o in outs] == [None, None, "length"]
    assert outs[0].prompt_tokens == 8 and outs[-1].completion_tokens == 3
    assert len(h.out.batches("a#0")) == 3  # one prefill, two decodes
    h.assert_clean()
    assert control.stats(h.sched).prompt_tokens_computed == 8


def test_a_second_request_hits_the_cached_prompt() -> None:
    h = harness()
    h.request("r1", prompt=40, max_tokens=1)
    h.run_until_idle()
    h.request("r2", prompt=40, max_tokens=1)
    batch = h.step()
    assert len(protocol.unpack_ids(batch.seqs[0].new_tokens)) < 40
    assert h.out.outputs("r2")[0].cached_tokens > 0
    h.assert_clean()


def test_memory_pressure_retracts_then_both_finish() -> None:
    # Two blocks: 128 slots for two requests that need 100 each at the end.
    h = harness(blocks=2, schedule_conservativeness=0.0)
    h.request("r1", prompt=20, max_tokens=80)
    h.request("r2", prompt=20, max_tokens=80, start=50)
    h.run_until_idle(steps=2000)
    assert control.stats(h.sched).retractions >= 1
    for rid in ("r1", "r2"):
        outs = h.out.outputs(rid)
        assert sum(len(o.new_token_ids) for o in outs) == 80
        assert outs[-1].finish_reason == "length" and outs[-1].status == 200
    h.assert_clean()


# ---- aborts ---------------------------------------------------------------------------
def test_abort_before_schedule_sends_nothing() -> None:
    h = harness(max_running_requests=1)
    h.request("r1")
    h.request("r2")  # waits behind r1
    h.send(protocol.AbortRequest("r2", "client gone"))
    h.run_until_idle()
    assert not h.out.outputs("r2") and not h.out.errors("r2")
    assert all(s.rid != "r2" for b in h.out.batches("a#0") for s in b.seqs)
    h.assert_clean()


def test_abort_during_a_step_frees_after_the_step() -> None:
    h = harness()
    h.request("r", max_tokens=50)
    h.step()
    assert h.inflight("a#0") is not None
    h.send(protocol.AbortRequest("r", "client gone"))
    assert "r" in h.sched.requests  # its slots are being written
    n = len(h.out.outputs("r"))
    h.step()
    # The step's token is not sent; one last output without tokens ends the
    # detokenizer's state of it (it had outputs: the first step's token).
    [*_, last] = h.out.outputs("r")
    assert len(h.out.outputs("r")) == n + 1 and n >= 1
    assert last.finish_reason == "abort" and last.new_token_ids == []
    assert h.inflight("a#0") is None
    h.assert_clean()


def test_abort_after_finish_is_a_no_op() -> None:
    h = harness()
    h.request("r", max_tokens=1)
    h.run_until_idle()
    sent = (len(h.out.detokenizer), len(h.out.front))
    h.send(protocol.AbortRequest("r", "late"))
    assert (len(h.out.detokenizer), len(h.out.front)) == sent
    h.assert_clean()


def test_early_abort_drops_the_request_when_it_arrives() -> None:
    h = harness()
    h.send(protocol.AbortRequest("r", "client gone", early=True))
    h.request("r")
    assert not h.out.runner and "r" not in h.sched.requests
    assert control.stats(h.sched).aborted_before_arrival == 1


# ---- runners --------------------------------------------------------------------------
def test_runner_death_fails_only_its_models_requests() -> None:
    h = harness(models=("a", "b"))
    h.request("ra", model="a", max_tokens=5)
    h.request("rb", model="b", max_tokens=5)
    h.send(protocol.RunnerDied("a#0", -9, restarting=True))
    [failed] = h.out.outputs("ra")
    assert failed.status == 503 and failed.finish_reason == "error"
    h.request("ra2", model="a")
    assert [e.status for e in h.out.errors("ra2")] == [503]  # restarting: refused
    h.run_until_idle("b#0")
    assert h.out.outputs("rb")[-1].finish_reason == "length"
    h.reply("a#0", ready("a"))  # back: serves again
    h.request("ra3", model="a", max_tokens=1)
    h.run_until_idle("a#0")
    assert h.out.outputs("ra3")[-1].finish_reason == "length"
    h.assert_clean()


def test_hung_runner_is_killed_and_its_requests_fail() -> None:
    hung = subprocess.Popen(["sleep", "60"])
    try:
        h = harness(runner_timeout=5.0)
        h.sched.runners["a#0"].pid = hung.pid
        h.request("r", max_tokens=5)
        supervision.check_timeouts(h.sched)
        assert hung.poll() is None  # within its time: left alone
        h.sched.runners["a#0"].sent_at -= 10.0
        supervision.check_timeouts(h.sched)
        assert hung.wait(10) == -9
        [failed] = h.out.outputs("r")
        assert failed.status == 503
        assert h.sched.runners["a#0"].state == "restarting"
        assert "hung" in (h.sched.models["a"].down_reason or "")
        h.assert_clean()
    finally:
        hung.kill()
        hung.wait()


def test_a_failed_step_fails_its_requests_with_500() -> None:
    h = harness()
    h.request("r")
    batch = h.inflight("a#0")
    assert batch is not None
    h.reply("a#0", protocol.ForwardResult(batch.batch_id, error="boom"))
    [out] = h.out.outputs("r")
    assert out.status == 500 and "boom" not in (out.error or "")
    h.assert_clean()


# ---- models at run time ---------------------------------------------------------------
def test_model_added_then_removed_at_run_time() -> None:
    h = harness()
    h.send(protocol.AddModel(ModelArg("/models/c", "c"), served="c"))
    assert not h.out.launcher  # waits for its runner
    h.request("r0", model="c")
    assert [e.status for e in h.out.errors("r0")] == [404]
    h.reply("c#0", ready("c"))
    [added] = h.out.launcher
    assert isinstance(added, protocol.ModelAdded) and added.error is None
    h.request("r1", model="c", max_tokens=2)
    h.run_until_idle("c#0")
    assert h.out.outputs("r1")[-1].finish_reason == "length"
    h.send(protocol.RemoveModel("c"))
    assert isinstance(h.out.launcher[-1], protocol.ModelRemoved)
    assert isinstance(h.out.detokenizer[-1], protocol.ModelRemoved)
    assert ("c#0", protocol.Shutdown()) in h.out.runner
    assert "c" not in h.sched.models and "c#0" not in h.sched.runners
    h.request("r2", model="c")
    assert [e.status for e in h.out.errors("r2")] == [404]
    h.request("r3", model="a", max_tokens=2)  # the others serve on
    h.run_until_idle("a#0")
    assert h.out.outputs("r3")[-1].finish_reason == "length"
    assert len(h.out.launcher) == 2  # removed once
    h.assert_clean()


def test_a_model_removed_mid_batch_goes_after_the_batch() -> None:
    h = harness(models=("a", "b"))
    h.request("r", model="a", max_tokens=20)
    h.send(protocol.RemoveModel("a"))
    assert [e.status for e in h.out.errors("r")] == [503]
    assert "a" in h.sched.models and not h.out.launcher  # its batch still writes KV
    h.step("a#0")
    [removed] = h.out.launcher
    assert isinstance(removed, protocol.ModelRemoved) and removed.name == "a"
    assert "a" not in h.sched.models and not h.sched.removing
    h.request("rb", model="b", max_tokens=1)
    h.run_until_idle("b#0")
    assert h.out.outputs("rb")[-1].finish_reason == "length"
    h.assert_clean()


def test_a_failed_load_at_run_time_is_reported() -> None:
    h = harness()
    h.send(protocol.AddModel(ModelArg("/models/c", "c"), served="c"))
    h.reply("c#0", protocol.Failed("no such file", NO_PID))
    [added] = h.out.launcher
    assert isinstance(added, protocol.ModelAdded) and "no such file" in (added.error or "")
    assert "c" not in h.sched.models and not h.sched.pending


def test_every_schedule_policy_name_has_a_policy() -> None:
    assert set(POLICIES) == set(SCHEDULE_POLICIES)


@pytest.mark.parametrize(("name", "version"), [("m", 1), ("m", 2), ("my-model.v3", 12)])
def test_instance_names_round_trip_to_served_name_and_version(name: str, version: int) -> None:
    instance = protocol.instance_name(name, version)
    assert ("@" in instance) == (version > 1)
    assert protocol.served_name(instance) == (name, version)
