"""The batch builder over a real radix cache and allocator (no runner needed:
a batch is what the builder decides, checked before anything runs)."""

from __future__ import annotations

import numpy as np

from radixmux.memory.allocator import KVAllocator
from radixmux.memory.layout import KVLayout
from radixmux.memory.radix_cache import ModelSpec, RadixCache
from radixmux.memory.radix_diagnostics import check_invariants
from radixmux.protocol import SamplingParams
from radixmux.scheduler.batch_builder import BatchBuilder, BatchLimits
from radixmux.scheduler.kv_manager import KVManager
from radixmux.scheduler.request import Req
from radixmux.scheduler.runners import RunnerState
from radixmux.scheduler.step_costs import StepCosts

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8)  # 64 slots per 4 KiB block


def builder(**limits: float) -> BatchBuilder:
    cache = RadixCache(KVAllocator(64, 4096))
    cache.register_model(ModelSpec("m", "g", "w", LAYOUT))
    lim = BatchLimits(
        policy="fcfs",
        chunked_prefill_size=int(limits.get("chunked", 512)),
        max_running_requests=64,
        conservativeness=0.0,
        prefill_tokens_during_decode=int(limits.get("during_decode", 0)),
        prefill_wait_ratio=limits.get("wait_ratio", 0.0),
    )
    return BatchBuilder(KVManager(cache), lim)


def request(rid: str, tokens: list[int], max_new_tokens: int = 8) -> Req:
    ids = np.asarray(tokens, dtype=np.int32)
    return Req(rid, "m", ids, SamplingParams(max_new_tokens=max_new_tokens), [], True, 0.0)


def run(b: BatchBuilder, runner: RunnerState, waiting: list[Req]) -> list[tuple[str, int]]:
    """Schedule a batch and apply it as if the runner had computed it."""
    batch = b.schedule_next_batch(runner, waiting)
    assert batch is not None
    for req, n in zip(batch.reqs, batch.chunks, strict=True):
        req.kv_len += n
        if req.kv_len == req.num_tokens:
            req.output_ids.append(5)
        b.kv.cache_progress(req)
    return [(r.rid, n) for r, n in zip(batch.reqs, batch.chunks, strict=True)]


def test_prefill_shrinks_while_requests_decode() -> None:
    b = builder(chunked=256, during_decode=32)
    runner = RunnerState("m#0", "m", state="up")
    first = request("first", list(range(1, 41)))
    waiting = [first]
    assert run(b, runner, waiting) == [("first", 40)]  # nothing decodes: the full budget
    waiting.append(request("long", list(range(100, 300))))
    # first now decodes: the long prompt comes in 31-token chunks beside it.
    assert run(b, runner, waiting) == [("first", 1), ("long", 31)]
    assert run(b, runner, waiting) == [("first", 1), ("long", 31)]
    check_invariants(
        b.kv.cache, held=b.kv.held_slots(runner.running), locks=[r.handle for r in runner.running]
    )


def test_step_budget_counts_the_decode_tokens() -> None:
    """A step computes at most ``chunked_prefill_size`` tokens, decodes included
    (vLLM's ``max_num_batched_tokens``), so a full step is exactly that many rows."""
    b = builder(chunked=64)
    runner = RunnerState("m#0", "m", state="up")
    waiting = [request("a", list(range(1, 41))), request("b", list(range(50, 74)))]
    assert run(b, runner, waiting) == [("a", 40), ("b", 24)]
    waiting.append(request("long", list(range(100, 300))))
    assert run(b, runner, waiting) == [("a", 1), ("b", 1), ("long", 62)]
    assert run(b, runner, waiting) == [("a", 1), ("b", 1), ("long", 62)]


def test_decodes_sharing_a_cached_prefix_form_a_group() -> None:
    b = builder()
    runner = RunnerState("m#0", "m", state="up")
    system = list(range(1, 65))
    waiting = [request(f"r{i}", system + [200 + i, 7]) for i in range(3)]
    run(b, runner, waiting)  # r0 computes the system prompt; the others wait for it
    run(b, runner, waiting)  # r1, r2 hit it
    batch = b.schedule_next_batch(runner, waiting)
    assert batch is not None and all(n == 1 for n in batch.chunks)
    (group,) = batch.prefix_groups
    assert group.prefix_len >= 64 and sorted(group.members) == [0, 1, 2]
    assert b.shared_prefix_rows == 2 * group.prefix_len


def test_lpm_admits_group_leaders_before_hits() -> None:
    """A burst of shuffled shared-prefix requests: lpm first computes one prompt
    of every group whose prefix is not cached yet (that turns the rest of the
    group into hits), then serves hits longest-first; plain longest-prefix
    order would spend the budget on hits and leave the last group's prompt,
    and its followers, for extra steps."""
    import random

    from radixmux.scheduler.policy import order_waiting

    b = builder(chunked=200)
    b.limits.policy = "lpm"
    runner = RunnerState("m#0", "m", state="up")
    cached = list(range(1, 65))
    run(b, runner, [request("warm", [*cached, 900])])  # `cached` is in the tree now
    runner.running.clear()
    groups = {g: list(range(1000 * g, 1000 * g + 64)) for g in (1, 2, 3)}
    reqs = [request(f"hit{i}", [*cached, 500 + i, 7]) for i in range(4)]
    reqs += [request(f"g{g}-{i}", [*p, 600 + i, 7]) for g, p in groups.items() for i in range(3)]
    random.Random(3).shuffle(reqs)
    for n, r in enumerate(reqs):  # arrival order = the shuffled order
        r.order = n
    ordered = order_waiting("lpm", reqs, b.kv.cache, b.rng)
    leaders = [
        min((r for r in reqs if r.rid.startswith(f"g{g}")), key=lambda r: r.order) for g in groups
    ]
    assert set(ordered[:3]) == set(leaders)
    assert all(r.rid.startswith("hit") for r in ordered[3:7])  # then the cached hits
    # One step's budget goes to the leaders first (their followers wait: in-batch sharing).
    waiting = list(reqs)
    admitted = [rid for rid, _ in run(b, runner, waiting)]
    assert admitted[:3] == [r.rid for r in ordered[:3]]
    assert not any(rid.startswith("g") for rid in admitted[3:])


def test_new_prompts_wait_for_decodes_about_to_finish() -> None:
    """With measured costs saying the running requests finish sooner than the
    new prompt's prefill would delay them, the prompt waits; once they are
    done it runs at the full budget. Far from finishing, it does not wait."""
    b = builder(chunked=256, wait_ratio=0.5)
    runner = RunnerState("m#0", "m", state="up")
    runner.costs = StepCosts(decode_ms=10.0, prefill_ms_per_token=1.0)
    first = request("first", list(range(1, 41)), max_new_tokens=3)
    waiting = [first]
    assert run(b, runner, waiting) == [("first", 40)]
    new = request("new", list(range(100, 300)))
    waiting.append(new)
    # first has 2 tokens left: 2 x 10 ms of waiting <= 0.5 x 200 ms of delay.
    assert run(b, runner, waiting) == [("first", 1)]
    assert run(b, runner, waiting) == [("first", 1)]
    assert b.waits_for_decodes == 2
    assert len(first.output_ids) == 3
    runner.running.remove(first)  # finished (max_new_tokens)
    b.kv.release(first, keep=True)
    assert run(b, runner, waiting) == [("new", 200)]

    # A request with 100 tokens left: 1,000 ms of waiting > 100 ms: no wait.
    b2 = builder(chunked=256, wait_ratio=0.5)
    runner2 = RunnerState("m#0", "m", state="up")
    runner2.costs = StepCosts(decode_ms=10.0, prefill_ms_per_token=1.0)
    waiting2 = [request("long", list(range(1, 41)), max_new_tokens=101)]
    run(b2, runner2, waiting2)
    waiting2.append(request("new", list(range(100, 300))))
    assert run(b2, runner2, waiting2) == [("long", 1), ("new", 200)]
    assert b2.waits_for_decodes == 0


def test_waiting_counts_only_the_uncached_part_of_a_prompt() -> None:
    """A prompt whose prefix is cached costs only its suffix: too cheap to be
    worth waiting for the running request (1 x 10 ms > 0.5 x 8 ms)."""
    b = builder(chunked=256, wait_ratio=0.5)
    runner = RunnerState("m#0", "m", state="up")
    shared = list(range(1, 201))
    waiting = [request("first", shared + [7, 7], max_new_tokens=2)]
    assert run(b, runner, waiting) == [("first", 202)]
    runner.costs = StepCosts(decode_ms=10.0, prefill_ms_per_token=1.0)
    waiting.append(request("second", shared + list(range(500, 508))))
    assert run(b, runner, waiting) == [("first", 1), ("second", 8)]
    assert b.waits_for_decodes == 0


def test_no_wait_when_the_waiting_prompts_need_more_than_one_step() -> None:
    """Prompts that need several steps delay the running requests' tokens
    anyway (and each other's): waiting would only delay their first token."""
    b = builder(chunked=256, wait_ratio=0.5)
    runner = RunnerState("m#0", "m", state="up")
    runner.costs = StepCosts(decode_ms=10.0, prefill_ms_per_token=1.0)
    waiting = [request("first", list(range(1, 41)), max_new_tokens=3)]
    run(b, runner, waiting)
    waiting += [request(f"p{i}", list(range(100 * i, 100 * i + 200))) for i in range(1, 4)]
    assert run(b, runner, waiting) == [("first", 1), ("p1", 200), ("p2", 55)]
    assert b.waits_for_decodes == 0


def test_no_wait_before_costs_are_measured() -> None:
    b = builder(chunked=256, wait_ratio=10.0)
    runner = RunnerState("m#0", "m", state="up")
    waiting = [request("first", list(range(1, 41)), max_new_tokens=2)]
    run(b, runner, waiting)
    waiting.append(request("new", list(range(100, 300))))
    assert run(b, runner, waiting) == [("first", 1), ("new", 200)]


def test_step_costs_separate_decode_from_prefill() -> None:
    costs = StepCosts()
    assert not costs.known
    costs.observe(decode_rows=4, prefill_tokens=0, step_ms=20.0)
    costs.observe(decode_rows=4, prefill_tokens=500, step_ms=520.0)
    assert costs.known
    assert costs.decode_ms == 20.0 and costs.prefill_ms_per_token == 1.0
    costs.observe(decode_rows=4, prefill_tokens=10, step_ms=500.0)  # too small a sample
    assert costs.prefill_ms_per_token == 1.0
    costs.observe(decode_rows=0, prefill_tokens=1000, step_ms=3000.0)
    assert 1.0 < costs.prefill_ms_per_token < 3.0  # moves toward the new cost
    costs.observe(decode_rows=4, prefill_tokens=0, step_ms=40.0)
    assert 20.0 < costs.decode_ms < 40.0
