"""Fuzzing the HTTP API from its own OpenAPI document (schemathesis), plus hostile inputs.

A real front process over real HTTP, its peers played by the harness (so
thousands of cases run in seconds): every generated request, valid or not,
must get a non-5xx answer, and every error must be the one JSON error shape
naming what is wrong. The same front also proves the document is valid
OpenAPI (schemathesis refuses to load one that is not) and matches the routes.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Iterator

import httpx
import hypothesis
import pytest
import schemathesis
from front_harness import RunningFront, chat_and_base_front
from schemathesis import GenerationMode

KEY = "fuzz-key"
LIMIT = 8192
CASES_PER_OPERATION = 100
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def front() -> Iterator[RunningFront]:
    with chat_and_base_front(api_key=KEY, max_request_bytes=LIMIT) as f:
        yield f


def check_error_body(text: str) -> None:
    """An error is OpenAI's JSON shape, its message free of internals."""
    body = json.loads(text)
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], body
    # Served model names are echoed back and may be anything a client loaded
    # (even "launch.py"), so look for the markers of a leaked stack trace.
    assert err["type"], body
    assert "Traceback (most recent call last)" not in err["message"], body
    assert not re.search(r'File "[^"]+\.py", line \d+', err["message"]), body


def fuzz_operation(op: schemathesis.APIOperation, mode: GenerationMode) -> int:
    """Send up to ``CASES_PER_OPERATION`` generated requests of ``mode``; the count sent."""
    sent = 0

    @hypothesis.settings(
        max_examples=CASES_PER_OPERATION,
        deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        derandomize=True,
        database=None,
        phases=[hypothesis.Phase.generate],
    )
    @hypothesis.given(case=op.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        nonlocal sent
        sent += 1
        r = case.call(headers={"Authorization": f"Bearer {KEY}"}, timeout=20)
        assert r.status_code < 500, (case.method, case.path, case.body, r.text[:500])
        if r.status_code >= 400:
            ctype = r.headers["content-type"]  # schemathesis keeps every value of a header
            assert ctype[0].startswith("application/json"), r.headers
            check_error_body(r.text)

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE  # nothing to get wrong: no body, no parameter
    return sent


def is_model_change(op: schemathesis.APIOperation) -> bool:
    """Load / unload / reload: they change which models the front serves."""
    return op.path.startswith("/models") and not op.path.endswith("/invalidate")


def fuzz_operations(front: RunningFront, model_changes: bool) -> collections.Counter[str]:
    """Positive and negative cases for every documented operation of one kind."""
    # Loading validates the document: schemathesis refuses invalid OpenAPI.
    schema = schemathesis.openapi.from_url(f"{front.url}/openapi.json")
    cases: collections.Counter[str] = collections.Counter()
    for result in schema.get_all_operations():
        op = result.ok()
        if is_model_change(op) != model_changes:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            cases[f"{op.label} {mode.value}"] += fuzz_operation(op, mode)
    return cases


def test_generated_requests_never_get_a_5xx(front: RunningFront) -> None:
    cases = fuzz_operations(front, model_changes=False)
    total = sum(cases.values())
    print(f"\nfuzz cases per operation ({total} in all):")
    for label, n in sorted(cases.items()):
        print(f"  {n:5d}  {label}")
    assert total >= 12 * CASES_PER_OPERATION, cases
    assert front.proc.poll() is None
    assert httpx.get(f"{front.url}/health", timeout=10).status_code == 200


def test_generated_model_changes_never_get_a_5xx() -> None:
    """Loads, unloads and reloads change the served set: a front of their own
    (the harness's launcher accepts every change), so the other tests keep theirs."""
    with chat_and_base_front(api_key=KEY, max_request_bytes=LIMIT) as front:
        cases = fuzz_operations(front, model_changes=True)
        print(f"\nmodel-change fuzz cases: {dict(cases)}")
        assert sum(cases.values()) >= 4 * CASES_PER_OPERATION, cases
        assert front.proc.poll() is None
        models = httpx.get(
            f"{front.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10
        )
        assert models.status_code == 200 and models.json()["data"]  # never the last one gone


def test_document_matches_the_routes(front: RunningFront) -> None:
    doc = httpx.get(f"{front.url}/openapi.json", timeout=10).json()  # no key needed
    assert doc["openapi"].startswith("3.1")
    ops = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    for op in [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models/{name}"),
        ("POST", "/generate"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/flush_cache"),
    ]:
        assert op in ops
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]
    # The document is the type the server decodes with: its fields and strictness.
    assert {"prompt", "max_tokens", "logit_bias", "user"} <= set(completion["properties"])
    assert completion["additionalProperties"] is False and completion["required"] == ["prompt"]
    page = httpx.get(f"{front.url}/docs", timeout=10)
    assert page.status_code == 200 and "CompletionRequest" in page.text
    assert "<script" not in page.text  # self-contained: nothing fetched from elsewhere


CMPL, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
HOSTILE: list[tuple[str, bytes, dict[str, str], int]] = [
    (CMPL, b'{"model": "chat", "prompt": "x", "max_tokens": 1e308}', {}, 400),
    (CMPL, b'{"model": "chat", "prompt": "x", "max_tokens": 9' + b"9" * 30 + b"}", {}, 400),
    (CMPL, b'{"model": "chat", "prompt": "x", "temperature": NaN}', {}, 400),
    (CMPL, b'{"model": "chat", "prompt": "x", "top_p": Infinity}', {}, 400),
    (CMPL, b'{"model": "chat", "prompt": "x", "max_tokens": -5}', {}, 400),
    (CMPL, b'{"model": "chat", "prompt": [1, -3]}', {}, 400),
    (CMPL, b'{"model": "chat", "prompt": [1, 4294967296]}', {}, 400),
    (CMPL, b'{"model": "chat", "prompt": "\xff\xfe"}', {}, 400),  # invalid UTF-8
    (CMPL, b"[" * 2000 + b"]" * 2000, {}, 400),
    (CMPL, b'{"model": "chat", "prompt": "' + b"a" * LIMIT + b'"}', {}, 413),
    (CMPL, b'{"model": "chat", "prompt": "x"}', {"content-type": "text/plain"}, 415),
    (CMPL, b'{"model": "chat", "prompt": "x"}', {"authorization": "Bearer no"}, 401),
    (CMPL, b'{"model": "chat", "prompt": "x"}', {"authorization": ""}, 401),
    (GEN, b'{"text": "x", "sampling_params": {"max_new_tokens": -1}, "model": "chat"}', {}, 400),
    (GEN, b'{"model": "chat", "input_ids": [999999]}', {}, 400),
    ("/detokenize", b'{"model": "chat", "tokens": [-1]}', {}, 400),
    ("/tokenize", b'{"model": "chat"}', {}, 400),
    (CHAT, b'{"model": "chat", "messages": [{"role": "user", "content": 5}]}', {}, 400),
    (CHAT, b'{"model": "chat", "messages": "hi"}', {}, 400),
    (CHAT, b"null", {}, 400),
    (CHAT, b'"just a string"', {}, 400),
]


@pytest.mark.parametrize(("path", "data", "headers", "status"), HOSTILE)
def test_hostile_input(
    front: RunningFront, path: str, data: bytes, headers: dict[str, str], status: int
) -> None:
    sent = {"content-type": "application/json", "authorization": f"Bearer {KEY}", **headers}
    r = httpx.post(f"{front.url}{path}", content=data, headers=sent, timeout=20)
    assert r.status_code == status, r.text
    check_error_body(r.text)
