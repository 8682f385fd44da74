"""SGLang's and vLLM's extension fields over real HTTP against a real server.

The tables in ``runtime/front/api/extensions.py`` drive these tests: every
neutral value is accepted, every other value of a field this server does not
honour is a 400 naming it, the honoured ones change the answer as their
origin's servers do, and a field in no table stays an unknown field.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from conftest import tiny_server
from transformers import AutoTokenizer

from bench.tiny_models import make_tiny_model_dir
from radixmux.runtime.front.api import extensions
from radixmux.runtime.front.api.native import NativeGenerate, NativeSampling
from radixmux.runtime.front.api.openai.chat import ChatRequest
from radixmux.runtime.front.api.openai.completions import CompletionRequest

pytestmark = pytest.mark.timeout(300)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "http-api.md"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
# The bodies sglang-router 0.3.2 forwards for a minimal request (captured from
# the router in front of a logging proxy): each must be served as is.
SGLANG_ROUTER_BODIES = {
    "/v1/completions": {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 4,
        "stream": False,
        "echo": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "return_hidden_states": False,
    },
    "/v1/chat/completions": {
        "messages": MESSAGES,
        "model": "tiny",
        "logprobs": False,
        "max_completion_tokens": 4,
        "stream": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "continue_final_message": False,
        "skip_special_tokens": True,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "return_hidden_states": False,
        "include_reasoning": True,  # vllm-router adds this one
    },
    "/generate": {
        "text": "Hello",
        "model": None,
        "sampling_params": {"max_new_tokens": 4},
        "return_text_in_logprobs": False,
        "stream": False,
        "log_metrics": True,
        "return_hidden_states": False,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
    },
}
# (endpoint, base body, its Struct, table, where the fields go)
ENDPOINTS = [
    (
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": 2},
        CompletionRequest,
        extensions.COMPLETION,
        "",
    ),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 2},
        ChatRequest,
        extensions.CHAT,
        "",
    ),
    (
        "/generate",
        {"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
        NativeGenerate,
        extensions.GENERATE,
        "",
    ),
    (
        "/generate",
        {"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
        NativeSampling,
        extensions.SAMPLING,
        "sampling_params.",
    ),
]
ENDPOINT_IDS = ["completions", "chat", "generate", "sampling_params"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("ext") / "tiny", seed=21)


@pytest.fixture(scope="module")
def url(model_dir: Path) -> Iterator[str]:
    with tiny_server(model_dir) as base:
        yield base


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60, trust_env=False)


def with_field(body: dict[str, Any], prefix: str, name: str, value: Any) -> dict[str, Any]:
    """``body`` with ``name`` set (inside ``sampling_params`` for that prefix)."""
    if not prefix:
        return {**body, name: value}
    return {**body, "sampling_params": {**body["sampling_params"], name: value}}


def field_types(struct: type[msgspec.Struct]) -> dict[str, Any]:
    return {f.name: f.type for f in msgspec.structs.fields(struct)}


def non_neutral(type_: Any, neutral: tuple[Any, ...]) -> Any:
    """A value ``type_`` admits that is not neutral; None if every one is."""
    for candidate in (True, False, 7, 2.5, "x", ["x"], {"k": "v"}):
        try:
            msgspec.convert(candidate, type_, strict=True)
        except msgspec.ValidationError:
            continue
        if candidate not in neutral:
            return candidate
    return None


def refusable(table: dict[str, extensions.Extension], struct: type) -> list[tuple[str, Any]]:
    """(field, a value refused) for every field of ``table`` accepted only neutral."""
    types = field_types(struct)
    out = []
    for row in table.values():
        if row.honoured:
            continue
        value = non_neutral(types[row.name], row.neutral)
        if value is not None:
            out.append((row.name, value))
    return out


def test_every_table_row_is_a_declared_field() -> None:
    for _, _, struct, table, _ in ENDPOINTS:
        declared = set(struct.__struct_fields__)
        assert set(table) <= declared, set(table) - declared


@pytest.mark.parametrize("path", list(SGLANG_ROUTER_BODIES))
def test_the_bodies_sglang_router_forwards_are_served(url: str, path: str) -> None:
    r = post(url, path, SGLANG_ROUTER_BODIES[path])
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("path", "body", "struct", "table", "prefix"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_every_neutral_value_is_accepted(
    url: str, path: str, body: dict, struct: type, table: dict, prefix: str
) -> None:
    neutral = {row.name: (row.neutral or (None,))[0] for row in table.values() if not row.honoured}
    sent = body
    for name, value in neutral.items():
        sent = with_field(sent, prefix, name, value)
    r = post(url, path, sent)
    assert r.status_code == 200, r.text
    # And None for each, as clients that send every field do.
    for name in neutral:
        sent = with_field(sent, prefix, name, None)
    assert post(url, path, sent).status_code == 200


@pytest.mark.parametrize(("path", "body", "struct", "table", "prefix"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_a_value_not_honoured_is_refused_naming_the_field(
    url: str, path: str, body: dict, struct: type, table: dict, prefix: str
) -> None:
    cases = refusable(table, struct)
    assert len(cases) >= 5  # the table really is exercised
    with httpx.Client(timeout=60, trust_env=False) as client:
        for name, value in cases:
            r = client.post(url + path, json=with_field(body, prefix, name, value))
            assert r.status_code == 400, (name, value, r.text)
            error = r.json()["error"]
            assert error["param"] == prefix + name, error
            assert f"'{prefix}{name}'" in error["message"], error
            assert "accepted: null" in error["message"], error


@pytest.mark.parametrize(("path", "body", "struct", "table", "prefix"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_a_field_in_no_table_is_still_unknown(
    url: str, path: str, body: dict, struct: type, table: dict, prefix: str
) -> None:
    r = post(url, path, with_field(body, prefix, "no_such_extension", False))
    assert r.status_code == 400
    assert "no_such_extension" in r.json()["error"]["message"]


def test_a_chat_extension_is_unknown_on_completions(url: str) -> None:
    r = post(url, "/v1/completions", {"prompt": "Hi", "continue_final_message": False})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "continue_final_message"


# ---- honoured ---------------------------------------------------------------------
def greedy(url: str, path: str, fields: dict[str, Any]) -> str:
    """The greedy text of 12 tokens (EOS ignored) for one fixed prompt;
    ``fields`` go where the endpoint takes its sampling fields."""
    sampling = {"temperature": 0, "ignore_eos": True, **fields}
    if path == "/generate":
        body = {"text": "The sky is", "sampling_params": {"max_new_tokens": 12, **sampling}}
    elif path == "/v1/completions":
        body = {"prompt": "The sky is", "max_tokens": 12, **sampling}
    else:
        body = {"messages": MESSAGES, "max_tokens": 12, **sampling}
    r = post(url, path, body)
    assert r.status_code == 200, r.text
    if path == "/generate":
        return r.json()["text"]
    choice = r.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize(
    ("path", "keep"),
    [
        ("/v1/completions", "no_stop_trim"),
        ("/v1/completions", "include_stop_str_in_output"),
        ("/v1/chat/completions", "no_stop_trim"),
        ("/generate", "no_stop_trim"),
    ],
)
def test_no_stop_trim_keeps_the_stop_string(url: str, path: str, keep: str) -> None:
    full = greedy(url, path, {})
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # from the middle of the text
    assert stop.strip(), full
    at = full.index(stop)
    assert greedy(url, path, {"stop": [stop]}) == full[:at]
    assert greedy(url, path, {"stop": [stop], keep: True}) == full[:at] + stop
    assert greedy(url, path, {"stop": [stop], keep: False}) == full[:at]


def prompt_tokens(url: str, messages: list[dict[str, str]], extra: dict[str, Any]) -> int:
    body = {"messages": messages, "max_tokens": 1, **extra}
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_continue_final_message_leaves_the_last_message_open(url: str, model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [*MESSAGES, {"role": "assistant", "content": "The colour is"}]

    def rendered(**kw: bool) -> int:
        text = tok.apply_chat_template(messages, tokenize=False, **kw)
        return len(tok(text, add_special_tokens=False).input_ids)

    open_end = rendered(add_generation_prompt=False, continue_final_message=True)
    assert prompt_tokens(url, messages, {"continue_final_message": True}) == open_end
    assert prompt_tokens(url, messages, {}) == rendered(add_generation_prompt=True)
    closed = rendered(add_generation_prompt=False)
    assert prompt_tokens(url, messages, {"add_generation_prompt": False}) == closed
    assert open_end < closed  # the open message has no end-of-turn


def test_continue_final_message_with_a_generation_prompt_is_refused(url: str) -> None:
    body = {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True}
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "continue_final_message"


def test_docs_list_every_extension_field() -> None:
    section = DOCS.read_text().split("## SGLang and vLLM extension fields", 1)[1]
    section = section.split("\n## ", 1)[0]
    documented: dict[str, str] = {}  # field -> its row's last column
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = line.strip("|").split("|")
            for name in re.findall(r"`(\w+)`", cells[0]):
                documented[name] = cells[-1]
    for table in (extensions.COMPLETION, extensions.CHAT, extensions.GENERATE, extensions.SAMPLING):
        for row in table.values():
            assert row.name in documented, f"docs/http-api.md does not list {row.name}"
            assert ("honoured" in documented[row.name]) == row.honoured, row.name
