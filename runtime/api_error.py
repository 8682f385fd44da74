"""A refused request: the error every API answers with, and JSON body decoding that raises it.

Errors follow OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
on every endpoint (OpenAI and native), so one client-side handler fits all.
Below the HTTP front because the launcher reads request bodies too: each line
of ``--warmup FILE`` is a ``POST /cache/warmup`` body, checked before anything
starts (``runtime/warmup_file.py``). The HTTP response is made in the front
(``front/api/common.error_response``).
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
    421: "misdirected_request",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
    507: "insufficient_storage",
}


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None  # the request field at fault, when one is
    code: int | str


class ErrorResponse(msgspec.Struct):
    """The body of every error answer, on every endpoint (OpenAI's shape)."""

    error: ErrorInfo


class APIError(Exception):
    """A request that ends with an HTTP error status and an OpenAI-style body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "error")
        info = ErrorInfo(self.message, kind, self.param, self.code or self.status)
        return msgspec.to_builtins(ErrorResponse(info))


_AT_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


def decode_body(data: bytes, type_: type[T]) -> T:
    """Decode a JSON body into ``type_``; malformed JSON or a bad field is a 400 naming it."""
    if not data.strip():
        raise APIError(400, "request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(data, type=type_)
    except RecursionError:
        # msgspec's decoder stops at the interpreter's recursion limit; no request
        # type of ours nests more than a few levels.
        raise APIError(400, "malformed JSON body: nested too deeply") from None
    except msgspec.ValidationError as exc:
        text = str(exc)
        named = _MISSING.search(text) or _UNKNOWN.search(text)
        at = _AT_PATH.search(text)
        param = named.group(1) if named else None
        if at and at.group(1):
            param = f"{at.group(1)}.{param}" if param else at.group(1)
        raise APIError(400, f"invalid request: {text}", param) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"malformed JSON body: {exc}") from None
