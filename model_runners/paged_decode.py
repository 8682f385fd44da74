"""The C++ paged decode kernel: built once per machine, loaded into torch.ops.

``kernels/paged_decode.cpp`` attends one query token per sequence over K/V
rows read in place from the arena (no per-step gather); its cascade entry
reads a prefix that several sequences share once for all of them
(:func:`paged_decode_cascade`), and :func:`paged_extend` attends prefill
chunks causally over their cached prefix, also in place. It is compiled with
the machine's compiler on first use (10-30 s here, logged) into
``$RADIXMUX_CACHE/kernels`` (default ``~/.cache/radixmux/kernels``), keyed by
the source, torch's version and this CPU's instruction set, so later starts
load it in milliseconds; processes starting together on a fresh cache take
turns on a lock file there, so one compiles and the others load its library.
Where it cannot be built (no compiler, no headers) :func:`load` says why once
and the runner falls back to gather + SDPA, which gives the same results.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from radixmux.common import file_lock

log = logging.getLogger("radixmux.kernels")

# One library: the attention kernels, the fused element-wise layers (fused_ops.py),
# the small-batch AMX linear layers and float32 layers over bfloat16 weights
# (packed_linear.py), the arena's K/V row
# writes (kv_store.py) and greedy sampling's argmax (sampling.py).
SOURCES = tuple(
    Path(__file__).parent / "kernels" / f
    for f in (
        "paged_decode.cpp",
        "fused_ops.cpp",
        "amx_linear.cpp",
        "widen_linear.cpp",
        "kv_write.cpp",
        "argmax.cpp",
    )
)
# Every header under kernels/ is part of the build key: a header added later
# cannot be left out of it.
HEADERS = tuple(sorted((Path(__file__).parent / "kernels").rglob("*.h")))
# Fast math lets gcc vectorise exp/tanh through glibc's vector math library;
# the kernel never relies on inf/nan (its running max starts at -FLT_MAX).
CFLAGS = ["-O3", "-ffast-math", "-fopenmp"]
# The instruction set the kernels are built for: this CPU's own by default.
# RADIXMUX_KERNEL_ARCH names another gcc -march (x86-64-v3: AVX2 + FMA + F16C,
# x86-64-v4: AVX-512 without BF16 or AMX), so one machine can build, test and
# measure the paths an older CPU takes; every ISA choice downstream (AMX
# tiles, bf16 dot products, vector widths) follows the library's build.
ARCH_ENV = "RADIXMUX_KERNEL_ARCH"
_ARCH_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def target_arch() -> str:
    """The ``-march`` the kernels are built for (``native`` unless overridden)."""
    arch = os.environ.get(ARCH_ENV, "") or "native"
    if not _ARCH_NAME.fullmatch(arch):
        raise ValueError(f"{ARCH_ENV}={arch!r} is not a gcc -march name")
    return arch


def cflags() -> list[str]:
    """The compiler flags of this build (``CFLAGS`` and the target arch)."""
    return [*CFLAGS, f"-march={target_arch()}"]


_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    """Where this source, torch and CPU's build lives."""
    key = hashlib.sha256()
    for part in (
        *(s.read_bytes() for s in SOURCES + HEADERS),
        torch.__version__.encode(),
        _cpu_flags().encode(),
    ):
        key.update(part)
    key.update(" ".join(cflags()).encode())
    root = os.environ.get("RADIXMUX_CACHE") or Path.home() / ".cache" / "radixmux"
    return Path(root) / "kernels" / f"paged_decode-{key.hexdigest()[:16]}"


NAME = "radixmux_paged_decode"

DETERMINISTIC = """With ``deterministic=True`` the kernel gives a query row the same bits
whatever shares its call: every row, decode or prefill, takes the one tiled
path over key tiles aligned to absolute context positions, and decodes are
not cut into pieces (merging partial softmaxes is another rounding). A group
of decodes sharing a prefix still reads it once: the prefix's softmax state,
cut at a tile boundary, is computed for all members together, and each
member's own keys go on from it, as one pass would (where the AMX path takes
the rows, which cannot resume a state, groups are ignored). A token's
attention is then identical computed alone, in any batch, in any chunk, over
a cached or a fresh prefix. It needs :func:`has_tiled_path` for the head size."""


def _build(target: Path, library: Path) -> None:
    """Compile into a private directory, then move the library into place.

    The caller holds the build lock (:func:`load`); the private directory and
    the rename still keep a reader that does not take it (an older version)
    from ever loading half a library, and one killed mid-build leaves only its
    own scratch directory (its lock goes with it).
    """
    from torch.utils import cpp_extension

    target.mkdir(parents=True, exist_ok=True)
    log.info(
        "compiling the paged decode kernel for -march=%s into %s (once per machine)",
        target_arch(),
        target,
    )
    t0 = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="build-", dir=target))
    try:
        cpp_extension.load(
            name=NAME,
            sources=[str(s) for s in SOURCES],
            build_directory=str(scratch),
            extra_cflags=cflags(),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        os.replace(scratch / f"{NAME}.so", library)  # atomic: readers see all or nothing
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log.info("paged decode kernel built in %.1f s", time.perf_counter() - t0)


def _log_waiting() -> None:
    log.info("waiting for another process compiling the paged decode kernel")


def load() -> bool:
    """Build (first time) and load the kernel; False, with the reason logged, if impossible."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        try:
            target = build_dir()
            library = target / f"{NAME}.so"
            built = False
            if not library.exists():
                # Runners (or test workers) starting together on a fresh cache:
                # one compiles, the others wait for its library instead of
                # each spending the 10-30 s of CPU on the same build.
                with file_lock.held(target / ".build.lock", on_wait=_log_waiting):
                    if not library.exists():
                        _build(target, library)  # compiling also loads it
                        built = True
            if not built:
                torch.ops.load_library(str(library))
            _state["ok"] = True
            log.info("kernels loaded: -march=%s, %s paths", target_arch(), built_isa())
        except Exception as exc:  # any build failure means: use the torch path
            log.warning("paged decode kernel unavailable (%s); using gather + SDPA", exc)
            _state["ok"] = False
            _state["error"] = str(exc)
        return bool(_state["ok"])


def loaded() -> bool:
    """Whether :func:`load` has loaded the kernels (this never builds them)."""
    return bool(_state.get("ok"))


def error() -> str:
    """Why the last :func:`load` failed ('' if it did not)."""
    return str(_state.get("error", ""))


def paged_decode(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    addr: torch.Tensor,
    offsets: torch.Tensor,
    scale: float,
    softcap: float | None,
    window: int | None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Attention of ``q [B, H, D]`` over each sequence's rows ``addr[offsets[b]:offsets[b+1]]``.

    ``k_rows``/``v_rows`` are one layer's ``[N, kv_heads, head_dim]`` tables
    of the arena (``KVStore.rows``; ``[N, kv_heads * head_dim]`` rows too);
    the result is ``[B, H, D]`` in ``q``'s dtype.
    ``deterministic``: the batch-invariant arithmetic (:data:`DETERMINISTIC`).
    """
    return torch.ops.radixmux.paged_decode(
        q,
        k_rows,
        v_rows,
        addr,
        offsets,
        float(scale),
        float(softcap or 0.0),
        int(window or 0),
        bool(deterministic),
    )


def paged_decode_cascade(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    addr: torch.Tensor,
    offsets: torch.Tensor,
    group_of: torch.Tensor,
    group_prefix: torch.Tensor,
    scale: float,
    softcap: float | None,
    window: int | None,
    deterministic: bool = False,
) -> torch.Tensor:
    """:func:`paged_decode` that reads each group's shared prefix once for all its members.

    ``group_of [B]`` int64: the group of each sequence, ``-1`` for none.
    ``group_prefix [G]`` int64: how many leading context rows the members of
    group ``g`` share. For every member ``b`` of ``g`` the rows
    ``addr[offsets[b] : offsets[b] + group_prefix[g]]`` must be the same
    (the kernel reads them through the first member's entries; that is the
    caller's promise, which the radix tree keeps: sequences sharing a cached
    prefix hold the same slots for it), and ``group_prefix[g]`` may not exceed
    any member's context length. The result equals :func:`paged_decode`'s up
    to float rounding, windows and soft-capping included; with
    ``deterministic``, bit for bit (:data:`DETERMINISTIC`).
    """
    return torch.ops.radixmux.paged_decode_cascade(
        q,
        k_rows,
        v_rows,
        addr,
        offsets,
        group_of,
        group_prefix,
        float(scale),
        float(softcap or 0.0),
        int(window or 0),
        bool(deterministic),
    )


@functools.cache
def has_tiled_path(head_dim: int) -> bool:
    """Whether ``head_dim``-wide heads get the kernel's vector tiles (AVX-512 or
    AVX2 + FMA, common sizes).

    :func:`paged_extend` beats torch's SDPA only there (2-8x on AVX-512 hosts,
    1.1-2.3x on an AVX2 one); its per-key scalar loops for other sizes are
    slower than SDPA.
    """
    return bool(torch.ops.radixmux.has_tiled_path(head_dim))


def built_isa() -> str:
    """The widest vector paths the loaded library was built with: ``amx``,
    ``avx512bf16``, ``avx512f``, ``avx2`` or ``scalar`` (its ``-march``
    decides, see :func:`target_arch`; '' when the library is not loaded)."""
    return str(torch.ops.radixmux.built_isa()) if loaded() else ""


def paged_extend(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    addr: torch.Tensor,
    offsets: torch.Tensor,
    q_offsets: torch.Tensor,
    scale: float,
    softcap: float | None,
    window: int | None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Causal attention of several prefill chunks ("extends"), K/V read in place.

    ``q [T, H, D]`` holds every extend's new tokens, sequence ``e``'s at rows
    ``q_offsets[e] : q_offsets[e + 1]`` (int64 ``[E + 1]``, 0 to ``T``). Its
    context (cached prefix, then the new tokens, whose K/V must already be in
    the arena) is ``addr[offsets[e] : offsets[e + 1]]`` (int64 ``[E + 1]``);
    positions are consecutive, so new token ``i`` sees the keys up to its own
    and, with a ``window``, only the last ``window`` of them. Only key tiles
    some query sees are computed. Returns ``[T, H, D]`` in ``q``'s dtype.
    ``deterministic``: the batch-invariant arithmetic (:data:`DETERMINISTIC`).
    """
    return torch.ops.radixmux.paged_extend(
        q,
        k_rows,
        v_rows,
        addr,
        offsets,
        q_offsets,
        float(scale),
        float(softcap or 0.0),
        int(window or 0),
        bool(deterministic),
    )
