"""Attention micro-benchmark: the paged kernel's decode (plain vs cascade) and extend paths.

**Decode.** SmolLM2-135M's attention shape (9 query heads, 3 KV heads,
head_dim 64, bfloat16 K/V) at batch 1, 16 and 64 over 1,100-token contexts.
In a *shared* batch, groups of 4, 16 or 64 sequences share a 1,000-token
prefix (the same arena rows, as sequences sharing a cached prefix in the
radix tree do) plus 100 tokens of their own; a *distinct* batch shares
nothing. Each step runs every layer once, and each layer has its own rows
(as in the model), so K/V come from DRAM rather than from the CPU's caches
(the tables are sized well beyond the L3). Compared per step: the plain
kernel (``paged_decode``, which reads a shared prefix once per member) and
the cascade kernel (``paged_decode_cascade``, once per group). K/V are laid
out as the arena stores them (``--kv-order head``: each KV head's rows of a
136-slot block together, memory/layout.py) or with every head of a token in
one row (``slot``, the arena before 2026-12-07); ``--kv-order head slot``
measures both per case, one after the other.

**Extend.** One layer's attention call (``paged_attention_forward``, K/V
write included) for prefill chunks, the SDPA path (gather the cached prefix,
one masked SDPA per chunk) against the kernel (``paged_extend``, all chunks
in one call, prefixes read in place, causal half only): 512 new tokens with
0 and with 448 cached, 64 new after 448 cached, four chunks of 128 new
tokens after 448 cached in one call, and four of 100 new after 1,000 cached
(vLLM's prefix_repetition suffixes).

**Against vLLM's kernel** (``--parts vllm``). vLLM CPU 0.32's own
attention kernel (``cpu_attention_with_kv_cache``, with the ISA its CPU
backend picks: ``amx`` on an AMX host; run by ``bench/peer_attention_vllm.py``
in the vLLM peer's venv over a KV cache written by its own
``cpu_attn_reshape_and_cache``) and radixmux's ``paged_extend`` (or
``paged_decode`` for decode batches) on the same causal attention (new
tokens after cached ones, one sequence or a batch of decodes over 1,100-token
contexts of their own), K/V writes excluded on both sides, 30 layers of their
own K/V per step, ms per layer; the two run in alternating rounds
(``--rounds``), in separate processes. ``--cases`` takes other shapes, as
"new@cached" or "new@cachedxB" (``--cases 1024@2127 1@3300x24``: a long
prompt's chunk after a cached prefix, 24 decodes over long contexts).

Each pair of radixmux's paths is timed interleaved, call by call, so both see
the same load from other processes on these shared cores; each figure is the
20th-percentile call. Prints tables and writes
``bench/results/decode_attention.json``.

    .venv/bin/python -m bench.bench_decode_attention [--parts decode extend vllm] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from bench.roofline import stream_bandwidth
from radixmux.memory.layout import slot_major
from radixmux.model_runners import paged_decode as kernel
from radixmux.model_runners.kv_store import KVStore
from radixmux.model_runners.paged_attention import (
    ExtendSeq,
    PagedBatch,
    paged_attention_forward,
    paged_batch,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
LAYERS = 30
PREFIX, OWN = 1000, 100
# Enough K/V rows across layers to be 8x the 32 MiB L3: every step reads DRAM.
MIN_TABLE_BYTES = 256 << 20


def _typical(times: list[float]) -> float:
    return float(np.percentile(times, 20))


@dataclass
class Case:
    """One decode batch: ``batch`` sequences, in groups of ``group`` (0: no sharing)."""

    batch: int
    group: int

    @property
    def name(self) -> str:
        return "distinct" if self.group == 0 else f"groups of {self.group}"

    def contexts(self) -> tuple[list[list[int]], list[int], list[int]]:
        """(each sequence's rows, group of each sequence, prefix of each group) in one layer."""
        rows, next_row = [], 0

        def take(n: int) -> list[int]:
            nonlocal next_row
            next_row += n
            return list(range(next_row - n, next_row))

        group_of, prefixes = [], []
        for b in range(self.batch):
            if self.group == 0:
                rows.append(take(PREFIX + OWN))
                group_of.append(-1)
                continue
            if b % self.group == 0:
                shared = take(PREFIX)
                prefixes.append(PREFIX)
            rows.append(shared + take(OWN))
            group_of.append(len(prefixes) - 1)
        return rows, group_of, prefixes


# The arena's block for SmolLM2's bfloat16 K/V (3 MiB blocks, 23,040 bytes a token).
BLOCK_SLOTS = 136


def arena_tables(
    k: torch.Tensor, v: torch.Tensor, spb: int = BLOCK_SLOTS
) -> tuple[torch.Tensor, torch.Tensor, KVStore]:
    """Slot-major ``[N, heads, dim]`` K and V written into blocks of ``spb``
    slots as the arena stores them (memory/layout.py), through a ``KVStore``
    over one layer: the ``[rows, heads, dim]`` tables it hands the kernels, and
    the store (``address`` maps slot ids to their rows)."""
    n, heads, dim = k.shape
    blocks = -(-n // spb)
    stored = torch.zeros(blocks, 1, 2, heads, spb, dim, dtype=k.dtype)
    store = KVStore(slot_major(stored))
    store.write(0, store.address(torch.arange(n)), k, v)
    k_rows, v_rows = store.rows(0)
    return k_rows, v_rows, store


@dataclass
class Figures:
    batch: int
    layout: str
    kv_order: str  # "head": the arena's head-major blocks; "slot": every head of a row together
    layers_in_table: int
    kv_mb_per_layer_plain: float
    kv_mb_per_layer_cascade: float
    plain_ms: float  # one step: every layer once
    cascade_ms: float
    speedup: float
    plain_gbs: float  # K/V bytes read a step / its time
    cascade_gbs: float


def measure(
    case: Case, dtype: torch.dtype, steps: int, det: bool = False, kv_order: str = "head"
) -> Figures:
    rows, group_of, prefixes = case.contexts()
    per_layer = max(max(r) for r in rows) + 1
    row_bytes = KV_HEADS * HEAD_DIM * torch.finfo(dtype).bits // 8
    # Distinct rows per layer, as many layers as it takes to overflow the caches.
    tables = max(1, min(LAYERS, math.ceil(MIN_TABLE_BYTES / (2 * per_layer * row_bytes))))
    g = torch.Generator().manual_seed(0)
    shape = (tables * per_layer, KV_HEADS, HEAD_DIM)
    k_rows = torch.randn(shape, generator=g).to(dtype)
    v_rows = torch.randn(shape, generator=g).to(dtype)
    base = torch.tensor([r for rs in rows for r in rs])
    addrs = [base + (layer % tables) * per_layer for layer in range(LAYERS)]
    if kv_order == "head":
        k_rows, v_rows, store = arena_tables(k_rows, v_rows)
        addrs = [store.address(a) for a in addrs]
    offsets = torch.tensor([0, *np.cumsum([len(r) for r in rows]).tolist()])
    group_t = torch.tensor(group_of, dtype=torch.int64)
    prefix_t = torch.tensor(prefixes, dtype=torch.int64)
    q = torch.randn(case.batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    scale = HEAD_DIM**-0.5

    def plain() -> torch.Tensor:
        for addr in addrs:
            out = kernel.paged_decode(q, k_rows, v_rows, addr, offsets, scale, None, None, det)
        return out

    def cascade() -> torch.Tensor:
        for addr in addrs:
            out = kernel.paged_decode_cascade(
                q, k_rows, v_rows, addr, offsets, group_t, prefix_t, scale, None, None, det
            )
        return out

    diff = (plain().float() - cascade().float()).abs().max().item()
    assert diff < 2e-2, f"cascade differs from the plain kernel by {diff}"
    assert not det or diff == 0, f"deterministic cascade differs by {diff}"
    times: dict[str, list[float]] = {"plain": [], "cascade": []}
    for _ in range(steps):
        for name, fn in (("plain", plain), ("cascade", cascade)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    plain_rows = len(base)
    cascade_rows = len(set(base.tolist()))
    mb = 2 * row_bytes / 2**20  # K and V
    p, c = _typical(times["plain"]), _typical(times["cascade"])
    step_mib = LAYERS * mb  # one row each of every layer's K and V
    return Figures(
        case.batch,
        case.name,
        kv_order,
        tables,
        round(plain_rows * mb, 2),
        round(cascade_rows * mb, 2),
        round(p * 1e3, 2),
        round(c * 1e3, 2),
        round(p / c, 2),
        round(plain_rows * step_mib * 2**20 / p / 1e9, 2),
        round(cascade_rows * step_mib * 2**20 / c / 1e9, 2),
    )


EXTEND_CASES = {  # name: (cached, new) per chunk, all chunks in one call
    "512 new": [(0, 512)],
    "448 cached + 512 new": [(448, 512)],
    "448 cached + 64 new": [(448, 64)],
    "4 x (448 cached + 128 new)": [(448, 128)] * 4,
    # vLLM's prefix_repetition suffixes: 100 new tokens after a cached 1,000.
    "4 x (1000 cached + 100 new)": [(1000, 100)] * 4,
}


@dataclass
class ExtendFigures:
    case: str
    kv_order: str
    sdpa_ms: float  # one layer's attention call
    kernel_ms: float
    speedup: float


class _Layer(torch.nn.Module):
    """What the attention function needs of a transformers attention module."""

    layer_idx = 0


def measure_extend(
    name: str, chunks: list[tuple[int, int]], dtype: torch.dtype, steps: int, kv_order: str
):
    spb = 4096  # one layer's rows in blocks of 4,096 slots
    total = sum(c + n for c, n in chunks)
    blocks = -(-total // spb)
    # Head-major blocks, as the arena stores them (memory/layout.py).
    view = slot_major(torch.zeros(blocks, 1, 2, KV_HEADS, spb, HEAD_DIM, dtype=dtype))
    store = KVStore(view if kv_order == "head" else view.contiguous())
    g = torch.Generator().manual_seed(1)
    extends, new_slots, next_slot, row = [], [], 0, 0
    for cached, new in chunks:
        slots = torch.arange(next_slot, next_slot + cached + new)
        next_slot += cached + new
        prefix = store.address(slots[:cached])
        kv = torch.randn(2, cached, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        store.write(0, prefix, kv[0], kv[1])  # the cached prefix
        new_slots.append(slots[cached:])
        end = cached + new
        extends.append(
            ExtendSeq(
                row, row + new, store.address(slots), torch.arange(end), torch.arange(cached, end)
            )
        )
        row += new
    empty = torch.zeros(0, dtype=torch.int64)
    query = torch.randn(1, HEADS, row, HEAD_DIM, generator=g).to(dtype)
    key = torch.randn(1, KV_HEADS, row, HEAD_DIM, generator=g).to(dtype)
    value = torch.randn(1, KV_HEADS, row, HEAD_DIM, generator=g).to(dtype)
    batches = {
        path: PagedBatch(
            store=store,
            write_addr=store.address(torch.cat(new_slots)),
            dec_rows=empty,
            dec_slots=empty,
            dec_offsets=torch.zeros(1, dtype=torch.int64),
            dec_q_pos=empty,
            extends=extends,
            use_kernel=path == "kernel",
        )
        for path in ("sdpa", "kernel")
    }
    layer = _Layer()

    def call(path: str) -> torch.Tensor:
        with paged_batch(batches[path]):
            return paged_attention_forward(layer, query, key, value, None, HEAD_DIM**-0.5)[0]

    diff = (call("sdpa").float() - call("kernel").float()).abs().max().item()
    assert diff < 3e-2, f"kernel differs from SDPA by {diff}"
    times: dict[str, list[float]] = {"sdpa": [], "kernel": []}
    for _ in range(steps):
        for path in times:
            t0 = time.perf_counter()
            call(path)
            times[path].append(time.perf_counter() - t0)
    s, k = _typical(times["sdpa"]), _typical(times["kernel"])
    return ExtendFigures(name, kv_order, round(s * 1e3, 2), round(k * 1e3, 2), round(s / k, 2))


# Against vLLM CPU's own attention kernel (``--parts vllm``): B sequences of
# `new` tokens after `cached` each, keyed "new@cached" (one sequence) or
# "new@cachedxB"; new = 1 is a decode batch (each its own context).
PEER_CASES = ("512@0", "64@448", "100@1000", "2048@0", "1@1099x16", "1@1099x64")
PEER_RUN = 128  # slots per contiguous run of a context: the peer script's BLOCK


@dataclass
class PeerFigures:
    case: str
    radixmux_ms: list[float]  # per layer, one per round
    vllm_ms: list[float]
    vllm_isa: str
    ratio: float  # vLLM's median time / radixmux's (> 1: radixmux faster)


def parse_case(case: str) -> tuple[int, int, int]:
    """(new, cached, sequences) of a peer case "new@cached" or "new@cachedxB"."""
    head, _, many = case.partition("x")
    new, cached = (int(x) for x in head.split("@"))
    return new, cached, int(many or 1)


def measure_case(case: str, dtype: torch.dtype, steps: int) -> float:
    """ms per layer of radixmux's kernel alone (20th percentile of 30-layer
    steps) on a peer case: ``paged_extend``, or ``paged_decode`` for a decode
    batch, as the runner calls them; each layer its own K/V rows, each
    context in runs of PEER_RUN slots scattered over the table, as the peer's
    contexts are in blocks of as many tokens (a fresh server's allocator
    hands out such runs; a fragmented arena scatters finer, which costs
    radixmux's decode more: 16-slot runs measured 0.94-1.00 ms per layer at
    16 x 1,100 against 0.72)."""
    new, cached, seqs = parse_case(case)
    total = cached + new
    g = torch.Generator().manual_seed(0)
    runs = -(-total // PEER_RUN)
    table = max(2 * runs * PEER_RUN * seqs, 8192)
    order = torch.randperm(table // PEER_RUN, generator=g)[: runs * seqs].view(seqs, runs)
    addr = torch.cat(
        [(row[:, None] * PEER_RUN + torch.arange(PEER_RUN)).flatten()[:total] for row in order]
    )
    # Each layer's K and V in head-major blocks, as the arena stores them.
    layers = []
    for _ in range(LAYERS):
        k, v = (torch.randn(table, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
        k_rows, v_rows, store = arena_tables(k, v)
        layers.append((k_rows, v_rows))
    addr = store.address(addr)  # every layer's store has the same blocks
    q = torch.randn(seqs * new, HEADS, HEAD_DIM, generator=g).to(dtype)
    offsets = torch.arange(seqs + 1) * total
    q_offsets = torch.arange(seqs + 1) * new
    scale = HEAD_DIM**-0.5

    def step() -> None:
        for k_rows, v_rows in layers:
            if new == 1:
                kernel.paged_decode(q, k_rows, v_rows, addr, offsets, scale, None, None)
            else:
                kernel.paged_extend(q, k_rows, v_rows, addr, offsets, q_offsets, scale, None, None)

    step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return _typical(times) * 1e3 / LAYERS


def measure_peer(cases: list[str], threads: int) -> dict[str, tuple[float, str]]:
    """vLLM's kernel on ``cases`` (bench/peer_attention_vllm.py in the peer's venv)."""
    from bench import peers

    if not peers.is_installed("vllm"):
        raise SystemExit("--parts vllm needs the vLLM peer: python -m bench.peers install vllm")
    script = Path(__file__).with_name("peer_attention_vllm.py")
    proc = subprocess.run(
        [str(peers.venv_python("vllm")), str(script), str(threads), *cases],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode:
        raise SystemExit(f"vLLM's kernel failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    wrong = [r for r in rows if not r["error"] < 3e-2]
    assert not wrong, f"vLLM's kernel is not the causal attention compared: {wrong}"
    return {r["case"]: (r["ms_per_layer"], r["isa"]) for r in rows}


def compare_with_vllm(
    dtype: torch.dtype, rounds: int, cases: tuple[str, ...] = PEER_CASES
) -> list[PeerFigures]:
    """Both kernels on ``cases``, rounds alternating (radixmux, then vLLM)."""
    ours: dict[str, list[float]] = {c: [] for c in cases}
    theirs: dict[str, list[float]] = {c: [] for c in cases}
    isa = ""
    for _ in range(rounds):
        for case in cases:
            new, cached, _ = parse_case(case)
            steps = 6 if new + cached >= 2048 else 20
            ours[case].append(round(measure_case(case, dtype, steps), 3))
        for case, (ms, case_isa) in measure_peer(list(cases), torch.get_num_threads()).items():
            theirs[case].append(round(ms, 3))
            isa = case_isa
    return [
        PeerFigures(
            c,
            ours[c],
            theirs[c],
            isa,
            round(statistics.median(theirs[c]) / statistics.median(ours[c]), 2),
        )
        for c in cases
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["decode", "extend"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--deterministic", action="store_true", help="decode: the batch-invariant arithmetic"
    )
    parser.add_argument("--rounds", type=int, default=2, help="--parts vllm: alternating rounds")
    parser.add_argument(
        "--kv-order",
        nargs="+",
        default=["head"],
        choices=["head", "slot"],
        help="K/V as the arena stores them (head: each head's rows of a "
        f"{BLOCK_SLOTS}-slot block together) or every head of a row together (slot), "
        "measured one after the other per case",
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        default=list(PEER_CASES),
        help='--parts vllm: "new@cached" or "new@cachedxB" (B sequences; new = 1: decodes)',
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not kernel.load():
        raise SystemExit(f"paged decode kernel not built: {kernel.error()}")
    dtype = getattr(torch, args.dtype)
    report: dict[str, object] = {
        "meta": {
            "dtype": args.dtype,
            "threads": torch.get_num_threads(),
            "steps": args.steps,
            "deterministic": args.deterministic,
        }
    }
    print(
        f"{HEADS}/{KV_HEADS} heads x {HEAD_DIM}, {args.dtype} K/V, "
        f"{torch.get_num_threads()} threads, 20th-percentile of {args.steps} calls"
    )
    if "decode" in args.parts:
        cases = [
            Case(b, grp)
            for b in args.batches
            for grp in [0, *args.groups]
            if grp <= b and (grp == 0 or b % grp == 0)
        ]
        bw = stream_bandwidth(torch.get_num_threads())
        print(
            f"\ndecode: {LAYERS} layers per step, {PREFIX}+{OWN}-token contexts; "
            f"this machine streams {bw.read_gbs:.1f} GB/s (read, {bw.threads} threads)"
        )
        report["stream_read_gbs"] = round(bw.read_gbs, 2)
        print(
            f"{'batch':>5} {'layout':>13} {'order':>5} {'K/V MB/layer plain':>19} {'cascade':>8} "
            f"{'plain ms/step':>14} {'cascade ms/step':>16} {'speed-up':>9} "
            f"{'plain GB/s':>11} {'cascade GB/s':>13}"
        )
        decode = []
        for case in cases:
            for order in args.kv_order:
                f = measure(case, dtype, args.steps, args.deterministic, order)
                decode.append(asdict(f))
                print(
                    f"{f.batch:>5} {f.layout:>13} {f.kv_order:>5} {f.kv_mb_per_layer_plain:>19.1f} "
                    f"{f.kv_mb_per_layer_cascade:>8.1f} {f.plain_ms:>14.1f} "
                    f"{f.cascade_ms:>16.1f} {f.speedup:>8.2f}x {f.plain_gbs:>11.1f} "
                    f"{f.cascade_gbs:>13.1f}"
                )
        report["decode"] = decode
    if "extend" in args.parts:
        print("\nextend: one layer's attention call")
        print(f"{'chunks':>28} {'order':>5} {'SDPA ms':>9} {'kernel ms':>10} {'speed-up':>9}")
        extend = []
        for name, chunks in EXTEND_CASES.items():
            for order in args.kv_order:
                e = measure_extend(name, chunks, dtype, args.steps, order)
                extend.append(asdict(e))
                print(
                    f"{e.case:>28} {e.kv_order:>5} {e.sdpa_ms:>9.2f} {e.kernel_ms:>10.2f} "
                    f"{e.speedup:>8.2f}x"
                )
        report["extend"] = extend
    if "vllm" in args.parts:
        if dtype != torch.bfloat16:
            raise SystemExit("--parts vllm compares bfloat16 kernels")
        print(f"\nattention against vLLM's kernel: ms per layer, {args.rounds} rounds")
        print(f"{'new@cached':>11} {'radixmux':>16} {'vLLM':>16} {'isa':>5} {'vLLM/ours':>10}")
        versus = compare_with_vllm(dtype, args.rounds, tuple(args.cases))
        for v in versus:
            ours = ", ".join(f"{x:.2f}" for x in v.radixmux_ms)
            theirs = ", ".join(f"{x:.2f}" for x in v.vllm_ms)
            print(f"{v.case:>11} {ours:>16} {theirs:>16} {v.vllm_isa:>5} {v.ratio:>9.2f}x")
        report["vs_vllm"] = [asdict(v) for v in versus]
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / "decode_attention.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
