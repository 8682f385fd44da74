"""What every HTTP endpoint shares: JSON responses (errors included), body reading, the
bounds on what one request may hold, sampling checks and model lookup.

Errors are ``APIError``s (``runtime/api_error.py``), answered in OpenAI's shape
on every endpoint by :func:`error_response`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from radixmux.protocol import GenerateRequest, ModelInfo, SamplingParams, ServedModel
from radixmux.runtime.api_error import APIError

FLOAT_PARAMS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)
# Past this a repetition penalty only turns logits into extreme values.
MAX_REPETITION_PENALTY = 100.0


def json_response(
    content: Any, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """A JSON response encoded by msgspec (Structs and dicts alike)."""
    return Response(msgspec.json.encode(content), status, headers, "application/json")


def error_response(error: APIError) -> Response:
    """``error`` as an HTTP response: its status and OpenAI-shaped body."""
    # 429: clients and SGLang's router back off for the time Retry-After says.
    headers = {"Retry-After": "1"} if error.status == 429 else None
    return json_response(error.body(), error.status, headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over ``limit`` bytes.

    Content-Length is checked first so a huge upload is refused before it is
    read; the stream is counted too, since chunked bodies carry no length.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def check_json_content_type(content_type: str | None) -> None:
    """Refuse (415) a body not declared as JSON instead of parsing it as JSON anyway.

    A missing type is refused too: a web page can send a body with no type, or
    text/plain, form and multipart bodies, to any server without a CORS
    preflight, while a JSON type needs the server's consent first."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    json_suffix = media.startswith("application/") and media.endswith("+json")
    if media == "application/json" or json_suffix:
        return
    shown = f"Content-Type {media!r} is" if media else "a body without a Content-Type is"
    raise APIError(415, f"{shown} not accepted; send application/json", "content-type")


def refuse_unsupported(
    req: msgspec.Struct, neutral: Mapping[str, tuple[Any, ...]], prefix: str = ""
) -> None:
    """A 400 naming the first of ``neutral``'s fields that ``req`` sets to something
    other than ``None`` or one of its neutral values: a field of the API this
    server does not implement is refused, never silently ignored."""
    for name, allowed in neutral.items():
        value = getattr(req, name)
        if value is not None and value not in allowed:
            accepted = ", ".join(msgspec.json.encode(v).decode() for v in (None, *allowed))
            raise APIError(
                400,
                f"'{prefix}{name}' is not supported by this server (accepted: {accepted})",
                f"{prefix}{name}",
            )


# ---- bounds on what one request may hold -------------------------------------------
# The body limit (--max-request-bytes, 1 MiB) bounds a request's bytes; these
# bound the lists whose cost is paid again on every step or every token, or by
# a process every request shares, far past what real clients send (each a 400
# naming the field). Prompts are bounded by the body limit and the context
# length, which the tokenizer worker checks with max_tokens.
# Stop strings are matched on every token of every choice by the one
# detokenizer, with an automaton of about one node per character (~350 bytes
# and ~1 us to build each, once per distinct list, kept while its requests
# run): 4,096 characters in all is ~1.4 MB and ~4 ms. OpenAI and TGI allow 4
# strings; real ones are a few characters long.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096  # all of a request's stop strings together
# Stop token ids and logit bias travel with the request in every forward batch,
# packed (one array operation each per step): 1,024 of each is ~12 KB a step.
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]
# Chat: OpenAI refuses more than 2,048 messages; a message's text parts are
# joined once, but each is a Python object to decode and check.
MAX_CHAT_MESSAGES = 4096
MAX_CONTENT_PARTS = 1024
# Names and tags that are only looked up, logged or echoed in errors (model,
# user, safety_identifier, prompt_cache_key, metadata): OpenAI allows 16
# metadata pairs with keys of 64 and values of 512 characters.
MAX_NAME_CHARS = 1024
MAX_METADATA_PAIRS = 64


def too_many(param: str, count: int, limit: int, what: str) -> APIError:
    """The 400 for a list or string past its bound, naming the field."""
    return APIError(400, f"'{param}' holds {count} {what}; at most {limit}", param)


def check_len(value: str | list[Any] | dict[str, Any], limit: int, param: str, what: str) -> None:
    """A 400 naming ``param`` when ``value`` holds more than ``limit`` items."""
    if len(value) > limit:
        raise too_many(param, len(value), limit, what)


def check_name(value: str | None, param: str) -> None:
    """A name or tag (looked up, logged, echoed) of at most MAX_NAME_CHARS characters."""
    if value is not None:
        check_len(value, MAX_NAME_CHARS, param, "characters")


def check_metadata(metadata: dict[str, str] | None, param: str = "metadata") -> None:
    """OpenAI's ``metadata``: a few short pairs, accepted and ignored."""
    if metadata is None:
        return
    check_len(metadata, MAX_METADATA_PAIRS, param, "pairs")
    for key, value in metadata.items():
        check_name(key, f"{param}.{key[:64]}")
        check_name(value, f"{param}.{key[:64]}")


def stop_list(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    """``stop`` as a checked list: bounded, and no empty string (it would end
    every request at once)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    check_len(stops, MAX_STOP_STRINGS, param, "strings")
    if any(not s for s in stops):
        raise APIError(400, f"'{param}' strings must be non-empty", param)
    total = sum(len(s) for s in stops)
    if total > MAX_STOP_CHARS:
        raise too_many(param, total, MAX_STOP_CHARS, "characters in all")
    return stops


def check_sampling(
    p: SamplingParams, info: ModelInfo, prefix: str = "", max_tokens_name: str = "max_tokens"
) -> None:
    """Reject parameters the runners cannot honour; the error names the field as sent.

    ``max_tokens`` is bounded here by the context length alone; the tokenizer
    worker, which knows the prompt's length, checks the two together."""
    vocab_size = info.vocab_size

    def bad(field: str, why: str) -> APIError:
        return APIError(400, f"'{prefix}{field}' {why}", f"{prefix}{field}")

    for field in FLOAT_PARAMS:  # NaN passes every range check below
        if not math.isfinite(getattr(p, field)):
            raise bad(field, "must be a finite number")
    if p.max_new_tokens < 1:
        raise bad(max_tokens_name, "must be >= 1")
    if info.context_length and p.max_new_tokens > info.context_length:
        raise bad(max_tokens_name, f"must be <= the context length ({info.context_length})")
    if p.temperature < 0:
        raise bad("temperature", "must be >= 0")
    if not 0 < p.top_p <= 1:
        raise bad("top_p", "must be in (0, 1]")
    if not 0 <= p.top_k <= vocab_size:
        raise bad("top_k", f"must be in [0, {vocab_size}] (the vocabulary size), or -1 to disable")
    if not 0 <= p.min_p <= 1:
        raise bad("min_p", "must be in [0, 1]")
    if not -2 <= p.frequency_penalty <= 2:
        raise bad("frequency_penalty", "must be in [-2, 2]")
    if not -2 <= p.presence_penalty <= 2:
        raise bad("presence_penalty", "must be in [-2, 2]")
    if not 0 < p.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise bad("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}]")
    if p.seed is not None and not 0 <= p.seed < 2**63:
        raise bad("seed", "must be in [0, 2**63)")
    if not 0 <= p.top_logprobs <= 20:
        raise bad("top_logprobs", "must be in [0, 20]")
    check_len(p.stop_token_ids, MAX_STOP_TOKEN_IDS, f"{prefix}stop_token_ids", "ids")
    if any(not 0 <= t < vocab_size for t in p.stop_token_ids):
        raise bad("stop_token_ids", f"must be token ids in [0, {vocab_size})")
    check_len(p.logit_bias, MAX_LOGIT_BIAS_TOKENS, f"{prefix}logit_bias", "tokens")
    if any(not 0 <= t < vocab_size for t, _ in p.logit_bias):
        raise bad("logit_bias", f"keys must be token ids in [0, {vocab_size})")
    if not all(math.isfinite(b) and abs(b) <= MAX_LOGIT_BIAS for _, b in p.logit_bias):
        raise bad("logit_bias", f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")


def logit_bias(bias: dict[str, float] | None, param: str) -> list[tuple[int, float]]:
    """OpenAI's ``logit_bias`` (token id as a string -> bias) as pairs, which
    :func:`check_sampling` then checks with the rest."""
    if not bias:
        return []
    check_len(bias, MAX_LOGIT_BIAS_TOKENS, param, "tokens")
    for key in bias:
        if not (key.isascii() and key.isdigit()):
            raise APIError(400, f"'{param}' keys must be token ids; got {key[:32]!r}", param)
    return [(int(key), float(value)) for key, value in bias.items()]


MAX_N = 16  # samples of one prompt
MAX_PROMPTS = 64  # prompts in one batch
MAX_CHOICES = 64  # prompts x n: each is a running request of its own


def check_n(n: int | None, param: str) -> int:
    """``n`` (samples per prompt), checked; None means 1."""
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"'{param}' must be in [1, {MAX_N}]", param)
    return n


def fan_out(prompts: list[GenerateRequest], n: int, param: str = "n") -> list[GenerateRequest]:
    """``n`` samples of each prompt, one request each, prompt ``i``'s samples
    at ``i*n`` to ``i*n+n-1`` (OpenAI's choice order; rids ``<rid>-<k>``).

    Samples of one prompt share its KV through the tree: the scheduler
    prefills it once and the others find it cached. A seeded request's sample
    ``j`` draws with ``seed + j``, so its samples differ from one another yet
    repeat run to run."""
    if len(prompts) * n > MAX_CHOICES:
        raise APIError(
            400, f"prompts x {param} = {len(prompts) * n} choices; at most {MAX_CHOICES}", param
        )
    if len(prompts) == 1 and n == 1:
        return prompts
    out = []
    for gen in prompts:
        for j in range(n):
            params = gen.params
            if params.seed is not None:
                params = msgspec.structs.replace(params, seed=(params.seed + j) % 2**63)
            rid = f"{gen.rid}-{len(out)}"
            out.append(msgspec.structs.replace(gen, rid=rid, params=params))
    return out


def check_input_ids(ids: list[Any], vocab_size: int, param: str) -> list[int]:
    """Token-id prompts must be a non-empty list of ids the model knows."""
    if not ids:
        raise APIError(400, f"'{param}' must not be empty", param)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise APIError(400, f"'{param}' must be a list of token ids (integers)", param)
    if any(not 0 <= t < vocab_size for t in ids):
        raise APIError(400, f"'{param}' holds token ids outside [0, {vocab_size})", param)
    return ids


def served_names(served: dict[str, ServedModel], limit: int = 16) -> str:
    """The served names for an error message, cut short when there are many."""
    names = sorted(served)
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}, ... {len(names) - limit} more]" if len(names) > limit else f"[{shown}]"


def resolve_model(served: dict[str, ServedModel], name: str | None) -> ServedModel:
    """The served model a request names; optional when only one model is served."""
    if name is None or name == "":
        if len(served) == 1:
            return next(iter(served.values()))
        raise APIError(400, f"'model' is required; served models: {served_names(served)}", "model")
    return served_model(served, name, "model")


def served_model(served: dict[str, ServedModel], name: str, param: str) -> ServedModel:
    """The served model ``name``, or a 404 naming ``param`` and the served ones."""
    check_name(name, param)  # echoed in the error
    model = served.get(name)
    if model is None:
        raise APIError(
            404,
            f"model '{name}' is not served; served models: {served_names(served)}",
            param,
            "model_not_found",
        )
    return model


def check_chat_messages(messages: list[Any], model: ServedModel, template_flag: bool) -> None:
    """Chat needs a template (the model's own or the --chat-template flag's) and
    1 to MAX_CHAT_MESSAGES messages (HTTP and ZMQ alike)."""
    if not model.info.has_chat_template and not template_flag:
        raise APIError(
            400,
            f"model '{model.name}' has no chat template; use a plain-text prompt "
            "(/v1/completions), or start the server with --chat-template",
            "messages",
            "no_chat_template",
        )
    if not messages:
        raise APIError(400, "'messages' must not be empty", "messages")
    check_len(messages, MAX_CHAT_MESSAGES, "messages", "messages")
