"""Continuous batching: what one runner computes next.

A batch mixes, in this order:

1. one decode token for every running request that has finished its prompt;
   when KV runs out, the running request with the least progress is retracted
   (its KV goes into the cache, it waits again and later resumes where it was);
2. the next chunk of prompts already being prefilled (chunked prefill), within
   ``chunked_prefill_size`` tokens per batch *counting the decode tokens* (as
   vLLM's ``max_num_batched_tokens``: a 2,048-token step with 16 decodes
   prefills 2,032, so the step's row count stays a multiple of the matmuls'
   64-row grain), or ``prefill_tokens_during_decode`` tokens (decodes
   counted too) when the batch decodes, so a long prompt arriving does not
   stretch every running request's next token;
3. new requests from the model's waiting queue, in schedule-policy order, while
   the token budget, ``max_running_requests`` and free KV allow, unless the
   running requests will finish soon: then new prompts wait for them (see
   ``_wait_for_decodes``) and later prefill together. A request that
   shares a not-yet-cached prefix with one admitted in this round waits a round,
   so the prefix is computed once and the others hit the cache. A request
   whose prompt continues on the disk tier first loads that part (it leaves
   the queue until its KV is in memory; see ``disk_tier``).
"""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from radixmux.memory.radix_cache import common_prefix_tokens
from radixmux.protocol import ForwardBatch, PrefixGroup, SeqInput
from radixmux.scheduler.kv_manager import KVManager
from radixmux.scheduler.policy import order_waiting
from radixmux.scheduler.request import Req

if TYPE_CHECKING:
    from radixmux.scheduler.runners import RunnerState

log = logging.getLogger("radixmux.scheduler")

# A request waits a round when this many not-yet-cached tokens of its prompt
# are shared with a request admitted in the same round.
IN_BATCH_SHARE_TOKENS = 32
# Admission keeps room for this many future decode tokens x conservativeness.
DECODE_RESERVE_TOKENS = 64
# New prompts wait for finishing decodes only while they fit this many full
# steps (``chunked_prefill_size``): one step is too tight, as prompts of a
# closed-loop cohort come a few tokens over it (vLLM's random 512-token prompts,
# 4 at a time, are ~2,060 tokens after tokenization), and larger cohorts cost
# their first tokens more than they save the running requests (random c=16:
# TTFT p50 1.8 -> 4.6 s for TPOT 150 -> 63 ms; docs/journal.md).
WAIT_MAX_STEPS = 2
# Decodes sharing at least this many cached tokens read them once per step.
MIN_SHARED_PREFIX = 32

_batch_ids = itertools.count()


@dataclass
class ScheduledBatch:
    """A batch sent to a runner: each request and how many tokens it computes."""

    runner_id: str
    reqs: list[Req]
    chunks: list[int]
    prefix_groups: list[PrefixGroup] = field(default_factory=list)
    batch_id: int = field(default_factory=lambda: next(_batch_ids))

    def to_forward_batch(
        self, threads: int = 0, layer_splits: list[int] | None = None
    ) -> ForwardBatch:
        seqs = []
        for req, n in zip(self.reqs, self.chunks, strict=True):
            start = req.kv_len
            end = start + n
            scored = req.wants_prompt_logprobs and end < len(req.input_ids)
            wire = req.wire
            # What a step sends grows with the context only through its slots,
            # which decode attention reads anyway.
            seqs.append(
                SeqInput(
                    rid=req.rid,
                    new_tokens=req.token_slice(start, end).tobytes(),
                    slots=req.slots[:end].astype(np.int32).tobytes(),
                    lower_slots=[p.slots[:end].astype(np.int32).tobytes() for p in req.lower],
                    lower_starts=_lower_starts(req, end),
                    sample=end == req.num_tokens,
                    params=wire.params,
                    output_ids=req.packed_output_ids() if wire.sends_output else b"",
                    next_token=int(req.input_ids[end]) if scored else -1,
                    stop_ids=wire.stop_ids,
                    logit_bias=wire.logit_bias,
                    num_output=len(req.output_ids),
                )
            )
        return ForwardBatch(self.batch_id, seqs, threads, self.prefix_groups, layer_splits or [])


def _lower_starts(req: Req, end: int) -> list[int]:
    """Where each lower layer group of a partial hit starts computing (it holds
    the tokens before), within the chunk computed up to ``end`` (a chunk that
    ends before it computes none of that group's rows: the group above takes
    them all from its stored hidden states); empty when every group starts at
    ``kv_len``."""
    starts = [min(max(req.kv_len, p.handle.length), end) for p in req.lower]
    return starts if any(s > req.kv_len for s in starts) else []


@dataclass
class BatchLimits:
    """The scheduler flags that bound one batch."""

    policy: str
    chunked_prefill_size: int
    max_running_requests: int
    conservativeness: float
    prefill_tokens_during_decode: int = 0  # 0: chunked_prefill_size
    prefill_wait_ratio: float = 0.0  # 0: new prompts never wait for decodes


class BatchBuilder:
    """Builds the next batch for a runner from its running set and its model's queue."""

    def __init__(self, kv: KVManager, limits: BatchLimits, seed: int = 0) -> None:
        self.kv = kv
        self.limits = limits
        self.rng = random.Random(seed)
        self.retractions = 0
        # Context rows decode attention reads once per group instead of once
        # per member (sum over steps of (members - 1) x shared prefix).
        self.shared_prefix_rows = 0
        # Rounds in which new prompts waited for the running requests to finish.
        self.waits_for_decodes = 0

    def schedule_next_batch(
        self, runner: RunnerState, waiting: list[Req], admit_cap: int | None = None
    ) -> ScheduledBatch | None:
        """The next batch for ``runner`` (None when it has nothing to do).

        Admitted requests move from ``waiting`` to ``runner.running``; retracted
        ones go back to the front of ``waiting``. ``admit_cap`` bounds the KV
        tokens newly admitted requests may take (the model's fair share left);
        None means no bound.
        """
        reqs: list[Req] = []
        chunks: list[int] = []
        self._decodes(runner, waiting, reqs, chunks)
        decoding = bool(reqs)
        budget = self.limits.chunked_prefill_size
        if reqs and self.limits.prefill_tokens_during_decode:
            budget = min(budget, self.limits.prefill_tokens_during_decode)
        budget -= len(reqs)
        prefilling = [r for r in runner.running if r.pending > 1]
        for req in prefilling:
            n = min(req.pending, budget)
            if n <= 0 or not self.kv.reserve(req, n):
                break
            reqs.append(req)
            chunks.append(n)
            budget -= n
        if decoding and self._wait_for_decodes(runner, waiting, budget):
            self.waits_for_decodes += 1
        elif admit_cap is None or admit_cap > 0 or not runner.running:
            # Prompts still being prefilled count as "computing this prefix now"
            # too: a new request sharing their uncached part waits for them.
            computing = [r.tokens.tobytes() for r in prefilling]
            self._admit(runner, waiting, budget, reqs, chunks, computing, admit_cap)
        if not reqs and runner.running:
            # Stuck: prompts being prefilled hold KV but none can grow. Free the
            # one with least progress so the others can go on.
            self._retract(runner, waiting, self._least_progress(runner.running))
            return self.schedule_next_batch(runner, waiting, admit_cap=0)
        if not reqs:
            return None
        return ScheduledBatch(runner.runner_id, reqs, chunks, self._prefix_groups(reqs, chunks))

    def _wait_for_decodes(self, runner: RunnerState, waiting: list[Req], budget: int) -> bool:
        """Whether new prompts should wait for the running requests to finish.

        Prefilling a prompt beside decodes delays every running request's next
        token by the prompt's cost; waiting instead delays the new prompt by
        the running requests' remaining decode steps, after which the waiting
        prompts prefill together and decode together undisturbed (the cohorts
        vLLM's schedule falls into). Wait when that wait, from measured step
        times, is at most ``prefill_wait_ratio`` x the delay, and only while
        the waiting prompts fit ``WAIT_MAX_STEPS`` full steps: past that they
        prefill over many steps anyway, the later chunks delaying the earlier
        prompts' tokens, so waiting would mostly add to their first token.
        The wait is bounded: nothing is admitted meanwhile, so the running set
        only drains.
        """
        ratio = self.limits.prefill_wait_ratio
        costs = runner.costs
        if not ratio or not waiting or budget <= 0 or not costs.known:
            return False
        most = WAIT_MAX_STEPS * self.limits.chunked_prefill_size
        queued = self._uncached_tokens(waiting, most + 1)
        if queued > most:
            return False
        steps_left = max(r.params.max_new_tokens - len(r.output_ids) for r in runner.running)
        wait_ms = steps_left * costs.decode_ms
        return wait_ms <= ratio * costs.prefill_ms(min(queued, budget))

    def _uncached_tokens(self, waiting: list[Req], limit: int) -> int:
        """Prompt tokens the waiting requests would prefill (counted up to
        ``limit``), from a look at the cache that locks nothing."""
        total = 0
        for req in waiting:
            cached = 0
            if self.kv.use_cache:
                cached = self.kv.cache.match(req.model, req.input_ids, record=False).length
            total += len(req.input_ids) - cached
            if total >= limit:
                return limit
        return total

    def _prefix_groups(self, reqs: list[Req], chunks: list[int]) -> list[PrefixGroup]:
        """The batch's single-token sequences grouped by the cached prefix they share."""
        if not self.kv.use_cache:
            return []
        decodes = [i for i, n in enumerate(chunks) if n == 1]
        handles = [reqs[i].handle for i in decodes]
        groups = [
            PrefixGroup(depth, [decodes[j] for j in members])
            for depth, members in self.kv.cache.shared_prefixes(handles, MIN_SHARED_PREFIX)
        ]
        self.shared_prefix_rows += sum((len(g.members) - 1) * g.prefix_len for g in groups)
        return groups

    def _decodes(
        self, runner: RunnerState, waiting: list[Req], reqs: list[Req], chunks: list[int]
    ) -> None:
        for req in sorted((r for r in runner.running if r.pending == 1), key=lambda r: r.order):
            while req in runner.running and not self.kv.reserve(req, 1):
                victim = self._least_progress([r for r in runner.running if r not in reqs])
                self._retract(runner, waiting, victim)
            if req in runner.running:
                reqs.append(req)
                chunks.append(1)

    @staticmethod
    def _least_progress(candidates: list[Req]) -> Req:
        return min(candidates, key=lambda r: (len(r.output_ids), -r.order))

    def _retract(self, runner: RunnerState, waiting: list[Req], req: Req) -> None:
        log.info(
            "rid=%s retracted (out of KV) after %d tokens; requeued", req.rid, len(req.output_ids)
        )
        self.requeue(runner, waiting, req)
        req.retractions += 1
        self.retractions += 1

    def requeue(self, runner: RunnerState, waiting: list[Req], req: Req) -> None:
        """Take a running request off ``runner`` and put it first in ``waiting``.

        Its computed KV goes into the cache, so it resumes (on whichever runner
        of the model admits it next) where it was, with the same output."""
        runner.running.remove(req)
        self.kv.release(req, keep=True)
        req.runner = None
        waiting.insert(0, req)

    def _admit(
        self,
        runner: RunnerState,
        waiting: list[Req],
        budget: int,
        reqs: list[Req],
        chunks: list[int],
        computing: list[bytes],
        cap: int | None,
    ) -> None:
        lim = self.limits
        if budget <= 0 or not waiting or len(runner.running) >= lim.max_running_requests:
            return
        cache = self.kv.cache if self.kv.use_cache else None
        admitted = list(computing)
        for req in order_waiting(lim.policy, waiting, cache, self.rng):
            if budget <= 0 or len(runner.running) >= lim.max_running_requests:
                break
            self.kv.lookup(req)  # locks the matched path: every exit below releases it
            loading = self.kv.start_disk_load(req)
            if loading == "loading":  # back in the queue once its KV is in memory
                waiting.remove(req)
                continue
            verdict = self._admissible(req, runner, budget, cap, admitted, loading)
            if verdict != "admit":
                self.kv.release(req, keep=False)
                if verdict == "stop":
                    break
                continue
            n = min(req.pending, budget)
            self.kv.admitted(req)
            waiting.remove(req)
            req.runner = runner.runner_id
            runner.running.append(req)
            reqs.append(req)
            chunks.append(n)
            budget -= n
            if cap is not None:
                cap -= n
            admitted.append(req.tokens.tobytes())

    def _admissible(
        self,
        req: Req,
        runner: RunnerState,
        budget: int,
        cap: int | None,
        admitted: list[bytes],
        loading: str | None = None,
    ) -> Literal["admit", "skip", "stop"]:
        """Whether a looked-up request runs now: ``admit`` (its first chunk's KV
        is reserved), ``skip`` (wait a round: it shares a prefix being computed
        or loaded from disk) or ``stop`` (no later request may be admitted this
        round either)."""
        if loading == "no room":
            return "stop"
        if loading == "wait" or (self.kv.use_cache and self._shares_uncached(req, admitted)):
            return "skip"
        n = min(req.pending, budget)
        if cap is not None and n > cap and runner.running:
            return "stop"  # past this model's fair share while another model waits
        lim = self.limits
        reserve = int(lim.conservativeness * min(req.params.max_new_tokens, DECODE_RESERVE_TOKENS))
        if not self.kv.reserve(req, n) or (
            runner.running and reserve and not self.kv.room_for(req, reserve)
        ):
            return "stop"  # out of KV: later requests would not fit either
        return "admit"

    def _shares_uncached(self, req: Req, admitted: list[bytes]) -> bool:
        """True when a prompt being computed in this batch covers part of this
        one's uncached prompt: wait, and hit the cache next round instead."""
        mine = req.tokens.tobytes()
        return any(
            common_prefix_tokens(mine, other) - req.kv_len >= IN_BATCH_SHARE_TOKENS
            for other in admitted
        )
