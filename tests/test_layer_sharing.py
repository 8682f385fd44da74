"""Layer sharing (on by default): models whose lower layers are identical
store those layers' K/V once (scheduler/layer_groups.py).

From the fingerprints (a changed lower tensor splits the chain there, an
upper or head change does not), through the plan (where models are cut) and
the scheduler (per-group handles and slots, the shortest group match,
deduplicated inserts, clean invariants under eviction), to real processes:
two tiny fine-tunes that share their lower layers answer exactly as each
does alone, while the shared layers' K/V are cached once.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_scheduler_unit import Harness, RecordingOutbox

from bench.tiny_models import make_tiny_model_dir
from radixmux import protocol
from radixmux.common.server_args import ServerArgs
from radixmux.memory.arena import ArenaSpec, KVArena
from radixmux.memory.layout import KVLayout
from radixmux.memory.radix_cache import ModelSpec
from radixmux.model_runners.fingerprint import layer_chain
from radixmux.protocol import ModelArg, RunnerId, runner_ids
from radixmux.runtime.client.engine import Engine
from radixmux.scheduler import bootstrap, control
from radixmux.scheduler.layer_groups import group_specs, plan_splits, shared_depth
from radixmux.scheduler.runners import RollCall
from radixmux.scheduler.scheduler import Scheduler

LAYOUT = KVLayout(num_layers=4, num_kv_heads=1, head_dim=8)  # 256 B a token
BLOCK_BYTES = 4096
NO_PID = 1 << 30

# Layer chains: a and b agree on layers 0-1 (b is a fine-tune with those
# frozen), c shares nothing, a2 is a replica of a.
CHAINS = {
    "a": ["x0", "x1", "a2", "a3"],
    "b": ["x0", "x1", "b2", "b3"],
    "c": ["c0", "c1", "c2", "c3"],
}


# ---- the plan ------------------------------------------------------------------------
def test_models_are_cut_where_their_chains_part() -> None:
    assert shared_depth(CHAINS["a"], CHAINS["b"]) == 2
    assert plan_splits(CHAINS) == {"a": (2,), "b": (2,), "c": ()}
    # A replica agrees everywhere: nothing to cut for it (it shares the whole key).
    assert plan_splits({"a": CHAINS["a"], "a2": list(CHAINS["a"])}) == {"a": (), "a2": ()}
    # Three fine-tunes parting at two depths: each is cut where it parts from another.
    three = {**CHAINS, "d": ["x0", "d1", "d2", "d3"]}
    assert plan_splits(three)["a"] == (1, 2)
    assert plan_splits(three)["d"] == (1,)


def test_a_model_added_later_follows_the_served_models_cuts() -> None:
    chains = {**CHAINS, "e": ["x0", "x1", "a2", "e3"]}  # agrees with a on 3 layers
    served = {"a": (2,), "b": (2,), "c": ()}
    assert plan_splits(chains, served) == {"e": (2,)}
    # Agreeing with a served model that was not cut: no group to share.
    assert plan_splits({"c": CHAINS["c"], "f": ["c0", "f1", "f2", "f3"]}, {"c": ()}) == {"f": ()}


def test_group_specs_share_lower_pools_and_keep_own_top_pools() -> None:
    def spec(name: str) -> ModelSpec:
        return ModelSpec(name, "tok", f"w-{name}:float32", LAYOUT, cost_per_token=4.0)

    a = group_specs(spec("a"), CHAINS["a"], (2,))
    b = group_specs(spec("b"), CHAINS["b"], (2,))
    assert [s.name for s in a] == ["a#layers0-2", "a"]
    assert [s.layout.num_layers for s in a] == [2, 2]
    assert a[0].pool == b[0].pool and a[1].pool != b[1].pool
    assert a[1].pool.startswith("w-a:float32")
    assert sum(s.cost_per_token for s in a) == pytest.approx(4.0)
    assert group_specs(spec("c"), CHAINS["c"], ()) == [spec("c")]


# ---- fingerprints of real layers ---------------------------------------------------------
def fine_tune(base: Path, dst: Path, layers: set[int], seed: int = 1) -> Path:
    """A copy of ``base`` with the tensors of ``layers`` perturbed (the rest bit-identical)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(base / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if any(f"layers.{i}." in name for i in layers):
            tensors[name] = t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layer-sharing")
    base = make_tiny_model_dir(root / "base", seed=3, layers=4)
    return {
        "base": base,
        "upper": fine_tune(base, root / "upper", {2, 3}),
        "lower": fine_tune(base, root / "lower", {1}),
    }


def chain_of(folder: Path) -> list[str]:
    from transformers import AutoModelForCausalLM

    return layer_chain(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))


def test_layer_chains_agree_exactly_as_far_as_the_weights_do(family: dict[str, Path]) -> None:
    base, upper, lower = (chain_of(family[k]) for k in ("base", "upper", "lower"))
    assert shared_depth(base, upper) == 2
    assert shared_depth(base, lower) == 1
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family["base"], dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # read by the logits only
    assert layer_chain(model) == base
    with torch.no_grad():
        model.model.embed_tokens.weight[5, 0] += 1.0  # read by every layer
    assert shared_depth(layer_chain(model), base) == 0


# ---- the scheduler -----------------------------------------------------------------------
LATE = {"e": ["x0", "x1", "a2", "e3"]}  # a fine-tune that arrives at run time


def info(name: str, restart: bool = False) -> protocol.ModelInfo:
    return protocol.ModelInfo(
        name=name,
        architecture="fake",
        layout=LAYOUT,
        context_length=4096,
        sliding_windows=[None] * 4,
        vocab_size=100,
        eos_token_ids=[0],
        tokenizer_fingerprint="tok",
        kv_share_key=f"weights-{name}",
        has_chat_template=False,
        dtype="float32",
        device="cpu",
        layer_keys={**CHAINS, **LATE}[name],
        hidden_size=16,  # one hidden pseudo-layer (2 x 8 values) per lower group
        layer_restart=restart,
    )


def harness(
    models: tuple[str, ...] = ("a", "b", "c"),
    blocks: int = 32,
    restart: bool = False,
    arena_dir: Path | None = None,
    **flags,
) -> Harness:
    """A scheduler over fake runners of ``models`` (``info``'s layer chains);
    with ``arena_dir`` a real arena file there (a disk tier reads and writes it)."""
    args = ServerArgs(
        models=[ModelArg(f"/models/{m}", m) for m in models],
        page_size=4,
        **flags,
    )
    if arena_dir is None:
        arena = ArenaSpec("/nonexistent-arena", blocks, BLOCK_BYTES)
    else:
        arena = KVArena.create(blocks, BLOCK_BYTES, directory=str(arena_dir)).spec
    roll = RollCall({rid for m in args.models for rid in runner_ids(m)})
    for rid in sorted(roll.expected):
        name = str(RunnerId.parse(rid).model)
        assert roll.answer(rid, protocol.Ready(info(name, restart), NO_PID, 0.1, 1)) is None
    out = RecordingOutbox()
    return Harness(Scheduler(args, arena, out, bootstrap.build(args, arena, roll)), out)


def lower_group(h: Harness, model: str) -> protocol.LayerGroupStatus:
    [group] = [g for g in control.stats(h.sched).layer_groups if g.model == model]
    return group


def test_batches_carry_each_groups_slots() -> None:
    h = harness()
    h.request("r", model="a", prompt=10, max_tokens=3)
    batch = h.inflight("a#0")
    assert batch is not None and batch.layer_splits == [2]
    [seq] = batch.seqs
    [lower] = seq.lower_slots
    assert len(protocol.unpack_ids(lower)) == len(protocol.unpack_ids(seq.slots)) == 10
    h.run_until_idle("a#0")
    h.request("s", model="c", prompt=10, max_tokens=2)
    batch = h.inflight("c#0")
    assert batch is not None and batch.layer_splits == [] and not batch.seqs[0].lower_slots
    h.run_until_idle("c#0")
    h.assert_clean()


def test_a_sibling_finds_the_shared_layers_cached_and_they_are_kept_once() -> None:
    h = harness()
    h.request("r1", model="a", prompt=17, max_tokens=2)
    h.run_until_idle("a#0")
    cached = lower_group(h, "a").cached_tokens
    assert cached >= 16
    assert lower_group(h, "a").shared_with == ["b"]
    # b has no K/V of its own for the prompt: nothing counts as cached for it
    # (its upper layers must be computed), but its lower group is found.
    h.request("r2", model="b", prompt=17, max_tokens=2)
    batch = h.inflight("b#0")
    assert batch is not None and len(protocol.unpack_ids(batch.seqs[0].new_tokens)) == 17
    h.run_until_idle("b#0")
    assert lower_group(h, "b").tokens_recomputed >= 16
    assert lower_group(h, "b").tokens_matched == 0
    # The lower layers of the prompt are held once for both models: b's
    # computed copy went back to the allocator when it was inserted.
    assert lower_group(h, "b").cached_tokens == lower_group(h, "a").cached_tokens == cached
    usage = h.sched.cache.allocator.usage().pools
    assert usage[lower_group(h, "a").pool].used_slots == cached
    assert usage[h.sched.cache.pool_of("b")].used_slots == cached
    # A second request of b now hits every group.
    h.request("r3", model="b", prompt=17, max_tokens=2)
    batch = h.inflight("b#0")
    assert batch is not None and len(protocol.unpack_ids(batch.seqs[0].new_tokens)) == 1
    h.run_until_idle("b#0")
    h.assert_clean()


def test_eviction_across_groups_keeps_the_invariants() -> None:
    # 12 blocks: a handful of prompts per model fit; the rest evicts.
    h = harness(blocks=12, check_invariants=True)
    rng = np.random.default_rng(0)
    for i in range(30):
        model = ("a", "b", "c")[i % 3]
        h.request(f"r{i}", model=model, prompt=int(rng.integers(8, 40)), start=1 + 50 * (i % 4))
        h.run_until_idle(f"{model}#0")
        assert not h.out.errors(f"r{i}")
    h.assert_clean()


def test_invalidating_a_model_drops_its_lower_groups_too() -> None:
    h = harness()
    h.request("r1", model="a", prompt=17, max_tokens=2)
    h.run_until_idle("a#0")
    assert lower_group(h, "a").cached_tokens > 0
    h.send(protocol.ControlRequest("c1", "invalidate", model="a"))
    assert lower_group(h, "a").cached_tokens == 0
    h.request("r2", model="a", prompt=17, max_tokens=2)
    batch = h.inflight("a#0")
    assert batch is not None and len(protocol.unpack_ids(batch.seqs[0].new_tokens)) == 17
    h.run_until_idle("a#0")
    h.assert_clean()


def add_e(h: Harness) -> None:
    """Fine-tune e (agreeing with a on 3 layers) loaded at run time."""
    h.send(protocol.AddModel(ModelArg("/models/e", "e"), served="e"))
    h.reply("e#0", protocol.Ready(info("e", restart=True), NO_PID, 0.1, 1))


def partial_hit_then_clean(h: Harness, model: str) -> None:
    """``model`` asks for the 41-token prompt another model ran: a partial hit."""
    h.request(f"{model}-partial", model=model, prompt=41, max_tokens=2)
    batch = h.inflight(f"{model}#0")
    assert batch is not None and batch.seqs[0].lower_starts == [40]
    h.run_until_idle(f"{model}#0")
    h.assert_clean()


def new_tokens(batch: protocol.ForwardBatch) -> int:
    return len(protocol.unpack_ids(batch.seqs[0].new_tokens))


def test_a_partial_hit_starts_the_lower_group_past_what_it_holds() -> None:
    h = harness(restart=True)
    assert h.sched.cache.model("a#layers0-2").layout.num_layers == 3  # + the hidden states
    h.request("r1", model="a", prompt=41, max_tokens=2)
    h.run_until_idle("a#0")
    h.request("r2", model="b", prompt=41, max_tokens=2)
    batch = h.inflight("b#0")
    assert batch is not None and new_tokens(batch) == 41  # b's own layers: all of it
    assert batch.seqs[0].lower_starts == [40]  # the shared layers: only the last token
    lower_used = h.sched.cache.allocator.usage().pools[lower_group(h, "b").pool].used_slots
    h.run_until_idle("b#0")
    assert (lower_group(h, "b").tokens_reused, lower_group(h, "b").tokens_recomputed) == (40, 0)
    assert lower_group(h, "b").tokens_matched == 40  # served from these layers
    # b computed one token of the shared layers: one more slot there, no copy of the 40.
    used = h.sched.cache.allocator.usage().pools[lower_group(h, "b").pool].used_slots
    assert used - lower_used <= 4  # within the page the last token and the output took
    h.assert_clean()


def test_a_partial_hit_under_chunked_prefill() -> None:
    h = harness(restart=True, chunked_prefill_size=8)
    h.request("r1", model="a", prompt=41, max_tokens=2)
    h.run_until_idle("a#0")
    h.request("r2", model="b", prompt=41, max_tokens=2)
    starts = []
    while (batch := h.inflight("b#0")) is not None:
        starts.append((new_tokens(batch), batch.seqs[0].lower_starts))
        h.step("b#0")
    # Chunks of 8 of b's own layers; the shared layers compute none of them
    # (they start at each chunk's end: position 40 is past it).
    assert starts[:5] == [(8, [8 * (i + 1)]) for i in range(5)]
    assert starts[5] == (1, [])  # the prompt's last token: every group computes it
    h.assert_clean()


def test_a_model_unloaded_while_a_sibling_shares_its_lower_layers() -> None:
    h = harness(restart=True)
    h.request("r1", model="a", prompt=41, max_tokens=2)
    h.run_until_idle("a#0")
    h.send(protocol.RemoveModel("a"))
    assert "a" not in h.sched.models and "a#layers0-2" not in h.sched.cache.models
    # The shared layers stay cached for b (their generation is b's too).
    assert lower_group(h, "b").cached_tokens >= 40
    partial_hit_then_clean(h, "b")


def test_a_fine_tune_added_at_run_time_shares_at_the_served_cuts() -> None:
    h = harness(restart=True)
    h.request("r1", model="a", prompt=41, max_tokens=2)  # a is busy while e arrives
    add_e(h)
    # e agrees with a on 3 layers, but busy a is cut at 2: e is cut there too.
    assert h.sched.kv.groups["a"].splits == h.sched.kv.groups["e"].splits == (2,)
    h.run_until_idle("a#0")
    assert lower_group(h, "e").pool == lower_group(h, "a").pool
    partial_hit_then_clean(h, "e")


def test_a_pin_holds_the_prefix_in_every_layer_group() -> None:
    h = harness(blocks=12, max_pinned_fraction=0.5)
    prefix = protocol.pack_ids(np.arange(1, 41, dtype=np.int32))
    h.send(protocol.WarmupRequest("w", "b", [prefix], pin=True))
    h.run_until_idle("b#0")
    [pin] = h.sched.warmups.pins.by_key.values()
    assert [x.length for x in (pin.handle, *pin.lower)] == [40, 40]
    # An eviction storm of other prompts leaves the pinned path whole.
    for i in range(12):
        model = ("a", "c")[i % 2]
        h.request(f"r{i}", model=model, prompt=30, start=100 + 40 * i)
        h.run_until_idle(f"{model}#0")
    h.request("hit", model="b", prompt=41, max_tokens=1)
    batch = h.inflight("b#0")
    assert batch is not None and new_tokens(batch) == 1  # every group still holds it
    h.run_until_idle("b#0")
    h.send(protocol.WarmupRequest("u", "b", [prefix], pin=False))
    h.run_until_idle("b#0")
    assert not h.sched.warmups.pins.by_key
    h.assert_clean()


def test_an_idle_base_is_cut_again_for_a_fine_tune_that_arrives() -> None:
    h = harness(models=("a", "c"), restart=True)  # a alone: nothing to share, not cut
    assert h.sched.kv.groups["a"].splits == ()
    h.request("r1", model="a", prompt=41, max_tokens=2)
    h.run_until_idle("a#0")
    add_e(h)
    # e agrees with a on 3 layers and a was idle: both are cut there now.
    assert h.sched.kv.groups["a"].splits == h.sched.kv.groups["e"].splits == (3,)
    assert lower_group(h, "e").pool == lower_group(h, "a").pool
    h.request("r2", model="e", prompt=41, max_tokens=2)
    h.run_until_idle("e#0")
    partial_hit_then_clean(h, "a")  # a's old cache was dropped: e's lower layers serve


def test_a_busy_base_keeps_its_cuts() -> None:
    h = harness(models=("a", "c"), restart=True)
    h.request("r1", model="a", prompt=41, max_tokens=8)  # in flight while e arrives
    add_e(h)
    assert h.sched.kv.groups["a"].splits == h.sched.kv.groups["e"].splits == ()
    h.run_until_idle("a#0")
    h.assert_clean()


# ---- real processes ----------------------------------------------------------------------
PROMPTS = [
    "The history of the printing press begins",
    "Write a short poem about the sea and the wind",
    "The history of the printing press begins in Mainz, where",
]


def serve_and_ask(
    models: dict[str, Path],
    share: bool,
    prompts: list[str] = PROMPTS,
    asks: list[tuple[str, str]] | None = None,
    **flags: object,
) -> tuple[dict[str, list[str]], dict]:
    """Serve ``models`` in one server, ask greedily (each of ``prompts`` of
    every model in turn, or the ``asks``: (model, prompt) in that order), and
    return each model's answers with the scheduler's info and metrics."""
    engine = Engine(
        model=[f"{path},name={name}" for name, path in models.items()],
        kv_cache_bytes=flags.pop("kv_cache_bytes", 16 << 20),
        kv_block_bytes=64 << 10,
        runner_threads=1,
        dtype="float32",
        disable_layer_sharing=not share,
        check_invariants=True,
        **flags,
    )
    try:
        url = f"http://127.0.0.1:{engine.args.port}"
        texts: dict[str, list[str]] = {name: [] for name in models}
        for name, prompt in asks or [(n, p) for p in prompts for n in models]:
            body = {"model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts[name].append(r.json()["choices"][0]["text"])
        info = httpx.get(f"{url}/get_server_info", timeout=30).json()["scheduler"]
        info["metrics"] = httpx.get(f"{url}/metrics", timeout=30).text
        return texts, info
    finally:
        engine.shutdown()


LONG = [f"Story {i}: " + " ".join(f"word{j}" for j in range(i * 7, i * 7 + 200)) for i in range(6)]
TWICE = LONG + LONG  # the second round finds the first's K/V (on disk, where it spilled)


def family_models(family: dict[str, Path], *names: str) -> dict[str, Path]:
    """The family's folders under their served names: base, ft (upper layers
    fine-tuned) and other (a lower layer fine-tuned)."""
    folders = {"base": family["base"], "ft": family["upper"], "other": family["lower"]}
    return {n: folders[n] for n in names}


@pytest.fixture(scope="module")
def alone(family: dict[str, Path]) -> tuple[dict[str, list[str]], dict[str, list[str]], dict]:
    """The references, from one server without layer sharing for the module
    (each model answers alone there, whatever else it serves): every model's
    answers to ``PROMPTS``, base's and ft's to ``TWICE``, and its scheduler
    info and metrics."""
    models = family_models(family, "base", "ft", "other")
    asks = [(n, p) for p in PROMPTS for n in models] + [
        (n, p) for p in TWICE for n in ("base", "ft")
    ]
    texts, info = serve_and_ask(models, share=False, asks=asks)
    short = {n: t[: len(PROMPTS)] for n, t in texts.items()}
    long = {n: texts[n][len(PROMPTS) :] for n in ("base", "ft")}
    return short, long, info


@pytest.mark.timeout(600)
def test_fine_tunes_sharing_lower_layers_answer_as_alone(
    family: dict[str, Path], alone: tuple[dict[str, list[str]], dict[str, list[str]], dict]
) -> None:
    shared, info = serve_and_ask(family_models(family, "base", "ft", "other"), share=True)
    short, _, plain = alone
    assert shared == short
    assert shared["base"] != shared["ft"]  # the fine-tune answers differently
    assert not plain["layer_groups"]
    # base and ft agree on 2 layers, other on 1 with both: cut at 1 and 2.
    assert sorted(g["model"] for g in info["layer_groups"]) == ["base", "base", "ft", "ft", "other"]
    lowest = [g for g in info["layer_groups"] if (g["start"], g["end"]) == (0, 1)]
    assert {g["model"] for g in lowest} == {"base", "ft", "other"}
    assert len({g["pool"] for g in lowest}) == 1
    # The models found the others' layer-0 K/V and hidden states for the
    # prompts (a partial hit: only their own layers computed), and the third
    # prompt extends the first (a full hit).
    assert sum(g["tokens_reused"] for g in lowest) > 0
    assert sum(g["tokens_recomputed"] for g in lowest) == 0
    assert sum(g["tokens_matched"] for g in lowest) > 0
    assert info["invariants"] in (None, "ok")
    assert (
        'radixmux_layer_group_cached_tokens{layers="0-1",model="ft",version="1"}'
        in (info["metrics"])
    )
    assert "radixmux_layer_group" not in plain["metrics"]


@pytest.mark.timeout(600)
def test_shared_layers_spill_to_disk_and_load_back_exactly(
    family: dict[str, Path],
    alone: tuple[dict[str, list[str]], dict[str, list[str]], dict],
    tmp_path: Path,
) -> None:
    shared, info = serve_and_ask(
        family_models(family, "base", "ft"),
        share=True,
        prompts=TWICE,
        kv_cache_bytes=3 << 20,  # a couple of prompts of the 6, for two models
        kv_disk_bytes=1 << 30,
        kv_disk_dir=str(tmp_path / "disk"),
    )
    assert shared == alone[1]
    disk = info["disk"]
    assert disk["chunks_written"] > 0 and disk["loads"] > 0
    assert set(disk["tokens_loaded"]) == {"base", "ft"}
    assert info["invariants"] in (None, "ok")
    # The shared layers' chunks are one namespace for both models.
    lowest = {g["pool"] for g in info["layer_groups"] if g["start"] == 0}
    assert len(lowest) == 1
