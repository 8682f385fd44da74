"""A request as the scheduler tracks it, from arrival to finish."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import msgspec
import numpy as np

from radixmux.memory.radix_cache import CacheHandle
from radixmux.protocol import SamplingParams, TokenLogprob, pack_bias, pack_ids

_arrival_order = itertools.count()


@dataclass(frozen=True)
class WireParams:
    """A request's sampling parameters as every forward batch carries them,
    made once: the lists packed as bytes (``SeqInput.stop_ids``,
    ``SeqInput.logit_bias``) and left out of ``params``."""

    params: SamplingParams
    stop_ids: bytes
    logit_bias: bytes
    # Penalties count the output, or a grammar's matcher may need rebuilding
    # from it in the runner: its ids go with every step.
    sends_output: bool


@dataclass
class LowerKV:
    """A request's K/V in one lower layer group of its model (``layer_groups.py``):
    the group's cache name, its locked handle and its slots, which follow the
    same rules as ``Req.handle`` and ``Req.slots`` and always have their length."""

    name: str
    handle: CacheHandle
    slots: np.ndarray
    found: int = 0  # tokens the group held at lookup (more than it could use: recomputed)
    # How far a finished disk load filled its slots (0: no load): the group
    # may hold more of the prompt than the request's own layers (a partial
    # hit from disk); set only until the release that caches it.
    loaded: int = 0

    @property
    def owned_slots(self) -> np.ndarray:
        return self.slots[self.handle.length :]


@dataclass(eq=False)
class Req:
    """One generation request.

    The KV of ``tokens[:kv_len]`` is in the arena at ``slots[:kv_len]``;
    ``slots`` may hold spare capacity past ``kv_len`` (whole pages). The first
    ``handle.length`` slots belong to the radix tree (locked by ``handle``); the
    rest are the request's own. The next forward computes ``tokens[kv_len:]``
    and samples the token after them.
    """

    rid: str
    model: str
    input_ids: np.ndarray  # int32
    params: SamplingParams
    stop: list[str]
    skip_special_tokens: bool
    arrival: float
    output_ids: list[int] = field(default_factory=list)
    order: int = field(default_factory=lambda: next(_arrival_order))
    runner: str | None = None
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    handle: CacheHandle | None = None
    # Its model's lower layer groups, when the model shares lower layers with
    # another (empty otherwise): ``slots``/``handle`` are its top group's.
    lower: list[LowerKV] = field(default_factory=list)
    # Prompt pages (tokens, first page's position) reported stored to KV-event
    # subscribers when scheduled, before the tree holds them
    # (``KVManager.hold_scheduled``); None when none are.
    event_hold: tuple[bytes, int] | None = None
    kv_len: int = 0
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    admitted_once: bool = False
    announced: bool = False  # first output sent (it carries stop strings)
    aborted: str | None = None  # reason, when aborted while a batch is in flight
    retractions: int = 0
    queue_time: float | None = None  # arrival to first admission (s); None until then
    # With prompt logprobs: prompt position -> the logprob of its token.
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    # ``output_ids`` packed so far (see ``packed_output_ids``).
    _packed_output: bytearray = field(default_factory=bytearray, init=False, repr=False)

    @functools.cached_property
    def wire(self) -> WireParams:
        """``params`` as forward batches carry them (``params`` never changes)."""
        p = self.params
        penalised = p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0
        sends_output = penalised or p.constraint is not None
        return WireParams(
            msgspec.structs.replace(p, stop_token_ids=[], logit_bias=[]),
            pack_ids(p.stop_token_ids) if p.stop_token_ids else b"",
            pack_bias(p.logit_bias) if p.logit_bias else b"",
            sends_output,
        )

    def packed_output_ids(self) -> bytes:
        """``output_ids`` as packed int32; only the ids added since the last call
        are converted (a step must not cost a Python pass over the whole output)."""
        done = len(self._packed_output) // 4
        if done > len(self.output_ids):  # never expected: output ids only grow
            self._packed_output.clear()
            done = 0
        if done < len(self.output_ids):
            self._packed_output += pack_ids(self.output_ids[done:])
        return bytes(self._packed_output)

    def token_slice(self, start: int, end: int) -> np.ndarray:
        """``tokens[start:end]`` without building ``tokens`` (a decode step
        needs one token, not a copy of the prompt and the output)."""
        prompt = len(self.input_ids)
        if end <= prompt:
            return self.input_ids[start:end]
        out = np.asarray(self.output_ids[max(start - prompt, 0) : end - prompt], dtype=np.int32)
        return out if start >= prompt else np.concatenate([self.input_ids[start:], out])

    @property
    def tokens(self) -> np.ndarray:
        """Prompt then every generated token (int32)."""
        if not self.output_ids:
            return self.input_ids
        return np.concatenate([self.input_ids, np.asarray(self.output_ids, dtype=np.int32)])

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and are not sent yet (they go with
        the first output; a request retracted later needs them no more)."""
        return self.params.prompt_logprobs_start >= 0 and not self.announced

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        """Tokens the next forward passes must compute before sampling."""
        return self.num_tokens - self.kv_len

    @property
    def owned_slots(self) -> np.ndarray:
        """Slots this request owns outside the tree (freed on abort)."""
        return self.slots[self.handle.length if self.handle is not None else 0 :]
