"""Metrics and the live view end to end: a real server, real HTTP, a real browser.

One server (launcher, every process) serves three tiny random-weight models:
``a``, ``a2`` (the same weights under another name, so it shares ``a``'s
cache) and ``b``, behind an API key, with a small arena so eviction is easy
to cause. Known workloads go in through HTTP; ``/metrics`` must move by what
they imply, exactly. Then headless Chromium renders ``/dashboard`` while the
server is under load and after, and what it shows must agree with ``/metrics``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.tiny_models import make_tiny_model_dir
from radixmux.runtime.client.engine import Engine

pytestmark = pytest.mark.timeout(240)

KEY = "dash-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODELS = ("a", "a2", "b")
REASONS = ("capacity", "invalidation", "flush", "unload")
METRICS_DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("dash_models")
    a = make_tiny_model_dir(root / "a", seed=11)
    b = make_tiny_model_dir(root / "b", seed=12, chat_template=False)
    engine = Engine(
        model=[f"{a},name=a", f"{a},name=a2", f"{b},name=b"],
        kv_cache_bytes=2 << 20,  # 32 blocks of 64 KiB: 128 tokens each for these models
        kv_block_bytes=64 << 10,
        runner_threads=1,
        check_invariants=True,
        api_key=KEY,
        dtype="float32",
    )
    try:
        yield f"http://127.0.0.1:{engine.args.port}"
    finally:
        engine.shutdown()


def scrape(url: str) -> Samples:
    """``/metrics`` as {(sample name, sorted labels): value}."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples carrying ``labels`` (others, e.g. version, any)."""
    want = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and want <= set(have))


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def complete(url: str, model: str, prompt: str | list[int], n: int = 2) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ---- metrics against known workloads --------------------------------------------------
def test_shared_prefix_hits_saved_tokens_and_queue_times(server: str) -> None:
    prefix = ids(1000, 40)
    before = scrape(server)
    for i in range(5):  # sequential: the first computes the prefix, the other 4 hit it
        usage = complete(server, "a", [*prefix, 2000 + i, 7, 7])["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == (40 if i else 0)
    # a2 has a's weights: one cache, so its first request hits what a computed.
    complete(server, "a2", [*prefix, 3000, 7, 7])
    after = scrape(server)

    def d(name: str, model: str) -> float:
        return delta(before, after, name, model=model)

    assert d("radixmux_cache_hits_total", "a") == 4
    assert d("radixmux_cache_misses_total", "a") == 1
    assert d("radixmux_cache_tokens_saved_total", "a") == 4 * 40
    assert d("radixmux_cache_tokens_queried_total", "a") == 5 * 43
    assert d("radixmux_cached_prompt_tokens_total", "a") == 4 * 40  # as the front saw it
    assert d("radixmux_cache_hits_total", "a2") == 1
    assert d("radixmux_cache_tokens_saved_total", "a2") == 40
    assert d("radixmux_cache_tokens_queried_total", "b") == 0
    # One queue-time observation per request, on the model it went to.
    assert d("radixmux_request_queue_time_seconds_count", "a") == 5
    assert d("radixmux_request_queue_time_seconds_count", "a2") == 1
    assert d("radixmux_request_queue_time_seconds_count", "b") == 0
    assert 0 < d("radixmux_request_queue_time_seconds_sum", "a") < 5 * 10
    # The tree holds the shared cache once: a's and a2's figures are the same tokens.
    assert value(after, "radixmux_cached_tokens", model="a") == value(
        after, "radixmux_cached_tokens", model="a2"
    )
    assert value(after, "radixmux_tree_tokens") >= 40 + 6 * 3
    assert value(after, "radixmux_tree_index_bytes") > value(after, "radixmux_tree_tokens") * 8


def test_invalidate_and_flush_move_per_model_evictions_by_exact_tokens(server: str) -> None:
    for i in range(3):  # both caches hold tokens, whatever ran before
        complete(server, "a", [*ids(4000, 30), 4500 + i])
        complete(server, "b", [*ids(5000, 30), 6000 + i])
    before = scrape(server)
    held_a = value(before, "radixmux_cached_tokens", model="a")
    held_b = value(before, "radixmux_cached_tokens", model="b")
    assert held_a > 0 and held_b > 0
    assert value(before, "radixmux_tree_tokens") == held_a + held_b  # a2 shares a's cache

    r = httpx.post(f"{server}/models/b/invalidate", headers=AUTH, timeout=30)
    assert r.status_code == 200 and f"freed {int(held_b)} tokens" in r.json()["message"]
    mid = scrape(server)
    ev = "radixmux_model_evicted_tokens_total"
    assert delta(before, mid, ev, model="b", reason="invalidation") == held_b
    for model in ("a", "a2"):
        assert delta(before, mid, ev, model=model, reason="invalidation") == 0
    assert delta(before, mid, "radixmux_evicted_tokens_total", reason="invalidation") == held_b

    assert httpx.post(f"{server}/flush_cache", headers=AUTH, timeout=30).status_code == 200
    after = scrape(server)
    # One cache, two models: the flush counts for each, the global counter once.
    assert delta(mid, after, ev, model="a", reason="flush") == held_a
    assert delta(mid, after, ev, model="a2", reason="flush") == held_a
    assert delta(mid, after, ev, model="b", reason="flush") == 0
    assert delta(mid, after, "radixmux_evicted_tokens_total", reason="flush") == held_a
    assert value(after, "radixmux_tree_tokens") == 0
    assert value(after, "radixmux_tree_nodes") == 0
    for model in MODELS:
        assert delta(before, after, ev, model=model, reason="capacity") == 0
        assert delta(before, after, ev, model=model, reason="unload") == 0


def test_capacity_evictions_per_model_add_up_to_the_global_count(server: str) -> None:
    before = scrape(server)
    # 2 x 10 prompts of 300 tokens: more than the arena's 4,096 slots.
    for i in range(10):
        for model in ("a", "b"):
            complete(server, model, ids(8000 + 400 * i, 300))
    after = scrape(server)
    ev = "radixmux_model_evicted_tokens_total"
    got = {m: delta(before, after, ev, model=m, reason="capacity") for m in MODELS}
    total = delta(before, after, "radixmux_evicted_tokens_total", reason="capacity")
    assert total > 0 and got["a"] > 0 and got["b"] > 0
    assert got["a"] == got["a2"]  # the shared cache's evictions count for both
    assert got["a"] + got["b"] == total  # ...but are one cache's tokens


def test_metrics_doc_documents_every_exposed_metric(server: str) -> None:
    text = httpx.get(f"{server}/metrics", timeout=30).text
    exposed = set()
    for fam in text_string_to_metric_families(text):
        if not fam.name.endswith("_created"):  # prometheus_client's timestamps (the doc says)
            exposed.add(fam.name + "_total" if fam.type == "counter" else fam.name)
    documented = set(re.findall(r"^\| `(radixmux_\w+)`", METRICS_DOC.read_text(), re.M))
    assert exposed - documented == set(), "metrics missing from docs/metrics.md's table"
    # Documented but not exposed here: only the disk tier's and layer sharing's
    # (this server has neither).
    absent = documented - exposed
    assert all(n.startswith(("radixmux_disk_", "radixmux_layer_group_")) for n in absent), absent


# ---- the live view -------------------------------------------------------------------
class Rendered(HTMLParser):
    """The dumped DOM's elements that carry a ``data-*`` key, with their text."""

    VOID = frozenset({"meta", "br", "img", "input", "link", "hr"})

    def __init__(self, html: str) -> None:
        super().__init__()
        self.elements: list[tuple[dict[str, str], list[str]]] = []
        self.body: dict[str, str] = {}
        self._open: list[list[str] | None] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        d = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = d
        if tag in self.VOID:
            return
        text: list[str] | None = None
        if any(k.startswith("data-") for k in d):
            text = []
            self.elements.append((d, text))
        self._open.append(text)

    def handle_endtag(self, tag: str) -> None:
        if tag not in self.VOID and self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for text in self._open:
            if text is not None:
                text.append(data)

    def find(self, **attrs: str) -> list[str]:
        """Text of every element whose attributes include ``attrs`` (``data_x`` for data-x)."""
        want = {k.replace("_", "-"): v for k, v in attrs.items()}
        return ["".join(t).strip() for d, t in self.elements if want.items() <= d.items()]

    def cell(self, model: str, field: str) -> str:
        (text,) = self.find(data_model=model, data_field=field)
        return text

    def number(self, model: str, field: str) -> float:
        return float(self.cell(model, field).replace(",", ""))

    def count(self, key: str, value: str) -> int:
        return sum(1 for d, _ in self.elements if d.get(key) == value)


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def dump_dom(browser: str, url: str, profile: Path, budget_ms: int = 2500) -> Rendered:
    """The page after ``budget_ms`` of virtual time (time stands still while a fetch is pending)."""
    out = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={profile}",
            f"--virtual-time-budget={budget_ms}",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0 and "<body" in out.stdout, out.stderr[-2000:]
    return Rendered(out.stdout)


SYSTEM = "You are the ship's navigator. Answer in one short sentence. " * 4


class Load(threading.Thread):
    """Completions over a and b, four at a time, sharing a system prompt, until
    ``stop`` is set or ``limit`` have been sent; ``sent`` counts them per model."""

    def __init__(self, url: str, limit: int = 400) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.limit = limit
        self.stop = threading.Event()
        self.sent = {"a": 0, "b": 0}
        self._lock = threading.Lock()
        self._next = 0

    def _take(self) -> int | None:
        with self._lock:
            if self.stop.is_set() or self._next >= self.limit:
                return None
            self._next += 1
            i = self._next
            self.sent["ab"[i % 2]] += 1
            return i

    def _worker(self) -> None:
        while (i := self._take()) is not None:
            complete(self.url, "ab"[i % 2], f"{SYSTEM}Question {i}: where are we?", n=24)

    def run(self) -> None:
        with ThreadPoolExecutor(4) as pool:
            for job in [pool.submit(self._worker) for _ in range(4)]:
                job.result()


def test_dashboard_in_headless_chromium_agrees_with_metrics(server: str, tmp_path: Path) -> None:
    browser = chromium()
    if browser is None:
        pytest.skip("chromium not found (Debian: apt-get install chromium; `make setup` does it)")
    page = f"{server}/dashboard#key={KEY}"
    complete(server, "a2", "Where are we?")  # the load's models are a and b; a2 is asked too
    start = scrape(server)
    load = Load(server)
    load.start()
    time.sleep(0.5)
    before = scrape(server)
    live = dump_dom(browser, page, tmp_path / "profile")
    after = scrape(server)
    assert load.is_alive(), "the load ended before the page was rendered: raise its limit"
    assert int(live.body.get("data-polls", "0")) >= 1, "the page never got its figures"
    assert live.find(data_card="tree")  # the summary cards are there
    for model in MODELS:
        assert live.find(data_model=model), f"model {model} not shown"
        # Counters rendered mid-load lie between the scrapes around the render.
        for field, metric in (
            ("tokens_saved", "radixmux_cache_tokens_saved_total"),
            ("cache_hits", "radixmux_cache_hits_total"),
            ("queue_time_count", "radixmux_request_queue_time_seconds_count"),
        ):
            shown = live.number(model, field)
            low, high = value(before, metric, model=model), value(after, metric, model=model)
            assert low <= shown <= high, (model, field, low, shown, high)

    load.stop.set()
    load.join(timeout=120)
    assert not load.is_alive()
    quiet = dump_dom(browser, page, tmp_path / "profile")
    final = scrape(server)
    for model in MODELS:
        shown = {f: quiet.number(model, f) for f in ("waiting", "running")}
        assert shown == {"waiting": 0, "running": 0}
        for field, metric in (
            ("tokens_saved", "radixmux_cache_tokens_saved_total"),
            ("tokens_queried", "radixmux_cache_tokens_queried_total"),
            ("cache_hits", "radixmux_cache_hits_total"),
            ("cache_misses", "radixmux_cache_misses_total"),
            ("cached_tokens", "radixmux_cached_tokens"),
            ("queue_time_count", "radixmux_request_queue_time_seconds_count"),
        ):
            assert quiet.number(model, field) == value(final, metric, model=model), (model, field)
        # A model never asked has no rate (the page shows a dash, /metrics a 0).
        rate = value(final, "radixmux_cache_hit_rate", model=model)
        asked = value(final, "radixmux_cache_tokens_queried_total", model=model)
        assert quiet.cell(model, "hit_rate") == (f"{100 * rate:.1f}%" if asked else "–")
        for reason in REASONS:
            assert quiet.number(model, f"evicted_{reason}") == value(
                final, "radixmux_model_evicted_tokens_total", model=model, reason=reason
            )
    # Every request of the load was counted, on its model.
    for model, n in load.sent.items():
        assert delta(start, final, "radixmux_request_queue_time_seconds_count", model=model) == n
    for reason in REASONS:
        (shown,) = quiet.find(data_reason=reason)
        metric = value(final, "radixmux_evicted_tokens_total", reason=reason)
        assert float(shown.replace(",", "")) == metric
    # The arena map: one cell per block, as many owned as /metrics says are in use.
    block = 64 << 10
    used_blocks = (
        value(final, "radixmux_arena_total_bytes") - value(final, "radixmux_arena_free_bytes")
    ) // block
    cells = [d for d, _ in quiet.elements if "data-owner" in d]
    assert len(cells) == 32
    assert sum(1 for d in cells if d["data-owner"] != "-1") == used_blocks
    # The tree top: the load's system prompt, held by a and b, previewed as text.
    rows = quiet.find(data_field="hits")
    assert rows and max(float(r.replace(",", "")) for r in rows) >= sum(load.sent.values()) - 2
    holders = {d["data-holder"] for d, _ in quiet.elements if "data-holder" in d}
    assert {"a,a2", "b"} <= holders
    assert any("ship's navigator" in t for t in quiet.find(data_prefix="0"))


def test_dashboard_page_is_open_and_its_figures_need_the_key(server: str) -> None:
    page = httpx.get(f"{server}/dashboard", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "dashboard.json" in page.text and "src=" not in page.text  # nothing fetched elsewhere
    assert httpx.get(f"{server}/dashboard.json", timeout=30).status_code == 401
    view = httpx.get(f"{server}/dashboard.json", headers=AUTH, timeout=30).json()
    assert view["error"] is None and view["stats"]["arena_total_bytes"] == 2 << 20
    assert [p["models"] for p in view["snapshot"]["arena"]["pools"]] in (
        [["a", "a2"], ["b"]],
        [["b"], ["a", "a2"]],
    )
