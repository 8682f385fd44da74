"""Load a served model's HF tokenizer, keeping only what serving reads.

Every process that tokenizes or detokenizes (a tokenizer worker, the
detokenizer, each runner for its grammar tables) loads the tokenizer of each
model it serves, so its size counts several times. Two things inflate it
beyond the Rust tokenizer that does the work:

* transformers 5's model-specific classes (``GemmaTokenizer``,
  ``LlamaTokenizer``, ...) parse ``tokenizer.json`` in Python, build the Rust
  tokenizer from that vocabulary and merge list, and keep both as ``_vocab``
  and ``_merges``: 124 MB of Python objects for Gemma 3's 262k tokens. They
  are dropped where no method of the class but ``__init__`` reads them (a
  class that does, such as one that saves them, keeps them);
* the parse frees far more than it keeps, in the middle of the C heap
  (``heap.trim_heap``): Gemma 3's tokenizer held 264 MB after loading, 94 MB
  once both are gone.

The processes that only tokenize (the tokenizer workers, the detokenizer)
import transformers as an install without torch would
(``import_transformers_without_torch``): transformers 5 imports torch at its
own import when torch is installed, ~3 CPU-seconds per process per server
start, and its tokenizers never use it.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

from radixmux.common.heap import trim_heap

# What the model-specific tokenizers build their Rust tokenizer from.
BUILD_INPUTS = frozenset({"_vocab", "_merges"})


def _names(code: types.CodeType) -> set[str]:
    """Attribute and global names ``code`` and the functions nested in it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _functions(value: Any) -> list[Any]:
    if isinstance(value, (staticmethod, classmethod)):
        return [value.__func__]
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if f is not None]
    return [value]


def read_after_init(cls: type, names: frozenset[str]) -> bool:
    """Whether a method of ``cls`` (or its bases) other than ``__init__`` reads one of ``names``."""
    for klass in cls.__mro__:
        for attr, value in vars(klass).items():
            if attr == "__init__":
                continue
            for fn in _functions(value):
                code = getattr(fn, "__code__", None)
                if code is not None and _names(code) & names:
                    return True
    return False


def drop_build_inputs(tokenizer: Any) -> list[str]:
    """Delete the vocabulary and merges ``tokenizer`` was built from, where only
    its ``__init__`` reads them; the names deleted."""
    held = sorted(n for n in BUILD_INPUTS if n in vars(tokenizer))
    if not held or read_after_init(type(tokenizer), BUILD_INPUTS):
        return []
    for name in held:
        delattr(tokenizer, name)
    return held


def import_transformers_without_torch() -> bool:
    """Import transformers as if torch were not installed; whether it did.

    For a process that only tokenizes, called before anything imports
    transformers: while transformers and its tokenizer classes import,
    ``sys.modules["torch"]`` is ``None``, which both ``importlib.util.find_spec``
    (transformers' availability check, cached for the process) and ``import``
    read as "not installed". torch stays importable afterwards: xgrammar,
    imported for a constrained request's first grammar, needs it, and
    transformers keeps taking its torch-less paths. A process that already
    imported either (a runner, a test) keeps them as they are."""
    if "transformers" in sys.modules or "torch" in sys.modules:
        return False
    # transformers says "PyTorch was not found" at import, an advisory warning.
    quiet = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    was = os.environ.get(quiet)
    os.environ[quiet] = "1"
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from transformers import AutoTokenizer  # noqa: F401
        from transformers.utils.import_utils import is_torch_available

        is_torch_available()  # computed now, while torch is hidden, and cached
    finally:
        del sys.modules["torch"]
        if was is None:
            del os.environ[quiet]
        else:
            os.environ[quiet] = was
    return True


def load_tokenizer(path: str | Path) -> Any:
    """The HF tokenizer of a model folder (or of a ``.gguf`` file), without its
    build inputs and with the heap trimmed after the load."""
    from transformers import AutoTokenizer

    path = Path(path)
    if path.suffix == ".gguf":
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    drop_build_inputs(tokenizer)
    trim_heap()
    return tokenizer
