"""One pool's page bitmap and its two bulk operations: release pages, take pages.

The allocator (``allocator.py``) decides which blocks give or get pages; a
``PageRows`` does the per-page work: it clears or sets the pages in the
pool's bitmap (``used``: one bool per page, a row of ``pages_per_block`` per
arena block) and keeps the arena's per-block used counts in step.

Two versions with the same results: ``page_bitmap.c`` through ctypes, one
pass over the pages, built once per machine into
``$RADIXMUX_CACHE/native`` (default ``~/.cache/radixmux/native``) with the
system C compiler; and numpy, where there is no compiler. On the eviction
trace of ``bench/bench_radix.py --peer mini-sglang`` the numpy release was
most of an eviction's time: about fifteen array calls, each a few
microseconds of dispatch on a few hundred pages.
``RADIXMUX_NATIVE_BITMAP=0`` keeps the numpy version.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("page_bitmap.c")
CFLAGS = ("-O2", "-shared", "-fPIC")
NATIVE_ENV = "RADIXMUX_NATIVE_BITMAP"

# rm_release's errors (page_bitmap.c), as the allocator reports them.
OUT_OF_RANGE, NOT_IN_USE, DUPLICATE = -1, -2, -3


class ReleaseError(ValueError):
    """A release that changed nothing: ``code`` says why (``OUT_OF_RANGE``,
    ``NOT_IN_USE`` or ``DUPLICATE``)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class PageRows:
    """A pool's page bitmap, with release and take done in numpy.

    ``block_used`` is the arena's count of used pages per block, shared by
    every pool's ``PageRows`` (a block belongs to one pool at a time).
    """

    def __init__(self, num_blocks: int, pages_per_block: int, block_used: np.ndarray) -> None:
        self.num_blocks = num_blocks
        self.ppb = pages_per_block
        self.used = np.zeros(num_blocks * pages_per_block, dtype=bool)
        self.block_used = block_used

    def release(self, pages: np.ndarray) -> list[int]:
        """Clear ``pages`` (int64) and take them off their blocks' counts.

        Returns ``[block, freed there, still used there, ...]`` for each
        block touched, ascending. Raises ``ReleaseError`` with nothing
        changed if a page is out of range, not in use, or listed twice.
        """
        # Pages come back as the runs ``take`` handed out: the stable sort
        # (a merge of runs) is several times faster on them than quicksort.
        pages = np.sort(pages, kind="stable")
        if pages[0] < 0 or pages[-1] >= self.used.size:
            raise ReleaseError(OUT_OF_RANGE)
        if np.count_nonzero(self.used[pages]) != pages.size:  # cheaper than .all()
            raise ReleaseError(NOT_IN_USE)
        if pages.size > 1 and np.count_nonzero(pages[1:] == pages[:-1]):
            raise ReleaseError(DUPLICATE)
        self.used[pages] = False
        ppb = self.ppb
        first, last = int(pages[0]) // ppb, int(pages[-1]) // ppb
        if first == last:  # one block (sorted): a scalar update
            self.block_used[first] -= pages.size
            return [first, pages.size, int(self.block_used[first])]
        # Pages per block as one bincount over every block: the counts drop
        # in one vector op, not a numpy op per block.
        per_block = np.bincount(pages // ppb, minlength=self.num_blocks)
        self.block_used -= per_block
        touched = np.flatnonzero(per_block)
        return np.stack([touched, per_block[touched], self.block_used[touched]], 1).ravel().tolist()

    def take(self, plan: list[int], need: int) -> np.ndarray:
        """Take ``need`` pages: ``plan`` is ``[block, pages to take there, ...]``,
        each block's lowest free pages first, and every block but the last
        gives all its free pages (as the allocator plans). Returns the page
        ids (int64) in plan order, ascending within a block."""
        rows = self.used.reshape(self.num_blocks, self.ppb)
        ppb = self.ppb
        if len(plan) == 2:
            block = plan[0]
            pages = np.flatnonzero(~rows[block])[:need] + block * ppb
            self.block_used[block] += need
        else:
            # Every block but the last gives all its free pages, so the first
            # ``need`` free pages of the blocks' rows, in row order, are the
            # ones to take: one gather and one scan for all of them.
            where = np.array(plan[0::2], dtype=np.int64)
            found = np.flatnonzero(~rows[where])[:need]
            pages = where[found // ppb] * ppb + found % ppb
            self.block_used[where] += np.array(plan[1::2], dtype=np.int64)
        if pages.size != need:
            raise RuntimeError("page bitmap has fewer free pages than its counts say")
        self.used[pages] = True
        return pages


class NativePageRows(PageRows):
    """``PageRows`` with release and take in ``page_bitmap.c`` (one pass each)."""

    def __init__(
        self,
        num_blocks: int,
        pages_per_block: int,
        block_used: np.ndarray,
        lib: ctypes.CDLL,
    ) -> None:
        super().__init__(num_blocks, pages_per_block, block_used)
        self._release = lib.rm_release
        self._take = lib.rm_take
        # Buffers the C side writes or reads, one set per pool, their
        # addresses in one struct (``_RowsStruct``): a call passes the
        # struct's address and a count (ctypes costs ~0.07 us an argument,
        # ``.ctypes.data`` a microsecond); pages go in and out through
        # ``_pages`` (a copy costs a fraction of that).
        self._scratch = np.zeros(num_blocks, dtype=np.int64)
        self._out = np.zeros(3 * num_blocks, dtype=np.int64)
        self._plan = np.zeros(2 * num_blocks, dtype=np.int64)
        self._pages = np.zeros(0, dtype=np.int64)  # grows as needed
        self._struct = _RowsStruct(
            used=self.used.ctypes.data,
            npages=self.used.size,
            block_used=block_used.ctypes.data,
            scratch=self._scratch.ctypes.data,
            ppb=pages_per_block,
            out=self._out.ctypes.data,
            plan=self._plan.ctypes.data,
        )
        self._struct_at = ctypes.addressof(self._struct)
        self._room_for(1024)

    def _room_for(self, n: int) -> None:
        if n > self._pages.size:
            self._pages = np.zeros(max(n, 2 * self._pages.size), dtype=np.int64)
            self._struct.pages = self._pages.ctypes.data

    def release(self, pages: np.ndarray) -> list[int]:
        n = pages.size
        self._room_for(n)
        self._pages[:n] = pages
        touched = self._release(self._struct_at, n)
        if touched < 0:
            raise ReleaseError(touched)
        return self._out[: 3 * touched].tolist()

    def take(self, plan: list[int], need: int) -> np.ndarray:
        self._plan[: len(plan)] = plan
        self._room_for(need)
        if self._take(self._struct_at, len(plan) // 2) != need:
            raise RuntimeError("page bitmap has fewer free pages than its counts say")
        return self._pages[:need].copy()


class _RowsStruct(ctypes.Structure):
    """``rm_rows`` of ``page_bitmap.c``: one pool's arrays, by address."""

    _fields_ = [
        ("used", ctypes.c_void_p),
        ("npages", ctypes.c_int64),
        ("block_used", ctypes.c_void_p),
        ("scratch", ctypes.c_void_p),
        ("ppb", ctypes.c_int64),
        ("pages", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("plan", ctypes.c_void_p),
    ]


def make_rows(
    num_blocks: int, pages_per_block: int, block_used: np.ndarray, native: bool | None = None
) -> PageRows:
    """A pool's ``PageRows``: native where the library loads (``native=None``:
    unless ``RADIXMUX_NATIVE_BITMAP=0``), numpy otherwise or with ``native=False``."""
    if native is None:
        native = os.environ.get(NATIVE_ENV, "1") != "0"
    lib = load() if native else None
    if lib is None:
        return PageRows(num_blocks, pages_per_block, block_used)
    return NativePageRows(num_blocks, pages_per_block, block_used, lib)


# ---- the library -------------------------------------------------------------

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def compiler() -> str:
    """The C compiler that builds the library (``$CC``, else ``cc``)."""
    return os.environ.get("CC") or "cc"


def library_path() -> Path:
    """Where this source and these flags' build lives (the key changes with either)."""
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(" ".join((compiler(), *CFLAGS)).encode())
    root = os.environ.get("RADIXMUX_CACHE") or Path.home() / ".cache" / "radixmux"
    return Path(root) / "native" / f"page_bitmap-{key.hexdigest()[:16]}.so"


def _build(library: Path) -> None:
    """Compile into a private file, then rename it into place (readers see all or nothing)."""
    fd, scratch = tempfile.mkstemp(prefix="build-", suffix=".so", dir=library.parent)
    os.close(fd)
    try:
        cmd = [compiler(), *CFLAGS, "-o", scratch, str(SOURCE)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(scratch, library)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    log.info("page bitmap library built: %s", library)


def load() -> ctypes.CDLL | None:
    """The built library (built on first use), or None, with the reason logged once."""
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]
        lib = None
        try:
            library = library_path()
            if not library.exists():
                # No lock between processes that start together: each builds
                # into its own file (a fraction of a second) and renames it
                # into place, so a reader only ever sees a whole library.
                library.parent.mkdir(parents=True, exist_ok=True)
                _build(library)
            lib = ctypes.CDLL(str(library))
            for fn in (lib.rm_release, lib.rm_take):
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int64]
                fn.restype = ctypes.c_int64
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            log.warning("page bitmap library unavailable (%s); the allocator uses numpy", exc)
            lib = None
        _loaded["lib"] = lib
        return lib
