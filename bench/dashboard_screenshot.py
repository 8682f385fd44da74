"""``docs/dashboard.png``: the dashboard of two real models under load, as
headless Chromium renders it.

::

    python -m bench.dashboard_screenshot [--out docs/dashboard.png] [--seconds 40]

smollm2 loads at start and gemma3-270m is on demand (its first request loads
it, so the model lifecycle table shows a load); four clients send completions
sharing a system prompt to both (three to smollm2 for one to gemma), each
with ~80 tokens of its own, over a 48 MiB arena (capacity evictions);
gemma3-270m's cache is invalidated halfway (the invalidation step of the
eviction chart); the page is captured while requests still run. About three
minutes on two busy shared cores.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from radixmux.runtime.client.engine import Engine

SYSTEM = (
    "You are a meticulous travel assistant for a rail company. Answer briefly, "
    "name the train, the platform and the time. "
)
MODELS = ("smollm2", "smollm2", "smollm2", "gemma3-270m")  # the request mix, in turn
CLIENTS = 4
WINDOW = (1400, 1200)  # the page down to the first prefixes


def timetable(worker: int, i: int) -> str:
    """A question of ~80 tokens of its own: enough KV, over the shared system
    prompt, for capacity evictions in 48 MiB within the run."""
    trains = (f"train {(worker * 7919 + i * 104729 + k * 31) % 9000 + 1000}" for k in range(12))
    return f"the timetable lists {', '.join(trains)}. When is the next train to Lyon?"


def clients(url: str, stop: threading.Event) -> None:
    """Completions from ``CLIENTS`` threads until ``stop``; errors end the run."""

    def one(worker: int) -> None:
        i = 0
        with httpx.Client(timeout=300) as http:
            while not stop.is_set():
                body = {
                    "model": MODELS[(worker + i) % len(MODELS)],
                    "prompt": f"{SYSTEM}Request {worker}-{i}: {timetable(worker, i)}",
                    "max_tokens": 16,
                    "temperature": 0,
                }
                http.post(f"{url}/v1/completions", json=body).raise_for_status()
                i += 1

    with ThreadPoolExecutor(CLIENTS) as pool:
        for job in [pool.submit(one, w) for w in range(CLIENTS)]:
            job.result()


def wait_loaded(url: str, model: str, timeout: float = 300.0) -> None:
    """Wait until ``/v1/models`` says ``model`` is loaded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cards = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        if any(c["id"] == model and c.get("state") == "loaded" for c in cards):
            return
        time.sleep(0.5)
    raise SystemExit(f"{model} did not load within {timeout:g} s")


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe
    (``--remote-debugging-pipe``: JSON messages ended by NUL on fds 3 and 4),
    so a page can stay open in real time and be captured later."""

    def __init__(self, binary: str) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="radixmux-chromium-")
        to_chrome, self._send = os.pipe()
        self._recv, from_chrome = os.pipe()

        def fds() -> None:  # in the child: the protocol's fds 3 (its input) and 4
            # Copies above 4 first: either pipe end may itself be fd 3 or 4.
            into, out = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_chrome, from_chrome))
            os.dup2(into, 3)
            os.dup2(out, 4)

        self.proc = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--remote-debugging-pipe",
                f"--user-data-dir={self._profile.name}",
                f"--window-size={WINDOW[0]},{WINDOW[1]}",
            ],
            pass_fds=(3, 4, to_chrome, from_chrome),  # 3, 4: kept once fds() made them
            preexec_fn=fds,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome)
        os.close(from_chrome)
        self._next_id = 0
        self._buffer = b""

    def call(self, method: str, session: str | None = None, **params: object) -> dict:
        """One protocol command; its result (events in between are skipped)."""
        self._next_id += 1
        msg: dict[str, object] = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            msg["sessionId"] = session
        os.write(self._send, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._recv, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium closed the pipe during {method}")
                self._buffer += chunk
            raw, _, self._buffer = self._buffer.partition(b"\0")
            reply = json.loads(raw)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def open(self, url: str) -> str:
        """Open ``url`` in a new page; its session id."""
        target = self.call("Target.createTarget", url=url)["targetId"]
        session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        width, height = WINDOW  # the viewport itself, not the window around it
        self.call(
            "Emulation.setDeviceMetricsOverride",
            session,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        return session

    def capture(self, session: str, out: Path) -> None:
        """The page as it is now, as PNG."""
        data = self.call("Page.captureScreenshot", session, format="png")["data"]
        out.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, OSError):
            self.call("Browser.close")
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._send)
        os.close(self._recv)
        self._profile.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    parser.add_argument("--seconds", type=float, default=40.0, help="load before the capture")
    args = parser.parse_args()
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        raise SystemExit("chromium not found (Debian: apt-get install chromium)")
    eng = Engine(
        model=["smollm2", "gemma3-270m,load=on_demand"],
        kv_cache_bytes=48 << 20,
        kv_block_bytes=1 << 20,
    )
    url = f"http://127.0.0.1:{eng.args.port}"
    stop = threading.Event()
    load = threading.Thread(target=clients, args=(url, stop), daemon=True)
    browser = Browser(binary)
    try:
        load.start()
        wait_loaded(url, "gemma3-270m")  # by its first request
        page = browser.open(f"{url}/dashboard")  # open through the load: its chart fills
        time.sleep(args.seconds / 2)
        httpx.post(f"{url}/models/gemma3-270m/invalidate", timeout=60).raise_for_status()
        time.sleep(args.seconds / 2)
        if not load.is_alive():
            raise SystemExit("the clients stopped before the capture (see the log)")
        browser.capture(page, args.out)
        print(f"wrote {args.out}")
    finally:
        browser.close()
        stop.set()
        load.join(timeout=300)
        eng.shutdown()


if __name__ == "__main__":
    main()
