"""OpenAI ``tools`` / ``tool_choice`` on ``/v1/chat/completions``.

``"required"`` and a named function work on any model: the output is held to a
JSON schema built from the tools' parameter schemas (structured output), then
read back as OpenAI's ``tool_calls``. ``"auto"`` (the default when tools are
given) needs the model's own tool-call syntax: it is served when the chat
template declares tools and writes calls as ``<tool_call>{json}</tool_call>``
(Hermes / Qwen style; the tokenizer worker checks the template and renders the
tools into the prompt), and the calls are parsed from the text. Otherwise
``auto`` is a 400 that says ``required`` or a named tool works on any model.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from radixmux import protocol
from radixmux.runtime.api_error import APIError

ToolMode = Literal["none", "auto", "required", "named"]
MAX_TOOLS = 128


class FunctionDef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    function: FunctionDef


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    function: NamedFunction


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ToolCallDelta(msgspec.Struct):
    """A streamed tool call (sent whole, in one delta, when generation ends)."""

    index: int
    id: str
    function: FunctionCall
    type: str = "function"


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of generation and of reading the answer."""

    mode: ToolMode
    tools: tuple[FunctionDef, ...] = ()
    constraint: protocol.Constraint | None = None
    specs: tuple[protocol.ToolSpec, ...] = ()  # for the chat template (auto)

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"


NO_TOOLS = ToolPlan("none")


def _params_schema(f: FunctionDef) -> dict[str, Any]:
    return f.parameters if f.parameters is not None else {"type": "object"}


def plan(
    tools: list[ToolDef] | None,
    choice: str | NamedToolChoice | None,
    parallel: bool | None,
) -> ToolPlan:
    """Check ``tools`` and ``tool_choice``; what the request asks for."""
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "'tool_choice' needs 'tools'", "tool_choice")
        return NO_TOOLS
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"'tools' holds more than {MAX_TOOLS} tools", "tools")
    for i, t in enumerate(tools):
        if t.type != "function":
            raise APIError(400, f"'tools[{i}].type' must be \"function\"", f"tools[{i}].type")
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", t.function.name):
            raise APIError(
                400,
                f"'tools[{i}].function.name' must be 1-64 letters, digits, '_' or '-'",
                f"tools[{i}].function.name",
            )
    funcs = tuple(t.function for t in tools)
    names = [f.name for f in funcs]
    if len(set(names)) != len(names):
        raise APIError(400, "'tools' names a function twice", "tools")
    if choice is None or choice == "auto":
        specs = tuple(
            protocol.ToolSpec(f.name, f.description or "", json.dumps(_params_schema(f)))
            for f in funcs
        )
        return ToolPlan("auto", funcs, None, specs)
    if choice == "none":
        return ToolPlan("none", funcs)
    if choice == "required":
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "parameters": _params_schema(f)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for f in funcs
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
        if parallel is False:
            schema["maxItems"] = 1
        c = protocol.Constraint("json", json.dumps(schema), True, "tools")
        return ToolPlan("required", funcs, c)
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function":
            raise APIError(400, "'tool_choice.type' must be \"function\"", "tool_choice.type")
        chosen = next((f for f in funcs if f.name == choice.function.name), None)
        if chosen is None:
            raise APIError(
                400,
                f"'tool_choice' names {choice.function.name!r}, which is not in 'tools'",
                "tool_choice.function.name",
            )
        schema = _params_schema(chosen)
        c = protocol.Constraint("json", json.dumps(schema), bool(chosen.strict), "tools")
        return ToolPlan("named", (chosen,), c)
    raise APIError(
        400,
        '\'tool_choice\' must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def _call(name: str, arguments: Any) -> ToolCall:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", FunctionCall(name, args))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def read_calls(p: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """The message content and the tool calls in a finished output. Text that
    does not parse (an output cut by ``max_tokens``) stays content, with no call."""
    if p.mode in ("required", "named"):
        try:
            doc = json.loads(text)
        except ValueError:
            return text, []
        if p.mode == "named":
            return None, [_call(p.tools[0].name, doc)]
        return None, [_call(c["name"], c["parameters"]) for c in doc]
    if p.mode == "auto":
        calls = []
        rest = []  # the text around the blocks read as calls (other blocks stay in it)
        at = 0
        offered = {f.name for f in p.tools}
        for m in _HERMES.finditer(text):
            try:
                doc = json.loads(m.group(1))
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get("name") in offered:  # else it stays text
                calls.append(_call(doc["name"], doc.get("arguments", doc.get("parameters", {}))))
                rest.append(text[at : m.start()])
                at = m.end()
        if calls:
            return "".join([*rest, text[at:]]).strip() or None, calls
    return text, []
