"""Compiling structured-output constraints for one tokenizer (xgrammar).

Both the tokenizer workers and the runners compile: a worker compiles first,
under a time limit, so a schema that is invalid or too slow is a 400 naming
its field before the request is ever scheduled; the runner then compiles the
same constraint for its own matchers (cached; it is known to compile quickly
by then). Neither is the scheduler's process, so a compile never stalls its loop.

xgrammar rather than llguidance or outlines-core: it is the fastest per
token on our CPUs and vocabularies (docs/structured-output.md has the
measurement; a mask for a 262k vocabulary in about 0.01 ms against 0.3 ms).
It is imported lazily: a server that never sees a constrained request never
loads it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import re
import threading
import time
from typing import Any

from radixmux.protocol import Constraint

COMPILE_TIMEOUT_S = 10.0  # the default of --grammar-compile-timeout
CACHE_ENTRIES = 128  # compiled grammars kept per tokenizer (a few MB each at most)
COMPILE_THREADS = 2


class GrammarError(ValueError):
    """A constraint that cannot be used: ``field`` names the request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def _key(c: Constraint) -> tuple[str, str, bool]:
    return (c.kind, c.spec, c.strict)


class GrammarCompiler:
    """Compiled grammars for one tokenizer: a bounded LRU of compile futures,
    so concurrent requests with one schema share one compile, and a compile
    that outlives its caller's time limit still fills the cache for the next."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = list(stop_ids)
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built on first use
        self._info: Any = None
        # When the tokenizer's tables were ready (monotonic): a compile's time
        # limit counts from then, not from the one-off table build.
        self.tables_ready_at: float | None = None
        self._lock = threading.Lock()
        self._futures: collections.OrderedDict[tuple[str, str, bool], concurrent.futures.Future] = (
            collections.OrderedDict()
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(
            COMPILE_THREADS, thread_name_prefix="grammar"
        )

    @property
    def token_info(self) -> Any:
        """xgrammar's ``TokenizerInfo`` (built on first use: about a second for 262k tokens)."""
        self._ensure_compiler()
        return self._info

    def _ensure_compiler(self) -> None:
        with self._lock:
            if self._compiler is not None:
                return
            import xgrammar as xgr

            self._info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids
            )
            # xgrammar's own cache stays off: ours is keyed the same way and bounded by count.
            self._compiler = xgr.GrammarCompiler(self._info, cache_enabled=False)
            self.tables_ready_at = time.monotonic()

    def compile(self, c: Constraint, timeout: float = COMPILE_TIMEOUT_S) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``c``; raises ``GrammarError``
        when it is invalid or takes longer than ``timeout`` seconds (the
        tokenizer's tables, built once, first: they do not count)."""
        self._ensure_compiler()
        return self._wait(self.start(c), c, timeout)

    def start(self, c: Constraint) -> concurrent.futures.Future:
        """Begin compiling ``c`` (or join the compile under way, or the cached one)."""
        key = _key(c)
        with self._lock:
            fut = self._futures.get(key)
            if fut is not None:
                self._futures.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, c)
            self._futures[key] = fut
            while len(self._futures) > CACHE_ENTRIES:
                self._futures.popitem(last=False)
            return fut

    def _wait(self, fut: concurrent.futures.Future, c: Constraint, timeout: float) -> Any:
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise GrammarError(
                c.field, f"{c.field or c.kind}: took longer than {timeout:g} s to compile"
            ) from None

    def _compile(self, c: Constraint) -> Any:
        self._ensure_compiler()
        try:
            if c.kind == "json":
                if not c.spec:
                    return self._compiler.compile_builtin_json_grammar()
                return self._compiler.compile_json_schema(
                    c.spec, any_whitespace=False, strict_mode=c.strict
                )
            if c.kind == "regex":
                return self._compiler.compile_regex(c.spec)
            return self._compiler.compile_grammar(c.spec)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with its reason
            raise GrammarError(c.field, f"{c.field or c.kind}: {_reason(exc)}") from exc


_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its time stamp and C++ source location."""
    text = str(exc).strip() or type(exc).__name__
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("  File", "[bt]"))]
    return _CPP_PREFIX.sub("", lines[0] if lines else text)


def check_schema_text(spec: str, field: str) -> None:
    """A JSON schema given as text must at least be JSON (a cheap check at the front)."""
    try:
        json.loads(spec)
    except ValueError as exc:
        raise GrammarError(field, f"{field}: not valid JSON ({exc})") from exc
