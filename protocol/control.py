"""Operations the front asks of the scheduler (stats, cache control, warm-ups) and
their replies."""

from __future__ import annotations

import msgspec

from radixmux.protocol.views import DashboardSnapshot, SchedulerStats


class ControlRequest(msgspec.Struct, tag="control", frozen=True):
    """Operations the front asks of the scheduler: ``stats``, ``check`` (stats
    with the invariant check run now, unless nothing changed since the last
    one or it ran under a second ago: rate-limited, the reply says its age),
    ``flush_cache``, ``invalidate`` (``model`` required), ``dashboard`` (stats
    plus a ``DashboardSnapshot``)."""

    req_id: str
    op: str
    model: str | None = None




class ControlReply(msgspec.Struct, tag="control_reply", frozen=True):
    req_id: str
    ok: bool
    message: str = ""
    stats: SchedulerStats | None = None
    dashboard: DashboardSnapshot | None = None


# ---- warm-up (POST /cache/warmup, --warmup FILE) ------------------------------------
class WarmupRequest(msgspec.Struct, tag="warmup", frozen=True):
    """Front to scheduler: prefill each prefix (packed int32 ids) at low
    priority and cache it; ``pin`` True keeps it from eviction, False releases
    a pin an earlier warm-up of the same prefix took. Answered by ``WarmupReply``."""

    req_id: str
    model: str  # instance name
    prefixes: list[bytes]
    pin: bool = False


class WarmedPrefix(msgspec.Struct, frozen=True):
    """One prefix after its warm-up: ``cached_tokens`` of its ``prompt_tokens``
    are in the tree now (whole pages), ``computed_tokens`` were prefilled for
    it, ``pinned_tokens`` are held by its pin (0 when not pinned)."""

    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    pinned_tokens: int


class WarmupReply(msgspec.Struct, tag="warmup_reply", frozen=True):
    """Scheduler to front: every prefix of a ``WarmupRequest`` is done
    (``status`` 200, one item each, in order) or it failed (``status`` >= 400,
    ``message`` says why, ``param`` names the field)."""

    req_id: str
    status: int = 200
    message: str = ""
    param: str | None = None
    items: list[WarmedPrefix] = msgspec.field(default_factory=list)
