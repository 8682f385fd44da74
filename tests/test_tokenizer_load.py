"""Tokenizers as every process loads them (common/tokenizer_load.py): the
vocabulary and merges they were built from are dropped only where nothing
reads them, and the tokenizer works as loaded by transformers."""

from __future__ import annotations

import pytest

from radixmux.common.tokenizer_load import (
    BUILD_INPUTS,
    drop_build_inputs,
    load_tokenizer,
    read_after_init,
)
from radixmux.model_runners import fetch

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
