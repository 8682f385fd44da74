"""Messages between the scheduler and a runner process (msgpack over ZeroMQ).

Token and slot arrays travel as packed little-endian int32 bytes
(:func:`pack_ids` / :func:`unpack_ids`); K/V never travel, they live in the arena.
"""

from __future__ import annotations

import msgspec
import numpy as np

from radixmux.model_runners.info import ModelInfo

# Decode attention: auto = the C++ kernel where it builds, else torch (gather + SDPA).
ATTENTION_BACKENDS = ("auto", "cpp", "torch")


def pack_ids(ids: object) -> bytes:
    """A sequence of ints as packed int32 bytes."""
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(data: bytes) -> np.ndarray:
    """Packed int32 bytes back to an int64 array."""
    return np.frombuffer(data, dtype="<i4").astype(np.int64)


class SamplingParams(msgspec.Struct, frozen=True):
    """How to pick a sequence's next token. Defaults mean greedy, no penalties.

    ``temperature <= 0`` or ``top_k == 1`` is greedy. ``top_k = 0``, ``top_p =
    1``, ``min_p = 0`` switch those filters off. Penalties apply over the
    sequence's ``output_ids``. ``seed`` makes sampling reproducible: the same
    seed, step and logits give the same token, whatever else is in the batch.
    ``logprobs`` asks for the chosen token's log-probability and the
    ``top_logprobs`` most likely alternatives. ``logit_bias`` adds to the
    logits of the listed token ids (after penalties, before everything else).
    ``prompt_logprobs_start >= 0`` asks for the log-probability (and the top
    alternatives) of every prompt token from that index on (the first prompt
    token has none): the scheduler then computes those positions instead of
    taking them from the cache.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    max_new_tokens: int = 128
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: list[tuple[int, float]] = msgspec.field(default_factory=list)
    prompt_logprobs_start: int = -1


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
    their top alternatives in ``prompt_top_logprobs``.
    """

    rid: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None  # this sequence alone failed (its batch-mates did not)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


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
