"""Structured-output fields of every endpoint, turned into one ``protocol.Constraint``.

Sources, one per request at most (two are a 400 naming both):

- OpenAI's ``response_format`` (chat and completions): ``text``, ``json_object``,
  ``json_schema`` (``strict`` as OpenAI's: objects take no unlisted property);
- SGLang's ``regex`` / ``ebnf`` / ``json_schema`` (the schema as JSON text), on the
  OpenAI endpoints and in ``/generate``'s ``sampling_params``;
- vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``) and its older ``guided_json`` / ``guided_regex`` /
  ``guided_choice`` / ``guided_grammar``.

Here only the shapes are checked (a schema is an object, a regex a string, ...);
whether the grammar compiles for the model's tokenizer, in time, is the tokenizer
worker's check (a 400 whose ``param`` is the ``field`` set here).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec

from radixmux.protocol import Constraint
from radixmux.runtime.api_error import APIError

# The one backend: the names clients use for it, or for "the server's choice".
BACKENDS = ("xgrammar", "auto")


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``response_format.json_schema``: a named schema (OpenAI's shape)."""

    name: str | None = None
    description: str | None = None
    schema: Any = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` (one of its constraint fields set)."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    # How vLLM shapes JSON: radixmux never emits free whitespace, which
    # satisfies either choice of disable_any_whitespace.
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    disable_fallback: bool | None = None
    whitespace_pattern: str | None = None


def _schema_text(value: Any, field: str) -> str:
    """A JSON schema given as an object, a boolean or JSON text: as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise APIError(400, f"'{field}' is not valid JSON: {exc}", field) from None
    if not isinstance(value, dict | bool):
        raise APIError(400, f"'{field}' must be a JSON schema (an object)", field)
    return json.dumps(value)


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise APIError(400, f"'{field}' must be a non-empty string", field)
    return value


def choice_grammar(choices: Any, field: str) -> str:
    """EBNF whose language is exactly the given strings."""
    if not isinstance(choices, list) or not choices:
        raise APIError(400, f"'{field}' must be a non-empty list of strings", field)
    if not all(isinstance(c, str) and c for c in choices):
        raise APIError(400, f"'{field}' must hold non-empty strings", field)
    # A JSON string literal is a valid EBNF string literal (same escapes).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def response_format(rf: ResponseFormat | None, field: str = "response_format") -> Constraint | None:
    """OpenAI's ``response_format``."""
    if rf is None:
        return None
    if rf.json_schema is not None and rf.type != "json_schema":
        # Nothing is silently ignored: a schema sent with another type is a mistake.
        where = f"{field}.json_schema"
        raise APIError(400, f"'{where}' goes only with type json_schema, not {rf.type!r}", where)
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return Constraint("json", "", field=field)
    if rf.type == "json_schema":
        js = rf.json_schema
        if js is None or js.schema is None:
            where = f"{field}.json_schema.schema"
            raise APIError(400, f"'{where}' is required with type json_schema", where)
        where = f"{field}.json_schema.schema"
        return Constraint("json", _schema_text(js.schema, where), bool(js.strict), where)
    raise APIError(
        400,
        f"'{field}.type' must be one of text, json_object, json_schema (got {rf.type!r})",
        f"{field}.type",
    )


def structured_outputs(so: StructuredOutputs | None, field: str) -> list[Constraint]:
    """vLLM's ``structured_outputs``: the constraints it sets."""
    if so is None:
        return []
    if so.structural_tag is not None:
        raise APIError(400, f"'{field}.structural_tag' is not supported", f"{field}.structural_tag")
    if so.whitespace_pattern is not None:
        where = f"{field}.whitespace_pattern"
        raise APIError(400, f"'{where}' is not supported (JSON has no free whitespace)", where)
    strict = bool(so.disable_additional_properties)
    found = []
    if so.json is not None:
        where = f"{field}.json"
        found.append(Constraint("json", _schema_text(so.json, where), strict, where))
    if so.json_object:
        found.append(Constraint("json", "", field=f"{field}.json_object"))
    if so.regex is not None:
        found.append(Constraint("regex", _text(so.regex, f"{field}.regex"), field=f"{field}.regex"))
    if so.choice is not None:
        where = f"{field}.choice"
        found.append(Constraint("ebnf", choice_grammar(so.choice, where), field=where))
    if so.grammar is not None:
        where = f"{field}.grammar"
        found.append(Constraint("ebnf", _text(so.grammar, where), field=where))
    if not found:  # as vLLM: the object is there to ask for one
        raise APIError(
            400,
            f"'{field}' sets no constraint (one of json, json_object, regex, choice, grammar)",
            field,
        )
    return found


# Flat fields: (name, kind, how its value becomes the grammar's text).
FLAT_FIELDS: tuple[tuple[str, str, Callable[[Any, str], str]], ...] = (
    ("regex", "regex", _text),
    ("ebnf", "ebnf", _text),
    ("json_schema", "json", _schema_text),
    ("guided_json", "json", _schema_text),
    ("guided_regex", "regex", _text),
    ("guided_choice", "ebnf", choice_grammar),
    ("guided_grammar", "ebnf", _text),
)


def extension_fields(req: Any, prefix: str = "") -> list[Constraint]:
    """The constraints of SGLang's and vLLM's fields that ``req`` has (each
    read only where the request type declares it)."""

    def has(name: str) -> Any:
        return getattr(req, name, None)

    found = []
    for name, kind, grammar in FLAT_FIELDS:
        if has(name) is not None:
            where = prefix + name
            found.append(Constraint(kind, grammar(has(name), where), field=where))  # type: ignore[arg-type]
    backend = has("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise APIError(
            400,
            f"'guided_decoding_backend' must be one of {', '.join(BACKENDS)} (got {backend!r})",
            "guided_decoding_backend",
        )
    if has("guided_whitespace_pattern") is not None:
        raise APIError(
            400,
            "'guided_whitespace_pattern' is not supported (JSON has no free whitespace)",
            "guided_whitespace_pattern",
        )
    found += structured_outputs(has("structured_outputs"), "structured_outputs")
    return found


def one_constraint(found: list[Constraint]) -> Constraint | None:
    """The request's constraint; two or more is a 400 naming them."""
    if len(found) > 1:
        names = ", ".join(f"'{c.field}'" for c in found)
        raise APIError(400, f"a request takes one output constraint, got {names}", found[1].field)
    return found[0] if found else None


def openai_constraint(req: Any) -> Constraint | None:
    """The constraint of an OpenAI request (chat or completions, tools aside)."""
    found = []
    rf = response_format(getattr(req, "response_format", None))
    if rf is not None:
        found.append(rf)
    return one_constraint(found + extension_fields(req))
