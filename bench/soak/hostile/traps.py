"""Traps planted in the disk tier's store, and their audit.

Foreign files and directories, FIFOs and symbolic links to canaries outside the store.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import stat
from pathlib import Path

from bench.soak.hostile.client import wait_or_stop
from bench.soak.hostile.records import HostileRun, Trap
from bench.soak.records import RunState

_HEX = "0123456789abcdef"


def make_canary(hs: HostileRun) -> None:
    """Files outside the store, named like chunk files, that links in it point to."""
    rng = random.Random(17)
    hs.canary.mkdir(parents=True)
    (hs.canary / "canary.txt").write_text("the disk tier must never touch this\n")
    ns = hs.canary / "".join(rng.choice(_HEX) for _ in range(16))
    ns.mkdir()
    for where in (hs.canary, ns):
        for _ in range(2):
            name = "".join(rng.choice(_HEX) for _ in range(64)) + ".kv"
            (where / name).write_bytes(rng.randbytes(256))
    hs.canary_digest = digest_tree(hs.canary)


def digest_tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: its type and, for files, a hash of the bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            mode = path.lstat().st_mode
            value = f"{stat.S_IFMT(mode):o}"
            if stat.S_ISREG(mode):
                value += ":" + hashlib.sha256(path.read_bytes()).hexdigest()
            out[str(path.relative_to(root))] = value
    return out


def _plant(hs: HostileRun, path: Path, kind: str, content: str = "") -> None:
    if kind == "file":
        path.write_text(content)
    elif kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(content)
    hs.traps.append(Trap(str(path), kind, content))


def plant_in(hs: HostileRun, where: Path, namespace: bool) -> None:
    """Foreign things in one directory of the store: files, a directory (holding a
    file named like a chunk outside any namespace), links to the canaries, a FIFO.

    Nothing planted in a namespace directory has a chunk file's name: a regular
    file named so there is the store's to delete (it cannot tell it apart)."""
    rng = random.Random(str(where))
    chunk_name = "".join(rng.choice(_HEX) for _ in range(64)) + ".kv"
    canary_ns = next(p for p in hs.canary.iterdir() if p.is_dir())
    _plant(hs, where / "foreign-notes.txt", "file", f"planted in {where.name}\n")
    sub = where / "foreign-dir"
    _plant(hs, sub, "dir")
    _plant(hs, sub / chunk_name, "file", "not a chunk of any namespace\n")
    _plant(hs, where / "link-to-canary-file", "symlink", str(hs.canary / "canary.txt"))
    _plant(hs, where / "link-to-canary-dir", "symlink", str(hs.canary))
    _plant(hs, where / "foreign-fifo", "fifo")
    if namespace:
        # A link named like a chunk, to a file outside: a read, write or delete
        # that followed it would touch the canary.
        _plant(hs, where / chunk_name, "symlink", str(hs.canary / "canary.txt"))
    else:
        # Named like a namespace, linking to a directory of chunk-named files.
        fake_ns = "".join(rng.choice(_HEX) for _ in range(16))
        _plant(hs, where / fake_ns, "symlink", str(canary_ns))
        _plant(hs, where / chunk_name, "file", "a chunk's name outside any namespace\n")
    hs.trapped.add(str(where))


def plant_traps(hs: HostileRun) -> int:
    """Plant in the store, its ``v1`` and every namespace not yet planted in; how many new."""
    before = len(hs.trapped)
    v1 = hs.store / "v1"
    for where in (hs.store, v1):
        if str(where) not in hs.trapped and where.is_dir():
            plant_in(hs, where, namespace=False)
    if v1.is_dir():
        for entry in sorted(v1.iterdir()):
            planted = any(t.path == str(entry) for t in hs.traps)
            is_ns = re.fullmatch(r"[0-9a-f]{16}", entry.name) and not entry.is_symlink()
            if is_ns and not planted and str(entry) not in hs.trapped:
                with contextlib.suppress(FileNotFoundError):  # removed by a flush meanwhile
                    plant_in(hs, entry, namespace=True)
    return len(hs.trapped) - before


def trap_problems(hs: HostileRun) -> list[str]:
    """Every planted thing that is gone or changed, and any change to the canaries."""
    problems = []
    for trap in hs.traps:
        path = Path(trap.path)
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            problems.append(f"{trap.kind} {trap.path} is gone")
            continue
        kinds = {
            "file": stat.S_ISREG,
            "dir": stat.S_ISDIR,
            "symlink": stat.S_ISLNK,
            "fifo": stat.S_ISFIFO,
        }
        if not kinds[trap.kind](mode):
            problems.append(f"{trap.path} is no longer a {trap.kind}")
        elif trap.kind == "file" and path.read_text() != trap.content:
            problems.append(f"{trap.path} was rewritten")
        elif trap.kind == "symlink" and os.readlink(path) != trap.content:
            problems.append(f"{trap.path} points elsewhere")
    now = digest_tree(hs.canary)
    if now != hs.canary_digest:
        diff = sorted(set(now.items()) ^ set(hs.canary_digest.items()))
        problems.append(f"canaries outside the store changed: {diff[:4]}")
    return problems


async def trap_task(run: RunState) -> None:
    """Plant traps in every namespace directory as it appears (flushes keep coming)."""
    hs: HostileRun = run.hostile
    while True:
        new = plant_traps(hs)
        if new:
            print(f"[soak] {run.now():6.0f}s planted traps in {new} more store directories")
        if await wait_or_stop(run, hs.profile.trap_every_s):
            return
