"""The mini-sglang peer arm of the radix benchmark (``bench_radix --peer mini-sglang``).

Runs the quick comparison when the peer is installed
(``python -m bench.peers install mini-sglang --source PATH``) and skips
otherwise. It checks that the figures are consistent with each other and
with each tree's own accounting, not how fast either tree is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_radix, peers
from bench.radix_peer_minisgl import TREE_OPS


def _installed() -> bool:
    try:
        peers.minisgl_paths()
    except peers.PeerUnavailable:
        return False
    return True


@pytest.mark.skipif(not _installed(), reason="mini-sglang peer not installed in bench/.peers")
def test_peer_arm_replays_the_same_requests_in_both_trees(tmp_path: Path) -> None:
    out = tmp_path / "peer.json"
    argv = ["--peer", "mini-sglang", "--quick", "--rounds", "2", "--out", str(out)]
    assert bench_radix.main(argv) == 0
    result = json.loads(out.read_text())
    requests = result["trace"]["requests"]
    arms = {a["arm"]: a for a in result["arms"]}
    assert set(arms) == {"radixmux", "mini-sglang"}
    for arm in arms.values():
        # The quick arena holds the longest request: everything is served,
        # under pressure (evictions happen).
        assert arm["requests"] == requests and arm["served"] == requests
        assert arm["rejected"] == 0
        assert arm["evict_calls"] > 0 and arm["evicted_tokens"] > 0
        # Every token a tree adopted is either still cached or was evicted,
        # by the tree's own counts.
        assert arm["adopted_tokens"] - arm["cached_at_end"] == arm["evicted_tokens"]
        assert arm["cached_at_end"] <= result["trace"]["capacity_tokens"]
        # One match, lock, insert and unlock per request, plus each eviction.
        assert arm["tree_calls"] == 4 * requests + arm["evict_calls"]
        assert all(arm["p50_us"][op] > 0 for op in TREE_OPS)
        assert arm["tree_ms"] > 0
        # Medians over rounds: of calls per second, of summed time. With an odd
        # count they are the same round's; with an even one, means of two, and
        # the mean rate is at least the rate of the mean time.
        ops_per_s = arm["tree_calls"] / (arm["tree_ms"] / 1e3)
        assert arm["tree_ops_per_s"] >= ops_per_s * 0.999
        assert 0.3 < arm["hit_rate"] < 1.0
    rx, ms = arms["radixmux"], arms["mini-sglang"]
    # Both are LRU over the same capacity: the same requests hit about the same.
    assert rx["hit_rate"] == pytest.approx(ms["hit_rate"], abs=0.02)
    assert rx["evicted_tokens"] == pytest.approx(ms["evicted_tokens"], rel=0.05)
    assert result["same_match_lengths"] > 0.9
    assert len(result["round_ratios"]) == 2
    assert result["ratio_tree_ops_per_s"] > 0
    assert result["minisgl"]["commit"] == peers.minisgl_paths().commit
