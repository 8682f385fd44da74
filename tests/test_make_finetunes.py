"""bench/make_finetunes.py on a tiny Llama: the ``upper`` family leaves the embeddings and the
lower layers bit-identical (so their hidden states, hence their K/V, are too), changes every
upper-layer linear, and the ``all`` family changes every layer; a re-run reuses the folders.

The tiny base has a real tokenizer and chat template, so the same code path as for SmolLM2
runs: persona data generation, LoRA training, merge, write, reload, evaluation.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.make_finetunes import FinetuneArgs, build_family, load_model
from bench.tiny_models import make_tiny_model_dir

LAYERS = 4
UPPER = 2
ARGS = FinetuneArgs(
    upper_layers=UPPER, steps=3, batch=2, seq_len=64, train_prompts=4, gen_tokens=8, lr=1e-2
)


def _layer(key: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return int(m.group(1)) if m else None


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("base") / "tiny", seed=3, layers=LAYERS)


@pytest.fixture(scope="module")
def upper(base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("finetunes")
    return build_family(str(base), "upper", 2, ARGS, out, eval_tokens=8), out


@torch.inference_mode()
def _hidden(folder: Path, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return load_model(folder)(input_ids=ids, output_hidden_states=True).hidden_states


def _assert_only_upper_linears_changed(base: Path, variant: Path) -> None:
    ref = load_file(base / "model.safetensors")
    got = load_file(variant / "model.safetensors")
    assert got.keys() == ref.keys()
    for key, tensor in ref.items():
        layer = _layer(key)
        upper_linear = layer is not None and layer >= LAYERS - UPPER and "norm" not in key
        # Embeddings, lm_head, final norm, lower layers and the upper norms: untouched.
        assert _bits_equal(got[key], tensor) != upper_linear, key


def test_upper_family_keeps_lower_layers_bit_identical(base: Path, upper: tuple[dict, Path]):
    manifest, _ = upper
    assert manifest["changed_layers"] == [LAYERS - UPPER + i for i in range(UPPER)]
    for v in manifest["variants"]:
        _assert_only_upper_linears_changed(base, Path(v["path"]))
    assert len({v["weights_sha256"] for v in manifest["variants"]}) == 2  # differ mutually


def test_perturb_upper_family_beside_the_fine_tunes(base: Path, tmp_path: Path):
    args = dataclasses.replace(ARGS, method="perturb")
    manifest = build_family(str(base), "upper", 1, args, tmp_path, eval_tokens=8)
    folder = Path(manifest["variants"][0]["path"])
    assert folder.name == "upper-perturb-0" and manifest["method"] == "perturb"
    _assert_only_upper_linears_changed(base, folder)


def test_upper_family_lower_hidden_states_identical_outputs_differ(
    base: Path, upper: tuple[dict, Path]
):
    manifest, _ = upper
    ids = torch.tensor([[1, 504, 3456, 42, 987, 2048, 77, 5]])
    ref = _hidden(base, ids)
    outs = [_hidden(Path(v["path"]), ids) for v in manifest["variants"]]
    for hs in outs:
        # hidden_states[j] is layer j-1's output: through layer LAYERS-UPPER-1, identical.
        for j in range(LAYERS - UPPER + 1):
            assert _bits_equal(hs[j], ref[j]), j
        assert not torch.equal(hs[-1], ref[-1])
    assert not torch.equal(outs[0][-1], outs[1][-1])


def test_all_family_changes_every_layer(base: Path, tmp_path: Path):
    manifest = build_family(str(base), "all", 1, ARGS, tmp_path, eval_tokens=8)
    ref = load_file(base / "model.safetensors")
    got = load_file(Path(manifest["variants"][0]["path"]) / "model.safetensors")
    changed = {_layer(k) for k in ref if not _bits_equal(got[k], ref[k])}
    assert changed == set(range(LAYERS))
    assert _bits_equal(got["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])
    # Another spec (one more step) is another fine-tune: the folder is rebuilt, not reused.
    more = dataclasses.replace(ARGS, steps=ARGS.steps + 1)
    other = build_family(str(base), "all", 1, more, tmp_path, eval_tokens=8)
    assert not other["variants"][0]["reused"]
    assert other["variants"][0]["weights_sha256"] != manifest["variants"][0]["weights_sha256"]


def test_rerun_reuses_folders(base: Path, upper: tuple[dict, Path]):
    manifest, out = upper
    weights = [Path(v["path"]) / "model.safetensors" for v in manifest["variants"]]
    stamps = [w.stat().st_mtime_ns for w in weights]
    again = build_family(str(base), "upper", 2, ARGS, out, eval_tokens=8)
    assert all(v["reused"] for v in again["variants"])
    assert [v["weights_sha256"] for v in again["variants"]] == [
        v["weights_sha256"] for v in manifest["variants"]
    ]
    assert [w.stat().st_mtime_ns for w in weights] == stamps
