"""A log of what the radix tree starts and stops holding, per model, for
publishing as KV events (``scheduler/kv_events.py`` hashes and sends them).

The tree appends one ``TreeEvent`` per entry it adds or drops while a log is
attached (``RadixCache.events``); with none attached it records nothing, so a
server without KV events pays one ``is None`` test per entry change. Events
carry token paths, not hashes: hashing is the publisher's work, off the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

TreeEventKind = Literal["stored", "removed"]
# Where the KV is: the arena (the tree's own entries) or the disk tier's chunks.
TreeEventTier = Literal["arena", "disk"]


@dataclass(frozen=True)
class TreeEvent:
    """Tokens ``[start, len(tokens))`` of a path (packed int32, from the
    namespace root) began or ceased to be cached for each of ``models``.
    ``start`` and the path length are whole pages."""

    kind: TreeEventKind
    models: tuple[str, ...]
    tokens: bytes
    start: int
    tier: TreeEventTier = "arena"


@dataclass
class TreeEventLog:
    """Events since the last ``drain``, in the order the tree changed."""

    events: list[TreeEvent] = field(default_factory=list)

    def add(
        self,
        kind: TreeEventKind,
        models: tuple[str, ...],
        tokens: bytes,
        start: int,
        tier: TreeEventTier = "arena",
    ) -> None:
        if models and len(tokens) > start * 4:
            self.events.append(TreeEvent(kind, models, tokens, start, tier))

    def drain(self) -> list[TreeEvent]:
        """The events recorded so far, oldest first; the log starts empty again."""
        events, self.events = self.events, []
        return events
