"""Models on demand on real servers with tiny models: a registered model loads on
its first request (one load for all its waiters), ``--max-loaded-models``
unloads the least recently used idle one, ``--idle-unload-seconds`` unloads
after the timeout and not before, and a failing load answers every waiter."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bench.tiny_models import make_tiny_model_dir
from radixmux.common.model_entry import parse_model_arg
from radixmux.common.server_args import parse_args
from radixmux.runtime.admission import RUNNER_OVERHEAD_BYTES, estimate, weight_copies
from radixmux.runtime.client import Client
from radixmux.runtime.client.engine import Engine, args_from_flags
from tests.test_dashboard import chromium, dump_dom

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("on_demand")
    return {n: make_tiny_model_dir(root / n, seed=s) for s, n in enumerate("abcd", 1)}


def start(folders: dict[str, Path], on_demand: str, **flags: object) -> Engine:
    """A server loading ``a`` at start, with ``on_demand``'s models registered."""
    models = [f"{folders['a']},name=a"]
    models += [f"{folders[n]},name={n},load=on_demand" for n in on_demand]
    return Engine(
        model=models,
        kv_cache_bytes=64 << 20,
        kv_block_bytes=256 << 10,
        dtype="float32",
        model_load_timeout=120.0,
        **flags,
    )


ENDPOINTS: dict[str, str] = {}  # base url -> the ZMQ client endpoint


@pytest.fixture
def serve(folders: dict[str, Path]) -> Iterator[Callable[..., str]]:
    """Starts a server (see :func:`start`) stopped after the test; returns its URL."""
    started: list[Engine] = []

    def run(on_demand: str, **flags: object) -> str:
        started.append(start(folders, on_demand, **flags))
        url = f"http://127.0.0.1:{started[-1].args.port}"
        ENDPOINTS[url] = started[-1].launcher.endpoints.client
        return url

    yield run
    for eng in started:
        eng.shutdown()


def complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=180)


def states(url: str) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(f"{url}/v1/models").json()["data"]}


def metric(url: str, name: str, **labels: str) -> float:
    """The value of one series of ``/metrics`` (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return 0.0


def lifecycle(url: str) -> dict[str, dict]:
    """``/dashboard.json``'s model lifecycle, by model."""
    view = httpx.get(f"{url}/dashboard.json", timeout=30).json()
    return {m.pop("name"): m for m in view["lifecycle"]}


def test_first_requests_share_one_load(serve: Callable[..., str], folders: dict[str, Path]) -> None:
    url = serve("b")
    assert states(url) == {"a": "loaded", "b": "registered"}
    r = httpx.post(
        f"{url}/models", json={"source": str(folders["c"]), "name": "c", "load": "on_demand"}
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"]["state"] == "registered"
    missing = {"source": str(folders["c"]) + "-gone", "name": "x", "load": "on_demand"}
    r = httpx.post(f"{url}/models", json=missing)
    assert r.status_code == 404 and r.json()["error"]["param"] == "source", r.text
    assert states(url) == {"a": "loaded", "b": "registered", "c": "registered"}

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: complete(url, "b"), range(4)))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    assert len({r.json()["choices"][0]["text"] for r in answers}) == 1
    assert metric(url, "radixmux_model_loads_total", model="b", reason="on_demand") == 1
    assert states(url)["b"] == "loaded"
    assert metric(url, "radixmux_model_registered_state", model="b", state="loaded") == 1
    assert complete(url, "c").status_code == 200
    assert states(url) == {"a": "loaded", "b": "loaded", "c": "loaded"}


def test_max_loaded_models_under_alternating_traffic(
    serve: Callable[..., str], folders: dict[str, Path]
) -> None:
    # a stays loaded (not on demand): at most 2 of b, c, d at once.
    url = serve("bcd", max_loaded_models=3)
    most = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            loaded = sum(s == "loaded" for s in states(url).values())
            most[0] = max(most[0], loaded)
            time.sleep(0.02)

    # Twice round: with room for two of the three, the opposite orders keep
    # asking for the one unloaded (three rounds repeated the same swaps).
    def client(order: str) -> list[int]:
        return [complete(url, m).status_code for m in order * 2]

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with ThreadPoolExecutor(2) as pool:
        codes = [c for got in pool.map(client, ["bcd", "dcb"]) for c in got]
    done.set()
    watcher.join()
    assert codes == [200] * 12, codes
    assert most[0] == 3
    lru = sum(metric(url, "radixmux_model_unloads_total", model=m, reason="lru") for m in "bcd")
    assert lru >= 2
    assert sum(s == "loaded" for s in states(url).values()) <= 3


def test_idle_unload_after_the_timeout_not_before(
    serve: Callable[..., str], folders: dict[str, Path]
) -> None:
    url = serve("b", idle_unload_seconds=3.0)
    t_sent = time.monotonic()  # the server's idle time starts between these two
    assert complete(url, "b").status_code == 200
    t_used = time.monotonic()
    while time.monotonic() - t_used < 2.0:  # not before
        assert states(url)["b"] == "loaded"
        time.sleep(0.2)
    while states(url)["b"] == "loaded":
        assert time.monotonic() - t_used < 10.0, "not unloaded within 10 s"
        time.sleep(0.2)
    assert time.monotonic() - t_sent >= 3.0
    assert states(url) == {"a": "loaded", "b": "registered"}
    # The name stops being served first; the unload is counted once its runners stopped.
    deadline = time.monotonic() + 30.0
    while metric(url, "radixmux_model_unloads_total", model="b", reason="idle") < 1:
        assert time.monotonic() < deadline, "the idle unload was never counted"
        time.sleep(0.2)
    assert metric(url, "radixmux_model_unloads_total", model="b", reason="idle") == 1
    assert states(url)["a"] == "loaded"  # loaded at start: never unloaded for idleness
    with Client(ENDPOINTS[url]) as client:  # and it comes back, for a ZMQ client too
        assert client.generate("b", prompt="Hello there", max_new_tokens=4).text
    assert states(url)["b"] == "loaded"


def test_failing_load_answers_every_waiter(
    serve: Callable[..., str], folders: dict[str, Path], tmp_path: Path
) -> None:
    folder = shutil.copytree(folders["d"], tmp_path / "d")
    url = serve("")
    r = httpx.post(f"{url}/models", json={"source": str(folder), "name": "d", "load": "on_demand"})
    assert r.status_code == 200, r.text
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(b"not a safetensors file")

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: complete(url, "d"), range(3)))
    assert all(r.status_code == 503 for r in answers), [r.text for r in answers]
    errors = [r.json()["error"] for r in answers]
    assert all("could not be loaded" in e["message"] for e in errors), errors
    assert len({e["message"] for e in errors}) == 1
    assert states(url) == {"a": "loaded", "d": "failed"}
    assert lifecycle(url)["d"]["state"] == "failed"  # the dashboard says so too
    assert complete(url, "a").status_code == 200  # the server stays up

    weights.write_bytes(good)  # a later request tries again
    assert complete(url, "d").status_code == 200
    assert states(url)["d"] == "loaded"


# Long enough for several of the disk tier's 64-token chunks.
LONG_PROMPT = "Story: " + " ".join(f"word{j}" for j in range(300))


def complete_long(url: str, model: str) -> dict:
    body = {
        "model": model,
        "prompt": LONG_PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("disk", [True, False], ids=["disk-tier", "no-disk-tier"])
def test_an_unloaded_models_cache_comes_back_from_the_disk_tier(
    serve: Callable[..., str], tmp_path: Path, disk: bool
) -> None:
    flags = {"kv_disk_bytes": 1 << 30, "kv_disk_dir": str(tmp_path / "kv")} if disk else {}
    url = serve("b", **flags)
    before = complete_long(url, "b")
    assert before["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    prompt_tokens = before["usage"]["prompt_tokens"]
    assert prompt_tokens > 4 * 64

    r = httpx.delete(f"{url}/models/b", timeout=120)
    assert r.status_code == 200, r.text
    assert states(url) == {"a": "loaded", "b": "registered"}
    saved = 'radixmux_disk_chunks_saved_total{reason="unload"}'
    if disk:  # the unload answers at once; the I/O thread saves in the background
        deadline = time.monotonic() + 30.0
        while metric(url, "radixmux_disk_chunks_saved_total", reason="unload") < 1:
            assert time.monotonic() < deadline, f"no {saved} within 30 s"
            time.sleep(0.1)
        # Every whole chunk of the prompt's cached KV (one token is always computed).
        chunks = (prompt_tokens - 1) // 64
        assert metric(url, "radixmux_disk_chunks_saved_total", reason="unload") >= chunks
    else:
        assert saved not in httpx.get(f"{url}/metrics", timeout=30).text

    after = complete_long(url, "b")  # loads b on demand again: the same weights
    assert states(url)["b"] == "loaded"
    assert metric(url, "radixmux_model_loads_total", model="b", reason="on_demand") == 2
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    cached = after["usage"]["prompt_tokens_details"]["cached_tokens"]
    loaded = metric(url, "radixmux_disk_tokens_loaded_total", model="b")
    if disk:  # the prefix came back from disk instead of being computed
        assert cached >= chunks * 64
        assert loaded == cached
    else:  # as before the disk tier: a reload starts with an empty cache
        assert cached == 0 and loaded == 0


def test_dashboard_shows_states_loads_and_unloads(
    serve: Callable[..., str], tmp_path: Path
) -> None:
    url = serve("bc")
    assert complete(url, "b").status_code == 200
    assert httpx.delete(f"{url}/models/b", timeout=120).status_code == 200
    assert complete(url, "b").status_code == 200  # loaded again by its request
    views = lifecycle(url)
    assert {n: (v["state"], v["on_demand"]) for n, v in views.items()} == {
        "a": ("loaded", False),
        "b": ("loaded", True),
        "c": ("registered", True),
    }
    b = views["b"]
    assert (b["loads"], b["unloads"]) == ({"on_demand": 2}, {"manual": 1})
    assert b["load_seconds"] > 0
    assert views["c"]["loads"] == {} and views["a"]["unloads"] == {}
    for reason, n in b["loads"].items():  # the figures /metrics reports
        assert metric(url, "radixmux_model_loads_total", model="b", reason=reason) == n
    assert metric(url, "radixmux_model_unloads_total", model="b", reason="manual") == 1

    browser = chromium()
    if browser is None:
        pytest.skip("chromium not found (Debian: apt-get install chromium; `make setup` does it)")
    page = dump_dom(browser, f"{url}/dashboard", tmp_path / "profile")
    assert int(page.body.get("data-polls", "0")) >= 1, "the page never got its figures"

    def shown(model: str, field: str) -> str:
        (text,) = page.find(data_lifecycle=model, data_field=field)
        return text

    assert [shown(m, "state") for m in "abc"] == ["loaded", "loaded", "registered"]
    assert [shown(m, "on_demand") for m in "abc"] == ["no", "yes", "yes"]
    assert (shown("b", "loads"), shown("b", "unloads")) == ("2", "1")
    assert shown("b", "reasons") == "loads: on_demand 2 · unloads: manual 1"
    assert shown("b", "load_mean").endswith(" s") and shown("c", "load_mean") == "–"


def test_a_manual_load_makes_room_like_an_on_demand_one(
    serve: Callable[..., str], folders: dict[str, Path]
) -> None:
    """``POST /models`` (not on demand) counts against ``--max-loaded-models``:
    it unloads the idle on-demand model first; with no on-demand model left to
    unload it is refused (503 no_room) and nothing more is loaded."""
    url = serve("b", max_loaded_models=2)
    assert complete(url, "b").status_code == 200
    assert states(url) == {"a": "loaded", "b": "loaded"}
    r = httpx.post(f"{url}/models", json={"source": str(folders["c"]), "name": "c"}, timeout=180)
    assert r.status_code == 200, r.text
    assert states(url) == {"a": "loaded", "b": "registered", "c": "loaded"}
    assert metric(url, "radixmux_model_unloads_total", model="b", reason="lru") == 1
    r = httpx.post(f"{url}/models", json={"source": str(folders["d"]), "name": "d"}, timeout=180)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_room", r.text
    assert states(url) == {"a": "loaded", "b": "registered", "c": "loaded"}


# ---- --models-file -------------------------------------------------------------------
def write_models_file(path: Path, data: object) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def test_models_file_entries_are_model_flags(tmp_path: Path) -> None:
    (tmp_path / "weights" / "b").mkdir(parents=True)
    path = write_models_file(
        tmp_path / "models.json",
        {
            "models": [
                {"source": "weights/b", "name": "b", "load": "on_demand", "keep_alive": 600},
                {"source": "gemma3-270m", "dtype": "float32", "priority": 2, "replicas": 1},
            ]
        },
    )
    args = parse_args(["--model", "smollm2,name=a", "--models-file", path])
    assert [(m.name, m.source, m.dtype, m.priority) for m in args.models] == [
        ("a", "smollm2", None, 1.0),
        ("gemma3-270m", "gemma3-270m", "float32", 2.0),
    ]
    (b,) = args.on_demand_models
    # A relative source beside the file is taken from there; a short name stays one.
    assert (b.name, b.source, b.on_demand, b.keep_alive) == (
        "b",
        str(tmp_path / "weights" / "b"),
        True,
        600.0,
    )
    # The same entry as a --model flag gives the same ModelArg: one checker.
    flag = parse_model_arg(f"{b.source},name=b,load=on_demand,keep_alive=600")
    assert flag == b
    # A bare list works too, and the Python Engine's flags take the file.
    listed = write_models_file(tmp_path / "list.json", [{"source": "smollm2", "name": "x"}])
    assert [m.name for m in args_from_flags({"models_file": listed}).models] == ["x"]


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (
            [{"source": "s", "name": "m", "replicas": 2.5}],
            "models[0] ('m'): replicas must be an int",
        ),
        ([{"name": "m"}], "models[0] ('m'): field 'source' is required"),
        ([{"source": "s"}, {"source": "t", "sise": 1}], "models[1]: unknown field 'sise'"),
        ([{"source": "s", "keep_alive": 5}], "models[0]: keep_alive needs load=on_demand"),
        ([{"source": "s", "load": "lazy"}], "models[0]: load must be one of"),
        ([{"source": "s", "priority": True}], "models[0]: field 'priority' must be a string"),
        ([{"source": "s", "name": "a@2"}], "models[0] ('a@2'): name: model name 'a@2'"),
        ({"model": []}, 'expected {"models": [entry, ...]} or a list of entries'),
        ([{"source": "s", "name": "m"}, {"source": "t", "name": "m"}], "names must be unique"),
    ],
)
def test_a_bad_models_file_names_the_entry_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: object, says: str
) -> None:
    path = write_models_file(tmp_path / "models.json", data)
    with pytest.raises(SystemExit):
        parse_args(["--models-file", path])
    assert says in capsys.readouterr().err


def test_an_unreadable_models_file_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad.json").write_text("{models: []}")
    for path, says in [("bad.json", "not JSON"), ("gone.json", "No such file")]:
        with pytest.raises(SystemExit):
            parse_args(["--models-file", str(tmp_path / path)])
        assert f"--models-file {tmp_path / path}: {says}" in capsys.readouterr().err


def test_every_model_on_demand_starts_with_none_loaded(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entries = [{"source": str(folders[n]), "name": n, "load": "on_demand"} for n in "bc"]
    path = write_models_file(tmp_path / "models.json", {"models": entries})
    eng = Engine(
        models_file=path,
        kv_cache_bytes=64 << 20,
        kv_block_bytes=256 << 10,
        dtype="float32",
        model_load_timeout=120.0,
        max_loaded_models=1,
    )
    url = f"http://127.0.0.1:{eng.args.port}"
    try:
        assert eng.launcher.served == [] and eng.models == ["b", "c"]
        assert not [c for c in eng.launcher.children if c.runner_id is not None]
        assert states(url) == {"b": "registered", "c": "registered"}
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 200 and health.json()["models"] == {}, health.text
        info = httpx.get(f"{url}/get_model_info", timeout=30)
        assert info.status_code == 409 and "no model is loaded" in info.text, info.text
        assert set(lifecycle(url)) == {"b", "c"}  # the dashboard has nothing loaded to show

        assert complete(url, "b").status_code == 200  # the first request loads it
        assert states(url) == {"b": "loaded", "c": "registered"}
        # --max-loaded-models 1: the one loaded model makes room although it is the last.
        assert complete(url, "c").status_code == 200
        assert states(url) == {"b": "registered", "c": "loaded"}
        assert metric(url, "radixmux_model_unloads_total", model="b", reason="lru") == 1
        (out,) = eng.generate("Hello there", {"max_new_tokens": 2}, model="b")  # over ZMQ
        assert out.text and states(url) == {"b": "loaded", "c": "registered"}
    finally:
        eng.shutdown()
    # The static partition's shares are fixed at start: nothing can load later.
    with pytest.raises(SystemExit):
        parse_args(["--models-file", path, "--kv-partition", "static"])
    assert "load=on_demand needs --kv-partition unified" in capsys.readouterr().err


def test_max_weights_bytes_makes_room_like_max_loaded_models(
    serve: Callable[..., str], folders: dict[str, Path]
) -> None:
    """``--max-weights-bytes`` holding 2.5 tiny models: ``a`` (loaded at start)
    and one more. A load past it unloads the LRU idle on-demand model (reason
    ``weights``); with only models that never go automatically, 503 no_room."""
    weights = estimate(str(folders["a"]), "float32", 1).weights_bytes
    url = serve("bc", max_weights_bytes=weights * 5 // 2)
    assert complete(url, "b").status_code == 200
    info = httpx.get(f"{url}/get_server_info", timeout=30).json()
    held = {m["name"]: m["info"]["weight_bytes"] for m in info["served_models"]}
    # What the runners report, which the budget counts, is what the files hold
    # (give or take buffers such as the rotary frequencies).
    assert held.keys() == {"a", "b"}, held
    assert all(abs(w - weights) <= weights // 100 for w in held.values()), (held, weights)
    assert complete(url, "c").status_code == 200
    assert states(url) == {"a": "loaded", "b": "registered", "c": "loaded"}
    assert metric(url, "radixmux_model_unloads_total", model="b", reason="weights") == 1
    assert metric(url, "radixmux_model_unloads_total", model="b", reason="lru") == 0

    # A load that is not on demand makes room the same way ...
    body = {"source": str(folders["d"]), "name": "d"}
    r = httpx.post(f"{url}/models", json=body, timeout=180)
    assert r.status_code == 200, r.text
    assert states(url) == {"a": "loaded", "b": "registered", "c": "registered", "d": "loaded"}
    # ... and stays: a and d never go automatically, so b finds no room.
    r = complete(url, "b")
    assert r.status_code == 503, r.text
    assert "--max-weights-bytes" in r.json()["error"]["message"], r.text
    assert states(url) == {"a": "loaded", "b": "failed", "c": "registered", "d": "loaded"}


# ---- the launcher's memory admission (507) ----------------------------------------------
def unloadable_weights_dir(path: Path, weights: int) -> Path:
    """A folder whose safetensors header counts ``weights`` bytes of float32
    (all admission reads) but that no runner can load: its config.json is not
    JSON, so a runner fails before it allocates anything."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("not a config: admission reads only the weights' header")
    n = weights // 4
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}})
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode())
    return path


def free_for_models(url: str) -> int:
    health = httpx.get(f"{url}/health", timeout=30).json()
    return health["admission"]["memory_free_for_models_bytes"]


def steady_free_for_models(url: str) -> int:
    """Free memory once two readings a second apart agree within 64 MiB (a
    runner that just answered may still be returning memory), at most 20 s."""
    last, deadline = free_for_models(url), time.monotonic() + 20.0
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = free_for_models(url)
        if abs(now - last) < 64 << 20:
            return now
        last = now
    return last


def runner_pids(url: str, model: str) -> list[int]:
    info = httpx.get(f"{url}/get_server_info", timeout=30).json()
    (pids,) = [m["runner_pids"] for m in info["scheduler"]["models"] if m["name"] == model]
    return pids


def private_bytes(pids: list[int]) -> int:
    """The anonymous memory of ``pids`` (what their exit frees), from /proc. Not
    Private_Dirty: that also counts page-cache pages of a file written moments
    ago (a model folder) that only this process maps, which stay cached after
    it exits."""
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Anonymous:"):
                total += int(line.split()[1]) * 1024
    return total


def register(url: str, source: Path, name: str, dtype: str = "float32") -> None:
    body = {"source": str(source), "name": name, "load": "on_demand", "dtype": dtype}
    r = httpx.post(f"{url}/models", json=body, timeout=60)
    assert r.status_code == 200, r.text


# Free memory decides it, to a few hundred MB: another test's servers would move it.
@pytest.mark.alone
def test_a_load_refused_for_memory_unloads_one_idle_model_and_retries(
    serve: Callable[..., str], tmp_path: Path
) -> None:
    """The launcher refuses a load that does not fit free memory (507); an
    on-demand load then unloads one idle on-demand model (reason ``memory``)
    and asks again. ``c`` is made to need more than is free with ``b``
    loaded and less than without it (its weights are counted from a header
    alone, and it cannot load): the retry is admitted, so the answer is the
    runner's failure, not the 507 a load without the retry would get."""
    # ~2.5 GB of float32 weights loaded as bfloat16: b's runner holds more than
    # 1 GB of its own (a converted copy on every CPU; float32 weights can stay
    # mapped from the file's page cache where nothing packs them), a margin far
    # above what the rest of the machine moves in the second or two between
    # reading the free memory and the launcher's checks. Written out to disk
    # first: dirty page cache is not available memory until it is, and its
    # writeback would move the free memory mid-test.
    big = make_tiny_model_dir(tmp_path / "big", seed=9, hidden=3072)
    os.sync()
    url = serve("")
    register(url, big, "b", "bfloat16")
    assert complete(url, "b").status_code == 200
    held = private_bytes(runner_pids(url, "b"))  # what b's exit gives back
    assert held > 1 << 30, held
    need = steady_free_for_models(url) + held // 2
    weights = int((need - RUNNER_OVERHEAD_BYTES) / weight_copies("float32"))
    register(url, unloadable_weights_dir(tmp_path / "c", weights), "c")

    r = complete(url, "c")
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    why = (message, held >> 20, need >> 20)
    assert "could not be loaded" in message and "not enough memory" not in message, why
    assert metric(url, "radixmux_model_unloads_total", model="b", reason="memory") == 1
    assert states(url) == {"a": "loaded", "b": "registered", "c": "failed"}
    assert complete(url, "a").status_code == 200


# ---- routes for a registered model that is not loaded ---------------------------------
def test_routes_for_a_registered_model_load_it_or_say_it_is_not_loaded(
    serve: Callable[..., str],
) -> None:
    """``/tokenize``, ``/detokenize`` and warm-ups load a registered model as a
    completion does; model info, invalidate and reload need it loaded and
    answer 409 ``model_not_loaded`` (never a 404: the model exists)."""
    url = serve("bc")
    for method, path, param in [
        ("GET", "/get_model_info?model=b", "model"),
        ("POST", "/models/b/invalidate", "model"),
        ("POST", "/models/b/reload", "name"),
    ]:
        r = httpx.request(method, f"{url}{path}", json={} if method == "POST" else None)
        assert r.status_code == 409, (path, r.text)
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_loaded", param), (path, error)
        assert "'b' is registered but not loaded (state: registered)" in error["message"]
    r = httpx.get(f"{url}/get_model_info?model=nope", timeout=30)
    assert r.status_code == 404, r.text  # unknown stays unknown
    assert states(url) == {"a": "loaded", "b": "registered", "c": "registered"}

    want = httpx.post(f"{url}/tokenize", json={"model": "a", "prompt": "Hello there"}).json()
    r = httpx.post(f"{url}/tokenize", json={"model": "b", "prompt": "Hello there"}, timeout=180)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == want["tokens"]  # the tiny models share SmolLM2's tokenizer
    assert r.json()["max_model_len"] == 2048  # the loaded model's, not the registry's 0
    body = {"model": "c", "tokens": want["tokens"]}
    r = httpx.post(f"{url}/detokenize", json=body, timeout=180)
    assert r.status_code == 200 and "Hello there" in r.json()["prompt"], r.text
    assert states(url) == {"a": "loaded", "b": "loaded", "c": "loaded"}
    for m in "bc":
        assert metric(url, "radixmux_model_loads_total", model=m, reason="on_demand") == 1

    assert httpx.delete(f"{url}/models/b", timeout=120).status_code == 200
    warm = {"model": "b", "prompts": ["Hello there, how are you today?"]}
    r = httpx.post(f"{url}/cache/warmup", json=warm, timeout=180)
    assert r.status_code == 200, r.text
    assert states(url)["b"] == "loaded"
    assert metric(url, "radixmux_model_loads_total", model="b", reason="on_demand") == 2
    # Its prefix is cached now: a request for it finds it.
    body = {"model": "b", "prompt": warm["prompts"][0], "max_tokens": 1}
    done = httpx.post(f"{url}/v1/completions", json=body, timeout=180).json()
    assert done["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, done
    r = httpx.get(f"{url}/get_model_info?model=b", timeout=30)
    assert r.status_code == 200 and r.json()["served_model_name"] == "b", r.text
