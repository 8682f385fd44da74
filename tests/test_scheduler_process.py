"""The scheduler process with real runner processes, over real ZeroMQ sockets.

The test plays the launcher (spawns the processes, collects ready messages),
the tokenizer (pushes TokenizedRequests) and the detokenizer (collects
TokenBatches). Greedy outputs are checked against transformers' own
``generate`` on the same weights, with the cache on and off, under every
schedule policy and under KV pressure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from bench.tiny_models import make_tiny_model_dir
from radixmux import protocol
from radixmux.common.ipc import Endpoints, make_runtime_dir, remove_runtime_dir, socket
from radixmux.common.process import ProcessContext, spawn
from radixmux.common.server_args import ServerArgs
from radixmux.memory.arena import ArenaSpec, KVArena
from radixmux.model_runners.runner_process import RunnerConfig, spawn_runner
from radixmux.protocol import ModelArg, SamplingParams

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "a": make_tiny_model_dir(root / "a", seed=1),
        "b": make_tiny_model_dir(root / "b", seed=2),
    }


@dataclass
class Runtime:
    """A scheduler and its runners, with the test on the other sockets."""

    endpoints: Endpoints
    zctx: zmq.Context
    to_sched: zmq.Socket
    from_sched: zmq.Socket  # detokenizer side
    front: zmq.Socket  # errors and control replies
    arena_spec: ArenaSpec
    procs: list[subprocess.Popen] = field(default_factory=list)
    served: list[protocol.ServedModel] = field(default_factory=list)

    def submit(self, model: str, ids: list[int], max_new: int = 8, **params: object) -> str:
        rid = uuid.uuid4().hex[:8]
        sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True, **params)
        self.to_sched.send(
            protocol.encode(protocol.TokenizedRequest(rid, model, protocol.pack_ids(ids), sp))
        )
        return rid

    def collect(self, rids: set[str], timeout_ms: int = 120_000) -> dict[str, list[int]]:
        """Every token of each request until it finishes."""
        dec = protocol.decoder(protocol.DetokenizerInbox)
        out: dict[str, list[int]] = {r: [] for r in rids}
        done: set[str] = set()
        while done != rids:
            assert self.from_sched.poll(timeout_ms), f"no output; still running {rids - done}"
            batch = dec.decode(self.from_sched.recv())
            for o in batch.outputs:
                assert o.error is None, o.error
                out[o.rid] += o.new_token_ids
                if o.finish_reason:
                    done.add(o.rid)
        return out

    def control(self, op: str, model: str | None = None) -> protocol.ControlReply:
        req_id = uuid.uuid4().hex
        self.to_sched.send(protocol.encode(protocol.ControlRequest(req_id, op, model)))
        assert self.front.poll(10_000)
        reply = protocol.decoder(protocol.FrontInbox).decode(self.front.recv())
        assert isinstance(reply, protocol.ControlReply) and reply.req_id == req_id
        return reply


@contextlib.contextmanager
def start_runtime(models: list[ModelArg], **flags: object) -> Iterator[Runtime]:
    rundir = make_runtime_dir()
    ep = Endpoints.in_dir(rundir)
    args = ServerArgs(models=models, check_invariants=True, **flags)
    arena = KVArena.create(args.kv_cache_bytes // args.kv_block_bytes, args.kv_block_bytes)
    zctx = zmq.Context()
    launcher = socket(zctx, zmq.PULL, ep.launcher, bind=True)
    rt = Runtime(
        ep,
        zctx,
        socket(zctx, zmq.PUSH, ep.scheduler, bind=False),
        socket(zctx, zmq.PULL, ep.detokenizer, bind=True),
        socket(zctx, zmq.PULL, ep.front, bind=True),
        arena.spec,
    )
    try:
        rt.procs.append(
            spawn(
                "radixmux.scheduler.scheduler",
                ProcessContext("scheduler", args, ep, arena=arena.spec),
            )
        )
        total = sum(m.replicas for m in models)
        for m in models:
            for i in range(m.replicas):
                cfg = RunnerConfig(
                    m.source,
                    arena.spec,
                    ep.runners,
                    f"{m.name}#{i}",
                    m.name,
                    page_size=args.page_size,
                    threads=1,
                    num_runners=total,
                    attention_backend=args.attention_backend,
                )
                rt.procs.append(spawn_runner(cfg))
        assert launcher.poll(180_000), "scheduler never reported"
        msg = protocol.decoder(protocol.LauncherInbox).decode(launcher.recv())
        assert isinstance(msg, protocol.ProcessReady), msg
        rt.served = msg.models
        yield rt
    finally:
        rt.to_sched.send(protocol.encode(protocol.ShutdownProcess()))
        for proc in rt.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        zctx.destroy(linger=0)
        arena.destroy()
        remove_runtime_dir(rundir)


def hf_greedy(folder: Path, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return out[0, len(ids) :].tolist()


PROMPTS = [
    [1, 504, 3300, 2830, 314, 253, 1789, 29, 1370, 2047] * 5,
    [1, 504, 3300, 2830, 314, 253, 1789, 29, 1370, 2047] * 5 + [905, 1102],
    [1, 22, 333, 4444, 8, 90, 17, 2900],
    [1, 504, 3300, 2830, 314] + list(range(600, 640)),
]


def test_scheduler_serves_greedy_like_transformers(tiny_dirs: dict[str, Path]) -> None:
    expected = [hf_greedy(tiny_dirs["a"], p, 8) for p in PROMPTS]
    with start_runtime([ModelArg(str(tiny_dirs["a"]), "a")], chunked_prefill_size=16) as rt:
        assert [m.name for m in rt.served] == ["a"]
        assert rt.served[0].info.kv_share_key
        rids = [rt.submit("a", p) for p in PROMPTS]
        out = rt.collect(set(rids))
        assert [out[r] for r in rids] == expected
        # Same prompts again: served from the cache, same tokens.
        rids = [rt.submit("a", p) for p in PROMPTS]
        out = rt.collect(set(rids))
        assert [out[r] for r in rids] == expected
        stats = rt.control("stats").stats
        assert stats is not None and stats.models[0].tokens_matched > 0
        assert stats.models[0].running == stats.models[0].waiting == 0
        # PROMPTS[0] and [1] share 50 cached tokens: their decodes read them once.
        assert stats.shared_prefix_rows >= 50


@pytest.mark.parametrize(
    "flags",
    [
        {"disable_radix_cache": True},
        {"schedule_policy": "fcfs", "page_size": 4},
        {"schedule_policy": "dfs-weight", "attention_backend": "torch"},
        {"schedule_policy": "lof", "max_running_requests": 2},
        {"schedule_policy": "random", "kv_cache_bytes": 16 * 4096, "kv_block_bytes": 4096},
    ],
)
def test_policies_and_pressure_keep_greedy_outputs(tiny_dirs: dict[str, Path], flags) -> None:
    expected = [hf_greedy(tiny_dirs["a"], p, 6) for p in PROMPTS]
    with start_runtime([ModelArg(str(tiny_dirs["a"]), "a")], **flags) as rt:
        for _ in range(2):
            rids = [rt.submit("a", p, max_new=6) for p in PROMPTS]
            out = rt.collect(set(rids))
            assert [out[r] for r in rids] == expected
        stats = rt.control("stats").stats
        if "kv_cache_bytes" in flags:  # 128 token slots for ~200 tokens of prompts
            assert stats.evicted_tokens["capacity"] > 0
        if flags.get("disable_radix_cache"):
            assert stats.models[0].tokens_matched == 0 and stats.tree_nodes == 0


def test_shared_prefix_is_prefilled_once_across_chunks(tiny_dirs: dict[str, Path]) -> None:
    # A 96-token system prompt in 64-token chunks: while the first request
    # prefills its second chunk, the rest of that batch's budget must not go to
    # a second request recomputing the same system-prompt tokens.
    system = list(range(1000, 1096))
    prompts = [system + [7, 8, 9, i] for i in range(4)]
    expected = [hf_greedy(tiny_dirs["a"], p, 3) for p in prompts]
    with start_runtime([ModelArg(str(tiny_dirs["a"]), "a")], chunked_prefill_size=64) as rt:
        rids = [rt.submit("a", p, max_new=3) for p in prompts]
        out = rt.collect(set(rids))
        assert [out[r] for r in rids] == expected
        computed = rt.control("stats").stats.prompt_tokens_computed
        # The system prompt once, then each request's own tail (at most 4 + 1 each).
        assert computed <= 96 + 4 * 5, computed


def test_decode_out_of_kv_retracts_and_resumes(tiny_dirs: dict[str, Path]) -> None:
    prompts = [
        PROMPTS[2],
        [1, 88, 99, 1000, 2000, 3000, 4000, 5],
        [7] * 8,
        [1, 2, 3, 4, 5, 6, 7, 8],
    ]
    expected = [hf_greedy(tiny_dirs["a"], p, 24) for p in prompts]
    # 8 blocks x 8 slots = 64 token slots; four requests need 4 x 32 together.
    flags = {"kv_cache_bytes": 8 * 4096, "kv_block_bytes": 4096, "schedule_conservativeness": 0}
    with start_runtime([ModelArg(str(tiny_dirs["a"]), "a")], **flags) as rt:
        rids = [rt.submit("a", p, max_new=24) for p in prompts]
        out = rt.collect(set(rids))
        assert [out[r] for r in rids] == expected
        assert rt.control("stats").stats.retractions > 0


def test_fair_share_keeps_a_flooded_arena_open_to_the_other_model(
    tiny_dirs: dict[str, Path],
) -> None:
    # 12 blocks x 8 slots = 96 token slots: two of a's 48-token requests fill
    # them. Model b sends one request after a's flood. Without fair share a's
    # runner (dispatched first) takes every slot that frees up and b waits for
    # a's whole queue; with it, a (over its half while b waits) stops admitting.
    # b finishes 10th without fair share; a few of a's may still finish first
    # (admitted in the steps before b's request reached the scheduler on a busy
    # machine, or beside b once it runs), hence the slack.
    models = [ModelArg(str(tiny_dirs["a"]), "a"), ModelArg(str(tiny_dirs["b"]), "b")]
    flags = {"kv_cache_bytes": 12 * 4096, "kv_block_bytes": 4096, "schedule_conservativeness": 0}
    with start_runtime(models, **flags) as rt:
        flood = [rt.submit("a", [i] * 40, max_new=8) for i in range(1, 11)]
        late = rt.submit("b", [9] * 24, max_new=4)
        order: list[str] = []
        dec = protocol.decoder(protocol.DetokenizerInbox)
        while len(order) < 11:
            assert rt.from_sched.poll(120_000)
            for o in dec.decode(rt.from_sched.recv()).outputs:
                assert o.error is None, o.error
                if o.finish_reason:
                    order.append(o.rid)
        assert order.index(late) <= 6, order.index(late)
        assert set(order) == {*flood, late}


def test_two_models_and_replicas_share_one_arena(tiny_dirs: dict[str, Path]) -> None:
    models = [ModelArg(str(tiny_dirs["a"]), "a", replicas=2), ModelArg(str(tiny_dirs["b"]), "b")]
    exp_a = hf_greedy(tiny_dirs["a"], PROMPTS[0], 5)
    exp_b = hf_greedy(tiny_dirs["b"], PROMPTS[0], 5)
    assert exp_a != exp_b
    with start_runtime(models) as rt:
        rids = {rt.submit(m, PROMPTS[0], max_new=5): m for m in ("a", "b") for _ in range(8)}
        out = rt.collect(set(rids))
        for rid, m in rids.items():
            assert out[rid] == (exp_a if m == "a" else exp_b)
        stats = {m.name: m for m in rt.control("stats").stats.models}
        assert stats["a"].replicas_up == 2
        assert stats["a"].tokens_matched > 0 and stats["b"].tokens_matched > 0
        # Invalidating one model drops its cache and keeps the other's.
        assert rt.control("invalidate", "b").ok
        after = {m.name: m for m in rt.control("stats").stats.models}
        assert after["b"].cached_tokens == 0 and after["a"].cached_tokens > 0


@pytest.mark.parametrize("fixed", [0, 1])
def test_cores_follow_the_busy_model(tiny_dirs: dict[str, Path], fixed: int) -> None:
    """With two models and only "a" busy, a's runner gets every core (it
    starts with half); ``--runner-threads N`` pins it at N instead."""
    from radixmux.common.cpu import cpu_cores

    models = [ModelArg(str(tiny_dirs["a"]), "a"), ModelArg(str(tiny_dirs["b"]), "b")]
    with start_runtime(models, runner_threads=fixed) as rt:
        rt.collect({rt.submit("a", PROMPTS[0], max_new=4)})
        stats = {m.name: m for m in rt.control("stats").stats.models}
        assert stats["a"].threads == (fixed or cpu_cores())
        assert stats["b"].threads == 0  # never ran a batch
        assert stats["a"].steps >= 4 and stats["a"].runner_busy_seconds > 0


def test_abort_and_bad_requests(tiny_dirs: dict[str, Path]) -> None:
    with start_runtime([ModelArg(str(tiny_dirs["a"]), "a")], max_queued_requests=64) as rt:
        long = rt.submit("a", PROMPTS[0], max_new=200)
        rt.to_sched.send(protocol.encode(protocol.AbortRequest(long, "test")))
        rid = rt.submit("a", PROMPTS[2], max_new=3)
        assert len(rt.collect({rid})[rid]) == 3
        bad = rt.submit("nope", [1, 2])
        err = protocol.decoder(protocol.FrontInbox).decode(rt.front.recv())
        assert isinstance(err, protocol.RequestError) and err.rid == bad and err.status == 404
        huge = rt.submit("a", [1] * 10, max_new=10**7)
        err = protocol.decoder(protocol.FrontInbox).decode(rt.front.recv())
        assert err.rid == huge and err.status == 400 and err.param == "max_tokens"
        stats = rt.control("stats").stats.models[0]
        assert stats.running == 0 and stats.waiting == 0


def test_runner_death_fails_only_its_model(tiny_dirs: dict[str, Path]) -> None:
    models = [ModelArg(str(tiny_dirs["a"]), "a"), ModelArg(str(tiny_dirs["b"]), "b")]
    with start_runtime(models) as rt:
        runner_b = rt.procs[2]
        runner_b.kill()
        runner_b.wait()
        rt.to_sched.send(protocol.encode(protocol.RunnerDied("b#0", runner_b.returncode)))
        rid = rt.submit("b", PROMPTS[2])
        err = protocol.decoder(protocol.FrontInbox).decode(rt.front.recv())
        assert err.rid == rid and err.status == 503 and "b#0" in err.message
        ok = rt.submit("a", PROMPTS[2], max_new=2)
        assert len(rt.collect({ok})[ok]) == 2
        status = {m.name: m for m in rt.control("stats").stats.models}
        assert status["a"].up and not status["b"].up
    assert np.all([p.poll() is not None for p in rt.procs])
    assert not os.path.exists(rt.endpoints.runtime_dir)


def _idle_and_clean(rt: Runtime) -> protocol.SchedulerStats:
    """The scheduler's independent check on an idle server: no request, no
    lock, no request-owned slot, invariants ok."""
    stats = rt.control("check").stats
    assert stats is not None
    assert all(m.running == 0 and m.waiting == 0 for m in stats.models), stats.models
    assert stats.invariants == "ok", stats.invariants
    assert stats.locks_held == 0 and stats.request_owned_slots == 0
    return stats


def test_fair_share_contention_leaks_no_lock(tiny_dirs: dict[str, Path]) -> None:
    # Two models flood a small arena: a model past its fair share stops
    # admitting after its cache lookup locked a path. That lock must be given
    # back: afterwards nothing is locked and a flush leaves the tree empty.
    models = [ModelArg(str(tiny_dirs["a"]), "a"), ModelArg(str(tiny_dirs["b"]), "b")]
    flags = {"kv_cache_bytes": 12 * 4096, "kv_block_bytes": 4096, "schedule_conservativeness": 0}
    with start_runtime(models, **flags) as rt:
        system = list(range(300, 324))
        rids = {rt.submit(m, system + [i] * 16, max_new=6) for i in range(8) for m in ("a", "b")}
        rt.collect(rids)
        _idle_and_clean(rt)
        assert rt.control("flush_cache").ok
        stats = _idle_and_clean(rt)
        assert [m.cached_tokens for m in stats.models] == [0, 0]
        assert stats.arena_free_bytes == stats.arena_total_bytes


def test_abort_that_overtakes_its_request_drops_it(tiny_dirs: dict[str, Path]) -> None:
    # The front sends aborts straight to the scheduler but requests through a
    # tokenizer worker, so an abort can come first. The request must not run.
    with start_runtime([ModelArg(str(tiny_dirs["a"]), "a")]) as rt:
        rt.to_sched.send(
            protocol.encode(protocol.AbortRequest("early-1", "client disconnected", early=True))
        )
        sp = SamplingParams(max_new_tokens=50, ignore_eos=True)
        late = protocol.TokenizedRequest("early-1", "a", protocol.pack_ids(PROMPTS[2]), sp)
        rt.to_sched.send(protocol.encode(late))
        ok = rt.submit("a", PROMPTS[3], max_new=3)
        dec = protocol.decoder(protocol.DetokenizerInbox)
        seen: set[str] = set()
        while ok not in seen or rt.from_sched.poll(500):
            assert rt.from_sched.poll(60_000)
            for o in dec.decode(rt.from_sched.recv()).outputs:
                if o.finish_reason:
                    seen.add(o.rid)
                assert o.rid != "early-1", "an aborted request ran"
        assert _idle_and_clean(rt).aborted_before_arrival == 1


def test_bad_message_and_bad_row_fail_alone(tiny_dirs: dict[str, Path]) -> None:
    # A message whose handling raises fails its own request (500, nothing
    # internal in the text) and the loop goes on; a sampling parameter that
    # makes the runner raise fails its row, not its batch-mates.
    with start_runtime([ModelArg(str(tiny_dirs["a"]), "a")]) as rt:
        sp = SamplingParams(max_new_tokens=4)
        rt.to_sched.send(
            protocol.encode(protocol.TokenizedRequest("torn", "a", b"\x01\x02\x03", sp))
        )
        err = protocol.decoder(protocol.FrontInbox).decode(rt.front.recv())
        assert isinstance(err, protocol.RequestError) and err.rid == "torn" and err.status == 500
        assert "Error" not in err.message and "Traceback" not in err.message
        good = rt.submit("a", PROMPTS[0], max_new=6)
        bad = rt.submit("a", PROMPTS[1], max_new=6, temperature=1.0, top_k=10**9)
        dec = protocol.decoder(protocol.DetokenizerInbox)
        tokens: list[int] = []
        failed = None
        while len(tokens) < 6 or failed is None:
            assert rt.from_sched.poll(60_000)
            for o in dec.decode(rt.from_sched.recv()).outputs:
                if o.rid == bad:
                    failed = o
                elif o.rid == good:
                    assert o.error is None, o.error
                    tokens += o.new_token_ids
        assert failed.status == 500 and failed.finish_reason == "error"
        assert "topk" not in failed.error and "Error" not in failed.error
        assert tokens == hf_greedy(tiny_dirs["a"], PROMPTS[0], 6)
        assert _idle_and_clean(rt).contained_failures == 1


def test_hung_runner_is_killed_and_a_new_one_serves(tiny_dirs: dict[str, Path]) -> None:
    models = [ModelArg(str(tiny_dirs["a"]), "a")]
    with start_runtime(models, runner_timeout=3.0) as rt:
        runner = rt.procs[1]
        os.kill(runner.pid, signal.SIGSTOP)  # hangs mid-batch from here on
        rid = rt.submit("a", PROMPTS[0], max_new=8)
        dec = protocol.decoder(protocol.DetokenizerInbox)
        assert rt.from_sched.poll(30_000), "a hung runner held its request"
        (o,) = dec.decode(rt.from_sched.recv()).outputs
        assert o.rid == rid and o.status == 503 and "hung" in o.error
        assert runner.wait(10) == -signal.SIGKILL
        (m,) = rt.control("stats").stats.models
        assert m.state == "restarting" and m.restarts == 1
        # What the launcher does next: the same runner id comes back.
        cfg = RunnerConfig(
            models[0].source, rt.arena_spec, rt.endpoints.runners, "a#0", "a", threads=1
        )
        rt.procs.append(spawn_runner(cfg))
        deadline = time.time() + 120
        while rt.control("stats").stats.models[0].state != "serving":
            assert time.time() < deadline, "the new runner never came into service"
            time.sleep(0.2)
        again = rt.submit("a", PROMPTS[0], max_new=8)
        assert rt.collect({again})[again] == hf_greedy(tiny_dirs["a"], PROMPTS[0], 8)
        _idle_and_clean(rt)


def test_dead_replica_hands_its_requests_to_the_other(tiny_dirs: dict[str, Path]) -> None:
    models = [ModelArg(str(tiny_dirs["a"]), "a", replicas=2)]
    prompts = [p + [i] for i in range(6) for p in PROMPTS[:2]]
    expected = [hf_greedy(tiny_dirs["a"], p, 24) for p in prompts]
    with start_runtime(models) as rt:
        rids = [rt.submit("a", p, max_new=24) for p in prompts]
        dec = protocol.decoder(protocol.DetokenizerInbox)
        out: dict[str, list[int]] = {r: [] for r in rids}
        while sum(map(len, out.values())) < 2 * len(rids):  # both replicas are at work
            assert rt.from_sched.poll(60_000)
            for o in dec.decode(rt.from_sched.recv()).outputs:
                out[o.rid] += o.new_token_ids
        runner = rt.procs[1]
        runner.kill()
        runner.wait()
        rt.to_sched.send(
            protocol.encode(protocol.RunnerDied("a#0", runner.returncode, restarting=False))
        )
        done: set[str] = set()
        while done != set(rids):
            assert rt.from_sched.poll(60_000)
            for o in dec.decode(rt.from_sched.recv()).outputs:
                assert o.error is None, o.error
                out[o.rid] += o.new_token_ids
                if o.finish_reason:
                    done.add(o.rid)
        assert [out[r] for r in rids] == expected
        (m,) = rt.control("stats").stats.models
        assert m.state == "serving" and m.replicas_up == 1
        _idle_and_clean(rt)
