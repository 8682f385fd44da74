"""Shared fixtures for the model-runner tests: arenas, tiny models, real models;
and a whole runtime serving one tiny model over HTTP."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from alone_turns import AloneTurns

from radixmux.memory.arena import KVArena
from radixmux.memory.layout import BlockGeometry
from radixmux.model_runners.loader import LoadedModel, describe
from radixmux.model_runners.model_runner import ModelRunner
from radixmux.model_runners.paged_attention import DecodeGroups, PagedBatch
from radixmux.protocol import SeqInput, pack_ids

# Two cores shared with other work: one thread per test process.
torch.set_num_threads(1)

BLOCK_BYTES = 64 * 1024


def tiny_config(kind: str, **overrides: object):
    """A small random-weight config of one architecture family."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(
        vocab_size=211,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if kind == "llama":
        cfg = LlamaConfig(**{**common, **overrides})
    elif kind == "qwen2":
        cfg = Qwen2Config(**{**common, "use_sliding_window": False, **overrides})
    elif kind == "qwen3":  # q/k RMS norms before rotary
        cfg = Qwen3Config(**{**common, "head_dim": 16, **overrides})
    elif kind == "gemma2":  # attention and final logit soft-capping
        gemma2 = dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            sliding_window=512,
        )
        cfg = Gemma2Config(**{**common, **gemma2, **overrides})
    elif kind == "mistral":
        cfg = MistralConfig(**{**common, "sliding_window": None, **overrides})
    elif kind == "gemma3":
        gemma = dict(
            head_dim=16,
            sliding_window=512,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
        )
        cfg = Gemma3TextConfig(**{**common, **gemma, **overrides})
    else:
        raise ValueError(kind)
    return cfg


def tiny_model(kind: str, seed: int = 0, dtype: str = "float32", **overrides: object):
    """A random-weight causal LM wrapped as a ``LoadedModel`` (no tokenizer)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(kind, **overrides)
    cfg._attn_implementation = _plain_impl(cfg)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # Random init leaves some norms at exactly zero/one; perturb every weight so
    # each layer matters to the output.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    # Same seed, same weights in every dtype (cast after init).
    model.to(getattr(torch, dtype))
    return LoadedModel(model, None, describe(model, None, kind, dtype, "cpu"), kind, 0.0)


def _plain_impl(config) -> str:
    # transformers refuses SDPA where it cannot soft-cap scores (Gemma 2).
    return "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"


@contextlib.contextmanager
def plain_attention(model) -> Iterator[None]:
    """Temporarily run ``model`` with transformers' own attention (SDPA or eager)."""
    old = model.config._attn_implementation
    model.config._attn_implementation = _plain_impl(model.config)
    try:
        yield
    finally:
        model.config._attn_implementation = old


@torch.inference_mode()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of a plain transformers forward over ``ids`` (all positions)."""
    with plain_attention(model):
        out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float()


class Sequences:
    """Drives a runner the way the scheduler will: per-sequence ids and slots."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.pool = SlotPool(runner.num_slots, seed)
        self.ids: dict[str, list[int]] = {}
        self.slots: dict[str, list[int]] = {}

    def step(self, work: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Append ``work[rid]`` to each sequence in one batch; logits at each last token."""
        batch = []
        for rid, new in work.items():
            ids = self.ids.setdefault(rid, [])
            slots = self.slots.setdefault(rid, [])
            start = len(ids)
            ids += new
            slots += self.pool.take(len(new))
            batch.append(seq(rid, new, list(slots), start))
        logits = self.runner.logits(batch)
        return {rid: logits[i] for i, rid in enumerate(work)}


class SlotPool:
    """Hands out arena slots in a shuffled order, so sequences straddle blocks."""

    def __init__(self, num_slots: int, seed: int = 0) -> None:
        self.free = list(np.random.default_rng(seed).permutation(num_slots))

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        assert len(taken) == n, "test arena too small"
        return [int(s) for s in taken]


@pytest.fixture
def arena() -> Iterator[KVArena]:
    a = KVArena.create(num_blocks=64, block_bytes=BLOCK_BYTES)
    try:
        yield a
    finally:
        a.destroy()


def fused_copy(loaded: LoadedModel) -> LoadedModel:
    """A copy of ``loaded`` with the fused kernels swapped in (as the server loads
    models), leaving ``loaded`` itself plain for reference forwards."""
    from radixmux.model_runners.fused_ops import fuse_model, is_fused

    if is_fused(loaded.model):
        return loaded
    model = copy.deepcopy(loaded.model)
    fuse_model(model)
    return dataclasses.replace(loaded, model=model)


def make_runner(
    loaded: LoadedModel,
    arena: KVArena,
    page_size: int = 1,
    backend: str = "auto",
    fused: bool = True,
) -> ModelRunner:
    """Bind a copy of a loaded model (fused, as served, unless ``fused=False``) to
    ``arena`` with its own layout; ``loaded.model`` stays the plain reference."""
    geometry = BlockGeometry(loaded.info.layout, arena.spec.block_bytes, page_size)
    served = fused_copy(loaded) if fused else loaded
    return ModelRunner(served, arena.view(geometry), backend)


def force_decode_groups(runner: ModelRunner, groups: DecodeGroups | None) -> None:
    """Make every batch ``runner`` builds carry ``groups`` (checked against its slots)."""
    build = type(runner)._paged_batch

    def with_groups(seqs, *args) -> tuple[PagedBatch, torch.Tensor, torch.Tensor, None]:
        batch, ids, pos, passes = build(runner, seqs, *args)
        assert passes is None  # one layer group
        if groups is not None:
            groups.check(batch.dec_slots, batch.dec_offsets)
        batch.dec_groups = groups
        return batch, ids, pos, passes

    runner._paged_batch = with_groups


@pytest.fixture(params=["cpp", "torch"])
def backend(request) -> str:
    """Each decode attention backend in turn (cpp skipped where it cannot build)."""
    from radixmux.model_runners import paged_decode

    if request.param == "cpp" and not paged_decode.load():
        pytest.skip(f"paged decode kernel not built: {paged_decode.error()}")
    return request.param


def seq(
    rid: str, new: list[int], slots: list[int], start: int, sample: bool = True, **kw
) -> SeqInput:
    """A SeqInput from plain lists; ``start`` (the first new token's position)
    is what the runner derives from them, checked here to keep tests honest."""
    assert start == len(slots) - len(new), (start, len(slots), len(new))
    return SeqInput(rid, pack_ids(new), pack_ids(slots), sample, **kw)


@pytest.fixture(scope="session")
def real_models():
    """Both embedded models, fetched once (converted into the cache) and loaded float32."""
    from radixmux.model_runners.loader import load_model

    models = {}
    for name in ("smollm2", "gemma3-270m"):
        models[name] = load_model(name, dtype="float32")
    return models


def pytest_configure(config) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config.addinivalue_line(
        "markers", "alone: no other test runs beside it under pytest-xdist (alone_turns.py)"
    )
    config.pluginmanager.register(AloneTurns(), "radixmux-alone-turns")


@contextlib.contextmanager
def tiny_server(folder: Path, name: str = "tiny") -> Iterator[str]:
    """The whole runtime (launcher, every process, HTTP) serving the model at
    ``folder`` as ``name``, small and float32; yields its base URL."""
    from radixmux.runtime.client.engine import Engine

    engine = Engine(
        model=[f"{folder},name={name}"],
        kv_cache_bytes=16 << 20,
        kv_block_bytes=64 << 10,
        runner_threads=1,
        dtype="float32",
    )
    try:
        yield f"http://127.0.0.1:{engine.args.port}"
    finally:
        engine.shutdown()


@pytest.fixture
def widen_kernel() -> None:
    """Skip where the kernel library has no AVX2 + FMA build (or no compiler):
    the widening kernel's tests (kernels/widen_linear.cpp)."""
    from radixmux.model_runners import paged_decode

    if not (paged_decode.load() and torch.ops.radixmux.has_widen_linear()):
        pytest.skip("the kernel library has no AVX2 + FMA build here (or no compiler)")


@torch.no_grad()
def pack_every_linear(plain: torch.nn.Module, model: torch.nn.Module, ids: torch.Tensor):
    """Swap ``model``'s linear layers (``pack_linear_weights``), assert every one
    was swapped, and return the packed layers and the largest difference of its
    logits over ``ids`` from ``plain``'s (the same weights, unpacked)."""
    from radixmux.model_runners.packed_linear import PackedLinear, pack_linear_weights

    want = plain(ids).logits
    swapped = pack_linear_weights(model)
    got = model(ids).logits
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert swapped == len(layers) > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    return layers, (got - want).abs().max().item()
