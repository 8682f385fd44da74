"""A minimal OpenAI-compatible server on plain ``transformers`` ``generate``: the baseline peer.

This is what serving a model "the obvious way" looks like, so the benchmark can
show what radixmux adds over it:

* one request at a time (an ``asyncio.Lock``): no batching;
* each request builds its own KV cache inside ``generate``: no prefix reuse;
* greedy decoding when ``temperature`` is 0, sampling otherwise.

Endpoints: ``/v1/completions`` and ``/v1/chat/completions`` (streaming SSE or not,
``usage`` in the response and, with ``stream_options.include_usage``, in a last
chunk), ``/v1/models`` and ``/health``. Request fields honoured: ``max_tokens``
(``max_completion_tokens`` for chat), ``temperature``, ``top_p``, ``seed``,
``ignore_eos`` (vLLM's extension) and ``min_tokens``; others are ignored.

Usage::

    .venv/bin/python -m bench.peer_transformers_server --model DIR \\
        --served-model-name smollm2 --port 8000 [--dtype float32] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria
from transformers.generation.streamers import BaseStreamer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; the message goes back to the client."""


@dataclass
class GenRequest:
    """One generation job, already tokenised and validated."""

    prompt_ids: list[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    seed: int | None


@dataclass
class GenResult:
    """What a finished generation produced."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"


class _QueueStreamer(BaseStreamer):
    """Hands each new token from ``generate``'s thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[int | None]):
        self.loop = loop
        self.queue = queue
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        # generate() first puts the whole prompt; only later calls are new tokens.
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for tok in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, int(tok))

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


class _Cancelled(StoppingCriteria):
    """Stops ``generate`` once the client has gone away, so the lock is freed early."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> Any:
        done = self.event.is_set()
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool)


class Engine:
    """The model, its tokenizer and the one-at-a-time lock."""

    def __init__(self, model_dir: str, served_name: str, dtype: str):
        self.served_name = served_name
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
        self.model.eval()
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 2048))
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids: set[int] = set(eos if isinstance(eos, list) else [eos])
        self.lock = asyncio.Lock()

    # -- request parsing -------------------------------------------------

    def prompt_ids(self, prompt: Any) -> list[int]:
        """Token ids of a completions ``prompt``: a string, a one-string list or token ids."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            # Completions send raw text: no chat template, but the model's usual BOS.
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise BadRequest("prompt must be a string, a list of one string, or a list of token ids")

    def chat_ids(self, messages: Any) -> list[int]:
        """Token ids of a chat conversation through the model's chat template."""
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        if self.tokenizer.chat_template is None:
            raise BadRequest("this model has no chat template; use /v1/completions")
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if hasattr(out, "input_ids"):  # some versions return a BatchEncoding
            out = out["input_ids"]
        return [int(t) for t in out]

    def build(self, body: dict[str, Any], prompt_ids: list[int], chat: bool) -> GenRequest:
        """Validate sampling fields and fit ``max_tokens`` into the context."""
        room = self.max_context - len(prompt_ids)
        if room <= 0:
            raise BadRequest(
                f"prompt has {len(prompt_ids)} tokens; the context holds {self.max_context}"
            )
        max_tokens = body.get("max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is None:
            max_tokens = room if chat else DEFAULT_COMPLETION_TOKENS
        max_tokens = int(max_tokens)
        if max_tokens < 1:
            raise BadRequest("max_tokens must be at least 1")
        if max_tokens > room:
            raise BadRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context ({self.max_context})"
            )
        if int(body.get("n", 1) or 1) != 1:
            raise BadRequest("only n=1 is supported")
        min_tokens = max_tokens if body.get("ignore_eos") else int(body.get("min_tokens") or 0)
        temperature = body.get("temperature")
        top_p = body.get("top_p")
        seed = body.get("seed")
        return GenRequest(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            min_tokens=min(min_tokens, max_tokens),
            temperature=1.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            seed=None if seed is None else int(seed),
        )

    # -- generation ------------------------------------------------------

    def _generate(self, req: GenRequest, streamer: BaseStreamer, cancel: threading.Event) -> None:
        # Runs in a worker thread so the event loop keeps answering /health.
        kwargs: dict[str, Any] = {}
        if req.temperature > 0:
            kwargs.update(do_sample=True, temperature=req.temperature, top_p=req.top_p, top_k=0)
            if req.seed is not None:
                torch.manual_seed(req.seed)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        ids = torch.tensor([req.prompt_ids], dtype=torch.long)
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=req.max_tokens,
                min_new_tokens=req.min_tokens,
                eos_token_id=sorted(self.eos_ids),
                pad_token_id=next(iter(sorted(self.eos_ids))),
                streamer=streamer,
                stopping_criteria=[_Cancelled(cancel)],
                use_cache=True,
                **kwargs,
            )

    async def tokens(self, req: GenRequest, result: GenResult) -> AsyncIterator[int]:
        """Yield generated token ids one by one; fills ``result`` as it goes.

        Holds the lock for the whole generation: one request at a time.
        """
        async with self.lock:
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[int | None] = asyncio.Queue()
            cancel = threading.Event()
            streamer = _QueueStreamer(loop, queue)

            def run() -> None:
                try:
                    self._generate(req, streamer, cancel)
                finally:
                    # end() may already have run; a second None is harmless.
                    loop.call_soon_threadsafe(queue.put_nowait, None)

            task = loop.run_in_executor(None, run)
            try:
                while True:
                    tok = await queue.get()
                    if tok is None:
                        break
                    if tok in self.eos_ids and len(result.token_ids) >= req.min_tokens:
                        result.finish_reason = "stop"
                        break
                    result.token_ids.append(tok)
                    yield tok
                    if len(result.token_ids) >= req.max_tokens:
                        break
            finally:
                # A client that went away (or a finished run) ends generate() now.
                cancel.set()
                await task


class _Detok:
    """Incremental detokenisation: re-decode everything, emit what is new.

    Decoding the whole list each time keeps multi-byte characters split over
    tokens intact; a trailing U+FFFD means "wait for the next token".
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = 0

    def push(self, tok: int) -> str:
        self.ids.append(tok)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[self.sent :], len(text)
        return delta

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        delta, self.sent = text[self.sent :], len(text)
        return delta


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}},
        status_code=status,
    )


def create_app(engine: Engine) -> FastAPI:
    """The FastAPI app serving ``engine``."""
    app = FastAPI(title="transformers peer")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": engine.served_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "transformers-peer",
                    "max_model_len": engine.max_context,
                }
            ],
        }

    async def handle(request: Request, chat: bool) -> Any:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            model = body.get("model")
            if model not in (None, engine.served_name):
                return _error(404, f"model {model!r} is not served here")
            ids = (
                engine.chat_ids(body.get("messages"))
                if chat
                else engine.prompt_ids(body.get("prompt"))
            )
            req = engine.build(body, ids, chat)
        except (BadRequest, ValueError, TypeError) as exc:
            return _error(400, str(exc))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            return StreamingResponse(
                _stream(engine, req, rid, created, obj, chat, bool(opts.get("include_usage"))),
                media_type="text/event-stream",
            )
        result = GenResult()
        async for _ in engine.tokens(req, result):
            pass
        text = engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": engine.served_name,
            "choices": [choice],
            "usage": _usage(len(req.prompt_ids), len(result.token_ids)),
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


async def _stream(
    engine: Engine,
    req: GenRequest,
    rid: str,
    created: int,
    obj: str,
    chat: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    """SSE chunks of one generation, OpenAI's shape, ending with ``[DONE]``."""
    chunk_obj = obj + ".chunk" if chat else obj

    def chunk(
        text: str | None, finish: str | None, usage: dict[str, int] | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice.update(text=text or "", logprobs=None)
        out: dict[str, Any] = {
            "id": rid,
            "object": chunk_obj,
            "created": created,
            "model": engine.served_name,
            "choices": [choice],
        }
        if include_usage:
            out["usage"] = usage  # null on every chunk but the last, as OpenAI does
        return out

    if chat:
        first = chunk("", None)
        first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        yield _sse(first)
    result = GenResult()
    detok = _Detok(engine.tokenizer)
    async for tok in engine.tokens(req, result):
        # One chunk per token, even when it adds no visible text yet, so clients
        # can time every token.
        yield _sse(chunk(detok.push(tok), None))
    tail = detok.flush()
    if tail:
        yield _sse(chunk(tail, None))
    yield _sse(chunk(None, result.finish_reason))
    if include_usage:
        last = chunk(None, None, _usage(len(req.prompt_ids), len(result.token_ids)))
        last["choices"] = []
        yield _sse(last)
    yield "data: [DONE]\n\n"


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, load the model, serve until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model folder")
    parser.add_argument("--served-model-name", default=None, help="name in /v1/models")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine(args.model, args.served_model_name or os.path.basename(args.model), args.dtype)
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
