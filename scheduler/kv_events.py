"""Publishing KV events in vLLM's format: what the radix cache stores and
evicts, per model (the format and hashes: ``kv_event_format``).

A ZMQ PUB socket sends each batch as the multipart ``(topic, 8-byte big-endian
sequence number, msgpack EventBatch)``; an optional ROUTER socket replays
buffered batches from a sequence number a client sends, then an end marker
(vLLM 0.32's ``ZmqEventPublisher`` protocol; docs/kv-events.md).

Several models share one stream. The events of a model are exactly what vLLM
publishes for a model without LoRA (no ``lora_name``, no extra keys, the same
block hashes), so a consumer such as vllm-router's ``kv_aware`` policy matches
them against its own hashes of a prompt. A model is told apart by the topic
frame: ``{model}`` in the configured topic is replaced by the served model name
(``"topic": "kv.{model}"`` gives ``kv.alpha``, ``kv.beta``; a subscriber filters
one model by its topic). A topic without ``{model}`` is sent as it is for every
model, as vLLM does (what a consumer that only knows vLLM's fixed topic needs).

The loop only hands the tree's ``TreeEvent`` log to a bounded queue
(``Scheduler.publish_kv_events``, after each round of events); hashing, encoding and
sending happen on a thread of their own, so a slow subscriber never stalls
the loop (a full queue drops the batch and counts it).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec
import numpy as np
import zmq

from radixmux.common.kv_events_config import KVEventsConfig
from radixmux.memory.tree_events import TreeEvent
from radixmux.scheduler.kv_event_format import (
    MEDIUM_OF_TIER,
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    EventBatch,
    VLLMEvent,
)

log = logging.getLogger("radixmux.scheduler.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
MODEL_PLACEHOLDER = "{model}"  # in the configured topic: the served model name


# ---- the publisher ---------------------------------------------------------------------
@dataclass(frozen=True)
class _Round:
    """One loop round's tree events, as the loop handed them over."""

    ts: float
    events: list[TreeEvent]
    names: Mapping[str, str]  # cache model (instance) name -> served name


@dataclass(frozen=True)
class _Cleared:
    """Publish AllBlocksCleared for each of these served models."""

    models: tuple[str, ...]


class KVEventPublisher:
    """vLLM's ZMQ publisher: PUB (+ ROUTER replay) served by one thread.

    ``submit`` never blocks: a round that finds the queue full is dropped
    (``dropped`` counts them) rather than stalling the scheduler's loop.
    """

    def __init__(self, config: KVEventsConfig, page_size: int, models: Mapping[str, str]) -> None:
        self.config = config
        self.page_size = page_size
        self.dropped = 0
        # Instance -> served name, kept after an instance goes: its removals
        # are drained after the scheduler forgot it.
        self._names: dict[str, str] = dict(models)
        self._queue: queue.Queue[_Round | _Cleared | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        zctx = zmq.Context.instance()
        self._pub = zctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if _binds(config.endpoint):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay: zmq.Socket | None = None
        if config.replay_endpoint is not None:
            self._replay = zctx.socket(zmq.ROUTER)
            # A full replay and its end marker fit, even to a slow reader (vLLM's choice).
            self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
            self._replay.setsockopt(zmq.LINGER, 0)
            try:
                self._replay.bind(config.replay_endpoint)
            except zmq.ZMQError:
                self._pub.close()
                self._replay.close()
                raise
        # Subscribers drop what a previous run of this server told them.
        self._queue.put_nowait(_Cleared(tuple(sorted(set(models.values())))))
        self._thread = threading.Thread(target=self._serve, name="kv-events", daemon=True)
        self._thread.start()

    def submit(self, events: list[TreeEvent], names: Mapping[str, str]) -> None:
        """Queue one round's events for the thread (dropped if the queue is full)."""
        self._names.update(names)
        try:
            self._queue.put_nowait(_Round(time.time(), events, dict(self._names)))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("KV events: queue full, %d batches dropped", self.dropped)

    def close(self, timeout: float = 1.0) -> None:
        """Publish what is queued (for up to ``timeout``), then stop the thread."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)

    # ---- the thread ----------------------------------------------------------------
    def _serve(self) -> None:
        translator = EventTranslator(BlockHasher(self.page_size), self.topic_of)
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._answer_replay()
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is None:
                    break
                # data_parallel_rank 0: what vLLM's publisher of a single rank sets.
                if isinstance(item, _Cleared):
                    topics = {self.topic_of(m) for m in item.models} or {self.topic_of("")}
                    batches = {t: EventBatch(time.time(), [AllBlocksCleared()], 0) for t in topics}
                else:
                    batches = {
                        topic: EventBatch(item.ts, events, 0)
                        for topic, events in translator.translate(item).items()
                    }
                for topic, batch in sorted(batches.items()):
                    self._send(topic, encoder.encode(batch))
        except Exception:
            log.exception("KV events publisher stopped")
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def topic_of(self, model: str) -> bytes:
        """The topic frame of a served model's batches."""
        return self.config.topic.replace(MODEL_PLACEHOLDER, model).encode()

    def _send(self, topic: bytes, payload: bytes) -> None:
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, topic, payload))

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, topic, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard, ipc:// and inproc:// endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventTranslator:
    """Tree events to vLLM events, by topic.

    A topic's block is published stored when its first holder stores it and
    removed when its last holder drops it: several instances can hold one
    block under one topic (replicas, a reload serving the same name while
    the old instance drains, models sharing a fixed topic), and one of them
    dropping it must not tell the consumer it is gone. Costs one counter per
    block held (per topic).
    """

    def __init__(self, hasher: BlockHasher, topic_of: Callable[[str], bytes]) -> None:
        self.hasher = hasher
        self.topic_of = topic_of
        # (topic, medium, block digest) -> how many hold it
        self._holders: Counter[tuple[bytes, str, bytes]] = Counter()

    def translate(self, item: _Round) -> dict[bytes, list[VLLMEvent]]:
        """One round's vLLM events by topic, in the order the tree changed."""
        out: dict[bytes, list[VLLMEvent]] = {}
        for event in item.events:
            parent, blocks = self.hasher.hashes(event.tokens, event.start)
            topics = Counter(self.topic_of(item.names.get(m, m)) for m in event.models)
            medium = MEDIUM_OF_TIER[event.tier]
            for topic, holders in topics.items():
                if event.kind == "stored":
                    ids = np.frombuffer(event.tokens, dtype=np.int32)[event.start :].tolist()
                    made = self._stored((topic, medium), holders, ids, parent, blocks)
                else:
                    made = self._removed((topic, medium), holders, blocks)
                out.setdefault(topic, []).extend(made)
        return out

    def _stored(
        self,
        where: tuple[bytes, str],
        holders: int,
        ids: list[int],
        parent: bytes | None,
        blocks: list[bytes],
    ) -> list[VLLMEvent]:
        """A BlockStored per run of blocks new to the topic (usually one run);
        ``ids`` are the blocks' tokens, ``parent`` the hash before the first."""
        size = self.hasher.page_size
        runs: list[tuple[bytes | None, list[int]]] = []  # (parent, block indices)
        for i, block in enumerate(blocks):
            key = (*where, block)
            self._holders[key] += holders
            if self._holders[key] == holders:  # nobody held it before
                if runs and runs[-1][1][-1] == i - 1:
                    runs[-1][1].append(i)
                else:
                    runs.append((blocks[i - 1] if i else parent, [i]))
        ext = self.hasher.external
        return [
            BlockStored(
                [ext(blocks[i]) for i in run],
                None if first_parent is None else ext(first_parent),
                ids[run[0] * size : (run[-1] + 1) * size],
                size,
                None,
                where[1],
                None,
                group_idx=0,
            )
            for first_parent, run in runs
        ]

    def _removed(
        self, where: tuple[bytes, str], holders: int, blocks: list[bytes]
    ) -> list[VLLMEvent]:
        gone = []
        for block in blocks:
            key = (*where, block)
            left = self._holders[key] - holders
            if left > 0:
                self._holders[key] = left
            else:
                self._holders.pop(key, None)
                gone.append(self.hasher.external(block))
        return [BlockRemoved(gone, where[1], group_idx=0)] if gone else []
