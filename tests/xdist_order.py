"""The order in which ``make test``'s two xdist workers get the suite's files.

``--dist loadfile`` hands out whole files, a new one to a worker with two
tests or fewer left, and by default orders them by how many tests each holds
(``--loadscope-reorder``): files of few long tests (a real-model reload, the
cluster) came last, and one worker ran them for minutes while the other had
finished. Here the files go out longest first (the longest-processing-time
rule: what is left at the end is short, so the workers end close together),
and before them the files that hold an ``alone`` test, shortest first, each
such test first in its file: an ``alone`` test waits for the other worker's
current test to end, idle, and at the start of the run that test is another
file's ``alone`` test or a short one, not a long test begun a moment earlier.

``SECONDS`` are measured figures (``--durations``, two workers on a 2-core
machine), rounded; a file not listed is short and keeps its place in the
collection order, after the listed ones. A stale figure only costs balance,
never a test. Without xdist nothing changes but the order.
"""

from __future__ import annotations

import pytest

# File name -> its tests' total seconds (calls and module set-ups), longest first.
SECONDS: dict[str, float] = {
    "test_on_demand.py": 420,
    "test_disk_tier.py": 330,
    "test_soak.py": 200,
    "test_model_admission.py": 190,
    "test_scheduler_process.py": 200,
    "test_model_lifecycle.py": 140,
    "test_cluster.py": 130,
    "test_structured_engine.py": 90,
    "test_models_real.py": 85,
    "test_layer_sharing.py": 75,
    "test_bench_serving.py": 60,
    "test_launcher.py": 55,
    "test_hostile_stalls.py": 55,
    "test_disk_store_safety.py": 50,
    "test_api_fuzz.py": 46,
    "test_scheduler_supervision.py": 45,
    "test_kv_share_key.py": 41,
    "test_structured_api.py": 40,
    "test_disk_tier_shared.py": 36,
    "test_grammar_runner.py": 34,
    "test_models_fetch.py": 34,
    "test_e2e_http.py": 33,
    "test_warmup.py": 28,
    "test_process_hygiene.py": 28,
    "test_dashboard.py": 25,
    "test_runner_process.py": 24,
    "test_kv_events.py": 20,
    "test_deterministic.py": 20,
    "test_bench_peers.py": 19,
}


class LongestFirst:
    """The plugin: registered by conftest.py; see the module docstring."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        """Controller: keep the collection order (the one made below) for the files."""
        if hasattr(config.option, "loadscopereorder"):
            config.option.loadscopereorder = False

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Every process: files with an ``alone`` test first, shortest first (the
        long rest of the last one overlaps the others' ``alone`` tests least),
        then the others longest first; within a file its ``alone`` tests first."""
        with_alone = {item.path for item in items if item.get_closest_marker("alone")}

        def key(item: pytest.Item) -> tuple[bool, float, bool]:
            seconds = SECONDS.get(item.path.name, 0.0)
            alone = item.get_closest_marker("alone") is not None
            if item.path in with_alone:
                return (False, seconds, not alone)
            return (True, -seconds, not alone)

        items.sort(key=key)  # stable: unlisted files keep the collection order
