"""The disk store owns only what it made, over a real server and real HTTP.

``--kv-disk-dir`` pointed at a directory that holds anything else must lose
none of it: a start on a non-empty directory the store did not make is
refused with a clear error, and ``/flush_cache`` deletes the store's chunk
files only, never a file, directory or link it did not make, nor anything a
link points at. (The store's own rules, link by link, are unit-tested in
``test_kv_disk_store.py``.)
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import httpx
import pytest
from test_disk_tier import PROMPTS, ask, scheduler, serve

from bench.tiny_models import make_tiny_model_dir
from radixmux.runtime.launcher import LaunchError

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("safety_model") / "a", seed=11)


def tree(root: Path) -> dict[str, object]:
    """Every entry under ``root``, no link followed: a link's target, a file's
    bytes or ``"dir"``."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            mode = path.lstat().st_mode
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(mode):
                out[rel] = ("link", os.readlink(path))
            else:
                out[rel] = "dir" if stat.S_ISDIR(mode) else path.read_bytes()
    return out


def test_flush_deletes_the_chunk_files_and_nothing_else(model, tmp_path) -> None:
    disk, outside = tmp_path / "kv", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_bytes(b"not yours")
    flags = {"kv_disk_write_policy": "write_through", "page_size": 16}
    with serve(model, disk, **flags) as url:
        ask(url, PROMPTS[0])
        assert scheduler(url)["disk"]["store_chunks"] >= 4  # saved as soon as cached
        (ns,) = [p for p in (disk / "v1").iterdir() if p.is_dir()]
        chunks = sorted(ns.glob("*.kv"))
        assert len(chunks) >= 4
        # Planted while the server runs: beside the store, beside the
        # namespaces, inside the namespace, and links out of it.
        (disk / "notes.txt").write_bytes(b"mine")
        (disk / "v1" / "photos").mkdir()
        (disk / "v1" / "photos" / "a.jpg").write_bytes(b"\xff\xd8")
        (disk / "v1" / "fedcba9876543210").symlink_to(outside)  # a namespace's name
        (outside / chunks[0].name).write_bytes(b"named like a chunk, not one")
        (ns / "keep.txt").write_bytes(b"keep")
        (ns / ("ab" * 32 + ".kv")).symlink_to(outside / "precious.txt")
        names = ["notes.txt", "v1/photos", "v1/photos/a.jpg", "v1/fedcba9876543210"]
        names += [f"v1/{ns.name}/keep.txt", f"v1/{ns.name}/{'ab' * 32}.kv"]
        planted = {k: v for k, v in tree(disk).items() if k in names}
        assert len(planted) == len(names)
        beyond = tree(outside)
        r = httpx.post(f"{url}/flush_cache", timeout=30)
        assert r.status_code == 200, r.text
        assert scheduler(url)["disk"]["store_chunks"] == 0
    # The server is down: its I/O thread ran the flush to the end.
    after = tree(disk)
    assert not [k for k, v in after.items() if k.endswith(".kv") and isinstance(v, bytes)]
    assert {k: v for k, v in after.items() if k in planted} == planted, "a planted entry went"
    assert tree(outside) == beyond


def test_a_non_empty_directory_the_store_did_not_make_is_refused(model, tmp_path) -> None:
    home = tmp_path / "home"
    (home / "projects").mkdir(parents=True)
    (home / "projects" / "thesis.tex").write_bytes(b"\\documentclass{article}")
    (home / "v1").mkdir()  # even one that looks like the store's
    before = tree(home)
    with pytest.raises(LaunchError) as caught, serve(model, home):
        pass
    message = str(caught.value)
    assert f"--kv-disk-dir {home} is not empty" in message, message
    assert "not a radixmux KV store" in message
    assert "point --kv-disk-dir at an empty or new directory" in message
    assert tree(home) == before, "the refused directory was changed"

    empty = tmp_path / "empty"
    empty.mkdir()
    with serve(model, empty) as url:  # an empty one is taken, and marked as the store's
        ask(url, PROMPTS[1])
    assert (empty / "radixmux-kv-store").is_file()
