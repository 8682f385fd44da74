"""Which structured-output library: xgrammar against llguidance on our tokenizers.

For each embedded model's tokenizer (SmolLM2: 49k tokens, Gemma 3: 262k) and
each grammar of a small JSON-schema/regex set, it measures what serving pays:

- **tables**: the one-off per-tokenizer build (xgrammar's ``TokenizerInfo``,
  llguidance's ``LLTokenizer``);
- **compile**: one grammar for that tokenizer, cold (xgrammar compiles ahead;
  llguidance builds lazily, so its first masks carry part of that cost);
- **mask**: filling one row's token bitmask per generated token while a valid
  document is fed token by token (mean, p50, p99 over every step).

outlines-core is not measured: it needs the vocabulary as decoded strings per
token (a byte-level conversion we would have to write for it) and builds a
whole-vocabulary index per regex up front, known to be slow at 262k tokens.

    .venv/bin/python -m bench.bench_grammar_backends [--rounds 3]

Needs ``pip install llguidance`` for its rows (a bench-only dependency);
xgrammar is the one radixmux serves with. Prints a table, writes a JSON and
a PNG under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_serving import write_json
from radixmux.model_runners.fetch import fetch

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
PERSON_DOC = {
    "name": "Ada Lovelace",
    "age": 36,
    "tags": ["math", "poetry", "engines"],
    "address": {"city": "London", "zip": "12345"},
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "qty", "price"],
            },
            "minItems": 1,
        },
        "express": {"type": "boolean"},
    },
    "required": ["id", "items", "express"],
}
ORDER_DOC = {
    "id": "ABC-1234",
    "items": [{"sku": "pen", "qty": 2, "price": 1.5}, {"sku": "ink", "qty": 1, "price": 7.25}],
    "express": False,
}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T[0-2][0-9]:[0-5][0-9]Z"
# (name, kind, grammar text, a document it accepts)
GRAMMARS: list[tuple[str, str, str, str]] = [
    ("json:person", "json", json.dumps(PERSON), json.dumps(PERSON_DOC)),
    ("json:order", "json", json.dumps(ORDER), json.dumps(ORDER_DOC)),
    ("regex:datetime", "regex", DATE, "2026-12-05T11:45Z"),
]


@dataclass
class Row:
    """One (library, tokenizer, grammar)'s figures, in milliseconds."""

    library: str
    tokenizer: str
    vocab: int
    grammar: str
    tables_ms: float
    compile_ms: float
    mask_mean_ms: float
    mask_p50_ms: float
    mask_p99_ms: float
    steps: int


class Backend:
    """What the bench asks of a library: tables, compile, a matcher's step."""

    name = ""

    def tables(self, tokenizer: Any, vocab: int, stop: list[int]) -> Any:
        raise NotImplementedError

    def compile(self, tables: Any, kind: str, text: str) -> Any:
        raise NotImplementedError

    def walk(self, tables: Any, compiled: Any, ids: Sequence[int]) -> list[float]:
        """Seconds to fill the mask before each of ``ids``, fed one by one."""
        raise NotImplementedError


class XGrammar(Backend):
    name = "xgrammar"

    def tables(self, tokenizer: Any, vocab: int, stop: list[int]) -> Any:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=stop)
        return xgr.GrammarCompiler(info, cache_enabled=False), vocab

    def compile(self, tables: Any, kind: str, text: str) -> Any:
        compiler, _ = tables
        if kind == "json":
            return compiler.compile_json_schema(text, any_whitespace=False)
        return compiler.compile_regex(text)

    def walk(self, tables: Any, compiled: Any, ids: Sequence[int]) -> list[float]:
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, tables[1])
        return _timed_walk(
            lambda: matcher.fill_next_token_bitmask(mask, 0), matcher.accept_token, ids
        )


class LLGuidance(Backend):
    name = "llguidance"

    def tables(self, tokenizer: Any, vocab: int, stop: list[int]) -> Any:
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def compile(self, tables: Any, kind: str, text: str) -> Any:
        import llguidance

        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                text,
                # The same output format as xgrammar's any_whitespace=False.
                defaults={
                    "whitespace_flexible": False,
                    "item_separator": ", ",
                    "key_separator": ": ",
                },
            )
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        return llguidance.LLMatcher(tables, grammar)

    def walk(self, tables: Any, compiled: Any, ids: Sequence[int]) -> list[float]:
        import llguidance.torch as lgt

        mask = lgt.allocate_token_bitmask(1, tables.vocab_size)
        return _timed_walk(
            lambda: lgt.fill_next_token_bitmask(compiled, mask, 0), compiled.consume_token, ids
        )


def _timed_walk(fill: Callable[[], Any], accept: Callable[[int], bool], ids: Sequence[int]):
    times = []
    for tid in ids:
        t = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t)
        if not accept(int(tid)):
            raise RuntimeError(f"the document's token {tid} was refused")
    return times


def available() -> list[Backend]:
    out: list[Backend] = [XGrammar()]
    try:
        import llguidance  # noqa: F401

        out.append(LLGuidance())
    except ImportError:
        print("llguidance not installed (pip install llguidance): its rows are skipped")
    return out


def measure(backends: Sequence[Backend], models: Sequence[str], rounds: int) -> list[Row]:
    from transformers import AutoTokenizer

    rows = []
    for model in models:
        folder = fetch(model)
        tok = AutoTokenizer.from_pretrained(folder)
        config = json.loads((Path(folder) / "config.json").read_text())
        vocab = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
        for b in backends:
            rows += measure_backend(b, model, tok, vocab, rounds)
    return rows


def measure_backend(b: Backend, model: str, tok: Any, vocab: int, rounds: int) -> list[Row]:
    """Every grammar's row for one library and tokenizer."""
    stop = [tok.eos_token_id]
    tables_s = min(_seconds(b.tables, tok, vocab, stop) for _ in range(rounds))
    tables = b.tables(tok, vocab, stop)
    rows = []
    for name, kind, text, doc in GRAMMARS:
        ids = tok.encode(doc, add_special_tokens=False) + stop
        compile_s = min(_seconds(b.compile, tables, kind, text) for _ in range(rounds))
        steps: list[float] = []
        for _ in range(rounds):
            steps += b.walk(tables, b.compile(tables, kind, text), ids)
        ms = np.asarray(steps) * 1e3
        row = Row(
            b.name, model, vocab, name, tables_s * 1e3, compile_s * 1e3,
            float(ms.mean()), float(np.percentile(ms, 50)), float(np.percentile(ms, 99)),
            len(ids),
        )  # fmt: skip
        print(
            f"{b.name:10} {model:12} {name:15} tables {row.tables_ms:7.0f} ms  "
            f"compile {row.compile_ms:7.2f} ms  mask mean {row.mask_mean_ms:.3f} "
            f"p50 {row.mask_p50_ms:.3f} p99 {row.mask_p99_ms:.3f} ms ({len(ids)} steps)",
            flush=True,
        )
        rows.append(row)
    return rows


def _seconds(fn: Callable[..., Any], *args: Any) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def plot(rows: Sequence[Row], path: Path) -> None:
    """Mean mask time per step and compile time, per (library, tokenizer, grammar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mask, ax_compile) = plt.subplots(1, 2, figsize=(14, 5))
    labels = [f"{r.tokenizer}\n{r.grammar}" for r in rows if r.library == rows[0].library]
    x = np.arange(len(labels))
    libraries = list(dict.fromkeys(r.library for r in rows))
    width = 0.8 / len(libraries)
    for i, lib in enumerate(libraries):
        mine = [r for r in rows if r.library == lib]
        ax_mask.bar(x + i * width, [r.mask_mean_ms for r in mine], width, label=lib)
        ax_compile.bar(x + i * width, [r.compile_ms for r in mine], width, label=lib)
    for ax, title in (
        (ax_mask, "mask per token, mean (ms, log)"),
        (ax_compile, "compile (ms, log)"),
    ):
        ax.set_xticks(x + width * (len(libraries) - 1) / 2, labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--rounds", type=int, default=3, help="best compile of N, masks over N walks")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: bench/results/)")
    a = ap.parse_args(argv)
    rows = measure(available(), a.models, a.rounds)
    out = write_json([asdict(r) for r in rows], a.out, "grammar-backends")
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
