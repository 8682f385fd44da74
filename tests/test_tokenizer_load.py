"""Tokenizers as every process loads them (common/tokenizer_load.py): the
vocabulary and merges they were built from are dropped only where nothing
reads them, and the tokenizer works as loaded by transformers; a process that
only tokenizes imports transformers without torch and tokenizes the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from radixmux.common.tokenizer_load import (
    BUILD_INPUTS,
    drop_build_inputs,
    load_tokenizer,
    read_after_init,
)
from radixmux.model_runners import fetch

ROOT = Path(__file__).resolve().parents[1]

TEXT = "Hello world! Ça va? 日本語 def f(x):\n\treturn x**2 <start_of_turn> <|im_start|>"


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_loaded_tokenizer_encodes_and_decodes_as_transformers_does(name):
    from transformers import AutoTokenizer

    folder = fetch.fetch(name, progress=False)
    slim = load_tokenizer(folder)
    plain = AutoTokenizer.from_pretrained(folder)
    assert not BUILD_INPUTS & set(vars(slim))
    ids = plain(TEXT).input_ids
    assert slim(TEXT).input_ids == ids
    assert slim.decode(ids) == plain.decode(ids)
    assert slim.decode(ids, skip_special_tokens=True) == plain.decode(ids, skip_special_tokens=True)
    assert slim.get_vocab() == plain.get_vocab()
    assert slim.all_special_ids == plain.all_special_ids


class _Keeps:
    def __init__(self) -> None:
        self._vocab = {"a": 0}
        self._merges = [("a", "b")]

    def save(self) -> list[str]:
        return [f"{a} {b}" for a, b in self._merges]  # read in a nested comprehension


class _Drops:
    def __init__(self) -> None:
        self._vocab = {"a": 0}

    @property
    def size(self) -> int:
        return 1


def test_build_inputs_stay_where_a_method_reads_them():
    assert read_after_init(_Keeps, BUILD_INPUTS)
    keeps = _Keeps()
    assert drop_build_inputs(keeps) == [] and keeps._merges == [("a", "b")]
    assert not read_after_init(_Drops, BUILD_INPUTS)
    drops = _Drops()
    assert drop_build_inputs(drops) == ["_vocab"] and not hasattr(drops, "_vocab")


CHAT = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Ça va? 日本語"},
]

# What a tokenizer worker and the detokenizer read of a tokenizer, as JSON.
USES = f"""
def uses(tok):
    text = {TEXT!r}
    ids = tok(text).input_ids
    chat = None
    if tok.chat_template:
        chat = tok.apply_chat_template({CHAT!r}, tokenize=False, add_generation_prompt=True)
    return dict(
        cls=type(tok).__name__,
        ids=ids,
        bare=tok(text, add_special_tokens=False).input_ids,
        text=tok.decode(ids),
        skipped=tok.decode(ids, skip_special_tokens=True),
        strs=tok.convert_ids_to_tokens(ids),
        chat=chat,
        special=tok.all_special_ids,
        size=len(tok),
    )
"""

# A tokenizing process: transformers imported without torch, then each model's
# tokenizer; torch stays out until something else imports it (xgrammar does,
# for a constrained request's grammar), which then works as usual.
WITHOUT_TORCH = (
    USES
    + """
import json, sys
from radixmux.common.tokenizer_load import import_transformers_without_torch, load_tokenizer
assert import_transformers_without_torch()
out = {"uses": {p: uses(load_tokenizer(p)) for p in sys.argv[1:]}}
out["torch_after_load"] = "torch" in sys.modules
import xgrammar
info = xgrammar.TokenizerInfo.from_huggingface(load_tokenizer(sys.argv[1]))
compiled = xgrammar.GrammarCompiler(info).compile_regex("(yes|no)")
out["grammar"] = xgrammar.GrammarMatcher(compiled).accept_string("yes")
print(json.dumps(out))
"""
)


def test_a_tokenizing_process_imports_transformers_without_torch_and_tokenizes_the_same():
    folders = [str(fetch.fetch(name, progress=False)) for name in ("smollm2", "gemma3-270m")]
    run = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *folders],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["torch_after_load"] is False
    assert out["grammar"] is True
    assert "PyTorch was not found" not in run.stderr  # its import warning stays quiet
    here: dict = {}
    exec(USES, here)  # this process has torch (conftest imports it)
    assert "torch" in sys.modules
    for folder in folders:
        assert out["uses"][folder] == json.loads(json.dumps(here["uses"](load_tokenizer(folder))))
    assert out["uses"][folders[0]]["chat"]  # SmolLM2's template was compared too
    # Too late in a process that has transformers or torch already: nothing changes.
    from radixmux.common.tokenizer_load import import_transformers_without_torch

    assert not import_transformers_without_torch()
