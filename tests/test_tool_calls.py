"""Tool calls: the plan a request's ``tools`` / ``tool_choice`` make, reading
calls back from an answer (JSON for required / named, Hermes ``<tool_call>``
blocks for auto), and ``auto`` on a real server whose chat template renders
tools."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from bench.tiny_models import make_tiny_model_dir
from radixmux.runtime.api_error import APIError
from radixmux.runtime.client.engine import Engine
from radixmux.runtime.front.api.openai import tools

pytestmark = pytest.mark.timeout(300)

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}

# A Hermes-style template (as Qwen's): the tools in the system turn, calls as
# <tool_call>{json}</tool_call>.
HERMES = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tools(*defs: dict) -> list[tools.ToolDef]:
    return msgspec.convert(list(defs), list[tools.ToolDef])


def test_required_is_an_array_of_calls_and_named_is_the_arguments() -> None:
    req = tools.plan(_tools(ADD, NOW), "required", None)
    assert req.mode == "required" and req.constraint is not None
    schema = json.loads(req.constraint.spec)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    names = [alt["properties"]["name"]["const"] for alt in schema["items"]["anyOf"]]
    assert names == ["add", "now"]
    one = tools.plan(_tools(ADD, NOW), "required", False)
    assert json.loads(one.constraint.spec)["maxItems"] == 1
    choice = msgspec.convert(
        {"type": "function", "function": {"name": "add"}}, tools.NamedToolChoice
    )
    named = tools.plan(_tools(ADD, NOW), choice, None)
    assert json.loads(named.constraint.spec) == ADD["function"]["parameters"]
    content, calls = tools.read_calls(named, '{"a": 1, "b": 2}')
    assert content is None and calls[0].function.name == "add"
    assert json.loads(calls[0].function.arguments) == {"a": 1, "b": 2}
    content, calls = tools.read_calls(req, '[{"name": "now", "parameters": {}}, ')
    assert calls == [] and content.startswith("[")  # cut by max_tokens: left as text


@pytest.mark.parametrize(
    ("defs", "choice", "param"),
    [
        ((), "required", "tool_choice"),
        ((ADD, ADD), "required", "tools"),
        ((ADD,), "sometimes", "tool_choice"),
        (({"type": "retrieval", "function": {"name": "x"}},), "required", "tools[0].type"),
        (({"type": "function", "function": {"name": "bad name"}},), "required",
         "tools[0].function.name"),
        (({"type": "function", "function": {"name": "a.b"}},), "required",
         "tools[0].function.name"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_naming_the_field(defs, choice, param) -> None:
    with pytest.raises(APIError) as err:
        tools.plan(_tools(*defs), choice, None)
    assert err.value.param == param


def test_auto_reads_hermes_blocks_and_keeps_the_rest_as_content() -> None:
    auto = tools.plan(_tools(ADD), "auto", None)
    assert auto.mode == "auto" and auto.constraint is None and auto.specs[0].name == "add"
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        "\n<tool_call>not json</tool_call>"
    )
    content, calls = tools.read_calls(auto, text)
    assert [c.function.name for c in calls] == ["add"]
    assert json.loads(calls[0].function.arguments) == {"a": 2, "b": 3}
    assert content.startswith("Let me add.") and "<tool_call>" not in content.split("\n")[0]
    assert tools.read_calls(auto, "No call here.") == ("No call here.", [])
    # A call to a function the request did not offer is not a call: it stays text.
    other = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    assert tools.read_calls(auto, other) == (other, [])
    # A block that is not a call stays in the content, where the reader sees it.
    assert content.endswith("<tool_call>not json</tool_call>")
    content, calls = tools.read_calls(
        auto, '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    )
    assert content is None and len(calls) == 1


@pytest.fixture(scope="module")
def hermes_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("hermes")
    folder: Path = make_tiny_model_dir(root / "m", seed=3)
    template = root / "hermes.jinja"
    template.write_text(HERMES)
    eng = Engine(
        model=[f"{folder},name=h"],
        kv_cache_bytes=16 << 20,
        kv_block_bytes=64 << 10,
        dtype="float32",
        chat_template=str(template),
    )
    try:
        yield f"http://127.0.0.1:{eng.args.port}"
    finally:
        eng.shutdown()


def test_auto_renders_the_tools_where_the_template_declares_them(hermes_url: str) -> None:
    def ask(**extra) -> dict:
        body = {
            "model": "h",
            "messages": [{"role": "user", "content": "Add 2 and 3."}],
            "max_tokens": 8,
            "temperature": 0,
            **extra,
        }
        r = httpx.post(f"{hermes_url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    plain = ask()
    auto = ask(tools=[ADD])
    # The template rendered the tool list into the prompt.
    assert auto["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 20
    choice = auto["choices"][0]
    # A random model writes no call: its text comes back as content.
    assert choice["message"]["content"] is not None and choice["finish_reason"] == "length"
