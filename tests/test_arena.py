"""The physical KV arena: a shared-memory file several processes map."""

import multiprocessing as mp
import os
import stat

import pytest
import torch

from radixmux.common.owner import Owner, remove_stale_arenas
from radixmux.memory.arena import ArenaSpec, KVArena
from radixmux.memory.layout import BlockGeometry, KVLayout

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32")
GEO = BlockGeometry(LAYOUT, block_bytes=4096, page_size=1)


def _write_slot(spec: ArenaSpec, block: int, layer: int, offset: int, value: float) -> None:
    view = KVArena.attach(spec).view(GEO)
    view[block, layer, 0, offset] = value
    view[block, layer, 1, offset] = -value


def test_second_process_writes_slot_first_reads_same_bytes() -> None:
    with KVArena.create(num_blocks=4, block_bytes=4096) as arena:
        ctx = mp.get_context("spawn")
        proc = ctx.Process(target=_write_slot, args=(arena.spec, 2, 1, 5, 3.25))
        proc.start()
        proc.join(timeout=60)
        assert proc.exitcode == 0
        view = arena.view(GEO)
        assert torch.all(view[2, 1, 0, 5] == 3.25)
        assert torch.all(view[2, 1, 1, 5] == -3.25)
        # Nothing else was touched.
        assert view.abs().sum().item() == pytest.approx(2 * 3.25 * 2 * 8)


def test_arena_file_is_private_and_removed() -> None:
    arena = KVArena.create(num_blocks=1, block_bytes=4096)
    mode = stat.S_IMODE(os.stat(arena.spec.path).st_mode)
    assert mode == 0o600
    arena.destroy()
    assert not os.path.exists(arena.spec.path)
    with pytest.raises(FileNotFoundError):
        KVArena.attach(arena.spec)


def test_view_layout_matches_geometry() -> None:
    with KVArena.create(num_blocks=2, block_bytes=8192) as arena:
        geo = BlockGeometry(LAYOUT, 8192, 1)
        view = arena.view(geo)
        assert view.shape == (2, 3, 2, geo.slots_per_block, 2, 8)
        assert geo.slots_per_block == 8192 // LAYOUT.bytes_per_token
        # Gather/scatter of (block, offset) pairs writes into the shared bytes.
        blk, off = torch.tensor([0, 1]), torch.tensor([3, 4])
        view[:, 2, 1][blk, off] = torch.ones(2, 2, 8)
        assert arena.bytes.view(torch.float32).sum().item() == 32


def test_bad_block_size_rejected() -> None:
    with pytest.raises(ValueError, match="multiple"):
        KVArena.create(num_blocks=1, block_bytes=1000)
    with pytest.raises(ValueError, match="cannot hold one page"):
        BlockGeometry(KVLayout(30, 3, 64), 4096, 16).check()


def test_stale_arena_of_a_dead_process_is_removed(tmp_path) -> None:
    """An arena whose owner provably died (this pid, another start time) goes;
    a live owner's, an old-format name and a foreign file stay."""
    me = Owner.this_process()
    dead = tmp_path / f"radixmux-kv-{Owner(me.pid, me.start + 1, me.host).token}-deadbeef"
    live = tmp_path / f"radixmux-kv-{me.token}-cafecafe"
    old_format = tmp_path / "radixmux-kv-999999999-deadbeef"  # owner unprovable: kept
    foreign = tmp_path / "notes.txt"
    for path in (dead, live, old_format, foreign):
        path.write_bytes(b"x")
    assert remove_stale_arenas(str(tmp_path)) == [dead.name]
    assert not dead.exists()
    assert live.exists() and old_format.exists() and foreign.exists()


def test_populate_maps_every_page_and_keeps_contents() -> None:
    """After ``populate`` the attaching process has the arena resident (no page
    faults on later writes) and still sees the owner's bytes."""
    import resource

    with KVArena.create(8, 1 << 20) as owner:
        owner.bytes[3, 5] = 7
        other = KVArena.attach(owner.spec)
        if not other.populate():
            pytest.skip("this kernel has no MADV_POPULATE_WRITE")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        other.bytes.fill_(1)  # every page written: none may fault any more
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < 16, faults  # 2,048 pages; a few for the interpreter itself
        assert int(owner.bytes[3, 5]) == 1 and int(owner.bytes[7, -1]) == 1
