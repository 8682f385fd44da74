"""``bench/roofline.py``: the bandwidth measurement and the bytes of a decode step,
on a tiny random Llama loaded as the runner loads it (packed, fused) and as stored."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from bench.roofline import Bandwidth, Roofline, step_bytes, stream_bandwidth, weight_bytes
from bench.tiny_models import make_tiny_model_dir
from radixmux.memory.layout import KVLayout
from radixmux.model_runners.loader import load_model
from radixmux.model_runners.packed_linear import PackedLinear, packing_works, small_kernel_limits


def _plain_read(model: nn.Module, rows: int) -> int:
    """Every parameter once (a tied head and embedding are one tensor), the embedding's
    full table swapped for the rows looked up: counted from the stored model."""
    embed = model.get_input_embeddings()
    tied = embed.weight is model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    table = 0 if tied else embed.weight.numel() * embed.weight.element_size()
    return total - table + rows * embed.embedding_dim * embed.weight.element_size()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("roof") / "m", seed=5)


def test_stored_weights_are_every_parameter_once(folder: Path) -> None:
    stored = load_model(str(folder), dtype="bfloat16", pack_weights=False, fuse_ops=False)
    for rows in (1, 16):
        w = weight_bytes(stored.model, rows)
        assert w.read == _plain_read(stored.model, rows)
        assert set(w.copies) == {"plain"}
    # More rows read more embedding rows, nothing else.
    dim = stored.model.get_input_embeddings().embedding_dim
    assert weight_bytes(stored.model, 16).read - weight_bytes(stored.model, 1).read == 15 * dim * 2


def test_packed_weights_count_the_copy_the_call_reads(folder: Path) -> None:
    if not packing_works(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bfloat16 weights on this CPU (below AVX-512)")
    stored = load_model(str(folder), dtype="bfloat16", pack_weights=False, fuse_ops=False)
    plain = weight_bytes(stored.model, 1).read
    packed = load_model(str(folder), dtype="bfloat16", onednn_copy=True)
    layers = [m for m in packed.model.modules() if isinstance(m, PackedLinear)]
    assert layers, "the runner's load packs the linear layers"
    w = weight_bytes(packed.model, 1)
    assert sum(w.copies.values()) == len(layers)
    # The same weights, in a layout that may pad them, but never fewer bytes.
    assert plain <= w.read <= 1.5 * plain
    if small_kernel_limits() is None:
        pytest.skip("no small-batch kernel on this CPU: one oneDNN copy per layer")
    assert w.copies == {"kernel tiles": len(layers)}
    # A layer holding both copies counts one; above the kernel's limit, oneDNN's.
    assert w.held > w.read
    big = weight_bytes(packed.model, 100_000)
    assert big.copies["oneDNN packed"] == sum(m.packed is not None for m in layers)
    assert big.copies["kernel tiles"] == sum(m.packed is None for m in layers)  # the head


def test_step_bytes_count_a_cascade_prefix_once() -> None:
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16")
    assert layout.bytes_per_token == 23_040
    per_seq = step_bytes(1000, layout, batch=4, context=1100, prefix_read_once=0)
    once = step_bytes(1000, layout, batch=4, context=1100, prefix_read_once=1000)
    assert per_seq.kv_read == 4 * 1100 * 23_040
    assert once.kv_read == (1000 + 4 * 100) * 23_040
    assert per_seq.kv_written == once.kv_written == 4 * 23_040
    assert once.total == 1000 + once.kv_read + once.kv_written


def test_roofline_of_a_step() -> None:
    bw = Bandwidth(read_gbs=20.0, copy_gbs=25.0, array_bytes=1 << 29, threads=2, reps=5)
    assert bw.limit_gbs == 25.0
    moved = step_bytes(250_000_000, KVLayout(1, 1, 1), 1, 1, 0)
    r = Roofline.of(moved, step_ms=20.0, bandwidth=bw)
    assert r.achieved_gbs == pytest.approx(moved.total / 0.020 / 1e9)
    assert r.limit_ms == pytest.approx(moved.total / 25e9 * 1e3)
    assert r.fraction == pytest.approx(r.limit_ms / 20.0)


def test_stream_bandwidth_is_measured_and_threads_restored() -> None:
    before = torch.get_num_threads()
    bw = stream_bandwidth(threads=1, array_bytes=64 << 20, reps=2)
    assert torch.get_num_threads() == before
    assert bw.array_bytes == 64 << 20 and bw.threads == 1
    # Any machine this runs on streams between 0.5 and 2,000 GB/s.
    assert 0.5 < bw.read_gbs < 2000 and 0.5 < bw.copy_gbs < 2000
