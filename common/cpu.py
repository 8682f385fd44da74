"""What this CPU can do natively (for choices made at start-up, e.g. ``--dtype auto``)
and the cores this process may use."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

# CPU flags (as /proc/cpuinfo names them) that do bfloat16 matmuls in hardware.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this machine's CPU (empty where unknown)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset(platform.processor().split())


def resolve_dtype(dtype: str) -> tuple[str, str]:
    """``(dtype, why)``: ``auto`` becomes bfloat16 where the CPU has native
    bfloat16 (half the bytes per weight and KV row, about twice the speed),
    float32 elsewhere (emulated bfloat16 is slower than float32)."""
    if dtype != "auto":
        return dtype, "as asked"
    native = [f for f in BF16_FLAGS if f in cpu_flags()]
    if native:
        return "bfloat16", f"auto: the CPU has {'/'.join(native)}"
    return "float32", "auto: the CPU has no native bfloat16 (AVX512-BF16 or AMX)"


def cpu_cores() -> int:
    """Cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1
