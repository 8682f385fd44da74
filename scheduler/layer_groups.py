"""Layer groups: models that share their lower layers store those layers' K/V once.

Fine-tunes of one base often leave the lower layers as they were (frozen
during training). Two such models compute identical K/V in those layers for
the same tokens, so the unified cache keeps those layers' K/V once for both.

A served model's layers are cut at *split points* into contiguous groups;
each group is a model of its own to the radix cache and the allocator (a
*group name* ``"<model>#layers<a>-<b>"``, a layout with ``b - a`` layers, a
pool keyed by the layer-chain fingerprint ``ModelInfo.layer_keys[b - 1]``),
so models whose chains agree up to ``b`` share the entries and slots of group
``[a, b)``. The model's own name is its top group ``[s, L)``: its hits are the
full hits. A request holds a handle and slots per group; the runner reads
each layer's K/V from its group's slots (``ForwardBatch.layer_splits``).

Split points are chosen when models register: at start from every model
given (for each pair, the depth to which their chains agree), at run time
from the split points of the models already served (a registered model's
layout is cut again only while it is idle). A prefix counts as cached for a
model (``kv_len``) where its own top group holds it. Where its lower groups
hold more (a sibling ran the prompt), a runner that can restart its upper
layers from stored hidden states (``ModelInfo.layer_restart``: each lower
group then keeps its boundary hidden state per token in extra pseudo-layers)
computes only the layers above for those tokens: a partial hit. Otherwise
every group is cut back to the shortest match and the lower layers are
recomputed (identical values; the insert keeps the tree's copy).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import msgspec

from radixmux.memory.layout import hidden_layers
from radixmux.memory.radix_cache import ModelSpec, RadixCache
from radixmux.protocol import ModelInfo


def shared_depth(a: Sequence[str], b: Sequence[str]) -> int:
    """How many leading layers two layer chains agree on."""
    depth = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        depth += 1
    return depth


def plan_splits(
    chains: Mapping[str, Sequence[str]], served: Mapping[str, tuple[int, ...]] | None = None
) -> dict[str, tuple[int, ...]]:
    """Split points for the models of ``chains`` (name -> ``layer_keys``).

    Without ``served``: each model is cut at every depth ``0 < d < L`` to which
    its chain agrees with another's. With ``served`` (models already
    registered, with their split points, their chains in ``chains`` too): each
    new model takes the served models' split points up to the depth it shares
    with them, and nothing else (their layouts are fixed). Models with no
    chain (an architecture whose layers were not found) are never cut.
    """
    served = served or {}
    new = [m for m in chains if m not in served]
    splits: dict[str, set[int]] = {m: set() for m in new}
    for m in new:
        mine = chains[m]
        for other, theirs in chains.items():
            if other == m or not mine or len(theirs) != len(mine):
                continue
            depth = shared_depth(mine, theirs)
            if other in served:
                splits[m] |= {s for s in served[other] if s <= depth}
            elif 0 < depth < len(mine):
                splits[m].add(depth)
    return {m: tuple(sorted(s)) for m, s in splits.items()}


def recuts(served: Mapping[str, ModelGroups], chain: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Served models a newcomer (``chain``) agrees with deeper than where
    they are cut, with the split points they would need to share with it."""
    out = {}
    for model, groups in served.items():
        if len(groups.chain) != len(chain):
            continue
        depth = shared_depth(groups.chain, chain)
        if 0 < depth < len(chain) and depth not in groups.splits:
            out[model] = tuple(sorted({*groups.splits, depth}))
    return out


def group_name(model: str, start: int, end: int) -> str:
    """The cache's name for layers ``start..end-1`` of ``model``."""
    return f"{model}#layers{start}-{end}"


def group_specs(
    spec: ModelSpec, layer_keys: Sequence[str], splits: tuple[int, ...], hidden: int = 0
) -> list[ModelSpec]:
    """The cache specs of a model cut at ``splits``: its lower groups first,
    then its own (top) group. ``spec`` is the model's spec as one group.

    A lower group's pool is the chain fingerprint at its top layer (plus its
    span and dtype), so models that agree that far share it; the top group
    keeps the model's KV-share key (a replica or alias shares everything).
    ``hidden`` pseudo-layers per lower group hold its boundary hidden states
    (``restart_layers``), from which the layers above can be run alone.
    """
    if not splits:
        return [spec]
    layout = spec.layout
    bounds = [0, *splits, layout.num_layers]
    out = []
    for a, b in itertools.pairwise(bounds):
        top = b == layout.num_layers
        pool = spec.pool if top else f"layers:{layer_keys[b - 1]}:{layout.dtype}:+{hidden}h"
        out.append(
            replace(
                spec,
                name=spec.name if top else group_name(spec.name, a, b),
                pool=f"{pool}:{a}-{b}",
                layout=msgspec.structs.replace(layout, num_layers=b - a + (0 if top else hidden)),
                cost_per_token=spec.cost_per_token * (b - a) / layout.num_layers,
                # A static partition's share is per model: its top group takes it.
                floor_bytes=spec.floor_bytes if top else 0,
                cap_bytes=spec.cap_bytes if top else None,
            )
        )
    return out


@dataclass(frozen=True)
class ModelGroups:
    """How one served model is cut: its split points, the cache names of its
    groups below the top one (the top group is the model's own name), its
    groups' pools and its layer chain (for models that register later)."""

    splits: tuple[int, ...]
    lower: tuple[str, ...]
    pools: tuple[str, ...]
    chain: tuple[str, ...]
    restart: bool = False  # its runner runs upper groups from stored hidden states


def restart_layers(info: ModelInfo) -> int:
    """Hidden-state pseudo-layers per lower group for a model whose runner can
    restart its upper layers from them (0: it cannot; its partial hits are
    recomputed)."""
    if not info.layer_restart or not info.hidden_size:
        return 0
    return hidden_layers(info.layout, info.hidden_size)


def register(
    cache: RadixCache,
    spec: ModelSpec,
    layer_keys: Sequence[str],
    splits: tuple[int, ...],
    hidden: int = 0,
) -> ModelGroups:
    """Register every group of a model with the cache (all or none: a
    ValueError, a group whose KV cannot live in the arena, undoes the rest)."""
    specs = group_specs(spec, layer_keys, splits, hidden)
    done: list[str] = []
    try:
        for s in specs:
            cache.register_model(s)
            done.append(s.name)
    except ValueError:
        for name in done:
            cache.unregister_model(name)
        raise
    names = tuple(s.name for s in specs[:-1])
    pools = tuple(s.pool for s in specs)
    return ModelGroups(splits, names, pools, tuple(layer_keys), restart=hidden > 0)


def join(
    cache: RadixCache, served: Mapping[str, ModelGroups], spec: ModelSpec, info: ModelInfo
) -> ModelGroups:
    """Register a model that arrives at run time: it is cut at the served
    models' split points as far as it shares their layers (``plan_splits``)."""
    chains: dict[str, Sequence[str]] = {m: g.chain for m, g in served.items()}
    chains[spec.name] = info.layer_keys
    splits = plan_splits(chains, {m: g.splits for m, g in served.items()})[spec.name]
    return register(cache, spec, info.layer_keys, splits, restart_layers(info))
