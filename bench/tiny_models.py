"""Tiny random-weight models saved as real HF folders, for fast runtime tests and the soak.

Each folder pairs a small random Llama (fast on CPU) with a real tokenizer
taken from an embedded model, so the whole serving path (tokenizer workers,
chat templates, detokenizer, runners) runs for real in seconds.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# Pristine folders made in this process, by their arguments: the same model
# again is a copy of the files (milliseconds) rather than a tokenizer load and
# a model init (seconds). Copies of a private folder, not links nor the first
# caller's folder: tests edit the files of theirs.
_MADE: dict[tuple[object, ...], Path] = {}
_PRISTINE: list[tempfile.TemporaryDirectory[str]] = []


def tokenizer_source(name: str = "smollm2") -> Path:
    """The converted folder of an embedded model (fetched once if needed)."""
    from radixmux.model_runners.fetch import fetch

    return fetch(name, progress=False)


def make_tiny_model_dir(
    path: Path,
    seed: int = 0,
    chat_template: bool = True,
    layers: int = 2,
    hidden: int = 64,
    context: int = 2048,
) -> Path:
    """A random tiny Llama with SmolLM2's tokenizer at ``path`` (idempotent).

    ``chat_template=False`` drops the template, as for a base model.
    Different ``seed`` values give different weights (so different KV-share keys).
    """
    if (path / "model.safetensors").exists():
        return path
    key = (seed, chat_template, layers, hidden, context)
    if key not in _MADE:
        if not _PRISTINE:
            _PRISTINE.append(tempfile.TemporaryDirectory(prefix="radixmux-tiny-models-"))
        made = Path(_PRISTINE[0].name) / str(len(_MADE))
        _make(made, *key)
        _MADE[key] = made
    _copy_into_place(_MADE[key], path)
    return path


def _copy_into_place(made: Path, path: Path) -> None:
    # A shared folder (the soak's, under the model cache) may be made by two
    # processes at once: each copies beside it and renames, so a reader never
    # sees half a folder; the loser of the rename drops its copy.
    staging = path.with_name(f".{path.name}.staging-{os.getpid()}")
    shutil.copytree(made, staging, dirs_exist_ok=True)
    try:
        os.rename(staging, path)  # onto nothing or an empty folder: atomic
    except OSError:  # ``path`` holds files: the other maker's folder, or the caller's own
        if not (path / "model.safetensors").exists():
            shutil.copytree(staging, path, dirs_exist_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _make(path: Path, seed: int, chat_template: bool, layers: int, hidden: int, context: int):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = tokenizer_source("smollm2")
    path.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists() and (chat_template or name != "chat_template.jinja"):
            shutil.copy(src / name, path / name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(path, safe_serialization=True)
