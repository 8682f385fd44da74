"""What the radix tree reports about itself: evictions by reason per model,
its size (tokens, index bytes kept in O(1)) and its most shared prefixes."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_radix_cache import make_cache, serve

from radixmux.memory.radix_cache import EVICTION_REASONS
from radixmux.memory.radix_diagnostics import check_invariants, dump, python_bytes, top_prefixes


def test_evictions_by_reason_per_model() -> None:
    cache = make_cache()  # a and a2 share one generation (same weights); b and c their own
    serve(cache, "a", [1, 2, 3, 4])
    serve(cache, "b", [1, 2, 3])
    serve(cache, "c", [9, 9])
    assert "unload" in EVICTION_REASONS
    # Invalidating b frees its 3 tokens: b's, and nobody else's.
    assert cache.invalidate("b") == 3
    # Invalidating replica a2 frees nothing yet: a still uses the shared generation.
    assert cache.invalidate("a2") == 0
    # A flush then frees a's 4 tokens (counted for a, whose generation it is now) and c's 2.
    assert cache.flush() == 4 + 2
    per = cache.stats().evicted_by_model
    assert per["b"] == {"capacity": 0, "invalidation": 3, "flush": 0, "unload": 0}
    assert per["a"]["flush"] == 4 and per["a2"]["flush"] == 0
    assert per["c"]["flush"] == 2
    # The global counts are the per-generation sums.
    assert cache.stats().evicted_tokens["flush"] == 6
    check_invariants(cache, held={})


def test_an_orphaned_generation_counts_for_the_models_it_served() -> None:
    cache = make_cache()
    serve(cache, "a", [1, 2, 3, 4, 5])
    cache.invalidate("a2")  # a2 leaves the shared generation first
    assert cache.invalidate("a") == 5  # now orphaned: freed under its last users
    per = cache.stats().evicted_by_model
    # Both replicas-by-weight used that generation, so both count its invalidation.
    assert per["a"]["invalidation"] == 5 and per["a2"]["invalidation"] == 5


def test_capacity_evictions_count_for_the_evicted_generation() -> None:
    cache = make_cache(num_blocks=1)  # one block: 64 TINY tokens
    serve(cache, "a", list(range(100, 140)))  # 40 tokens of a
    serve(cache, "a", list(range(200, 240)))  # needs 40: evicts the first path
    per = cache.stats().evicted_by_model
    assert per["a"]["capacity"] == 40 and per["a2"]["capacity"] == 40
    assert per["b"]["capacity"] == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_index_bytes_tracks_the_walk(page_size: int) -> None:
    cache = make_cache(page_size=page_size, num_blocks=16)
    rng = random.Random(0)
    empty = cache.index_bytes()
    for step in range(300):
        model = rng.choice(["a", "b", "c", "a2"])
        n = rng.randrange(1, 12) * page_size
        tokens = [rng.randrange(8) for _ in range(n)]  # small vocab: many splits
        serve(cache, model, tokens)
        if step % 50 == 49:
            cache.invalidate_prefix("g1", tokens[:page_size])
        if step % 97 == 96:
            cache.invalidate("b")
        check_invariants(cache, held={})  # includes the kept counts
        walked = python_bytes(cache)
        assert cache.index_bytes() == pytest.approx(walked, rel=0.25)
    assert cache.stats().tree_tokens == sum(len(t) for t in dump(cache).values())
    cache.flush()
    assert cache.index_bytes() == empty and cache.tree_tokens == 0


def test_top_prefixes_finds_the_shared_system_prompt() -> None:
    cache = make_cache()
    system = list(range(500, 540))  # 40 tokens
    for i in range(5):  # 5 requests of a: 4 hit the system prompt
        serve(cache, "a", system + [i, i, i])
    for i in range(3):  # 3 of b (same tokenizer group): 2 hit it
        serve(cache, "b", system + [10 + i])
    serve(cache, "c", [1, 2, 3])  # another group, never shared
    top = top_prefixes(cache, k=5)
    assert top.complete
    first = top.prefixes[0]
    assert np.frombuffer(first.tokens, dtype=np.int32).tolist() == system
    assert first.children == 8  # 5 + 3 continuations
    by_models = {h.models: h for h in first.holders}
    assert by_models[("a", "a2")].hits == 4 and by_models[("b",)].hits == 2
    # What hangs below: the prompt plus each request's own continuation.
    assert by_models[("a", "a2")].subtree_tokens == 40 + 5 * 3
    assert by_models[("b",)].subtree_tokens == 40 + 3
    assert first.hits == 6
    # Nothing else was ever shared: unshared paths are not listed.
    assert len(top.prefixes) == 1
    check_invariants(cache, held={})


def test_top_prefixes_reports_where_sharing_changes_and_is_bounded() -> None:
    cache = make_cache()
    base = [1, 2, 3, 4]
    for tail in ([5, 6], [5, 6], [5, 6, 7], [8]):
        serve(cache, "a", base + tail)
    prefixes = top_prefixes(cache, k=10).prefixes
    # [1..4] is shared by 3 later lookups, [1..4, 5, 6] by 2: two levels, most hits first.
    got = [(np.frombuffer(p.tokens, np.int32).tolist(), p.hits) for p in prefixes]
    assert got == [(base, 3), (base + [5, 6], 2)]
    # A tiny budget stops early and says so.
    assert not top_prefixes(cache, k=10, max_visits=1).complete
