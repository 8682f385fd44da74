"""Structured output in the runner: one grammar matcher per constrained request,
the token mask of each step computed while that step's forward pass runs.

The scheduler sends a constrained row's ``Constraint`` and its output ids with
every step. The matcher of a row lives here between steps; it is rebuilt
from the output ids whenever it is missing or does not hold exactly the
tokens the scheduler says were generated (a restarted runner, a retried
batch, a row this runner dropped), so nothing about it has to be in sync
with the scheduler. Rows without a constraint cost nothing.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixmux.common.grammar import GrammarCompiler, GrammarError
from radixmux.protocol import Constraint

log = logging.getLogger("radixmux.runner")

IDLE_ROW_S = 300.0  # a matcher no batch used for this long is dropped (aborted requests)
MAX_ROWS = 4096


@dataclass
class _Row:
    constraint: Constraint
    matcher: Any  # xgrammar.GrammarMatcher
    consumed: int  # output tokens the matcher has accepted
    used_at: float


@dataclass
class StepMasks:
    """The masks of one step's constrained rows: ``bitmask[k]`` is for batch
    row ``rows[k]``; ``errors`` maps a batch row to why it cannot be sampled."""

    rows: list[int]
    bitmask: torch.Tensor | None
    errors: dict[int, str]

    def apply(self, logits: torch.Tensor, vocab_size: int) -> None:
        """Send every token the grammar forbids to -inf, in place (``logits``
        has one row per sampled batch row, in ``rows``' order of batch rows)."""
        if self.bitmask is None or not self.rows:
            return
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(
            logits, self.bitmask, vocab_size=vocab_size, indices=self.rows
        )


class GrammarRows:
    """The matchers of one runner's constrained requests."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_ids: list[int], compile_timeout: float
    ) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_ids)
        self.compile_timeout = compile_timeout
        self._rows: collections.OrderedDict[str, _Row] = collections.OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def start(
        self,
        rids: Sequence[str],
        constraints: Sequence[Constraint | None],
        outputs: Sequence[np.ndarray],
    ) -> concurrent.futures.Future[StepMasks] | None:
        """Begin this step's masks for the sampled rows (``rids[k]`` with its
        constraint and output ids so far); ``None`` when no row is constrained.
        The work runs on a thread while the caller runs the forward pass."""
        if all(c is None for c in constraints):
            return None
        for c in constraints:
            if c is not None:
                self.compiler.start(c)  # compiles of new grammars begin at once
        return self._pool.submit(self._masks, list(rids), list(constraints), list(outputs))

    def _masks(
        self, rids: list[str], constraints: list[Constraint | None], outputs: list[np.ndarray]
    ) -> StepMasks:
        import xgrammar as xgr

        now = time.monotonic()
        self._drop_idle(now)
        rows = [k for k, c in enumerate(constraints) if c is not None]
        errors: dict[int, str] = {}
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        kept: list[int] = []
        for k in rows:
            c = constraints[k]
            assert c is not None
            try:
                row = self._row(rids[k], c, outputs[k], now)
            except GrammarError as exc:
                errors[k] = exc.message
                continue
            row.matcher.fill_next_token_bitmask(bitmask, len(kept))
            kept.append(k)
        return StepMasks(kept, bitmask[: len(kept)] if kept else None, errors)

    def _row(self, rid: str, c: Constraint, output: np.ndarray, now: float) -> _Row:
        """The matcher of ``rid`` holding exactly ``output``: kept, rolled back or rebuilt."""
        import xgrammar as xgr

        row = self._rows.get(rid)
        n = len(output)
        if row is not None and row.constraint == c and row.consumed > n:
            row.matcher.rollback(row.consumed - n)  # a step the scheduler did not keep
            row.consumed = n
        if row is None or row.constraint != c or row.consumed != n:
            grammar = self.compiler.compile(c, self.compile_timeout)
            matcher = xgr.GrammarMatcher(grammar)
            for token in output.tolist():
                if not matcher.accept_token(int(token)):
                    raise GrammarError(c.field, "the output so far does not follow the grammar")
            row = _Row(c, matcher, n, now)
            self._rows[rid] = row
        row.used_at = now
        self._rows.move_to_end(rid)
        return row

    def accept(self, rid: str, token: int) -> bool:
        """Advance ``rid``'s matcher by its sampled token; True when the grammar
        is complete (the row ends with ``stop``). Raises ``GrammarError`` if the
        token breaks the grammar (it cannot, once masked)."""
        row = self._rows[rid]
        if not row.matcher.accept_token(token):
            self._rows.pop(rid)
            raise GrammarError(row.constraint.field, f"token {token} does not follow the grammar")
        row.consumed += 1
        return bool(row.matcher.is_terminated())

    def jump_forward(self, rid: str, most: int) -> list[int]:
        """Tokens the grammar now forces for ``rid`` (at most ``most``), accepted
        by its matcher: they are outputs without a forward pass each (SGLang's
        jump-forward). The forced text is tokenized on its own, so the token
        boundary with the sampled token before it may differ from what the
        model would have chosen; every token is checked against the grammar."""
        if most <= 0:
            return []
        row = self._rows[rid]
        text = row.matcher.find_jump_forward_string()
        if not text:
            return []
        forced = []
        for token in self.tokenizer.encode(text, add_special_tokens=False)[:most]:
            if not row.matcher.accept_token(int(token)):
                break  # a token the grammar does not take whole: stop before it
            forced.append(int(token))
        row.consumed += len(forced)
        if row.matcher.is_terminated():  # never end on a forced token: leave the end to sampling
            row.matcher.rollback(1)
            row.consumed -= 1
            forced.pop()
        return forced

    def forget(self, rid: str) -> None:
        """Drop ``rid``'s matcher (its request ended here)."""
        self._rows.pop(rid, None)

    def _drop_idle(self, now: float) -> None:
        # Rows are kept in least-recently-used order: the stale ones are first.
        while self._rows:
            rid, row = next(iter(self._rows.items()))
            if now - row.used_at < IDLE_ROW_S and len(self._rows) <= MAX_ROWS:
                break
            del self._rows[rid]

    def __len__(self) -> int:
        return len(self._rows)
