"""Scheduler <-> runner: a ragged forward batch in, sampled tokens out, and the
runner's start-up report."""

from __future__ import annotations

import msgspec

from radixmux.protocol.types import ModelInfo, SamplingParams


class SeqInput(msgspec.Struct, frozen=True):
    """One sequence's part of a forward pass.

    ``slots`` lists the arena slot of every context token, oldest first
    (cached prefix then the new tokens); the last ``len(new_tokens)`` are where
    the new tokens' K/V are written, so the first new token's position is
    ``len(slots) - len(new_tokens)``. ``sample`` is False for a prefill chunk
    that is not the prompt's last. ``next_token`` is the prompt token after
    a chunk that does not end the prompt (-1 otherwise): with prompt logprobs,
    the chunk's last position scores it.
    """

    rid: str
    new_tokens: bytes
    slots: bytes
    sample: bool = True
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    output_ids: bytes = b""
    next_token: int = -1
    # The scheduler packs the request's stop token ids and logit bias here and
    # leaves them out of ``params``: as lists they would be decoded item by
    # item on every step. The lists in ``params``, if any, count too.
    stop_ids: bytes = b""
    logit_bias: bytes = b""
    # Tokens generated so far. ``output_ids`` holds them only when penalties
    # count them (-1: as many as ``output_ids`` holds).
    num_output: int = -1
    # With ``ForwardBatch.layer_splits``: the slots of each lower layer group,
    # lowest first, as ``slots`` is for the top group (same length).
    lower_slots: list[bytes] = msgspec.field(default_factory=list)
    # Per lower group, the position from which it computes (a partial hit:
    # that group holds the K/V and boundary hidden states before it, so the
    # groups above start from those). Empty: every group starts at the first
    # new token. Only for runners with ``ModelInfo.layer_restart``.
    lower_starts: list[int] = msgspec.field(default_factory=list)


class PrefixGroup(msgspec.Struct, frozen=True):
    """Single-token sequences of a batch whose first ``prefix_len`` context
    slots are the same slot ids (a cached prefix they share): decode attention
    reads that prefix's K/V once for all of them. ``members`` index
    ``ForwardBatch.seqs``."""

    prefix_len: int
    members: list[int]


class ForwardBatch(msgspec.Struct, tag="forward", frozen=True):
    """A ragged batch: any mix of prefill chunks and single-token decodes."""

    batch_id: int
    seqs: list[SeqInput]
    # torch threads to run it with (0: keep the runner's current count); the
    # scheduler gives a runner more cores while the others have no work.
    threads: int = 0
    prefix_groups: list[PrefixGroup] = msgspec.field(default_factory=list)
    # Layers where the model's K/V is cut into groups stored apart (models
    # sharing their lower layers, scheduler/layer_groups.py): layers
    # ``[0, s0)`` read ``SeqInput.lower_slots[0]``, ..., layers ``[s_last,
    # num_layers)`` read ``SeqInput.slots``. Empty: one group.
    layer_splits: list[int] = msgspec.field(default_factory=list)


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    """Asks the runner to exit cleanly."""


class SeqOutput(msgspec.Struct, frozen=True):
    """The sampled token of one sequence (``token_id == -1`` when not sampled).

    ``finish_reason`` is ``"stop"`` (a stop / EOS token), ``"length"``
    (``max_new_tokens`` reached with this token) or ``None``. ``error`` is set
    (and ``token_id`` is -1) when this sequence failed on its own.
    ``prompt_logprobs`` (with prompt logprobs asked for, on prompt chunks):
    the logprob of each prompt token this chunk scores, i.e. the tokens at
    positions ``first_pos + 1 ..`` of the chunk (and ``next_token``), with
    their top alternatives in ``prompt_top_logprobs``. ``forced_ids``: tokens
    a grammar forces after ``token_id`` (jump-forward), outputs too, whose
    K/V the next step computes.
    """

    rid: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None  # this sequence alone failed (its batch-mates did not)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    forced_ids: list[int] | None = None


class ForwardResult(msgspec.Struct, tag="result", frozen=True):
    """The runner's answer to one ``ForwardBatch`` (outputs in batch order)."""

    batch_id: int
    outputs: list[SeqOutput] = msgspec.field(default_factory=list)
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    error: str | None = None
    threads: int = 0  # torch threads it ran with


class Ready(msgspec.Struct, tag="ready", frozen=True):
    """First message a runner sends once its model is loaded and the arena mapped."""

    info: ModelInfo
    pid: int
    load_seconds: float
    threads: int


class Failed(msgspec.Struct, tag="failed", frozen=True):
    """Sent instead of ``Ready`` when start-up fails (then the runner exits)."""

    error: str
    pid: int


RunnerRequest = ForwardBatch | Shutdown
RunnerReply = Ready | Failed | ForwardResult
