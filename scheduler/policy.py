"""Schedule policies: in what order a model's waiting requests are admitted.

- ``fcfs``: arrival order.
- ``lof``: longest output first (largest ``max_new_tokens``).
- ``random``: seeded shuffle.
- ``lpm``: longest cached prefix first, so hits run while their KV is warm;
  but first the *leader* of every group of waiting requests that share a
  not-yet-cached prefix (the earliest of them), because computing its prompt
  is what turns the rest of its group into hits. Serving hits before leaders
  (plain longest-prefix order) left the last group's leader for the budget
  that hits did not use, and its followers for an extra step at the end: 0.89-0.95x
  fcfs's throughput on a burst of shuffled shared-prefix requests.
- ``dfs-weight``: walk the radix tree depth first, heavier subtrees (more
  waiting requests under them) first, so requests sharing a prefix run
  back to back.
``lpm`` and ``dfs-weight`` need the cache: with it disabled, or with a queue
too long to probe cheaply, they fall back to ``fcfs`` (as SGLang does).
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

from radixmux.memory.radix_cache import Node, RadixCache
from radixmux.scheduler.request import Req

# Probing the tree costs O(prompt) per request; past this queue length the
# ordering is not worth it.
MAX_PROBED_QUEUE = 256
# Waiting requests whose next uncached tokens agree on this many form a group
# (the scheduler's in-batch prefix sharing uses the same length).
GROUP_TOKENS = 32


Policy = Callable[[Sequence[Req], RadixCache | None, random.Random], list[Req]]


def _fcfs(waiting: Sequence[Req], cache: RadixCache | None, rng: random.Random) -> list[Req]:
    return sorted(waiting, key=lambda r: r.order)


def _lof(waiting: Sequence[Req], cache: RadixCache | None, rng: random.Random) -> list[Req]:
    return sorted(waiting, key=lambda r: (-r.params.max_new_tokens, r.order))


def _random(waiting: Sequence[Req], cache: RadixCache | None, rng: random.Random) -> list[Req]:
    out = list(waiting)
    rng.shuffle(out)
    return out


def _lpm(waiting: Sequence[Req], cache: RadixCache | None, rng: random.Random) -> list[Req]:
    assert cache is not None
    probes = {r: cache.match(r.model, r.tokens[:-1], record=False) for r in waiting}
    leaders = group_leaders(waiting, {r: probes[r].length for r in waiting})
    return sorted(waiting, key=lambda r: (r not in leaders, -probes[r].length, r.order))


def _dfs(waiting: Sequence[Req], cache: RadixCache | None, rng: random.Random) -> list[Req]:
    assert cache is not None
    probes = {r: cache.match(r.model, r.tokens[:-1], record=False) for r in waiting}
    return _dfs_weight(waiting, {r: probes[r].handle.node for r in waiting})


# Every name in ``common.server_args.SCHEDULE_POLICIES`` and nothing else.
POLICIES: dict[str, Policy] = {
    "lpm": _lpm,
    "dfs-weight": _dfs,
    "fcfs": _fcfs,
    "lof": _lof,
    "random": _random,
}
# Policies that probe the tree (they fall back to ``fcfs`` without it).
CACHE_POLICIES = ("lpm", "dfs-weight")


def order_waiting(
    policy: str,
    waiting: Sequence[Req],
    cache: RadixCache | None,
    rng: random.Random,
) -> list[Req]:
    """``waiting`` in the order ``policy`` admits them."""
    if policy in CACHE_POLICIES and (cache is None or len(waiting) > MAX_PROBED_QUEUE):
        policy = "fcfs"
    if policy not in POLICIES:
        raise ValueError(f"unknown schedule policy {policy!r}")
    return POLICIES[policy](waiting, cache, rng)


def group_leaders(waiting: Sequence[Req], cached: dict[Req, int]) -> set[Req]:
    """The earliest request of each group of two or more waiting requests whose
    prompts agree on everything cached plus ``GROUP_TOKENS`` uncached tokens."""
    groups: defaultdict[bytes, list[Req]] = defaultdict(list)
    for req in sorted(waiting, key=lambda r: r.order):
        end = cached[req] + GROUP_TOKENS
        if end < req.num_tokens:
            groups[req.tokens[:end].tobytes()].append(req)
    return {members[0] for members in groups.values() if len(members) > 1}


def _dfs_weight(waiting: Sequence[Req], last_node: dict[Req, Node]) -> list[Req]:
    weight: Counter[Node] = Counter()
    at: defaultdict[Node, list[Req]] = defaultdict(list)
    roots: dict[int, Node] = {}
    for req in sorted(waiting, key=lambda r: r.order):
        node = last_node[req]
        at[node].append(req)
        while True:
            weight[node] += 1
            if node.parent is None:
                roots[id(node)] = node
                break
            node = node.parent
    out: list[Req] = []
    stack = sorted(roots.values(), key=lambda n: weight[n])
    while stack:
        node = stack.pop()
        out.extend(at[node])
        children = [c for c in node.children.values() if weight[c]]
        stack.extend(sorted(children, key=lambda n: weight[n]))
    return out
