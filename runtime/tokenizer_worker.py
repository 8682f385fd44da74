"""Tokenizer worker: text, ids or chat messages in; validated prompt ids out.

One of ``--tokenizer-workers`` processes. It PULLs ``GenerateRequest`` from the
front (whose PUSH socket round-robins between workers), turns each into prompt
ids with its model's own tokenizer and chat template, checks them, and PUSHes a
``TokenizedRequest`` to the scheduler. A request it rejects goes straight back
to the front as a ``RequestError`` (status 400/404/500, ``param`` naming the
field). Bad input never ends the process: every request is handled in its own
``try``. A constrained request (structured output) goes on only once its
grammar compiled for the model's tokenizer (``grammar_gate``).

Run as ``python -m radixmux.runtime.tokenizer_worker '<ProcessContext JSON>'``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from radixmux import protocol
from radixmux.common.grammar import GrammarCompiler
from radixmux.common.heap import trim_heap
from radixmux.common.ipc import socket
from radixmux.common.process import ProcessContext, inbox_messages, report, run_process
from radixmux.common.tokenizer_load import import_transformers_without_torch, load_tokenizer
from radixmux.runtime.grammar_gate import GrammarGate

log = logging.getLogger("radixmux.tokenizer")


class RejectedRequest(Exception):
    """A request the worker refuses; becomes a ``RequestError`` for the front."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def load_missing_tokenizers(models: list[protocol.ServedModel], by_folder: dict[str, Any]) -> None:
    """Add to ``by_folder`` the tokenizer of each of ``models``' folders it
    lacks: one load per folder, however many instances (versions, aliases)
    share it."""
    for m in models:
        if m.folder not in by_folder:
            by_folder[m.folder] = load_tokenizer(m.folder)


@dataclass
class ModelTokenizer:
    """One served model's tokenizer, chat template and limits."""

    model: protocol.ServedModel
    tokenizer: Any
    chat_template: str | None
    _grammar: GrammarCompiler | None = field(default=None, repr=False)

    @property
    def grammar(self) -> GrammarCompiler:
        """Structured-output grammars compiled for this tokenizer (built on first use)."""
        if self._grammar is None:
            info = self.model.info
            self._grammar = GrammarCompiler(
                self.tokenizer, info.vocab_size, list(info.eos_token_ids)
            )
        return self._grammar

    def encode_prompt(self, req: protocol.GenerateRequest) -> list[int]:
        """The request's prompt ids, from whichever of its three forms it carries."""
        given = [f for f in ("prompt", "input_ids", "messages") if getattr(req, f) is not None]
        if len(given) != 1:
            raise RejectedRequest(
                400,
                "a request needs exactly one of prompt, input_ids or messages"
                + (f" (got {', '.join(given)})" if given else ""),
                given[-1] if given else "prompt",
            )
        if req.messages is not None:
            return self.encode_chat(
                req.messages,
                req.add_generation_prompt,
                continue_final=req.continue_final_message,
                tools=req.tools,
            )
        if req.input_ids is not None:
            return self.check_ids(req.input_ids, "input_ids")
        return self.encode_text(req.prompt or "")

    def encode_text(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids; by default with the tokenizer's own special tokens
        (e.g. BOS), as transformers' ``tokenizer(text)`` adds them."""
        if not prompt:
            raise RejectedRequest(400, "the prompt is empty", "prompt")
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)

    def encode_chat(
        self,
        messages: list[protocol.ChatMessage],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        continue_final: bool = False,
        tools: list[protocol.ToolSpec] | None = None,
    ) -> list[int]:
        """Chat messages through the model's template; the rendered template
        already holds every special token it wants, so none are added by default.
        ``continue_final``: the last message is left open for the model to go on
        with (no end-of-turn after it), as transformers renders it. ``tools``
        (tool_choice "auto") go to a template that renders them and writes
        Hermes-style ``<tool_call>`` blocks; any other template is a 400."""
        if self.chat_template is None:
            raise RejectedRequest(
                400,
                f"model {self.model.name!r} has no chat template (it is a base model); "
                "send a plain prompt, or start the server with --chat-template FILE",
                "messages",
            )
        if not messages:
            raise RejectedRequest(400, "messages is empty", "messages")
        extra: dict[str, Any] = {}
        if tools is not None:
            extra["tools"] = self.template_tools(tools)
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages],
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final,
                **extra,
            )
        except Exception as exc:  # the template's own raise_exception(), bad roles, ...
            raise RejectedRequest(400, f"chat template failed: {exc}", "messages") from exc
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def template_tools(self, tools: list[protocol.ToolSpec]) -> list[dict[str, Any]]:
        """``tools`` as the chat template takes them (OpenAI's shape), or a 400
        when this model's template does not render tools and Hermes-style calls."""
        template = self.chat_template or ""
        if "tools" not in template or "<tool_call>" not in template:
            raise RejectedRequest(
                400,
                f"tool_choice 'auto' needs a chat template that declares tools; "
                f"{self.model.name!r}'s does not (tool_choice 'required' or a named "
                "function works on any model: the output is held to the tools' schemas)",
                "tool_choice",
            )
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": json.loads(t.parameters),
                },
            }
            for t in tools
        ]

    def check_ids(self, ids: list[int], field: str) -> list[int]:
        """``ids`` unchanged if every one is in the vocabulary; else a 400 naming ``field``."""
        vocab = self.model.info.vocab_size
        for i, tok in enumerate(ids):
            if not 0 <= tok < vocab:
                raise RejectedRequest(
                    400, f"{field}[{i}] = {tok} is outside the vocabulary [0, {vocab})", field
                )
        return ids

    def tokenize(self, req: protocol.TokenizeRequest) -> protocol.TokenizerReply:
        """``/tokenize``: exactly one of prompt or messages, tokenized as generation
        would (special tokens for text, none beyond the template's for chat)."""
        if (req.prompt is None) == (req.messages is None):
            raise RejectedRequest(400, "send exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            special = bool(req.add_special_tokens)
            ids = self.encode_chat(req.messages, req.add_generation_prompt, special)
        else:
            special = req.add_special_tokens is not False
            ids = self.encode_text(req.prompt or "", special)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return protocol.TokenizerReply(req.req_id, tokens=ids, token_strs=strs)

    def detokenize(self, req: protocol.DetokenizeRequest) -> protocol.TokenizerReply:
        """``/detokenize``: the text of ``tokens`` (special tokens kept, as vLLM does)."""
        ids = self.check_ids(req.tokens, "tokens")
        return protocol.TokenizerReply(req.req_id, text=self.tokenizer.decode(ids))

    def check_length(self, ids: list[int], params: protocol.SamplingParams) -> None:
        """Reject empty prompts and prompts that leave no room for ``max_tokens``."""
        if not ids:
            raise RejectedRequest(400, "the prompt is empty (no tokens)", "prompt")
        limit = self.model.info.context_length
        need = len(ids) + params.max_new_tokens
        if limit and need > limit:
            raise RejectedRequest(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_new_tokens}) = {need} "
                f"exceeds the context length of {self.model.name!r} ({limit} tokens)",
                "max_tokens",
            )


def load_models(
    served: list[protocol.ServedModel], chat_template_file: str | None
) -> dict[str, ModelTokenizer]:
    """Every served instance's tokenizer (loaded once per folder) and chat template.

    ``--chat-template`` overrides every model's own template (as in SGLang) and
    gives one to models that have none.
    """
    models: dict[str, ModelTokenizer] = {}
    sync_models(models, served, chat_template_file)
    return models


def sync_models(
    models: dict[str, ModelTokenizer],
    table: list[protocol.ServedModel],
    chat_template_file: str | None,
) -> None:
    """Make ``models`` hold exactly the instances of ``table`` (models loaded
    or unloaded at run time), loading only the tokenizers it lacks.

    Runs on the table thread while the serving loop reads ``models``: the
    slow loads come first, then only single dict stores and deletes, each
    atomic for the reader."""
    wanted = {m.instance: m for m in table}
    override = Path(chat_template_file).read_text() if chat_template_file else None
    by_folder = {mt.model.folder: mt.tokenizer for mt in list(models.values())}
    load_missing_tokenizers([m for m in table if m.instance not in models], by_folder)
    gone = [n for n in list(models) if n not in wanted]
    for name in gone:
        del models[name]
    if gone:  # as the detokenizer does: the dropped tokenizers' memory back to the OS
        trim_heap(collect=True)
    for name, m in wanted.items():
        if name not in models:
            tok = by_folder[m.folder]
            template = override or getattr(tok, "chat_template", None) or None
            models[name] = ModelTokenizer(m, tok, template)


def apply_table(
    load: Callable[[], None], table: protocol.ModelTable, name: str
) -> protocol.ModelTableApplied:
    """Run ``load`` (a ``sync_models`` for ``table``) and say how it went."""
    try:
        load()
    except Exception as exc:  # a model that cannot load fails its load, not this process
        log.exception("model table %d not applied", table.version)
        return protocol.ModelTableApplied(name, table.version, f"{type(exc).__name__}: {exc}")
    log.info("model table %d: %s", table.version, ", ".join(m.instance for m in table.models))
    return protocol.ModelTableApplied(name, table.version)


class TableThread:
    """Applies model tables off the serving loop, in order, each acknowledged
    to the launcher when done: loading a tokenizer takes seconds (Gemma 3's
    ~6 s here), and meanwhile the process must keep serving the other models
    (a detokenizer blocked on it stalls every stream)."""

    def __init__(self, zctx: zmq.Context, launcher: str, name: str) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="model-table")
        self._zctx, self._launcher, self._name = zctx, launcher, name
        self._sock: zmq.Socket | None = None  # the thread's own: sockets are not thread-safe

    def submit(self, load: Callable[[], None], table: protocol.ModelTable) -> None:
        self._pool.submit(self._apply, load, table)

    def _apply(self, load: Callable[[], None], table: protocol.ModelTable) -> None:
        reply = apply_table(load, table, self._name)
        if self._sock is None:
            self._sock = socket(self._zctx, zmq.PUSH, self._launcher, bind=False)
        self._sock.send(protocol.encode(reply))


def model_tokenizer(models: dict[str, ModelTokenizer], name: str) -> ModelTokenizer:
    """The served model ``name``'s tokenizer, or a 404 naming the served ones."""
    mt = models.get(name)
    if mt is None:
        raise RejectedRequest(
            404, f"model {name!r} is not served; served: {', '.join(sorted(models))}", "model"
        )
    return mt


def tokenize(
    models: dict[str, ModelTokenizer], req: protocol.GenerateRequest
) -> protocol.TokenizedRequest:
    """Turn one request into a ``TokenizedRequest`` or raise ``RejectedRequest``."""
    mt = model_tokenizer(models, req.model)
    ids = mt.encode_prompt(req)
    mt.check_length(ids, req.params)
    return protocol.TokenizedRequest(
        rid=req.rid,
        model=req.model,
        input_ids=protocol.pack_ids(ids),
        params=req.params,
        stop=list(req.stop),
        skip_special_tokens=req.skip_special_tokens,
        arrival=req.arrival,
    )


def tokenizer_service(
    models: dict[str, ModelTokenizer], req: protocol.TokenizeRequest | protocol.DetokenizeRequest
) -> protocol.TokenizerReply:
    """Answer ``/tokenize`` or ``/detokenize``; every failure is a reply, never a raise."""
    try:
        mt = model_tokenizer(models, req.model)
        return mt.tokenize(req) if isinstance(req, protocol.TokenizeRequest) else mt.detokenize(req)
    except RejectedRequest as exc:
        return protocol.TokenizerReply(req.req_id, exc.status, error=exc.message, param=exc.param)
    except Exception:  # a tokenizer bug fails this call, not the worker
        log.exception("req_id=%s %s failed", req.req_id, type(req).__name__)
        return protocol.TokenizerReply(
            req.req_id, 500, error="tokenization failed (see the server log)"
        )


def main(pctx: ProcessContext, zctx: zmq.Context) -> int:
    """Load tokenizers, report ready, then serve requests until shutdown."""
    # SIGTERM from the launcher is a normal stop: leave through run_process's
    # KeyboardInterrupt path with exit code 0.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    import_transformers_without_torch()  # tokenizers only: no torch in this process
    models = load_models(pctx.served, pctx.args.chat_template)
    eps = pctx.endpoints
    inbox = socket(zctx, zmq.PULL, eps.tokenizer, bind=False)
    to_scheduler = socket(zctx, zmq.PUSH, eps.scheduler, bind=False)
    to_front = socket(zctx, zmq.PUSH, eps.front, bind=False)
    tables = TableThread(zctx, eps.launcher, pctx.name)
    gate = GrammarGate(zctx, eps, pctx.args.grammar_compile_timeout)
    table = socket(zctx, zmq.SUB, eps.models, bind=False)
    table.setsockopt(zmq.SUBSCRIBE, b"")
    decoder = protocol.decoder(protocol.TokenizerInbox)
    report(zctx, eps, protocol.ProcessReady(pctx.name, os.getpid()))
    log.info(
        "ready: %s",
        ", ".join(f"{n} (chat={m.chat_template is not None})" for n, m in models.items()),
    )
    also = (table, protocol.decoder(protocol.ModelTable))
    for msg in inbox_messages(inbox, decoder, log, also=also):
        if isinstance(msg, protocol.ModelTable):
            load = functools.partial(sync_models, models, msg.models, pctx.args.chat_template)
            tables.submit(load, msg)
            continue
        if isinstance(msg, protocol.TokenizeRequest | protocol.DetokenizeRequest):
            to_front.send(protocol.encode(tokenizer_service(models, msg)))
            continue
        try:
            out = tokenize(models, msg)
            if out.params.constraint is not None:
                now = gate.submit(model_tokenizer(models, msg.model).grammar, out)
                if now is None:
                    continue  # the gate sends it once its grammar compiled
                if isinstance(now, protocol.RequestError):
                    raise RejectedRequest(now.status, now.message, now.param)
        except RejectedRequest as exc:
            log.info("rid=%s rejected %d: %s", msg.rid, exc.status, exc.message)
            to_front.send(
                protocol.encode(protocol.RequestError(msg.rid, exc.status, exc.message, exc.param))
            )
            continue
        except Exception:  # a tokenizer bug must fail the request, not the worker
            log.exception("rid=%s tokenization failed", msg.rid)
            err = protocol.RequestError(
                msg.rid, 500, "tokenization failed (the server log has details)"
            )
            to_front.send(protocol.encode(err))
            continue
        log.debug("rid=%s model=%s %d prompt tokens", msg.rid, msg.model, len(out.input_ids) // 4)
        to_scheduler.send(protocol.encode(out))
    return 0


if __name__ == "__main__":
    run_process(main)
