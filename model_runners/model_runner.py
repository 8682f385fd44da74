"""Runs one ``ForwardBatch`` through a transformers model with KV in the arena."""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from radixmux.common.grammar import COMPILE_TIMEOUT_S, GrammarError
from radixmux.common.server_args import ATTENTION_BACKENDS
from radixmux.memory.allocator import distinct_sorted
from radixmux.memory.layout import hidden_layers
from radixmux.model_runners import paged_decode
from radixmux.model_runners.batch_invariance import AttentionShape, check_deterministic
from radixmux.model_runners.grammar import GrammarRows, StepMasks
from radixmux.model_runners.kv_scales import calibrate
from radixmux.model_runners.kv_store import KVStore
from radixmux.model_runners.lean_stack import GroupPass, LeanStack
from radixmux.model_runners.loader import LoadedModel
from radixmux.model_runners.paged_attention import (
    ATTN_NAME,
    DecodeGroups,
    ExtendSeq,
    LayerGroups,
    PagedBatch,
    paged_batch,
    set_attention,
)
from radixmux.model_runners.sampling import sample
from radixmux.protocol import (
    ForwardBatch,
    ForwardResult,
    PrefixGroup,
    SamplingParams,
    SeqInput,
    SeqOutput,
    pack_bias,
    unpack_bias,
    unpack_ids,
)

log = logging.getLogger("radixmux.runner")


class BatchError(ValueError):
    """A ForwardBatch that cannot be run as given (reported back, never fatal)."""


@dataclass
class _Seq:
    tokens: np.ndarray
    slots: np.ndarray
    start_pos: int
    output_ids: np.ndarray  # what penalties count (empty when none is set)
    num_output: int  # tokens generated so far
    stop_ids: np.ndarray  # stop token ids (int64)
    bias: np.ndarray  # logit bias records (protocol.BIAS_RECORD)
    lower_slots: list[np.ndarray]  # per lower layer group (ForwardBatch.layer_splits)
    lower_starts: list[int]  # where each lower group starts computing (empty: start_pos)


class ModelRunner:
    """A loaded model bound to its view of the KV arena.

    ``kv`` is ``KVArena.view(geometry)`` for this model's layout: ``[blocks,
    layers, 2, slots_per_block, kv_heads, head_dim]``.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        kv: torch.Tensor,
        attention_backend: str = "auto",
        lean: bool = True,
        grammar_compile_timeout: float = COMPILE_TIMEOUT_S,
        jump_forward: bool = False,
        deterministic: bool = False,
        view_for: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        layout = loaded.info.layout
        expect = (layout.num_layers, 2, layout.num_kv_heads, layout.head_dim)
        got = (kv.shape[1], kv.shape[2], kv.shape[4], kv.shape[5])
        if got != expect:
            raise ValueError(f"arena view {tuple(kv.shape)} does not match layout {layout}")
        self.loaded = loaded
        self.model = loaded.model
        self.info = loaded.info
        self.kv = kv
        self.store = KVStore(kv)
        if self.store.quantized:  # before the paged attention replaces SDPA
            self.store.k_scale, self.store.v_scale = calibrate(
                loaded.model, loaded.tokenizer, layout.num_layers
            )
        self.slots_per_block = self.store.slots_per_block
        self.num_slots = self.store.num_slots
        # The arena seen with a layout of n of this model's layers, for layer
        # groups stored apart (ForwardBatch.layer_splits); None: never split.
        self.view_for = view_for
        self._group_stores: dict[int, KVStore] = {layout.num_layers: self.store}
        self.device = next(self.model.parameters()).device
        self.use_kernel = self._pick_kernel(attention_backend)
        # Batch-invariant arithmetic (batch_invariance.py): refused here, at
        # load, where this CPU or model cannot give it.
        self.deterministic = deterministic
        # Why deterministic decodes are not grouped by shared prefix here (None:
        # they are, or the mode is off).
        self.ungrouped_why: str | None = None
        if deterministic:
            self.ungrouped_why = check_deterministic(
                self.model, self.use_kernel, layout.head_dim, self._attention_shapes()
            )
            if self.ungrouped_why is not None:
                log.warning(
                    "--deterministic: decodes are not grouped by shared prefix on this CPU "
                    "(each reads its prefix itself): %s",
                    self.ungrouped_why,
                )
        set_attention(self.model, ATTN_NAME)
        # Llama-code models with fused ops skip transformers' per-module Python
        # (lean_stack.py; same kernels, same results). lean=False: never.
        self.lean = LeanStack.build(self.model) if lean else None
        # Lower layer groups store their boundary hidden states beside their
        # K/V (this many pseudo-layers) when the lean stack can restart the
        # layers above from them: what the scheduler learns from ``info``.
        self.hidden_layers = hidden_layers(layout, self.info.hidden_size) if self.lean else 0
        self.info = msgspec.structs.replace(self.info, layer_restart=self.lean is not None)
        self.grammar_compile_timeout = grammar_compile_timeout
        self.jump_forward = jump_forward
        self._grammar: GrammarRows | None = None  # built at the first constrained request

    @property
    def grammar(self) -> GrammarRows:
        """This model's structured-output matchers (the tokenizer's grammar tables
        are built on first use: a server that never constrains pays nothing)."""
        if self._grammar is None:
            info = self.info
            self._grammar = GrammarRows(
                self.loaded.tokenizer,
                info.vocab_size,
                list(info.eos_token_ids),
                self.grammar_compile_timeout,
            )
        return self._grammar

    def _attention_shapes(self) -> list[AttentionShape]:
        """This model's attention configurations (one per distinct window)."""
        layout = self.info.layout
        config = getattr(self.model.config, "text_config", None) or self.model.config
        heads = int(getattr(config, "num_attention_heads", layout.num_kv_heads))
        dtype, kv_dtype = getattr(torch, self.info.dtype), getattr(torch, layout.dtype)
        windows = dict.fromkeys(self.info.sliding_windows or [None])
        return [
            AttentionShape(heads, layout.num_kv_heads, layout.head_dim, w, dtype, kv_dtype)
            for w in windows
        ]

    def _pick_kernel(self, backend: str) -> bool:
        """Whether decode attention runs in the C++ kernel (else gather + SDPA)."""
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {backend!r}: one of {ATTENTION_BACKENDS}")
        if backend == "torch":
            return False
        usable = self.kv.device.type == "cpu" and self.store.fast
        if backend == "cpp" and not usable:
            raise ValueError("the cpp attention backend needs a CPU arena with a regular row grid")
        if usable and paged_decode.load():
            return True
        if backend == "cpp":
            raise RuntimeError(f"paged decode kernel not built: {paged_decode.error()}")
        return False

    # ---- validation -------------------------------------------------------
    def _decode(self, seq: SeqInput, stores: Sequence[KVStore]) -> _Seq:
        """``seq`` checked and unpacked; ``stores`` are its layer groups' (top last)."""
        tokens = unpack_ids(seq.new_tokens)
        slots = unpack_ids(seq.slots)
        n = len(tokens)
        if n == 0:
            raise BatchError(f"{seq.rid}: no new tokens")
        if len(slots) < n:
            raise BatchError(f"{seq.rid}: {len(slots)} slots for {n} new tokens")
        if len(seq.lower_slots) != len(stores) - 1:
            raise BatchError(
                f"{seq.rid}: {len(seq.lower_slots)} lower slot lists for {len(stores)} layer groups"
            )
        lower = [unpack_ids(x) for x in seq.lower_slots]
        for ids, store in zip([*lower, slots], stores, strict=True):
            if len(ids) != len(slots):
                raise BatchError(f"{seq.rid}: layer groups with {len(ids)} and {len(slots)} slots")
            if ids.min() < 0 or ids.max() >= store.num_slots:
                raise BatchError(f"{seq.rid}: slot ids outside [0, {store.num_slots})")
            if len(distinct_sorted(ids)) != len(ids):
                raise BatchError(f"{seq.rid}: repeated slot ids")
        if tokens.min() < 0 or tokens.max() >= self.info.vocab_size:
            raise BatchError(f"{seq.rid}: token ids outside [0, {self.info.vocab_size})")
        starts = list(seq.lower_starts)
        if starts:
            first = len(slots) - n
            if len(starts) != len(lower):
                raise BatchError(f"{seq.rid}: {len(starts)} lower starts for {len(lower)} groups")
            if min(starts) < first or max(starts) > len(slots):
                raise BatchError(f"{seq.rid}: lower starts outside [{first}, {len(slots)}]")
            if not self.hidden_layers and max(starts) > first:
                raise BatchError(f"{seq.rid}: this runner cannot restart its upper layers")
        output_ids = unpack_ids(seq.output_ids)
        num_output = len(output_ids) if seq.num_output < 0 else seq.num_output
        # Packed by the scheduler (one array op per step, whatever their length);
        # lists in ``params`` (a caller that builds SeqInput itself) count too.
        p = seq.params
        stop_ids = unpack_ids(seq.stop_ids)
        if p.stop_token_ids:
            stop_ids = np.concatenate([stop_ids, np.asarray(p.stop_token_ids, dtype=np.int64)])
        bias = unpack_bias(seq.logit_bias)
        if p.logit_bias:
            bias = np.concatenate([bias, unpack_bias(pack_bias(p.logit_bias))])
        return _Seq(
            tokens, slots, len(slots) - n, output_ids, num_output, stop_ids, bias, lower, starts
        )

    # ---- batch preparation -----------------------------------------------
    def _stores(self, splits: Sequence[int]) -> list[KVStore]:
        """The KV store of each layer group of a batch cut at ``splits`` (top
        last); a lower group's view has its hidden pseudo-layers too."""
        num_layers = self.info.layout.num_layers
        if not splits:
            return [self.store]
        if list(splits) != sorted(set(splits)) or splits[0] <= 0 or splits[-1] >= num_layers:
            raise BatchError(f"layer splits {list(splits)} are not increasing in (0, {num_layers})")
        if self.view_for is None:
            raise BatchError("this runner cannot store its layers in groups")
        bounds = [0, *splits, num_layers]
        out = []
        for a, b in itertools.pairwise(bounds):
            n = b - a + (self.hidden_layers if b < num_layers else 0)
            if n not in self._group_stores:
                self._group_stores[n] = KVStore(self.view_for(n))
            out.append(self._group_stores[n])
        return out

    def _paged_batch(
        self, seqs: list[_Seq], groups: Sequence[PrefixGroup] = (), splits: Sequence[int] = ()
    ) -> tuple[PagedBatch | LayerGroups, torch.Tensor, torch.Tensor, list[GroupPass] | None]:
        """The batch's attention metadata (one ``PagedBatch`` per layer group),
        its token ids and positions, and, for a model whose lower groups keep
        their boundary hidden states, each group's pass (``GroupPass``)."""
        lens = [len(s.tokens) for s in seqs]
        row0 = np.concatenate([[0], np.cumsum(lens)])
        input_ids = torch.from_numpy(np.concatenate([s.tokens for s in seqs]))
        positions = np.concatenate(
            [np.arange(s.start_pos, s.start_pos + len(s.tokens)) for s in seqs]
        )
        stores = self._stores(splits)
        if len(stores) == 1:
            starts = [s.start_pos for s in seqs]
            batch = self._group_batch(self.store, [s.slots for s in seqs], starts, groups)
            return batch, input_ids, torch.from_numpy(positions), None
        bounds = [0, *splits, self.info.layout.num_layers]
        batches: list[PagedBatch] = []
        passes: list[GroupPass] = []
        below: list[int] = []  # where the group below started, per sequence
        for g, store in enumerate(stores):
            top = g == len(stores) - 1
            slots = [s.slots if top else s.lower_slots[g] for s in seqs]
            # A lower group of a partial hit starts past the tokens it holds.
            starts = [s.start_pos if top or not s.lower_starts else s.lower_starts[g] for s in seqs]
            batch = self._group_batch(store, slots, starts, groups)
            batches.append(batch)
            # Only the lean loop runs groups on their own rows (transformers'
            # forward runs every row through every layer): no passes otherwise.
            if self.hidden_layers:
                rows = np.concatenate(
                    [np.arange(row0[i] + st - s.start_pos, row0[i + 1]) for i, (s, st) in
                     enumerate(zip(seqs, starts, strict=True))]
                )  # fmt: skip
                fill = None
                if g and any(b > st for b, st in zip(below, starts, strict=True)):
                    # Rows this group computes that the group below held already.
                    held = [np.arange(st, max(b, st)) for b, st in zip(below, starts, strict=True)]
                    lower = stores[g - 1]
                    fill = (
                        lower,
                        bounds[g] - bounds[g - 1],
                        lower.address(self._t(np.concatenate(
                            [seqs[i].lower_slots[g - 1][p] for i, p in enumerate(held)]
                        ))),
                        self._t(np.concatenate(
                            [row0[i] + p - s.start_pos for i, (s, p) in
                             enumerate(zip(seqs, held, strict=True))]
                        )),
                    )  # fmt: skip
                save = None if top else (store, bounds[g + 1] - bounds[g], batch.write_addr)
                subset = None if len(rows) == len(input_ids) else self._t(rows)
                passes.append(GroupPass(bounds[g], bounds[g + 1], subset, fill, save))
            below = starts
        routed = LayerGroups(tuple(bounds[:-1]), tuple(batches))
        return routed, input_ids, torch.from_numpy(positions), passes or None

    def _t(self, a: np.ndarray) -> torch.Tensor:
        """Batch metadata as int64 where the arena is (cpu today, cuda later)."""
        return torch.as_tensor(a, dtype=torch.int64).to(self.kv.device)

    def _group_batch(
        self,
        store: KVStore,
        slots: list[np.ndarray],
        starts: list[int],
        groups: Sequence[PrefixGroup],
    ) -> PagedBatch:
        """One layer group's ``PagedBatch`` over the rows it computes:
        ``slots[i]`` is sequence i's context in ``store``; it computes the
        positions from ``starts[i]`` (default: its new tokens) to the end."""
        t, dev = self._t, self.kv.device
        ends = [len(s) for s in slots]
        firsts = starts
        lens = [e - f for e, f in zip(ends, firsts, strict=True)]
        row0 = np.concatenate([[0], np.cumsum(lens)])
        positions = np.concatenate([np.arange(f, e) for f, e in zip(firsts, ends, strict=True)])
        dec = [i for i, n in enumerate(lens) if n == 1]
        new_slots = np.concatenate([s[f:] for s, f in zip(slots, firsts, strict=True)])
        dec_slots = np.concatenate([slots[i] for i in dec]) if dec else np.zeros(0, np.int64)
        dec_offsets = np.concatenate([[0], np.cumsum([len(slots[i]) for i in dec])])
        extends = []
        for i, n in enumerate(lens):
            if n <= 1:  # a decode, or nothing for this group to compute
                continue
            extends.append(
                ExtendSeq(
                    start=int(row0[i]),
                    end=int(row0[i + 1]),
                    addr=store.address(t(slots[i])),
                    k_pos=torch.arange(0, ends[i], device=dev),
                    q_pos=torch.arange(firsts[i], ends[i], device=dev),
                )
            )
        dec_groups = self._decode_groups(dec, groups)
        batch = PagedBatch(
            store=store,
            write_addr=store.address(t(new_slots)),
            dec_rows=t(row0[dec]),
            dec_slots=t(dec_slots),
            dec_offsets=t(dec_offsets),
            dec_q_pos=t(positions[row0[dec]]),
            extends=extends,
            use_kernel=self.use_kernel,
            deterministic=self.deterministic,
            dec_groups=dec_groups,
        )
        if dec_groups is not None:
            dec_groups.check(batch.dec_slots, batch.dec_offsets)
        return batch

    def _decode_groups(self, dec: list[int], groups: Sequence[PrefixGroup]) -> DecodeGroups | None:
        """The batch's prefix groups as decode positions (None: nothing shared,
        a kernel that could not use them, or deterministic decodes that must
        not be grouped on this CPU: ``ungrouped_why``)."""
        if not groups or not self.use_kernel or self.ungrouped_why is not None:
            return None
        position = {seq: j for j, seq in enumerate(dec)}
        try:
            members = [[position[i] for i in g.members] for g in groups]
        except KeyError:
            raise BatchError("a prefix group names a sequence that is not a decode") from None
        return DecodeGroups.build(len(dec), members, [g.prefix_len for g in groups])

    # ---- forward ------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, seqs: list[SeqInput], rows: list[int] | None = None) -> torch.Tensor:
        """Run the batch; return float32 logits ``[len(rows), vocab]`` at each
        listed sequence's last new token (default: every sequence)."""
        decoded = [self._decode(s, [self.store]) for s in seqs]
        return self._logits(decoded, list(range(len(seqs))) if rows is None else rows)[0].float()

    def _logits(
        self,
        seqs: list[_Seq],
        rows: list[int],
        groups: Sequence[PrefixGroup] = (),
        every: Sequence[int] = (),
        splits: Sequence[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run the batch; logits ``[len(rows), vocab]`` at each listed
        sequence's last new token, in the model's dtype (sampling widens them
        to float where it needs more than greedy's argmax), and for each of
        ``every`` (prompt logprobs) its float32 logits at every new token."""
        batch, input_ids, positions, passes = self._paged_batch(seqs, groups, splits)
        ends = np.cumsum([len(s.tokens) for s in seqs])
        if every:
            spans = [np.arange(ends[i] - len(seqs[i].tokens), ends[i]) for i in every]
            last = ends[rows] - 1
            keep = np.concatenate([*spans, last])
        else:
            keep = ends[rows] - 1
        ids, pos = input_ids[None].to(self.device), positions[None].to(self.device)
        keep_at = torch.as_tensor(keep, dtype=torch.int64).to(self.device)
        with paged_batch(batch):
            if passes is not None:
                assert self.lean is not None  # passes need the lean stack's loop
                out = self.lean.run_groups(ids, pos, keep_at, passes)
            elif self.lean is not None:
                out = self.lean(ids, pos, keep_at)
            else:
                out = self.model(
                    input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep_at
                ).logits
        logits = out[0].cpu()
        if not every:
            return logits, {}
        by_seq, start = {}, 0
        for i, span in zip(every, spans, strict=True):
            by_seq[i] = logits[start : start + len(span)].float()
            start += len(span)
        return logits[start:], by_seq

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> ForwardResult:
        """Run one ForwardBatch and sample; never raises.

        A malformed batch gives ``error`` set. When the pass or the sampling
        fails on a well-formed batch, each sequence is retried alone (writing
        its K/V again to the same slots is harmless), so only the sequences
        that fail by themselves get ``SeqOutput.error`` and their batch-mates
        still get their tokens.
        """
        t0 = time.perf_counter()
        try:
            stores = self._stores(fb.layer_splits)
            seqs = [self._decode(s, stores) for s in fb.seqs]
            if not seqs:
                raise BatchError("empty batch")
        except BatchError as exc:
            return ForwardResult(fb.batch_id, error=str(exc))
        try:
            outputs, t1 = self._run(fb.seqs, seqs, fb.prefix_groups, fb.layer_splits)
        except Exception as exc:
            log.exception("batch %d failed", fb.batch_id)
            if len(seqs) == 1:
                outputs = [SeqOutput(fb.seqs[0].rid, -1, error=_describe(exc))]
            else:  # find the sequences that fail on their own
                outputs = [
                    self._run_alone(s, d, fb.layer_splits)
                    for s, d in zip(fb.seqs, seqs, strict=True)
                ]
            t1 = time.perf_counter()
        t2 = time.perf_counter()
        return ForwardResult(
            fb.batch_id,
            outputs,
            forward_ms=(t1 - t0) * 1e3,
            sample_ms=(t2 - t1) * 1e3,
            threads=torch.get_num_threads(),
        )

    def _run_alone(self, seq: SeqInput, decoded: _Seq, splits: Sequence[int]) -> SeqOutput:
        """One sequence of a failed batch, run by itself: its output or its error."""
        try:
            return self._run([seq], [decoded], (), splits)[0][0]
        except Exception as exc:
            log.exception("rid=%s failed on its own", seq.rid)
            return SeqOutput(seq.rid, -1, error=_describe(exc))

    def _run(
        self,
        inputs: list[SeqInput],
        seqs: list[_Seq],
        groups: Sequence[PrefixGroup] = (),
        splits: Sequence[int] = (),
    ) -> tuple[list[SeqOutput], float]:
        """Forward and sample some sequences; returns the outputs and when the
        forward ended (``perf_counter``)."""
        rows = [i for i, s in enumerate(inputs) if s.sample]
        scored = [i for i, s in enumerate(inputs) if _scores_prompt(s, seqs[i])]
        params = [inputs[i].params for i in rows]
        outs = [seqs[i].output_ids for i in rows]
        pending = self._start_masks([inputs[i].rid for i in rows], params, outs)
        logits, prompt_logits = self._logits(seqs, rows, groups, scored, splits)
        t1 = time.perf_counter()
        masks = pending.result() if pending is not None else None
        steps = [seqs[i].num_output for i in rows]
        biases = [seqs[i].bias for i in rows]
        constrain = None
        if masks is not None:
            constrain = functools.partial(masks.apply, vocab_size=self.info.vocab_size)
        picked = sample(logits, params, outs, steps, biases, constrain) if rows else None
        prompt_lps = {i: _prompt_logprobs(prompt_logits[i], inputs[i], seqs[i]) for i in scored}
        outputs = []
        by_row = {r: j for j, r in enumerate(rows)}
        eos = set(self.info.eos_token_ids)
        for i, s in enumerate(inputs):
            j = by_row.get(i)
            plp, ptop = prompt_lps.get(i, (None, None))
            if j is None or picked is None:
                outputs.append(SeqOutput(s.rid, -1, prompt_logprobs=plp, prompt_top_logprobs=ptop))
                continue
            if masks is not None and j in masks.errors:
                outputs.append(SeqOutput(s.rid, -1, error=masks.errors[j]))
                continue
            token = int(picked.tokens[j])
            p = s.params
            finish = None
            stops = seqs[i].stop_ids  # one vectorised compare, however many there are
            if (stops.size and bool((stops == token).any())) or (not p.ignore_eos and token in eos):
                finish = "stop"
            elif seqs[i].num_output + 1 >= p.max_new_tokens:
                finish = "length"
            forced = None
            if p.constraint is not None:
                try:
                    if self.grammar.accept(s.rid, token):
                        finish = "stop"  # the grammar is complete
                    elif finish is None:
                        forced = self._forced(s, seqs[i]) or None
                except GrammarError as exc:
                    outputs.append(SeqOutput(s.rid, -1, error=exc.message))
                    continue
                if finish is not None:
                    self.grammar.forget(s.rid)
            lp = float(picked.logprobs[j]) if picked.logprobs is not None and p.logprobs else None
            top = None
            if p.top_logprobs and picked.top_ids is not None:
                ids = picked.top_ids[j, : p.top_logprobs].tolist()
                vals = picked.top_logprobs[j, : p.top_logprobs].tolist()
                top = list(zip(ids, vals, strict=True))
            outputs.append(SeqOutput(s.rid, token, lp, top, finish, None, plp, ptop, forced))
        return outputs, t1

    def _forced(self, inp: SeqInput, seq: _Seq) -> list[int]:
        """Jump-forward tokens after this step's sampled one: none for a row that
        asked for logprobs (a forced token has none to report); always room
        left for one more sampled token, within ``max_new_tokens`` and the
        context."""
        p = inp.params
        if not self.jump_forward or p.logprobs or p.top_logprobs:
            return []
        produced = seq.num_output + 1
        room = min(
            p.max_new_tokens - produced - 1,
            self.info.context_length - (len(seq.slots) + 1) - 1,
        )
        return self.grammar.jump_forward(inp.rid, room)

    def _start_masks(
        self, rids: list[str], params: list[SamplingParams], outputs: list[np.ndarray]
    ) -> concurrent.futures.Future[StepMasks] | None:
        """This step's grammar masks, computed on a thread during the forward
        pass (``None`` when no sampled row is constrained)."""
        constraints = [p.constraint for p in params]
        if all(c is None for c in constraints):
            return None
        return self.grammar.start(rids, constraints, outputs)


def _scores_prompt(inp: SeqInput, seq: _Seq) -> bool:
    """A prompt chunk that asked for prompt logprobs and scores some token."""
    if inp.params.prompt_logprobs_start < 0 or seq.num_output:
        return False
    return len(seq.tokens) > 1 or inp.next_token >= 0


def _prompt_logprobs(
    logits: torch.Tensor, inp: SeqInput, seq: _Seq
) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """Each position's logprob of the prompt token after it (the model's raw
    distribution: no penalties or bias), and the top alternatives if asked;
    ``logits`` are the chunk's, one row per new token."""
    targets = seq.tokens[1:].tolist() + ([inp.next_token] if inp.next_token >= 0 else [])
    lp = torch.log_softmax(logits[: len(targets)], dim=-1)
    chosen = lp.gather(1, torch.as_tensor(targets, dtype=torch.int64)[:, None])[:, 0].tolist()
    k = inp.params.top_logprobs
    if not k:
        return chosen, None
    vals, ids = lp.topk(k, dim=-1)
    top = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
    return chosen, top


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
