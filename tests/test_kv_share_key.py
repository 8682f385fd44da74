"""The KV-share key: the same KV only (same weights *and* the same K/V-relevant config).

Unit checks on model folders (a copy, an alias, a config-only edit) and on the
architecture families' own K/V settings, then the end-to-end case of the hostile soak:
a reload after a config-only change must not reuse the cached KV (memory or
disk) and must answer as a fresh server on the new config does.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import tiny_model
from test_model_lifecycle import greedy, text

from bench.tiny_models import make_tiny_model_dir
from radixmux.model_runners.fingerprint import weights_fingerprint
from radixmux.model_runners.loader import load_model
from radixmux.runtime.client.engine import Engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("kvkey") / "tiny", seed=4)


def edit_config(folder: Path, change: Callable[[dict], None]) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def scale_rope_theta(cfg: dict, factor: float = 0.1) -> None:
    """Rope theta times ``factor``, wherever this config keeps it."""
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        rope["rope_theta"] *= factor
    else:
        cfg["rope_theta"] = cfg.get("rope_theta", 10000.0) * factor


def copy_with(src: Path, dst: Path, change: Callable[[dict], None] | None = None) -> Path:
    shutil.copytree(src, dst)
    if change is not None:
        edit_config(dst, change)
    return dst


def key_of(folder: Path, name: str | None = None) -> str:
    loaded = load_model(str(folder), name=name, pack_weights=False, fuse_ops=False)
    return loaded.info.kv_share_key


@pytest.mark.timeout(300)
def test_config_only_changes_that_touch_kv_change_the_key(tiny: Path, tmp_path: Path) -> None:
    base = key_of(tiny)
    same = {
        "same folder again": key_of(tiny),
        "an alias": key_of(tiny, name="alias"),
        "an identical copy": key_of(copy_with(tiny, tmp_path / "copy")),
        # What wrote the config and where it lives change no K/V byte.
        "harmless fields": key_of(
            copy_with(
                tiny,
                tmp_path / "harmless",
                lambda c: c.update(
                    transformers_version="4.0.0",
                    _name_or_path="/somewhere/else",
                    use_cache=False,
                    eos_token_id=[2, 3],
                    pad_token_id=0,
                ),
            )
        ),
        # 10000 and 10000.0 mean the same theta.
        "theta spelt as an int": key_of(
            copy_with(tiny, tmp_path / "int", lambda c: scale_rope_theta(c, 1))
        ),
    }
    assert all(k == base for k in same.values()), same

    changed = {
        "rope theta / 10": copy_with(tiny, tmp_path / "theta", scale_rope_theta),
        "rms norm epsilon": copy_with(tiny, tmp_path / "eps", lambda c: c.update(rms_norm_eps=0.1)),
        # A field nobody listed counts by default (the deny-list design).
        "an unknown field": copy_with(tiny, tmp_path / "new", lambda c: c.update(kv_knob=2)),
    }
    keys = {what: key_of(folder) for what, folder in changed.items()}
    assert all(k != base for k in keys.values()), keys
    assert len(set(keys.values())) == len(keys)
    # Only the config differs: the weights fingerprint alone would have matched.
    weights = load_model(str(changed["rope theta / 10"]), pack_weights=False, fuse_ops=False)
    assert weights_fingerprint(weights.model) == weights_fingerprint(
        load_model(str(tiny), pack_weights=False, fuse_ops=False).model
    )


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [
        ("gemma2", "attn_logit_softcapping", 10.0),
        ("gemma2", "query_pre_attn_scalar", 32),
        ("gemma2", "sliding_window", 64),
        ("gemma2", "rms_norm_eps", 1e-3),
        ("gemma3", "layer_types", ["sliding_attention", "full_attention", "full_attention"]),
        ("qwen2", "use_sliding_window", True),
        ("llama", "attention_bias", False),  # the default: the same key (control)
    ],
)
def test_each_family_kv_setting_is_in_the_key(kind: str, field: str, value: object) -> None:
    base = tiny_model(kind, seed=1).info.kv_share_key
    other = tiny_model(kind, seed=1, **{field: value}).info.kv_share_key
    assert (other == base) == (field == "attention_bias"), (kind, field)


def namespaces(disk: Path) -> set[str]:
    """The disk store's namespace directories (``v<N>/<16 hex>``)."""
    return {
        p.name
        for p in disk.glob("v*/*")
        if p.is_dir() and re.fullmatch(r"[0-9a-f]{16}", p.name)
    }


def wait_for(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def card(url: str, model: str) -> dict:
    data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return next(m for m in data if m["id"] == model)


def cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


# Long enough for whole disk-tier chunks (16 tokens each).
PROMPT = " ".join(["The quick brown fox jumps over the lazy dog because"] * 4)
SMALL = dict(kv_cache_bytes=16 << 20, kv_block_bytes=64 << 10, dtype="float32", runner_threads=1)


@pytest.mark.timeout(600)
def test_reload_after_a_config_only_change_does_not_reuse_kv(tiny: Path, tmp_path: Path) -> None:
    folder = copy_with(tiny, tmp_path / "model")
    disk = tmp_path / "disk"
    disk_flags = dict(kv_disk_dir=str(disk), kv_disk_chunk_tokens=16)
    eng = Engine(
        model=[f"{folder},name=m"],
        kv_disk_bytes=64 << 20,
        kv_disk_write_policy="write_through",
        **disk_flags,
        **SMALL,
    )
    url = f"http://127.0.0.1:{eng.args.port}"
    try:
        old_key = card(url, "m")["kv_share_key"]
        old = text(greedy(url, "m", PROMPT))
        again = greedy(url, "m", PROMPT)
        assert text(again) == old and cached(again) > 0  # the prompt is cached: a reuse shows
        wait_for(lambda: len(namespaces(disk)) == 1, "no chunk written to the disk tier")

        edit_config(folder, scale_rope_theta)
        r = httpx.post(f"{url}/models/m/reload", json={}, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["model"]["kv_share_key"] != old_key  # a new pool
        after = greedy(url, "m", PROMPT)
        assert cached(after) == 0, "the reload reused KV the old config computed"
        reloaded = text(after)
        # A new disk namespace too: the store's namespace follows the pool key.
        wait_for(lambda: len(namespaces(disk)) == 2, "no new disk namespace")
    finally:
        eng.shutdown()

    fresh_engine = Engine(model=[f"{folder},name=m"], **SMALL)
    try:
        fresh = text(greedy(f"http://127.0.0.1:{fresh_engine.args.port}", "m", PROMPT))
    finally:
        fresh_engine.shutdown()
    assert fresh != old, "the config change must show in the answer for this test to mean anything"
    assert reloaded == fresh, PROMPT
