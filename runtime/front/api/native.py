"""SGLang-compatible ``/generate``: request schema, conversion, response formatting, route.

Responses match SGLang's so its tools (router, ``bench_serving``) can drive us:
``{"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
"cached_tokens", "finish_reason": {"type": "stop"|"length"|"abort", ...},
"e2e_latency"}}``; streamed chunks carry the *cumulative* text and ids
(only the new ones with ``--incremental-streaming-output``) and only the new
logprobs (see :class:`NativeFormat`).
Sampling defaults follow SGLang: temperature 1, 128 new tokens.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from radixmux import protocol
from radixmux.protocol import ModelInfo, SamplingParams
from radixmux.runtime.api_error import APIError
from radixmux.runtime.front.api import extensions
from radixmux.runtime.front.api.common import (
    MAX_PROMPTS,
    check_input_ids,
    check_n,
    check_sampling,
    fan_out,
    logit_bias,
    refuse_unsupported,
    stop_list,
)
from radixmux.runtime.front.api.structured import extension_fields, one_constraint
from radixmux.runtime.front.hub import InFlight, new_rid
from radixmux.runtime.front.openapi import Endpoint, Handler
from radixmux.runtime.front.state import Front
from radixmux.runtime.front.stream import serve_generation

DEFAULT_MAX_NEW_TOKENS = 128


class NativeSampling(extensions.SamplingExtensions, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's own name for it
    skip_special_tokens: bool | None = True
    n: int | None = None
    logit_bias: dict[str, float] | None = None


class NativeGenerate(extensions.GenerateExtensions, kw_only=True, forbid_unknown_fields=True):
    text: str | list[Any] | None = None
    input_ids: list[Any] | None = None
    model: str | None = None
    sampling_params: NativeSampling | None = None
    stream: bool | None = False
    return_logprob: bool | None = False
    top_logprobs_num: int | None = 0
    log_metrics: bool | None = None  # accepted: every request is in /metrics
    return_text_in_logprobs: bool | None = False
    logprob_start_len: int | None = None


# SGLang fields this server does not implement, and the values that ask for
# nothing (None always does): anything else is a 400 naming the field.
UNSUPPORTED_GENERATE = extensions.neutral_only(extensions.GENERATE)
UNSUPPORTED_SAMPLING = extensions.neutral_only(extensions.SAMPLING)


class NativeMeta(msgspec.Struct, omit_defaults=True):
    """SGLang's meta_info; the logprob lists appear only when asked for."""

    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: dict[str, Any] | None
    e2e_latency: float
    # (logprob, token id, token text or None): the text with return_text_in_logprobs.
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None
    output_top_logprobs: list[list[tuple[float, int, str | None]]] | None = None
    # With logprob_start_len >= 0: the prompt's, from that index (the first
    # prompt token's logprob is None, as in SGLang).
    input_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    input_top_logprobs: list[list[tuple[float, int, str | None]] | None] | None = None


class NativeResponse(msgspec.Struct, omit_defaults=True):
    text: str
    output_ids: list[int]
    meta_info: NativeMeta
    index: int | None = None  # the item's place in a batched answer (streamed chunks)


def sampling_params(
    s: NativeSampling, info: ModelInfo, logprobs: bool, top_logprobs: int
) -> SamplingParams:
    """Checked runner sampling parameters from SGLang's ``sampling_params``."""
    pre = "sampling_params."
    top_k = -1 if s.top_k is None else s.top_k
    if top_k < -1:
        raise APIError(400, f"'{pre}top_k' must be >= 0, or -1 to disable", f"{pre}top_k")
    params = SamplingParams(
        temperature=1.0 if s.temperature is None else s.temperature,
        top_k=max(top_k, 0),
        top_p=1.0 if s.top_p is None else s.top_p,
        min_p=s.min_p or 0.0,
        repetition_penalty=1.0 if s.repetition_penalty is None else s.repetition_penalty,
        frequency_penalty=s.frequency_penalty or 0.0,
        presence_penalty=s.presence_penalty or 0.0,
        seed=s.seed if s.seed is not None else s.sampling_seed,
        stop_token_ids=list(s.stop_token_ids or []),
        ignore_eos=bool(s.ignore_eos),
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS if s.max_new_tokens is None else s.max_new_tokens,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        logit_bias=logit_bias(s.logit_bias, f"{pre}logit_bias"),
        constraint=one_constraint(extension_fields(s, pre)),
    )
    check_sampling(params, info, pre, "max_new_tokens")
    return params


def generate_request(
    body: NativeGenerate, rid: str, model: protocol.ServedModel, arrival: float
) -> list[protocol.GenerateRequest]:
    """The tokenizer's requests for a /generate body: one per prompt, ``n``
    samples each (SGLang answers a batch or ``n`` > 1 with a list, in that order)."""
    refuse_unsupported(body, UNSUPPORTED_GENERATE)
    if body.sampling_params is not None:
        refuse_unsupported(body.sampling_params, UNSUPPORTED_SAMPLING, "sampling_params.")
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "send exactly one of 'text' or 'input_ids'", "text")
    top_n = body.top_logprobs_num or 0
    if not 0 <= top_n <= 20:
        raise APIError(400, "'top_logprobs_num' must be in [0, 20]", "top_logprobs_num")
    s = body.sampling_params or NativeSampling()
    n = check_n(s.n, "sampling_params.n")
    params = sampling_params(s, model.info, bool(body.return_logprob), top_n)
    start = -1 if body.logprob_start_len is None else body.logprob_start_len
    if start < -1:
        raise APIError(400, "'logprob_start_len' must be -1 (none) or >= 0", "logprob_start_len")
    if start >= 0 and body.return_logprob:  # the prompt's logprobs from ``start``
        params = msgspec.structs.replace(params, prompt_logprobs_start=start)
    prompts = [
        protocol.GenerateRequest(
            rid=rid,
            model=model.instance,
            params=params,
            prompt=text,
            input_ids=ids,
            stop=stop_list(s.stop, "sampling_params.stop"),
            stream=bool(body.stream),
            skip_special_tokens=True if s.skip_special_tokens is None else s.skip_special_tokens,
            arrival=arrival,
            keep_stop_string=bool(s.no_stop_trim),
        )
        for text, ids in _prompts(body, model.info.vocab_size)
    ]
    return fan_out(prompts, n, "sampling_params.n")


def is_batch(body: NativeGenerate) -> bool:
    """Whether SGLang answers ``body`` with a list: a batch of prompts, or n > 1."""
    n = body.sampling_params.n if body.sampling_params else None
    ids = body.input_ids
    return isinstance(body.text, list) or bool(ids and isinstance(ids[0], list)) or (n or 1) > 1


def _prompts(body: NativeGenerate, vocab: int) -> list[tuple[str | None, list[int] | None]]:
    """(text, ids) per prompt: ``text`` a string or a list of them, ``input_ids``
    a list of ids or a list of such lists."""
    if isinstance(body.text, str):
        return [(body.text, None)]
    if body.text is not None:
        if not body.text or len(body.text) > MAX_PROMPTS:
            raise APIError(400, f"'text' batches hold 1 to {MAX_PROMPTS} prompts", "text")
        if not all(isinstance(t, str) and t for t in body.text):
            raise APIError(400, "'text' batches hold non-empty strings", "text")
        return [(t, None) for t in body.text]
    ids = body.input_ids or []
    if not (ids and isinstance(ids[0], list)):
        return [(None, check_input_ids(ids, vocab, "input_ids"))]
    if len(ids) > MAX_PROMPTS or not all(isinstance(p, list) for p in ids):
        raise APIError(
            400, f"'input_ids' batches hold up to {MAX_PROMPTS} lists of ids", "input_ids"
        )
    return [(None, check_input_ids(p, vocab, f"input_ids[{i}]")) for i, p in enumerate(ids)]


def finish_reason(
    reason: str | None, matched: str | None, last_token: int | None, length: int
) -> dict[str, Any] | None:
    """SGLang's finish_reason object."""
    if reason is None and matched is None:
        return None
    if matched is not None:
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": length}
    if reason == "stop":
        return {"type": "stop", "matched": last_token}
    return {"type": "abort", "message": reason}


def response(
    rid: str,
    text: str,
    ids: list[int],
    last: protocol.TextOutput,
    finish: dict[str, Any] | None,
    latency: float,
    logprobs: list[protocol.TokenLogprob] | None,
    with_text: bool = False,
    prompt_logprobs: list[protocol.TokenLogprob] | None = None,
) -> NativeResponse:
    meta = NativeMeta(
        id=rid,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        cached_tokens=last.cached_tokens,
        finish_reason=finish,
        e2e_latency=round(latency, 6),
    )
    if logprobs is not None:
        meta.output_token_logprobs = _native_logprobs(logprobs, with_text)
        meta.output_top_logprobs = [_native_tops(lp, with_text) for lp in logprobs]
    if prompt_logprobs is not None:
        meta.input_token_logprobs = _native_logprobs(prompt_logprobs, with_text)
        meta.input_top_logprobs = [
            None if lp.logprob is None else _native_tops(lp, with_text) for lp in prompt_logprobs
        ]
    return NativeResponse(text, ids, meta)


def _native_logprobs(
    lps: list[protocol.TokenLogprob], with_text: bool
) -> list[tuple[float | None, int, str | None]]:
    return [(lp.logprob, lp.token_id, lp.text if with_text else None) for lp in lps]


def _native_tops(lp: protocol.TokenLogprob, with_text: bool) -> list[tuple[float, int, str | None]]:
    texts = lp.top_text if with_text else None
    return [(v, t, texts[k] if texts else None) for k, (t, v) in enumerate(lp.top or [])]


# ---- response formatting ---------------------------------------------------------
class _Streamed:
    """One item's text and ids streamed so far (cumulative chunks repeat them)."""

    def __init__(self) -> None:
        self.text = ""
        self.ids: list[int] = []
        self.last_id: int | None = None  # for finish_reason's ``matched``


class NativeFormat:
    """SGLang ``/generate``; a batch (or ``n`` > 1) is answered with a list, its
    chunks tagged by index.

    Streamed chunks carry the text and ids so far (SGLang's default, which its
    own clients parse), or only the new ones with ``incremental`` (SGLang's
    ``--incremental-streaming-output``). Logprob lists are always only the new
    entries, the prompt's in the first chunk alone: resending them would make
    a stream's bytes, and the front's work, grow with the square of its length.
    """

    def __init__(
        self,
        logprobs: bool,
        with_text: bool = False,
        batch: bool = False,
        incremental: bool = False,
    ) -> None:
        self.logprobs = logprobs
        self.with_text = with_text  # return_text_in_logprobs
        self.batch = batch
        self.incremental = incremental
        self.streamed: dict[int, _Streamed] = {}

    def _response(
        self,
        gen: InFlight,
        index: int,
        text: str,
        ids: list[int],
        last_id: int | None,
        logprobs: list[protocol.TokenLogprob],
        prompt_logprobs: list[protocol.TokenLogprob] | None,
    ) -> NativeResponse:
        last = gen.last
        assert last is not None
        finish = None
        if gen.done:
            finish = finish_reason(
                gen.finish_reason, gen.matched_stop, last_id, last.completion_tokens
            )
        out = response(
            gen.rid,
            text,
            ids,
            last,
            finish,
            gen.latency,
            logprobs if self.logprobs else None,
            self.with_text,
            prompt_logprobs,
        )
        if self.batch:
            out.index = index
        return out

    def chunks(self, out: protocol.TextOutput, gen: InFlight, index: int) -> list[msgspec.Struct]:
        item = self.streamed.setdefault(index, _Streamed())
        if out.token_ids:
            item.last_id = out.token_ids[-1]
        if self.incremental:
            text, ids = out.text, out.token_ids
        else:
            item.text += out.text
            item.ids += out.token_ids
            text, ids = item.text, list(item.ids)
        if not (out.text or out.token_ids or out.logprobs or out.prompt_logprobs or gen.done):
            return []
        lps = out.logprobs or []
        return [self._response(gen, index, text, ids, item.last_id, lps, out.prompt_logprobs)]

    def tail(self, gens: list[InFlight]) -> list[msgspec.Struct]:
        return []

    def full(self, outputs: list[list[protocol.TextOutput]], gens: list[InFlight]) -> Any:
        answers = []
        for i, (outs, gen) in enumerate(zip(outputs, gens, strict=True)):
            ids = [t for o in outs for t in o.token_ids]
            lps = [lp for o in outs for lp in o.logprobs or []]
            prompt = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
            text = "".join(o.text for o in outs)
            last_id = ids[-1] if ids else None
            answers.append(self._response(gen, i, text, ids, last_id, lps, prompt))
        return answers if self.batch else answers[0]


# ---- routes ----------------------------------------------------------------------
def endpoints(front: Front) -> list[tuple[Endpoint, Handler]]:
    """SGLang's ``/generate``, for the front's route table and OpenAPI document."""

    async def generate(request: Request) -> Response:
        req = await front.body(request, NativeGenerate)
        model = await front.model(req.model)
        rid = new_rid()
        gens = generate_request(req, rid, model, time.time())
        with_text = bool(req.return_text_in_logprobs)
        incremental = front.args.incremental_streaming_output
        fmt = NativeFormat(gens[0].params.logprobs, with_text, is_batch(req), incremental)
        return await serve_generation(request, front.hub, gens, fmt, "generate")

    return [
        (
            Endpoint(
                "/generate",
                "POST",
                "SGLang native generation",
                NativeGenerate,
                NativeResponse,
                streams=True,
            ),
            generate,
        ),
    ]
