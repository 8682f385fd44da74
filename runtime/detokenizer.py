"""Detokenizer: token ids from the scheduler in, UTF-8-safe text deltas out.

Binds PULL on ``endpoints.detokenizer`` (``TokenBatch`` from the scheduler) and
PUSHes one ``TextBatch`` per ``TokenBatch`` to the front. Per request it keeps
an :class:`IncrementalText` that

* decodes incrementally with the prefix/read offsets SGLang and vLLM use:
  decode the window of tokens since the last emission, with and without the
  newest ones, and emit only the difference, and only once it no longer ends in
  an incomplete multi-byte character (U+FFFD). Concatenated deltas equal
  ``tokenizer.decode(all ids)``;
* applies stop strings: text is emitted up to the first stop string found, the
  request is finished with ``finish_reason="stop"`` / ``matched_stop`` and its
  later outputs are dropped (the front, seeing ``matched_stop``, asks the
  scheduler to abort it so its KV is freed at once). A tail that could still
  grow into a stop string is held back until it cannot.

A request's state ends with its last output (``finish_reason`` or ``error``
set), so nothing leaks. Bad outputs fail their request, never the process.

Run as ``python -m radixmux.runtime.detokenizer '<ProcessContext JSON>'``.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from radixmux import protocol
from radixmux.common.heap import trim_heap
from radixmux.common.ipc import socket
from radixmux.common.process import ProcessContext, inbox_messages, report, run_process
from radixmux.common.tokenizer_load import import_transformers_without_torch
from radixmux.runtime.tokenizer_worker import TableThread, load_missing_tokenizers

log = logging.getLogger("radixmux.detokenizer")

# Requests finished here by a stop string whose later outputs are still being
# dropped. The scheduler sends at most a batch's worth more after the front's
# abort and no final output for an aborted request, so entries expire instead.
STOPPED_TTL_S = 60.0
MAX_STOPPED = 65536
TOKEN_NAMES_CACHED = 65536  # per model: token id -> text, for logprobs
# A UTF-8 character spans at most 4 bytes (4 byte tokens): past this many
# tokens without new complete text, the window stops growing (see _read).
MAX_UNREAD_TOKENS = 16
# Distinct stop lists whose automata are kept (at most ~1.4 MB each, see
# api_common.MAX_STOP_CHARS); the n choices of a request share one.
STOP_MATCHERS_CACHED = 32


class IncrementalText:
    """Incremental detokenization and stop-string matching for one request.

    Each token costs time bounded by the decode window and the new text, never
    by the length of the output or the number of stop strings: only the
    window's ids and the unsent text are kept.
    """

    def __init__(
        self, tokenizer: Any, stop: list[str], skip_special_tokens: bool, model: str = ""
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model  # the instance whose tokenizer this is
        self.skip_special_tokens = skip_special_tokens
        stops = tuple(s for s in stop if s)
        self.matcher = stop_matcher(stops) if stops else None
        self.state = 0  # the matcher's node: its depth is the unsent text's length
        self.ids: list[int] = []  # the decode window: context, then tokens not yet read
        self.read_offset = 0  # window tokens before this are already in the text
        self.unsent = ""  # decoded text not emitted yet (a tail that may start a stop)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int], final: bool = False) -> tuple[str, str | None]:
        """Append ``new_ids``; return ``(text delta, matched stop string or None)``.

        ``final`` flushes everything, including an incomplete character and a
        held-back tail.
        """
        new = self._read(new_ids, final)
        if self.matcher is not None and new:
            self.state, matched = self.matcher.scan(self.state, new, len(self.unsent))
            self.unsent += new
            if matched is not None:
                index, stop = matched
                delta, self.unsent = self.unsent[:index], ""
                return delta, stop
        else:
            self.unsent += new
        held = 0 if final or self.matcher is None else self.matcher.depth[self.state]
        cut = len(self.unsent) - held
        delta, self.unsent = self.unsent[:cut], self.unsent[cut:]
        return delta, None

    def _read(self, new_ids: list[int], final: bool) -> str:
        """The text ``new_ids`` complete (prefix/read offsets as SGLang and vLLM)."""
        self.ids.extend(new_ids)
        if len(self.ids) <= self.read_offset:
            return ""
        # Decoding the window with its context keeps tokenizers that drop or
        # merge leading spaces consistent with a decode of the whole.
        before = self._decode(self.ids[: self.read_offset])
        after = self._decode(self.ids)
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            if len(self.ids) - self.read_offset <= MAX_UNREAD_TOKENS:
                return ""  # an incomplete character: wait for its other bytes
            # So many tokens cannot be one character still arriving: bound the
            # window every step decodes instead of letting it grow.
            if after == before:  # tokens that add no text (skipped special tokens)
                del self.ids[self.read_offset :]
                return ""
            # else stray bytes that never complete a character: emitted as they are
        del self.ids[: self.read_offset]  # the tokens just read are the next context
        self.read_offset = len(self.ids)
        return after[len(before) :]


class StopMatcher:
    """An Aho-Corasick automaton over one request's stop strings.

    Fed the text as it grows, it finds the earliest stop string and the longest
    unsent tail that could still grow into one in time proportional to the new
    text alone, whatever the number or length of the stop strings (the scan it
    replaces tried every stop string at every held-back position for every
    token). A state is a node: the longest suffix of the text so far that is a
    prefix of some stop string; its depth is the tail to hold back.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(dict.fromkeys(s for s in stops if s))  # first of equals wins
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        ends = [-1]  # index of the stop string that ends at a node (-1: none)
        for index, stop in enumerate(self.stops):
            node = 0
            for c in stop:
                nxt = goto[node].get(c)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][c] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    ends.append(-1)
                node = nxt
            ends[node] = index
        fail = [0] * len(goto)
        # The longest stop string that is a suffix of a node's string (-1: none).
        self.out = list(ends)
        queue = list(goto[0].values())
        for node in queue:  # breadth first: a node's fail link is shallower
            for c, child in goto[node].items():
                f = fail[node]
                while f and c not in goto[f]:
                    f = fail[f]
                target = goto[f].get(c, 0)
                fail[child] = target if target != child else 0
                if self.out[child] < 0:
                    self.out[child] = self.out[fail[child]]
                queue.append(child)
        self.goto = goto
        self.fail = fail
        self.depth = depth

    def scan(self, state: int, text: str, base: int) -> tuple[int, tuple[int, str] | None]:
        """Feed ``text`` from ``state``; ``base`` is the length of the unsent
        text before it (held back: the depth of ``state``). Returns the new
        state and the earliest stop string now complete, as (index in the
        unsent text, stop string), ties at one index going to the stop string
        listed first, as a search for each one in turn would pick."""
        goto, fail, out, depth, stops = self.goto, self.fail, self.out, self.depth, self.stops
        node = state
        best: tuple[int, int] | None = None  # (start, stop index)
        for i, c in enumerate(text):
            while node and c not in goto[node]:
                node = fail[node]
            node = goto[node].get(c, 0)
            end = base + i + 1
            if best is not None and depth[node] < end - best[0]:
                break  # no stop string ending later can start at or before ``best``
            k = out[node]
            if k >= 0:
                # The longest stop string ending here starts earliest of those that do.
                start = end - len(stops[k])
                if best is None or (start, k) < best:
                    best = (start, k)
        if best is None:
            return node, None
        return node, (best[0], stops[best[1]])


@functools.lru_cache(maxsize=STOP_MATCHERS_CACHED)
def stop_matcher(stops: tuple[str, ...]) -> StopMatcher:
    """The automaton of a stop list; the ``n`` samples of one request, and
    requests repeating a client's usual stop list, build it once."""
    return StopMatcher(stops)


class Detokenizer:
    """Every live request's :class:`IncrementalText`, keyed by rid."""

    def __init__(self, tokenizers: dict[str, Any]) -> None:
        self.tokenizers = tokenizers  # model instance -> tokenizer
        self.folders: dict[str, str] = {}  # model instance -> its folder
        self.live: dict[str, IncrementalText] = {}
        self.stopped: OrderedDict[str, float] = OrderedDict()  # rid -> when it stopped
        self.namers: dict[str, Callable[[int], str]] = {}  # model -> token id -> text
        self.lock = threading.Lock()  # the table thread adds models, the loop removes them
        # Tables are applied on their own thread, in order, behind the loop: one
        # still queued when an instance's ModelRemoved arrives (a resend, slow
        # behind a tokenizer load) would add the instance back, and nothing would
        # drop it again (one tokenizer leaked per such race, seen as +11% RSS in
        # the soak). Instance -> the newest table version the loop had seen when
        # it was removed: tables up to that version skip it.
        self.newest_table = 0
        self.removed: dict[str, int] = {}

    def add_models(self, table: list[protocol.ServedModel], version: int = 0) -> None:
        """Load the tokenizers of instances it lacks (one per folder) from table
        ``version``. It never drops one here: an instance's last outputs may
        still be on their way; ``remove_model`` follows them."""
        # On the table thread while the loop serves: load first, then store
        # under the lock ``remove_model`` takes (the loop only reads).
        with self.lock:
            by_folder = {f: self.tokenizers[n] for n, f in self.folders.items()}
            listed = {m.instance for m in table}
            for name, removed_at in list(self.removed.items()):
                if version >= removed_at and name not in listed:
                    del self.removed[name]  # the launcher knows: a later listing is a new load
            missing = [
                m
                for m in table
                if m.instance not in self.tokenizers and version > self.removed.get(m.instance, -1)
            ]
        load_missing_tokenizers(missing, by_folder)
        with self.lock:
            for m in missing:
                if version <= self.removed.get(m.instance, -1):
                    continue  # removed while its tokenizer loaded
                self.tokenizers[m.instance] = by_folder[m.folder]
                self.folders[m.instance] = m.folder

    def remove_model(self, name: str) -> None:
        """An instance was unloaded (after its last outputs, on the same socket)."""
        with self.lock:
            self.removed[name] = self.newest_table
            self.tokenizers.pop(name, None)
            self.folders.pop(name, None)
            self.namers.pop(name, None)
        # Nothing more comes for its requests (their last outputs came first):
        # a state left by one that never got a final output would keep the
        # dropped tokenizer alive (the soak's detokenizer: +11% RSS a cycle).
        for rid in [rid for rid, st in self.live.items() if st.model == name]:
            del self.live[rid]
        # Its tokenizer's memory goes back to the OS, not only to the heap: a
        # process this small (~140 MB) otherwise keeps a dropped model's
        # tokenizer as resident growth (cycles hold part of it: collected first).
        trim_heap(collect=True)
        log.info("model %s removed", name)

    def process(self, batch: protocol.TokenBatch) -> list[protocol.TextOutput]:
        """The text outputs for one batch (outputs of stopped requests dropped)."""
        outputs: list[protocol.TextOutput] = []
        now = time.monotonic()
        while self.stopped and (
            len(self.stopped) > MAX_STOPPED
            or next(iter(self.stopped.values())) < now - STOPPED_TTL_S
        ):
            self.stopped.popitem(last=False)
        for out in batch.outputs:
            if out.rid in self.stopped:
                # Already finished by a stop string: drop; a final output from
                # the scheduler ends our memory of it early.
                if out.finish_reason is not None or out.error is not None:
                    del self.stopped[out.rid]
                continue
            try:
                text, finish, matched = self._step(out)
            except Exception as exc:  # a bad output fails its request only
                log.exception("rid=%s detokenization failed", out.rid)
                self.live.pop(out.rid, None)
                outputs.append(_text_output(out, "", "error", None, f"detokenization: {exc}", 500))
                continue
            if matched is not None and out.finish_reason is None:
                log.debug("rid=%s stop string %r matched", out.rid, matched)
                self.stopped[out.rid] = now
            out = self._named(out)
            outputs.append(_text_output(out, text, finish, matched, out.error, out.status))
        return outputs

    def _named(self, out: protocol.RequestOutput) -> protocol.RequestOutput:
        """``out`` with its logprob tokens named by their text (the front has no tokenizer)."""
        if not (out.logprobs or out.prompt_logprobs) or out.model not in self.tokenizers:
            return out
        name = self._namer(out.model)

        def named(lps: list[protocol.TokenLogprob] | None) -> list[protocol.TokenLogprob] | None:
            if not lps:
                return lps
            return [
                msgspec.structs.replace(
                    lp,
                    text=name(lp.token_id),
                    top_text=[name(t) for t, _ in lp.top] if lp.top is not None else None,
                )
                for lp in lps
            ]

        return msgspec.structs.replace(
            out, logprobs=named(out.logprobs), prompt_logprobs=named(out.prompt_logprobs)
        )

    def _namer(self, model: str) -> Callable[[int], str]:
        namer = self.namers.get(model)
        if namer is None:
            tokenizer = self.tokenizers[model]

            @functools.lru_cache(maxsize=TOKEN_NAMES_CACHED)
            def namer(token_id: int) -> str:
                # One token alone, special tokens by name; a piece of a
                # multi-byte character decodes to U+FFFD, as in vLLM.
                return tokenizer.decode([token_id], skip_special_tokens=False)

            self.namers[model] = namer
        return namer

    def _step(self, out: protocol.RequestOutput) -> tuple[str, str | None, str | None]:
        state = self.live.get(out.rid)
        if state is None:
            tokenizer = self.tokenizers.get(out.model)
            if tokenizer is None:
                raise KeyError(f"no tokenizer for model {out.model!r}")
            state = IncrementalText(tokenizer, out.stop or [], out.skip_special_tokens, out.model)
            self.live[out.rid] = state
        final = out.finish_reason is not None or out.error is not None
        text, matched = state.add(out.new_token_ids, final)
        finish = "stop" if matched is not None else out.finish_reason
        if finish is not None or out.error is not None:
            del self.live[out.rid]
        return text, finish, matched


def _text_output(
    out: protocol.RequestOutput,
    text: str,
    finish: str | None,
    matched: str | None,
    error: str | None,
    status: int,
) -> protocol.TextOutput:
    return protocol.TextOutput(
        rid=out.rid,
        text=text,
        token_ids=out.new_token_ids,
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        cached_tokens=out.cached_tokens,
        finish_reason=finish,
        matched_stop=matched,
        logprobs=out.logprobs,
        error=error,
        status=status,
        queue_time=out.queue_time,
        prompt_logprobs=out.prompt_logprobs,
    )


def main(pctx: ProcessContext, zctx: zmq.Context) -> int:
    """Load tokenizers, bind the inbox, report ready, then detokenize until shutdown."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM: clean exit 0
    import_transformers_without_torch()  # tokenizers only: no torch in this process
    detok = Detokenizer({})
    detok.add_models(pctx.served)
    eps = pctx.endpoints
    inbox = socket(zctx, zmq.PULL, eps.detokenizer, bind=True)
    to_front = socket(zctx, zmq.PUSH, eps.front, bind=False)
    tables = TableThread(zctx, eps.launcher, pctx.name)
    decoder = protocol.decoder(protocol.DetokenizerInbox)
    report(zctx, eps, protocol.ProcessReady(pctx.name, os.getpid()))
    log.info("ready: %s", ", ".join(detok.tokenizers))
    for msg in inbox_messages(inbox, decoder, log):
        if isinstance(msg, protocol.ModelTable):
            detok.newest_table = max(detok.newest_table, msg.version)
            tables.submit(functools.partial(detok.add_models, msg.models, msg.version), msg)
        elif isinstance(msg, protocol.ModelRemoved):
            detok.remove_model(msg.name)
        else:
            outputs = detok.process(msg)
            if outputs:
                to_front.send(protocol.encode(protocol.TextBatch(outputs)))
    log.info("stopping with %d requests live", len(detok.live))
    return 0


if __name__ == "__main__":
    run_process(main)
