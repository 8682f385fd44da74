"""A web page must not drive a local server: Host, Origin, content type, no state on GET.

Real front processes over real HTTP, their peers played by the harness, so
what reached the pipeline is known exactly: a refused request must leave no
control op (flush, invalidate), no generation and no model change behind.
Where Chromium is installed, real pages make the cross-site and rebinding
attempts a hostile page would, and the dashboard and an allowed browser
application run through the same guard. One test runs the whole runtime to
show the KV cache survives every refused flush.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from front_harness import RunningFront, chat_and_base_front, stats, words

from bench.tiny_models import make_tiny_model_dir
from radixmux.common.allowed_names import HostAllowList
from radixmux.common.server_args import parse_args
from radixmux.runtime.client.engine import Engine

pytestmark = pytest.mark.timeout(180)

KEY = "guard-key"
APP = "http://app.example:3000"
READ_ONLY_OPS = {"stats", "check", "dashboard"}
COMPLETION = {"model": "chat", "prompt": "hello", "max_tokens": 2}
# A body every route might take: it must never be read as JSON without a JSON type.
PWNED = json.dumps({"model": "chat", "prompt": "pwned", "text": "pwned", "source": "chat"})
NOT_JSON = [
    None,  # no Content-Type: what a page's fetch sends with a Blob body
    "",
    "text/plain",
    "text/plain;charset=UTF-8",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "text/json",
]


@pytest.fixture(scope="module")
def front() -> Iterator[RunningFront]:
    """The default configuration, no API key: the one a local user runs."""
    with chat_and_base_front() as f:
        yield f


@pytest.fixture
def clean(front: RunningFront) -> RunningFront:
    """The module's front with its peers reset and their queues empty."""
    front.peers.script = words()
    front.peers.stats = stats(["chat", "base"])
    front.peers.control_ok = True
    for q in (front.peers.requests, front.peers.aborts, front.peers.controls):
        while not q.empty():
            q.get_nowait()
    return front


def operations(front: RunningFront) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, from its own OpenAPI document (path
    parameters filled with a served model's name): a new route is covered here."""
    doc = httpx.get(f"{front.url}/openapi.json", timeout=10).json()
    return [
        (method.upper(), re.sub(r"\{[^}]+\}", "chat", path))
        for path, item in doc["paths"].items()
        for method in item
    ]


def pipeline_heard(front: RunningFront) -> tuple[list[str], list[str | None]]:
    """The control ops and generation prompts that reached the peers since the
    queues were emptied. A sentinel of each kind, sent now, marks the end, so
    nothing here waits on a clock."""
    assert httpx.get(f"{front.url}/get_server_info", timeout=10).status_code == 200  # op "check"
    sentinel = {"model": "chat", "prompt": "sentinel", "max_tokens": 1}
    assert httpx.post(f"{front.url}/v1/completions", json=sentinel, timeout=10).status_code == 200
    ops: list[str] = []
    while (op := front.peers.controls.get(timeout=10).op) != "check":
        ops.append(op)
    prompts: list[str | None] = []
    while (prompt := front.peers.requests.get(timeout=10).prompt) != "sentinel":
        prompts.append(prompt)
    return ops, prompts


def served(front: RunningFront) -> list[str]:
    return [m["id"] for m in httpx.get(f"{front.url}/v1/models", timeout=10).json()["data"]]


def error_of(r: httpx.Response) -> dict:
    assert r.headers["content-type"].startswith("application/json"), r.headers
    return r.json()["error"]


# ---- JSON bodies only with a JSON type ------------------------------------------------
@pytest.mark.parametrize("ctype", NOT_JSON)
def test_a_body_that_is_not_json_is_refused_on_every_route(
    clean: RunningFront, ctype: str | None
) -> None:
    """No-CORS pages can send these types (or none) without a preflight: every
    route that takes a body, or might, answers 415 and nothing runs."""
    ops = [op for op in operations(clean) if op[0] != "GET"]
    assert ("POST", "/flush_cache") in ops and ("DELETE", "/models/chat") in ops
    headers = {} if ctype is None else {"content-type": ctype}
    wrong = []
    for method, path in ops:
        r = httpx.request(method, clean.url + path, content=PWNED, headers=headers, timeout=10)
        if ctype is None:
            assert "content-type" not in r.request.headers
        if r.status_code != 415 or error_of(r)["param"] != "content-type":
            wrong.append((method, path, r.status_code, r.text[:200]))
    assert not wrong, wrong
    assert error_of(r)["type"] == "unsupported_media_type"
    controls, prompts = pipeline_heard(clean)
    assert set(controls) <= READ_ONLY_OPS and "pwned" not in prompts, (controls, prompts)
    assert served(clean) == ["chat", "base"]  # DELETE /models/chat did not run


def test_json_types_and_bodyless_posts_are_served(clean: RunningFront) -> None:
    """What real clients send keeps working: JSON with a charset, a +json type,
    the official client, and SGLang's bodyless POST /flush_cache."""
    for ctype in ("application/json", "Application/JSON; charset=utf-8", "application/x+json"):
        r = httpx.post(
            f"{clean.url}/v1/completions",
            content=json.dumps(COMPLETION),
            headers={"content-type": ctype},
            timeout=10,
        )
        assert r.status_code == 200, (ctype, r.text)
    r = httpx.post(f"{clean.url}/v1/completions", content=b"", timeout=10)
    assert r.status_code == 415  # an empty body without a type is refused before decoding
    client = openai.OpenAI(base_url=f"{clean.url}/v1", api_key="none", max_retries=0)
    out = client.completions.create(model="chat", prompt="hello", max_tokens=2)
    assert out.choices[0].text == "w0 w1 "
    assert httpx.post(f"{clean.url}/flush_cache", timeout=10).status_code == 200
    controls, _ = pipeline_heard(clean)
    assert controls.count("flush_cache") == 1


# ---- no state change on GET ------------------------------------------------------------
def test_get_changes_no_state(clean: RunningFront) -> None:
    """An ``<img src=.../flush_cache>`` sends a GET with no Origin: a 405 that
    flushes nothing. Every GET route of the app reaches the scheduler with
    read-only ops at most, and a GET of every other route is a 405."""
    r = httpx.get(f"{clean.url}/flush_cache", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
    assert error_of(r)["type"] == "method_not_allowed"
    ops = operations(clean)
    for method, path in ops:
        r = httpx.get(clean.url + path, timeout=70)
        if method == "GET":
            assert r.status_code < 500, (path, r.text)
        elif ("GET", path) not in ops:
            assert r.status_code == 405, (path, r.status_code, r.text)
    controls, prompts = pipeline_heard(clean)
    assert set(controls) <= READ_ONLY_OPS, controls
    assert "pwned" not in prompts and served(clean) == ["chat", "base"]


# ---- Host allow-list -------------------------------------------------------------------
FOREIGN_HOSTS = [
    "evil.example",
    "evil.example:30000",
    "127.0.0.1.evil.example",
    "localhost.evil.example",
    "localhost:1@evil.example",
    "10.1.2.3",
    "a:b:c",
]


def test_a_foreign_host_is_misdirected(clean: RunningFront) -> None:
    """DNS rebinding: the page's own name re-pointed at 127.0.0.1 arrives as Host."""
    for host in FOREIGN_HOSTS:
        for method, path in (("GET", "/v1/models"), ("POST", "/flush_cache")):
            r = httpx.request(method, clean.url + path, headers={"host": host}, timeout=10)
            assert r.status_code == 421, (host, path, r.text)
            err = error_of(r)
            assert err["param"] == "host" and "--allowed-hosts" in err["message"], err
    controls, _ = pipeline_heard(clean)
    assert "flush_cache" not in controls


def test_loopback_hosts_are_served(clean: RunningFront) -> None:
    port = clean.port
    for host in (
        f"127.0.0.1:{port}",
        "127.0.0.1",
        f"localhost:{port}",
        "LocalHost.",
        f"app.localhost:{port}",
        "127.0.0.2:8080",  # an SSH tunnel's port: only the name is checked
        f"[::1]:{port}",
    ):
        r = httpx.get(f"{clean.url}/v1/models", headers={"host": host}, timeout=10)
        assert r.status_code == 200, (host, r.text)


def test_allowed_hosts_widen_the_list() -> None:
    with chat_and_base_front(allowed_hosts=["models.example", ".corp.test"]) as f:
        for host, status in [
            ("models.example", 200),
            (f"models.example:{f.port}", 200),
            ("corp.test", 200),
            ("gpu1.corp.test", 200),
            (f"localhost:{f.port}", 200),
            ("evil.example", 421),
            ("models.example.evil", 421),
            ("notcorp.test", 421),
        ]:
            r = httpx.get(f"{f.url}/v1/models", headers={"host": host}, timeout=10)
            assert r.status_code == status, (host, r.text)


def test_star_serves_any_host() -> None:
    with chat_and_base_front(allowed_hosts=["*"]) as f:
        for host in ("evil.example", "a:b:c", "10.1.2.3:80"):
            r = httpx.get(f"{f.url}/v1/models", headers={"host": host}, timeout=10)
            assert r.status_code == 200, (host, r.text)


def test_bound_to_every_interface() -> None:
    """On 0.0.0.0 the server cannot know its names: any Host, unless --allowed-hosts names them."""
    with chat_and_base_front(host="0.0.0.0") as f:
        r = httpx.get(f"{f.url}/v1/models", headers={"host": "anything.example"}, timeout=10)
        assert r.status_code == 200
        # The Origin check still holds: a page elsewhere cannot drive it.
        r = httpx.post(f"{f.url}/flush_cache", headers={"origin": "https://evil.example"})
        assert r.status_code == 403
    with chat_and_base_front(host="0.0.0.0", allowed_hosts=["models.example"]) as f:
        for host, status in [("models.example", 200), ("127.0.0.1", 200), ("evil.example", 421)]:
            r = httpx.get(f"{f.url}/v1/models", headers={"host": host}, timeout=10)
            assert r.status_code == status, (host, r.text)


# ---- browser Origin and CORS -----------------------------------------------------------
def test_a_foreign_origin_is_forbidden(clean: RunningFront) -> None:
    """A page's cross-site fetch or form POST carries its Origin: refused, preflights
    too, and no CORS header tells the browser it may read anything."""
    port = clean.port
    for origin in (
        "https://evil.example",
        f"http://evil.example:{port}",
        "http://127.0.0.1:1",  # another port of this machine is another origin
        f"https://127.0.0.1:{port}.evil.example",
        "null",  # sandboxed frames, file:// pages
    ):
        for method, path in (("POST", "/flush_cache"), ("GET", "/v1/models")):
            r = httpx.request(method, clean.url + path, headers={"origin": origin}, timeout=10)
            assert r.status_code == 403, (origin, path, r.text)
            err = error_of(r)
            assert err["param"] == "origin" and "--allowed-origins" in err["message"], err
            assert "access-control-allow-origin" not in r.headers
        preflight = {"origin": origin, "access-control-request-method": "POST"}
        r = httpx.options(f"{clean.url}/v1/completions", headers=preflight, timeout=10)
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    controls, _ = pipeline_heard(clean)
    assert "flush_cache" not in controls


def test_same_origin_requests_are_served(clean: RunningFront) -> None:
    """The dashboard page's own requests: Origin is the server's scheme://host:port."""
    port = clean.port
    for host, origin in [
        (f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"),
        (f"localhost:{port}", f"http://localhost:{port}"),
        (f"localhost:{port}", f"https://localhost:{port}"),  # behind a TLS proxy
    ]:
        r = httpx.post(
            f"{clean.url}/flush_cache", headers={"host": host, "origin": origin}, timeout=10
        )
        assert r.status_code == 200, (origin, r.text)
        assert "access-control-allow-origin" not in r.headers  # same origin needs none
    controls, _ = pipeline_heard(clean)
    assert controls.count("flush_cache") == 3


def test_allowed_origins_get_cors_and_preflights() -> None:
    with chat_and_base_front(allowed_origins=[APP, "HTTPS://Tool.Example:443/"], api_key=KEY) as f:
        auth = {"authorization": f"Bearer {KEY}"}
        for origin in (APP, "https://tool.example"):
            r = httpx.post(
                f"{f.url}/v1/completions",
                json=COMPLETION,
                headers={"origin": origin, **auth},
                timeout=10,
            )
            assert r.status_code == 200, (origin, r.text)
            assert r.headers["access-control-allow-origin"] == origin
            assert "origin" in r.headers["vary"].lower()
        # Errors too are readable by the allowed page: a wrong body, a missing key.
        r = httpx.post(f"{f.url}/v1/completions", json={}, headers={"origin": APP, **auth})
        assert r.status_code == 400 and r.headers["access-control-allow-origin"] == APP
        r = httpx.post(f"{f.url}/v1/completions", json=COMPLETION, headers={"origin": APP})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == APP
        # The preflight carries no key, and is answered before the key guard.
        preflight = {
            "origin": APP,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
            "access-control-request-private-network": "true",
        }
        r = httpx.options(f"{f.url}/v1/completions", headers=preflight, timeout=10)
        assert r.status_code == 204, r.text
        assert r.headers["access-control-allow-origin"] == APP
        assert "POST" in r.headers["access-control-allow-methods"]
        assert r.headers["access-control-allow-headers"] == "authorization, content-type"
        assert r.headers["access-control-allow-private-network"] == "true"
        assert int(r.headers["access-control-max-age"]) > 0
        # Not a preflight: OPTIONS is no method of the API.
        r = httpx.options(f"{f.url}/v1/completions", headers={"origin": APP, **auth})
        assert r.status_code == 405 and error_of(r)
        r = httpx.post(f"{f.url}/flush_cache", headers={"origin": "https://evil.example", **auth})
        assert r.status_code == 403
    with chat_and_base_front(allowed_origins=["*"]) as f:
        r = httpx.post(f"{f.url}/flush_cache", headers={"origin": "https://any.example"})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://any.example"


def test_flags_parse_lists_and_refuse_what_they_cannot_match(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = parse_args(
        ["--allowed-hosts", "a.example, .b.example", "--allowed-hosts", "[::1]"]
        + ["--allowed-origins", APP]
    )
    assert args.allowed_hosts == ["a.example", ".b.example", "[::1]"]
    assert args.allowed_origins == [APP] and parse_args([]).allowed_origins == []
    for flag, value in [
        ("--allowed-hosts", "http://a.example"),
        ("--allowed-hosts", "a.example:8080"),
        ("--allowed-hosts", "a b"),
        ("--allowed-origins", "app.example:3000"),
        ("--allowed-origins", "http://app.example/path"),
    ]:
        with pytest.raises(SystemExit):
            parse_args([flag, value])
        assert flag in capsys.readouterr().err


def test_host_names_are_compared_in_one_spelling() -> None:
    """Bound to one address, that address is served in any spelling, IPv6 included."""
    hosts = HostAllowList("FD00:0::5", ["[fe80::1]", "Models.Example."])
    for host in ("fd00::5", "fd00:0:0::5", "fe80::1", "models.example", "::1", "127.9.9.9"):
        assert hosts.allows(host), host
    for host in ("fd00::6", "10.0.0.1", "evil.example", "models.example.evil"):
        assert not hosts.allows(host), host
    assert HostAllowList("192.168.1.5", []).allows("192.168.1.5")
    assert not HostAllowList("192.168.1.5", []).allows("192.168.1.6")


# ---- real pages in a real browser ------------------------------------------------------
def chromium() -> str | None:
    return next(
        (p for n in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(n))),
        None,
    )


def dump_dom(url: str, profile: Path, *flags: str) -> str:
    """The DOM of ``url`` in headless Chromium once its fetches have settled."""
    browser = chromium()
    if browser is None:
        pytest.skip("chromium not found (Debian: apt-get install chromium; `make setup` does it)")
    out = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=5000",
            *flags,
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0 and "<body" in out.stdout, out.stderr[-2000:]
    return out.stdout


@contextlib.contextmanager
def page_server(pages: dict[str, str]) -> Iterator[str]:
    """An HTTP server of ``pages`` (path -> HTML) on its own port: another origin."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path, "").encode()
            self.send_response(200 if body else 404)
            self.send_header("content-type", "text/html; charset=utf-8")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


ATTACK_PAGE = """<!doctype html><body>
<img src="TARGET/flush_cache">
<img src="TARGET/models/chat/invalidate">
<script>
const T = "TARGET";
const tried = [];
async function attempt(name, path, init) {
  try { const r = await fetch(T + path, init); tried.push(name + ":" + r.type); }
  catch (e) { tried.push(name + ":failed"); }
}
const pwned = JSON.stringify({model: "chat", prompt: "pwned", text: "pwned", max_tokens: 1});
(async () => {
  await attempt("flush", "/flush_cache", {method: "POST", mode: "no-cors"});
  await attempt("invalidate", "/models/chat/invalidate", {method: "POST", mode: "no-cors",
    headers: {"Content-Type": "application/x-www-form-urlencoded"}, body: "a=b"});
  await attempt("generate", "/generate", {method: "POST", mode: "no-cors",
    body: new Blob([pwned])});  // no Content-Type at all
  await attempt("completions", "/v1/completions", {method: "POST", mode: "no-cors",
    headers: {"Content-Type": "text/plain"}, body: pwned});
  await attempt("unload", "/models/chat", {method: "DELETE"});  // needs a preflight
  await attempt("read", "/v1/models", {});
  document.body.dataset.tried = tried.join(" ");
})();
</script></body>"""


def test_a_hostile_page_in_a_browser_changes_nothing(clean: RunningFront, tmp_path: Path) -> None:
    """The issue's attacks from a real page on another origin: images, no-CORS
    POSTs with no type, text/plain and form bodies, a DELETE, a cross-origin read."""
    with page_server({"/": ATTACK_PAGE.replace("TARGET", clean.url)}) as site:
        dom = dump_dom(f"{site}/", tmp_path / "profile")
    tried = re.search(r'data-tried="([^"]*)"', dom)
    assert tried, dom[-2000:]
    # no-cors answers are opaque whatever happened; the DELETE's preflight and
    # the read fail in the browser: what counts is what reached the server.
    assert "unload:failed" in tried.group(1) and "read:failed" in tried.group(1), tried.group(1)
    controls, prompts = pipeline_heard(clean)
    assert set(controls) <= READ_ONLY_OPS, controls
    assert "pwned" not in prompts and served(clean) == ["chat", "base"]


def test_the_dashboard_works_and_a_rebound_name_does_not(
    clean: RunningFront, tmp_path: Path
) -> None:
    """Same-origin polls of /dashboard.json pass the guard; the same page through
    a name re-pointed at 127.0.0.1 (DNS rebinding) is refused."""
    dom = dump_dom(f"{clean.url}/dashboard", tmp_path / "profile")
    polls = re.search(r'data-polls="(\d+)"', dom)
    assert polls and int(polls.group(1)) >= 1, dom[-2000:]
    rebound = f"http://rebind.test:{clean.port}/dashboard"
    dom = dump_dom(rebound, tmp_path / "profile", "--host-resolver-rules=MAP rebind.test 127.0.0.1")
    assert "is not served here" in dom and "data-polls" not in dom, dom[-2000:]


APP_PAGE = """<!doctype html><body><script>
fetch("TARGET/v1/completions", {method: "POST",
  headers: {"Content-Type": "application/json", "Authorization": "Bearer KEY"},
  body: JSON.stringify({model: "chat", prompt: "hello", max_tokens: 2})})
  .then((r) => r.json())
  .then((j) => { document.body.dataset.text = j.choices[0].text; })
  .catch((e) => { document.body.dataset.text = "failed: " + e; });
</script></body>"""


def test_an_allowed_browser_application_is_served(tmp_path: Path) -> None:
    """A page on an origin in --allowed-origins: preflight, then the JSON POST, read back."""
    pages: dict[str, str] = {}
    with page_server(pages) as site, chat_and_base_front(allowed_origins=[site], api_key=KEY) as f:
        pages["/"] = APP_PAGE.replace("TARGET", f.url).replace("KEY", KEY)
        dom = dump_dom(f"{site}/", tmp_path / "profile")
    assert 'data-text="w0 w1 "' in dom, dom[-2000:]


# ---- the whole runtime -------------------------------------------------------------------
def test_refused_flushes_leave_the_real_cache_alone(tmp_path: Path) -> None:
    """Launcher, scheduler, runner: the cached prefix survives a GET, a no-type
    body, a foreign Origin and a foreign Host on /flush_cache, and a plain
    bodyless POST (SGLang's clients) still flushes it."""
    folder = make_tiny_model_dir(tmp_path / "a", seed=11)
    engine = Engine(
        model=[f"{folder},name=a"],
        kv_cache_bytes=4 << 20,
        kv_block_bytes=64 << 10,
        runner_threads=1,
        dtype="float32",
    )
    url = f"http://127.0.0.1:{engine.args.port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    prompt = list(range(1000, 1040))

    def cached() -> int:
        usage = client.completions.create(model="a", prompt=prompt, max_tokens=1).usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return usage.prompt_tokens_details.cached_tokens or 0

    try:
        cached()
        assert cached() > 0
        for r in (
            httpx.get(f"{url}/flush_cache", timeout=30),
            httpx.post(f"{url}/flush_cache", content=b"{}", timeout=30),
            httpx.post(f"{url}/flush_cache", headers={"origin": "https://evil.example"}),
            httpx.post(f"{url}/flush_cache", headers={"host": "evil.example"}),
        ):
            assert r.status_code in (405, 415, 403, 421), r.text
            assert error_of(r)["message"]
        assert cached() > 0  # still there
        assert httpx.post(f"{url}/flush_cache", timeout=30).status_code == 200
        assert cached() == 0
    finally:
        engine.shutdown()
