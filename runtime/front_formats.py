"""Per-request formatters: TextOutput deltas to OpenAI completion / chat and SGLang shapes.

Each formatter is created for one request; streaming calls ``chunks`` per output
and ``tail`` after the last, non-streaming calls ``full`` with every output.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from radixmux.runtime import native_api as N
from radixmux.runtime import openai_api as O
from radixmux.runtime import protocol as P
from radixmux.runtime.front_hub import Generation


def _reason(gen: Generation) -> str | None:
    return gen.finish_reason if gen.done else None


def _usage(gens: list[Generation], n: int = 1) -> O.Usage:
    return O.usage([g.last for g in gens], n)


class CompletionFormat:
    """``/v1/completions`` (``n`` choices per prompt)."""

    def __init__(
        self,
        rid: str,
        model: str,
        logprobs: bool,
        include_usage: bool,
        n: int = 1,
        echo: list[str] | None = None,
        best_of: int | None = None,
    ) -> None:
        self.id = f"cmpl-{rid}"
        self.n = n
        self.best_of = best_of or n  # samples drawn per prompt (the best n are returned)
        self.echo = echo  # ``echo``: each prompt's text, put before its choices' text
        self.echoed: set[int] = set()  # streamed choices whose prompt is sent
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.offsets: dict[int, int] = {}  # choice -> text streamed so far

    def _lps(self, outs: list[P.TextOutput], offset: int) -> O.CompletionLogprobs | None:
        if not self.logprobs:
            return None
        # With echo, the first output carries the prompt's logprobs: they come first.
        lps = [lp for o in outs for lp in (o.prompt_logprobs or []) + (o.logprobs or [])]
        return O.completion_logprobs(lps, offset)

    def _response(self, choices: list[O.CompletionChoice], usage=None) -> O.CompletionResponse:
        return O.CompletionResponse(self.id, self.created, self.model, choices, usage)

    def _prompt(self, prompt: int) -> str:
        """Prompt ``prompt``'s text when echoing it, else nothing."""
        return self.echo[prompt] if self.echo else ""

    def chunks(self, out: P.TextOutput, gen: Generation, index: int) -> list[msgspec.Struct]:
        reason = _reason(gen)
        text = out.text
        if self.echo and index not in self.echoed:
            self.echoed.add(index)
            text = self._prompt(index // self.n) + text
        if not text and not out.logprobs and not out.prompt_logprobs and reason is None:
            return []
        offset = self.offsets.get(index, 0)
        lps = self._lps([out], offset)
        self.offsets[index] = offset + len(text)
        return [self._response([O.CompletionChoice(index, text, lps, reason)])]

    def tail(self, gens: list[Generation]) -> list[msgspec.Struct]:
        return [self._response([], _usage(gens, self.n))] if self.include_usage else []

    def full(self, outputs: list[list[P.TextOutput]], gens: list[Generation]) -> msgspec.Struct:
        picked = self._best(outputs)
        choices = [
            O.CompletionChoice(
                i,
                self._prompt(k // self.best_of) + "".join(o.text for o in outputs[k]),
                self._lps(outputs[k], 0),
                _reason(gens[k]),
            )
            for i, k in enumerate(picked)
        ]
        return self._response(choices, _usage(gens, self.best_of))  # every sample is billed

    def _best(self, outputs: list[list[P.TextOutput]]) -> list[int]:
        """The samples to answer with, in choice order: all of them, or with
        ``best_of`` > ``n`` each prompt's ``n`` of highest mean token logprob."""
        if self.best_of == self.n:
            return list(range(len(outputs)))
        picked = []
        for first in range(0, len(outputs), self.best_of):
            samples = range(first, first + self.best_of)
            picked += sorted(samples, key=lambda k: -_mean_logprob(outputs[k]))[: self.n]
        return picked


def _mean_logprob(outs: list[P.TextOutput]) -> float:
    lps = [lp.logprob for o in outs for lp in o.logprobs or [] if lp.logprob is not None]
    return sum(lps) / len(lps) if lps else float("-inf")


class ChatFormat:
    """``/v1/chat/completions``."""

    def __init__(self, rid: str, model: str, logprobs: bool, include_usage: bool) -> None:
        self.id = f"chatcmpl-{rid}"
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.started: set[int] = set()  # choices whose role chunk is sent

    def _chunk(self, index: int, delta: O.ChatDelta, lps=None, reason=None) -> O.ChatChunk:
        choices = [O.ChatChunkChoice(index, delta, lps, reason)]
        return O.ChatChunk(self.id, self.created, self.model, choices)

    def chunks(self, out: P.TextOutput, gen: Generation, index: int) -> list[msgspec.Struct]:
        found: list[msgspec.Struct] = []
        if index not in self.started:
            # OpenAI's first chunk of a choice announces the role with empty content.
            self.started.add(index)
            found.append(self._chunk(index, O.ChatDelta(role="assistant", content="")))
        if out.text or out.logprobs:
            lps = O.chat_logprobs(out.logprobs or []) if self.logprobs else None
            found.append(self._chunk(index, O.ChatDelta(content=out.text), lps))
        if gen.done:
            found.append(self._chunk(index, O.ChatDelta(), reason=_reason(gen)))
        return found

    def tail(self, gens: list[Generation]) -> list[msgspec.Struct]:
        if not self.include_usage:
            return []
        return [O.ChatChunk(self.id, self.created, self.model, [], _usage(gens))]

    def full(self, outputs: list[list[P.TextOutput]], gens: list[Generation]) -> msgspec.Struct:
        choices = []
        for i, (outs, gen) in enumerate(zip(outputs, gens, strict=True)):
            text = "".join(o.text for o in outs)
            lps = None
            if self.logprobs:
                lps = O.chat_logprobs([lp for o in outs for lp in o.logprobs or []])
            message = O.ChatMessageOut("assistant", text)
            choices.append(O.ChatChoice(i, message, lps, _reason(gen)))
        return O.ChatResponse(self.id, self.created, self.model, choices, _usage(gens))


class _NativeChoice:
    """One item's text, ids and logprobs so far (SGLang chunks are cumulative)."""

    def __init__(self, logprobs: bool) -> None:
        self.text = ""
        self.ids: list[int] = []
        self.logprobs: list[P.TokenLogprob] | None = [] if logprobs else None
        self.prompt_logprobs: list[P.TokenLogprob] | None = None  # logprob_start_len

    def add(self, out: P.TextOutput) -> None:
        self.text += out.text
        self.ids += out.token_ids
        if self.logprobs is not None:
            self.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs


class NativeFormat:
    """SGLang ``/generate``: every streamed chunk carries the text and ids so far;
    a batch (or ``n`` > 1) is answered with a list, its chunks tagged by index."""

    def __init__(self, logprobs: bool, with_text: bool = False, batch: bool = False) -> None:
        self.logprobs = logprobs
        self.with_text = with_text  # return_text_in_logprobs
        self.batch = batch
        self.items: dict[int, _NativeChoice] = {}

    def _item(self, index: int) -> _NativeChoice:
        if index not in self.items:
            self.items[index] = _NativeChoice(self.logprobs)
        return self.items[index]

    def _response(self, gen: Generation, index: int) -> N.NativeResponse:
        item = self._item(index)
        last = gen.last
        assert last is not None
        finish = None
        if gen.done:
            finish = N.finish_reason(
                gen.finish_reason,
                gen.matched_stop,
                item.ids[-1] if item.ids else None,
                last.completion_tokens,
            )
        lps = list(item.logprobs) if item.logprobs is not None else None
        out = N.response(
            gen.rid,
            item.text,
            list(item.ids),
            last,
            finish,
            gen.latency,
            lps,
            self.with_text,
            item.prompt_logprobs,
        )
        if self.batch:
            out.index = index
        return out

    def chunks(self, out: P.TextOutput, gen: Generation, index: int) -> list[msgspec.Struct]:
        self._item(index).add(out)
        if not out.text and not out.token_ids and not gen.done:
            return []
        return [self._response(gen, index)]

    def tail(self, gens: list[Generation]) -> list[msgspec.Struct]:
        return []

    def full(self, outputs: list[list[P.TextOutput]], gens: list[Generation]) -> Any:
        answers = []
        for i, (outs, gen) in enumerate(zip(outputs, gens, strict=True)):
            for out in outs:
                self._item(i).add(out)
            answers.append(self._response(gen, i))
        return answers if self.batch else answers[0]
