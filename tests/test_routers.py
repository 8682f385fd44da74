"""SGLang's and vLLM's routers in front of a real radixmux server.

Each router (``sglang-router`` 0.3.2, ``vllm-router`` 0.1.17, from the dev
extras) runs as a process of its own with its cache-aware policy and the
server as its one worker; completions, chat and ``/generate``, streamed and
not, must come back through it answered 200 with text. The routers add
SGLang's and vLLM's extension fields to each request they forward, so this
is where a field refused by mistake shows.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import tiny_server

from bench.server_process import ServerProcess, free_port
from bench.tiny_models import make_tiny_model_dir

pytestmark = pytest.mark.timeout(300)

ROUTER_START_S = 60.0
# (package, launch module): both take the same core flags.
ROUTERS = {
    "sglang-router": ("sglang_router", "sglang_router.launch_router"),
    "vllm-router": ("vllm_router", "vllm_router.launch_router"),
}
MESSAGES = [{"role": "user", "content": "Name a colour."}]
TOKENS = 4


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = make_tiny_model_dir(tmp_path_factory.mktemp("routers") / "tiny", seed=31)
    with tiny_server(folder) as url:
        yield url


@pytest.fixture(scope="module", params=list(ROUTERS))
def router(
    request: pytest.FixtureRequest, worker: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    package, module = ROUTERS[request.param]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{request.param} is not installed (pip install -e '.[dev]')")
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        module,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        worker,
        "--policy",
        "cache_aware",
        # Each router's own metrics listener, on a port of its own (the default
        # one is shared by both routers and anything else running).
        "--prometheus-port",
        str(free_port()),
    ]
    log = Path(tmp_path_factory.mktemp("router_logs")) / f"{request.param}.log"
    proc = ServerProcess(cmd, port, log)
    try:
        proc.wait_healthy(ROUTER_START_S)
        yield proc.base_url
    finally:
        proc.stop()


def body_for(path: str, stream: bool) -> dict[str, Any]:
    """A greedy request of TOKENS tokens (EOS ignored, so the text is never empty)."""
    if path == "/generate":
        sampling = {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        return {"text": "The sky is", "sampling_params": sampling, "stream": stream}
    common = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
    if path == "/v1/completions":
        return {"model": "tiny", "prompt": "The sky is", **common}
    return {"model": "tiny", "messages": MESSAGES, **common}


def text_of(path: str, answer: dict[str, Any]) -> str:
    """The text in one answer or one streamed chunk."""
    if path == "/generate":
        return answer["text"]
    choices = answer["choices"]
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice["text"]
    return (choice.get("message") or choice.get("delta") or {}).get("content") or ""


def events(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON events of an SSE stream, up to ``[DONE]``."""
    out = []
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        out.append(json.loads(data))
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_router_forwards_and_is_answered(router: str, path: str, stream: bool) -> None:
    with httpx.Client(timeout=60, trust_env=False) as client:
        if not stream:
            r = client.post(router + path, json=body_for(path, False))
            assert r.status_code == 200, r.text
            assert text_of(path, r.json())
            return
        with client.stream("POST", router + path, json=body_for(path, True)) as r:
            assert r.status_code == 200, r.read()
            chunks = events(r)
    assert chunks
    if path == "/generate":  # SGLang's chunks carry the text so far
        text = text_of(path, chunks[-1])
        assert chunks[-1]["meta_info"]["completion_tokens"] == TOKENS
    else:
        text = "".join(text_of(path, c) for c in chunks)
    assert text


def test_router_passes_on_a_refusal(router: str) -> None:
    """A field in no table is refused through the router too (400, named)."""
    body = {**body_for("/v1/completions", False), "no_such_extension": 1}
    r = httpx.post(router + "/v1/completions", json=body, timeout=60, trust_env=False)
    assert r.status_code == 400
    assert "no_such_extension" in r.text
