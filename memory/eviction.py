"""Eviction policies: which unlocked leaf entry of the radix tree goes first.

A policy maps an entry to a sort key; the tree evicts the smallest key first.
Only leaf-most entries of a model are ever candidates (an entry whose node has
no child holding the same model's KV), so a cached prefix never loses its head
while its tail stays.

``weighted`` scores the value a cached entry keeps per byte it holds::

    value = priority * (1 + hits) * cost_per_token / bytes_per_token
            * 0.5 ** (age / half_life)

- ``cost_per_token`` is the compute a hit saves for that model (e.g. its
  parameter count, so a hit on a big model is worth more than on a small one);
  a hit on an entry of ``t`` tokens saves ``t * cost_per_token`` and the entry
  holds ``t * bytes_per_token``, so ``t`` cancels and the score is per byte.
- ``hits`` counts matches that used the entry (frequency).
- ``age`` is the time since the entry was last used, in the tree's clock
  (a logical tick per match/insert by default); it halves the value every
  ``half_life`` ticks (recency).
- ``priority`` is the model's ``--model-priority``.

Because ``age = now - last_access`` and ``now`` is the same for every entry
at one eviction, ordering by ``log2(value)`` equals ordering by
``log2(priority * (1 + hits) * cost / bytes) + last_access / half_life``: a key
that does not change while the entry is untouched, so the tree can keep its
candidates in one persistent heap instead of re-scoring every leaf per call.
Entries of an invalidated (orphaned) model always sort first.
"""

from __future__ import annotations

import math
from collections.abc import Callable

EVICTION_POLICIES = ("lru", "lfu", "weighted")

# (orphaned, last_access, hits, weight) -> sort key; weight is
# priority * cost_per_token / bytes_per_token of the entry's cache.
KeyFn = Callable[[bool, float, int, float], tuple[float, ...]]


def _lru(orphaned: bool, last_access: float, hits: int, weight: float) -> tuple[float, ...]:
    return (0.0 if orphaned else 1.0, last_access)


def _lfu(orphaned: bool, last_access: float, hits: int, weight: float) -> tuple[float, ...]:
    return (0.0 if orphaned else 1.0, float(hits), last_access)


def make_weighted(half_life: float) -> KeyFn:
    """The ``weighted`` policy with a recency half-life in clock ticks."""

    def key(orphaned: bool, last_access: float, hits: int, weight: float) -> tuple[float, ...]:
        if orphaned:
            return (0.0, last_access)
        return (1.0, math.log2(weight * (1 + hits)) + last_access / half_life)

    return key


def get_policy(name: str, half_life: float = 1000.0) -> KeyFn:
    """The sort-key function of a policy by name (``lru``, ``lfu``, ``weighted``)."""
    if name == "lru":
        return _lru
    if name == "lfu":
        return _lfu
    if name == "weighted":
        return make_weighted(half_life)
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {EVICTION_POLICIES}")
