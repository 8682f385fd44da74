"""The OpenAPI 3.1 document (``/openapi.json``) and its browsable page (``/docs``).

Both are generated from the same msgspec Structs the endpoints decode and
encode with (``msgspec.json.schema_components``), so the document cannot
drift from what the server validates: a field added to a request type
appears here, a field a type forbids is ``additionalProperties: false``.
"""

from __future__ import annotations

import html
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from radixmux.runtime.api_error import ErrorResponse

# What every API module hands the app: (Endpoint, Handler) pairs.
Handler = Callable[[Request], Awaitable[Response]]

REF = "#/components/schemas/{name}"


@dataclass(frozen=True)
class Endpoint:
    """One documented route: what it takes and what it answers."""

    path: str  # Starlette form; ``{name:path}`` is written ``{name}`` in the document
    method: str
    summary: str
    request: type | None = None  # the JSON body's type
    response: type | None = None  # the 200 JSON body's type (None: a free-form object)
    streams: bool = False  # with ``"stream": true`` it answers server-sent events
    text: bool = False  # answers text/plain (Prometheus metrics)
    html: bool = False  # answers an HTML page


def _path(path: str) -> str:
    return path.replace(":path}", "}")


def _operation(ep: Endpoint, refs: dict[type, dict[str, Any]]) -> dict[str, Any]:
    error = {"application/json": {"schema": refs[ErrorResponse]}}
    body = refs[ep.response] if ep.response is not None else {"type": "object"}
    ok: dict[str, Any] = {"application/json": {"schema": body}}
    if ep.text:
        ok = {"text/plain": {"schema": {"type": "string"}}}
    if ep.html:
        ok = {"text/html": {"schema": {"type": "string"}}}
    if ep.streams:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    op: dict[str, Any] = {
        "summary": ep.summary,
        "operationId": f"{ep.method}_{_path(ep.path).strip('/').replace('/', '_')}",
        "responses": {
            "200": {"description": "OK", "content": ok},
            "4XX": {"description": "refused; `param` names the field", "content": error},
            "5XX": {"description": "the server could not serve it", "content": error},
        },
    }
    params = [seg[1:-1].split(":")[0] for seg in ep.path.split("/") if seg.startswith("{")]
    if params:
        op["parameters"] = [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
            for p in params
        ]
    if ep.request is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": refs[ep.request]}},
        }
    return op


def openapi_document(endpoints: list[Endpoint], title: str, version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``endpoints``."""
    types = [ErrorResponse]
    for ep in endpoints:
        types += [t for t in (ep.request, ep.response) if t is not None and t not in types]
    schemas, components = msgspec.json.schema_components(types, ref_template=REF)
    refs = dict(zip(types, schemas, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for ep in endpoints:
        paths.setdefault(_path(ep.path), {})[ep.method.lower()] = _operation(ep, refs)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}, {}],
    }


def docs_page(doc: dict[str, Any]) -> str:
    """A self-contained HTML page of the document (no scripts, nothing fetched)."""
    out = [
        "<!doctype html><meta charset='utf-8'>",
        f"<title>{html.escape(doc['info']['title'])} API</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:auto}"
        "pre{background:#f4f4f4;padding:.5em;overflow:auto}"
        "code{font-weight:bold}</style>",
        f"<h1>{html.escape(doc['info']['title'])} {html.escape(doc['info']['version'])}</h1>",
        "<p>Machine-readable: <a href='/openapi.json'>/openapi.json</a> (OpenAPI 3.1).</p>",
    ]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            out.append(f"<h2><code>{method.upper()} {html.escape(path)}</code></h2>")
            out.append(f"<p>{html.escape(op['summary'])}</p>")
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body:
                out.append(f"<p>Body: <code>{html.escape(_ref_name(body['schema']))}</code></p>")
    out.append("<h2>Schemas</h2>")
    for name, schema in doc["components"]["schemas"].items():
        out.append(f"<h3 id='{html.escape(name)}'>{html.escape(name)}</h3>")
        out.append(f"<pre>{html.escape(json.dumps(schema, indent=2))}</pre>")
    return "\n".join(out)


def _ref_name(schema: dict[str, Any]) -> str:
    return schema.get("$ref", "object").rsplit("/", 1)[-1]
