"""Models at run time: load, unload and reload over HTTP on real servers, under load.

Tiny random-weight models for the mechanics (seconds each), the two embedded
real models for the reload's "never mixed" property.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.tiny_models import make_tiny_model_dir
from radixmux.runtime.client import Client, ClientError
from radixmux.runtime.client.engine import Engine

pytestmark = pytest.mark.timeout(600)
PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lifecycle")
    return {n: make_tiny_model_dir(root / n, seed=s) for n, s in (("a", 1), ("b", 2), ("c", 3))}


def greedy(url: str, model: str, prompt: str = PROMPT, max_tokens: int = 12) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def scheduler(url: str) -> dict:
    return httpx.get(f"{url}/get_server_info", timeout=30).json()["scheduler"]


class Traffic:
    """Clients sending the same greedy request to one model until stopped (bounded)."""

    def __init__(self, url: str, model: str, clients: int = 2, limit_s: float = 300) -> None:
        self.results: list[tuple[float, int, str]] = []  # (time, status, text or error)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(url, model, limit_s), daemon=True)
            for _ in range(clients)
        ]
        for t in self._threads:
            t.start()

    def _run(self, url: str, model: str, limit_s: float) -> None:
        end = time.monotonic() + limit_s
        while not self._stop.is_set() and time.monotonic() < end:
            r = greedy(url, model)
            body = r.json()
            got = body["choices"][0]["text"] if r.status_code == 200 else json.dumps(body)
            self.results.append((time.monotonic(), r.status_code, got))

    def stop(self) -> list[tuple[float, int, str]]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)
        return self.results


ENDPOINTS: dict[str, str] = {}  # base url -> the ZMQ client endpoint


@pytest.fixture
def server(folders: dict[str, Path]) -> Iterator[str]:
    """A server of its own per test: each one loads, reloads and unloads models."""
    eng = Engine(
        model=[f"{folders['a']},name=a", f"{folders['b']},name=b"],
        kv_cache_bytes=64 << 20,
        kv_block_bytes=256 << 10,
        dtype="float32",
        check_invariants=True,
    )
    url = f"http://127.0.0.1:{eng.args.port}"
    ENDPOINTS[url] = eng.launcher.endpoints.client
    try:
        yield url
    finally:
        eng.shutdown()


def test_load_reload_unload_under_load(server: str, folders: dict[str, Path]) -> None:
    url = server
    old_a, out_b = text(greedy(url, "a")), text(greedy(url, "b"))
    on_b = Traffic(url, "b")
    on_a = Traffic(url, "a")
    time.sleep(1.0)

    r = httpx.post(f"{url}/models", json={"source": str(folders["c"]), "name": "c"}, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["model"]["id"] == "c" and r.json()["version"] == 1
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert sorted(ids) == ["a", "b", "c"]
    out_c = text(greedy(url, "c"))
    assert out_c != old_a  # different weights: the reload below is visible in the outputs

    t_switch = time.monotonic()
    r = httpx.post(f"{url}/models/a/reload", json={"source": str(folders["c"])}, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 2 and r.json()["model"]["version"] == 2
    t_done = time.monotonic()
    assert text(greedy(url, "a")) == out_c  # a now runs c's weights
    time.sleep(1.0)
    a_results, b_results = on_a.stop(), on_b.stop()

    # Other model: no failed request, same greedy output throughout.
    assert b_results and all(s == 200 and t == out_b for _, s, t in b_results), b_results
    # The reloaded one: never failed, each answer exactly one version's, old
    # before the switch began, new after it ended.
    assert all(s == 200 for _, s, _ in a_results), a_results
    assert all(t in (old_a, out_c) for _, _, t in a_results)
    assert any(t == old_a for when, _, t in a_results if when < t_switch)
    assert all(t == out_c for when, _, t in a_results if when > t_done + 0.5)

    # a@v2 has c's weights: unloading c keeps the shared cache (nothing freed).
    before = scheduler(url)
    r = httpx.delete(f"{url}/models/c", timeout=300)
    assert r.status_code == 200 and r.json()["freed_tokens"] == 0, r.text
    assert greedy(url, "c").status_code == 404
    again = greedy(url, "a")
    assert (
        text(again) == out_c and again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    )
    after = scheduler(url)
    assert after["invariants"] == "ok"
    assert {m["name"] for m in after["models"]} == {"a@v2", "b"}
    assert {m["name"] for m in before["models"]} == {"a@v2", "b", "c"}
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["models"] == {"a": "serving", "b": "serving"}

    # The same over the ZMQ client.
    with Client(ENDPOINTS[url]) as client:
        change = client.change_model("load", "d", source=str(folders["b"]))
        assert change.version == 1 and change.model is not None and change.model.id == "d"
        assert client.generate("d", prompt=PROMPT, max_new_tokens=12).text == out_b
        with pytest.raises(ClientError) as exc:
            client.change_model("load", "d", source=str(folders["b"]))
        assert exc.value.status == 409
        assert client.change_model("unload", "d").name == "d"
    assert greedy(url, "d").status_code == 404


def test_unload_frees_blocks_times_out_running_and_refuses_bad_input(
    server: str, folders: dict[str, Path]
) -> None:
    url = server
    assert greedy(url, "b", "b " * 300).status_code == 200  # b holds blocks of its own
    held = {m["name"]: m["arena_bytes"] for m in scheduler(url)["models"]}
    assert held["b"] > 0
    free_before = scheduler(url)["arena_free_bytes"]

    # A long request still running when the unload's timeout runs out: a 503 JSON.
    result: dict[str, httpx.Response] = {}
    long = threading.Thread(
        target=lambda: result.setdefault("r", greedy(url, "b", "go", max_tokens=1500))
    )
    long.start()
    time.sleep(1.5)
    r = httpx.delete(f"{url}/models/b?timeout=0.5", timeout=120)
    long.join(timeout=120)
    assert r.status_code == 200 and r.json()["aborted"] == 1, r.text
    assert result["r"].status_code == 503 and "unloaded" in result["r"].json()["error"]["message"]
    state = scheduler(url)
    assert [m["name"].split("@")[0] for m in state["models"]] == ["a"]
    assert state["arena_free_bytes"] >= free_before + held["b"]  # its blocks are back
    assert state["invariants"] == "ok" and state["locks_held"] == 0

    def post(body: dict) -> httpx.Response:
        return httpx.post(f"{url}/models", json=body, timeout=300)

    cases = [
        (post({"source": "/no/such/model", "name": "x"}), 400, "source"),
        (post({"source": str(folders["a"]), "name": "a"}), 409, "name"),
        (post({"source": str(folders["a"]), "name": "x@v2"}), 400, "name"),
        (post({"source": str(folders["a"]), "replicas": 0}), 400, "replicas"),
        (post({"source": str(folders["a"]), "colour": "red"}), 400, "colour"),
        (httpx.delete(f"{url}/models/nope", timeout=30), 404, "name"),
        (httpx.delete(f"{url}/models/a", timeout=30), 409, "name"),  # the last one
        (httpx.delete(f"{url}/models/a?timeout=-1", timeout=30), 400, "timeout"),
    ]
    for resp, status, param in cases:
        assert resp.status_code == status, resp.text
        assert param in (resp.json()["error"]["param"] or resp.json()["error"]["message"])

    # A load that fails half way (the runner cannot read the weights): cleaned
    # up, the arena untouched, a clear error; the server keeps serving.
    broken = folders["a"].parent / "broken"
    broken.mkdir(exist_ok=True)
    for f in folders["a"].iterdir():
        target = broken / f.name
        if not target.exists():
            target.write_bytes(b"not weights" if f.suffix == ".safetensors" else f.read_bytes())
    before = scheduler(url)
    r = post({"source": str(broken), "name": "broken"})
    assert 400 <= r.status_code < 600 and r.status_code != 200, r.text
    assert "broken" in r.json()["error"]["message"]
    after = scheduler(url)
    assert after["arena_free_bytes"] == before["arena_free_bytes"]
    assert after["models"] == state["models"] or len(after["models"]) == 1
    assert after["invariants"] == "ok"
    assert text(greedy(url, "a"))


def test_reload_never_mixes_versions_on_real_models() -> None:
    """SmolLM2 -> Gemma 3 under one served name while clients keep asking:
    every answer is exactly one model's greedy output, none fails."""
    eng = Engine(model=["smollm2,name=m"], kv_cache_bytes=256 << 20, dtype="float32")
    url = f"http://127.0.0.1:{eng.args.port}"
    try:
        old = text(greedy(url, "m"))
        traffic = Traffic(url, "m", clients=2)
        # The old version answers some of the traffic before the reload (a fixed
        # pause was too short on a busy machine: every answer came from the new).
        deadline = time.monotonic() + 120
        while not traffic.results and time.monotonic() < deadline:
            time.sleep(0.2)
        assert traffic.results, "no answer from the old version within 120 s"
        r = httpx.post(f"{url}/models/m/reload", json={"source": "gemma3-270m"}, timeout=600)
        assert r.status_code == 200, r.text
        assert r.json()["model"]["architecture"].startswith("Gemma3")
        new = text(greedy(url, "m"))
        assert new != old
        time.sleep(3.0)
        results = traffic.stop()
        texts = [t for _, s, t in results if s == 200]
        assert len(texts) == len(results), [r for r in results if r[1] != 200]
        assert set(texts) == {old, new}, set(texts)  # both versions answered, nothing else
        card = httpx.get(f"{url}/v1/models/m").json()
        assert card["version"] == 2 and card["root"].endswith("gemma3-270m")
        assert [m["name"] for m in scheduler(url)["models"]] == ["m@v2"]
        # Series keep the served name across the reload; the version is its own label.
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'radixmux_model_up{model="m",version="2"} 1.0' in metrics
        finished = r'^radixmux_requests_total\{finish_reason="\w+",model="m",version="2"\}'
        assert re.search(finished, metrics, re.M)
        assert "m@v2" not in metrics
    finally:
        eng.shutdown()
