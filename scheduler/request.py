"""A request as the scheduler tracks it, from arrival to finish."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from radixmux.memory.radix_cache import CacheHandle
from radixmux.protocol import SamplingParams, TokenLogprob

_arrival_order = itertools.count()


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
    kv_len: int = 0
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    admitted_once: bool = False
    announced: bool = False  # first output sent (it carries stop strings)
    aborted: str | None = None  # reason, when aborted while a batch is in flight
    retractions: int = 0
    queue_time: float | None = None  # arrival to first admission (s); None until then
    # With prompt logprobs: prompt position -> the logprob of its token.
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)

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
