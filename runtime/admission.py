"""Admission of model loads: a load starts only if it fits the machine.

Two limits, checked for ``POST /models`` and reloads (and, as a warning only,
for the ``--model`` flags at start-up):

replicas
    at most the cores this server may use (see :func:`max_replicas`);
memory
    a load's *need* is ``replicas x (RUNNER_OVERHEAD_BYTES + its weights in
    the load dtype x weight_copies(dtype))``, the weights counted from the
    model's files (safetensors headers, GGUF tensor tables: nothing is
    loaded). It must fit what is *free*: ``MemAvailable`` now, less the KV
    arena's pages not yet resident (they will be), less
    ``--memory-reserve-bytes`` (kept for the rest of the machine), less what
    loads in progress and runners waiting to restart will still take. A load
    that does not fit is refused with a 507 naming both figures, before any
    process starts: the OOM killer never has to choose.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import msgspec

from radixmux.common.cpu import BF16_FLAGS, cpu_flags

if TYPE_CHECKING:
    from radixmux.common.server_args import ServerArgs

log = logging.getLogger("radixmux.launcher")

MiB = 1 << 20
# A runner's own memory beside its weights: Python, torch, transformers,
# oneDNN's primitives for every batch shape (packed_linear.warm_up). Measured:
# a runner serving a 2-layer, 64-wide model holds 629 MiB of anonymous memory
# (/proc/PID/smaps_rollup), rounded up for the margin.
RUNNER_OVERHEAD_BYTES = 768 * MiB
_LOAD_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# safetensors dtype -> bytes per element; floating ones are cast to the load dtype.
_ST_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
_MAX_HEADER = 100 * MiB  # the safetensors format's own bound


@dataclass(frozen=True)
class LoadNeed:
    """What one model load will take: per runner, and in all."""

    weights_bytes: int  # the weights in the load dtype, one copy
    per_runner_bytes: int
    replicas: int

    @property
    def total_bytes(self) -> int:
        return self.per_runner_bytes * self.replicas


class MemoryState(msgspec.Struct, frozen=True):
    """Memory as admission sees it now (``/health`` shows it too)."""

    available_bytes: int  # MemAvailable
    arena_pending_bytes: int  # KV arena pages not resident yet
    reserve_bytes: int  # --memory-reserve-bytes
    promised_bytes: int = 0  # loads in progress, runners waiting to restart

    @property
    def free_bytes(self) -> int:
        used = self.arena_pending_bytes + self.reserve_bytes + self.promised_bytes
        return max(0, self.available_bytes - used)


class Admission(msgspec.Struct, frozen=True):
    """The ``admission`` part of ``/health``: the limits a load must meet."""

    max_replicas: int
    memory_available_bytes: int | None  # None: not measurable here (no check)
    memory_free_for_models_bytes: int | None
    memory_reserve_bytes: int
    kv_arena_pending_bytes: int
    runner_overhead_bytes: int = RUNNER_OVERHEAD_BYTES


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_replicas() -> int:
    """Replicas one model may have.

    A replica is a runner process whose torch threads share the cores with the
    others (``--runner-threads 0`` divides them): past one replica per core a
    replica adds its weights' memory and context switches but no throughput,
    and 16 replicas on 2 cores only exhaust memory.
    """
    return usable_cores()


def mem_available() -> int | None:
    """Bytes the kernel can hand out now without swapping (``MemAvailable``);
    free pages where there is no /proc/meminfo; None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:  # lower than MemAvailable (no reclaimable cache): errs on the safe side
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def arena_pending(path: str | None, total_bytes: int) -> int:
    """Bytes of the KV arena that are not resident yet. Runners populate it
    at start (``KVArena.populate``); where the kernel cannot, its pages come
    as KV is written, and that memory is spoken for already."""
    if path is None:
        return total_bytes
    try:
        resident = os.stat(path).st_blocks * 512
    except OSError:
        return 0  # gone: the server is stopping
    return max(0, total_bytes - resident)


def memory_state(
    arena_path: str | None, arena_bytes: int, reserve: int, promised: int = 0
) -> MemoryState | None:
    """Memory now, or None when this platform does not say."""
    available = mem_available()
    if available is None:
        return None
    return MemoryState(available, arena_pending(arena_path, arena_bytes), reserve, promised)


def weight_copies(dtype: str) -> float:
    """Bytes a runner holds per byte of its weights in ``dtype``.

    Measured on SmolLM2-135M (a runner's anonymous memory less a tiny model's):
    1.6x its float32 weights (the oneDNN-packed copy replaces each linear
    weight, but a tied output head keeps a second copy of the embeddings), 2.5x
    its bfloat16 weights where the small-batch kernel keeps a tile copy beside
    oneDNN's (CPUs with AVX512-BF16 or AMX, packed_linear.py). Rounded up.
    """
    if dtype == "bfloat16" and any(f in cpu_flags() for f in BF16_FLAGS):
        return 3.0
    return 2.0


def estimate(source: str, dtype: str, replicas: int) -> LoadNeed:
    """The need of ``source`` (a resolved local folder or ``.gguf`` file) in ``dtype``."""
    size = _LOAD_DTYPE_BYTES.get(dtype, 4)
    path = Path(source)
    staged = 0
    if path.is_file() and path.suffix == ".gguf":
        elements = _gguf_elements(path)
        weights = elements * size
        # transformers de-quantises every tensor to float32 before the model
        # takes it in ``dtype``: both exist while it loads.
        staged = elements * 4
    else:
        weights = _folder_weights(path, size)
    per_runner = RUNNER_OVERHEAD_BYTES + max(
        math.ceil(weights * weight_copies(dtype)), weights + staged
    )
    return LoadNeed(weights, per_runner, replicas)


def refusal(name: str, need: LoadNeed, dtype: str, state: MemoryState) -> str | None:
    """Why ``need`` does not fit ``state`` (the 507 message), or None when it fits."""
    if need.total_bytes <= state.free_bytes:
        return None
    parts = [f"MemAvailable {_mib(state.available_bytes)}"]
    if state.arena_pending_bytes:
        parts.append(f"KV arena still to fill {_mib(state.arena_pending_bytes)}")
    parts.append(f"--memory-reserve-bytes {_mib(state.reserve_bytes)}")
    if state.promised_bytes:
        parts.append(f"loads in progress {_mib(state.promised_bytes)}")
    return (
        f"not enough memory to load model {name!r}: it needs about {_mib(need.total_bytes)} "
        f"({need.replicas} runner(s) x ({_mib(need.weights_bytes)} of {dtype} weights "
        f"x {weight_copies(dtype):g} + {_mib(RUNNER_OVERHEAD_BYTES)} per process)), "
        f"only {_mib(state.free_bytes)} is free ({' - '.join(parts)})"
    )


def health(arena_path: str | None, arena_bytes: int, reserve: int) -> Admission:
    """The limits as ``/health`` reports them."""
    state = memory_state(arena_path, arena_bytes, reserve)
    return Admission(
        max_replicas=max_replicas(),
        memory_available_bytes=None if state is None else state.available_bytes,
        memory_free_for_models_bytes=None if state is None else state.free_bytes,
        memory_reserve_bytes=reserve,
        kv_arena_pending_bytes=0 if state is None else state.arena_pending_bytes,
    )


def startup_warnings(args: ServerArgs) -> list[str]:
    """What the ``--model`` flags exceed (sources resolved, dtypes concrete).

    Start-up only warns: the operator chose these models on the command line
    and is there to read the log, and a machine's MemAvailable is often low
    only until page cache is reclaimed.
    """
    warnings = []
    cores = max_replicas()
    for m in args.models:
        if m.replicas > cores:
            warnings.append(
                f"model {m.name}: {m.replicas} replicas on {cores} usable cores (POST /models "
                f"refuses more than {cores}): replicas past one per core add memory, not speed"
            )
    state = memory_state(None, args.kv_cache_bytes, args.memory_reserve_bytes)
    if state is None:
        return warnings
    total = 0
    for m in args.models:
        try:
            total += estimate(m.source, m.dtype or args.dtype, m.replicas).total_bytes
        except (OSError, ValueError):
            continue
    if total > state.free_bytes:
        warnings.append(
            f"the models need about {_mib(total)} but only {_mib(state.free_bytes)} is free "
            f"(MemAvailable {_mib(state.available_bytes)} - KV arena "
            f"{_mib(state.arena_pending_bytes)} - --memory-reserve-bytes "
            f"{_mib(state.reserve_bytes)}): the server may run out of memory"
        )
    return warnings


def _mib(n: int) -> str:
    return f"{n / MiB:,.0f} MiB"


# ---- weights from files ------------------------------------------------------------------
def _folder_weights(folder: Path, size: int) -> int:
    """The weights of a HF folder in a dtype of ``size`` bytes, from its files
    as ``from_pretrained`` picks them (an index's shards, else the one file)."""
    for index, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        files = _index_files(folder / index)
        if not files and (folder / single).is_file():
            files = [folder / single]
        if files:
            read = _safetensors_bytes if single.endswith(".safetensors") else _bin_bytes
            return sum(read(f, size) for f in files)
    return sum(_safetensors_bytes(f, size) for f in sorted(folder.glob("*.safetensors")))


def _index_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return [index.parent / name for name in sorted(set(weight_map.values()))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def _safetensors_bytes(file: Path, size: int) -> int:
    """A safetensors file's tensors in the load dtype, from its header alone."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER:
                raise ValueError("header too large")
            header = json.loads(f.read(n))
        total = 0
        for key, t in header.items():
            if key == "__metadata__":
                continue
            elements = math.prod(int(d) for d in t["shape"])
            dt = t["dtype"]
            total += elements * (size if dt.startswith(("F", "BF")) else _ST_BYTES[dt])
        return total
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error):
        # Not a safetensors file after all: its load fails with a clear error;
        # until then its size on disk is the best guess.
        return _bin_bytes(file, size)


def _bin_bytes(file: Path, size: int) -> int:
    """A pickled checkpoint: its size on disk, as if stored in 16 bits (the
    common case; float32 files are then over-counted in bfloat16, never under)."""
    try:
        return file.stat().st_size * size // 2
    except OSError:
        return 0


# GGUF metadata value types -> bytes (8: string, 9: array are read apart).
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _gguf_elements(file: Path) -> int:
    """Weights in a GGUF file (version 2 or 3), counted from its tensor table.
    Read here rather than with ``gguf.GGUFReader``, which maps every tensor
    and field and takes seconds on a 100 MB file."""
    try:
        with open(file, "rb") as f:
            data = f.read(8 + 16)
            magic, version, n_tensors, n_kv = struct.unpack("<4sIQQ", data)
            if magic != b"GGUF" or version < 2:
                raise ValueError(f"not a GGUF v2+ file ({magic!r}, version {version})")
            read = _Reader(f)
            for _ in range(n_kv):
                read.skip_string()
                read.skip_value(read.u32())
            total = 0
            for _ in range(n_tensors):
                read.skip_string()
                dims = [read.u64() for _ in range(read.u32())]
                read.skip(4 + 8)  # type, offset
                total += math.prod(dims)
            return total
    except (OSError, ValueError, struct.error) as exc:
        # A file that cannot be read fails its load with a clear error later.
        log.warning("%s: cannot read its tensor table (%s); guessing from its size", file, exc)
        return file.stat().st_size * 2  # about 4.5 bits a weight in the common quantisations


class _Reader:
    """Little-endian reads from a file, for the GGUF header."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def _read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise ValueError("truncated")
        return data

    def u32(self) -> int:
        return struct.unpack("<I", self._read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self._read(8))[0]

    def skip(self, n: int) -> None:
        self.f.seek(n, os.SEEK_CUR)

    def skip_string(self) -> None:
        self.skip(self.u64())

    def skip_value(self, kind: int) -> None:
        if kind == 8:
            self.skip_string()
        elif kind == 9:
            item, count = self.u32(), self.u64()
            if item in _GGUF_SIZES:
                self.skip(_GGUF_SIZES[item] * count)
            else:
                for _ in range(count):
                    self.skip_value(item)
        elif kind in _GGUF_SIZES:
            self.skip(_GGUF_SIZES[kind])
        else:
            raise ValueError(f"unknown metadata type {kind}")
