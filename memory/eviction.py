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
Entries of an invalidated (orphaned) model always score lowest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

EVICTION_POLICIES = ("lru", "lfu", "weighted")


@dataclass(frozen=True)
class EntryFacts:
    """What a policy may look at for one candidate entry."""

    last_access: float
    hits: int
    tokens: int
    bytes_per_token: int
    cost_per_token: float
    priority: float
    orphaned: bool


ScoreFn = Callable[[EntryFacts, float], tuple[float, ...]]


def _lru(f: EntryFacts, now: float) -> tuple[float, ...]:
    return (0.0 if f.orphaned else 1.0, f.last_access)


def _lfu(f: EntryFacts, now: float) -> tuple[float, ...]:
    return (0.0 if f.orphaned else 1.0, float(f.hits), f.last_access)


def make_weighted(half_life: float) -> ScoreFn:
    """The ``weighted`` policy with a recency half-life in clock ticks."""

    def score(f: EntryFacts, now: float) -> tuple[float, ...]:
        if f.orphaned:
            return (0.0, f.last_access)
        decay = 0.5 ** (max(0.0, now - f.last_access) / half_life)
        value = f.priority * (1 + f.hits) * f.cost_per_token / f.bytes_per_token * decay
        return (1.0, value, f.last_access)

    return score


def get_policy(name: str, half_life: float = 1000.0) -> ScoreFn:
    """The sort-key function of a policy by name (``lru``, ``lfu``, ``weighted``)."""
    if name == "lru":
        return _lru
    if name == "lfu":
        return _lfu
    if name == "weighted":
        return make_weighted(half_life)
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {EVICTION_POLICIES}")
