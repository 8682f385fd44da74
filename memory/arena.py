"""The physical KV arena: one byte buffer that every runner process maps.

On CPU the buffer is a shared-memory file (``/dev/shm`` where it exists),
created by the scheduler's side with mode 0600 and mapped ``MAP_SHARED`` by each
runner, so K/V written by one process are read by another without copying.
The interface is device-neutral: callers get torch tensors and never touch the
file. A CUDA arena (one allocation shared through CUDA IPC) will implement the
same ``ArenaSpec`` / ``KVArena.attach`` / ``view`` contract once a GPU can test it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import tempfile
import uuid
from typing import TYPE_CHECKING

import msgspec

from radixmux.memory.layout import BlockGeometry, slot_major

if TYPE_CHECKING:
    import torch

log = logging.getLogger("radixmux.arena")

# torch is imported where a tensor is made: the processes that only pass an
# ArenaSpec along (front, tokenizer workers, detokenizer) then start without it.

# Block sizes are kept a multiple of this so every dtype view is aligned.
BLOCK_ALIGN = 4096
MADV_POPULATE_WRITE = 23  # Linux 5.14+


class ArenaSpec(msgspec.Struct, frozen=True):
    """What a process needs to map an existing arena (sent to runners)."""

    path: str
    num_blocks: int
    block_bytes: int
    device: str = "cpu"

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def default_arena_dir() -> str:
    """Shared memory where the OS has it, else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


ARENA_PREFIX = "radixmux-kv-"


class KVArena:
    """A mapped arena. Create it once (``create``), attach from other processes."""

    def __init__(self, spec: ArenaSpec, owner: bool) -> None:
        if spec.device != "cpu":
            raise NotImplementedError(
                f"arena device {spec.device!r}: only 'cpu' (shared-memory file) is implemented"
            )
        self.spec = spec
        self.owner = owner

    @functools.cached_property
    def bytes(self) -> torch.Tensor:
        """The arena as ``[num_blocks, block_bytes]`` bytes, mapped on first use:
        the launcher creates and removes the file without mapping it, so it
        never imports torch (140 MB of a process's memory)."""
        import torch

        spec = self.spec
        flat = torch.from_file(spec.path, shared=True, size=spec.total_bytes, dtype=torch.uint8)
        return flat.view(spec.num_blocks, spec.block_bytes)

    @classmethod
    def create(
        cls,
        num_blocks: int,
        block_bytes: int,
        directory: str | None = None,
        name: str | None = None,
    ) -> KVArena:
        """Create a zero-filled arena file of ``num_blocks * block_bytes`` bytes,
        named ``name`` (default: ``ARENA_PREFIX`` and a random part; the
        launcher names it after its owner, so a dead one's can be removed:
        ``common/owner.py``)."""
        if num_blocks <= 0:
            raise ValueError("an arena needs at least one block")
        if block_bytes <= 0 or block_bytes % BLOCK_ALIGN:
            raise ValueError(f"block_bytes must be a positive multiple of {BLOCK_ALIGN}")
        directory = directory or default_arena_dir()
        path = os.path.join(directory, name or f"{ARENA_PREFIX}{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, num_blocks * block_bytes)
        finally:
            os.close(fd)
        return cls(ArenaSpec(path, num_blocks, block_bytes), owner=True)

    @classmethod
    def attach(cls, spec: ArenaSpec) -> KVArena:
        """Map an arena another process created."""
        if not os.path.exists(spec.path):
            raise FileNotFoundError(f"KV arena {spec.path} does not exist (was it destroyed?)")
        return cls(spec, owner=False)

    def populate(self) -> bool:
        """Map every page of the arena into this process now, writable.

        A mapped file's pages are faulted in one at a time on first touch: a
        runner writing K/V to fresh slots paid a fault per page per (layer,
        K|V) row group, which measured 45 us per write call at a batch of 16
        (3 us once touched) and ~7% of such a decode step. Populating costs
        0.34 s per GiB for the first process (the pages are allocated) and
        0.09 s for later ones, and commits the arena's memory at start, as
        peers that allocate their KV cache up front do. False where the kernel
        cannot (before Linux 5.14): pages then fault in as they are used.
        """
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        addr = self.bytes.data_ptr()
        return libc.madvise(addr, self.spec.total_bytes, MADV_POPULATE_WRITE) == 0

    def view(self, geometry: BlockGeometry) -> torch.Tensor:
        """This arena seen with one model's layout.

        Shape ``[num_blocks, num_layers, 2, slots_per_block, num_kv_heads,
        head_dim]``: a strided view into the shared bytes (writes land in the
        arena) of blocks stored head-major (``layout.py``), so a slot's heads
        are ``slots_per_block * head_dim`` values apart. Blocks the model does
        not own are visible too: the scheduler, not the view, decides which
        slots a model may touch.
        """
        import torch

        geometry.check()
        if geometry.block_bytes != self.spec.block_bytes:
            raise ValueError("geometry block size differs from the arena's")
        lay = geometry.layout
        used = geometry.slots_per_block * lay.bytes_per_token
        typed = self.bytes[:, :used].view(getattr(torch, lay.dtype))
        return slot_major(typed.view(self.spec.num_blocks, *geometry.block_shape))

    def destroy(self) -> None:
        """Remove the backing file (owner only); live mappings stay valid until dropped."""
        if self.owner and os.path.exists(self.spec.path):
            os.unlink(self.spec.path)

    def __enter__(self) -> KVArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()
