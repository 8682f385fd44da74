"""KV events in vLLM's format from a real server, read by a ZMQ subscriber.

The subscriber decodes with a schema written here from vLLM's documented
0.32 layout (``EventBatch`` array, events as tagged maps) and recomputes each
block hash from the tokens on its own, so a change of format or hash shows.
A ``{model}`` in the configured topic gives each model a topic of its own.
With ``vllm-router`` installed, its ``kv_aware`` policy consumes the stream.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import zmq
from cluster_harness import credited_prefix_tokens, kv_aware_router

from bench.server_process import free_port
from bench.tiny_models import make_tiny_model_dir
from deploy.specs import EventSource, kv_events_config
from radixmux.common.kv_events_config import KVEventsConfig, parse_kv_events_config
from radixmux.common.server_args import ServerArgs
from radixmux.memory.allocator import KVAllocator
from radixmux.memory.layout import KVLayout
from radixmux.memory.radix_cache import ModelSpec, RadixCache
from radixmux.memory.tree_events import TreeEventLog
from radixmux.protocol import SamplingParams
from radixmux.runtime.client.engine import Engine
from radixmux.scheduler.batch_builder import BatchBuilder, BatchLimits
from radixmux.scheduler.kv_event_format import BlockHasher, BlockRemoved, BlockStored
from radixmux.scheduler.kv_events import EventTranslator, KVEventPublisher, _Round
from radixmux.scheduler.kv_manager import KVManager
from radixmux.scheduler.request import Req
from radixmux.scheduler.runners import RunnerState

pytestmark = pytest.mark.timeout(180)

PAGE = 4
TOPIC = ""  # vLLM's default: one topic for every model (what vllm-router reads)
WAIT_S = 20.0


# ---- vLLM's layout, as its docs and kv_events.py state it ----------------------------
class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None = None


class Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


DECODER = msgspec.msgpack.Decoder(Batch)


def vllm_chain(tokens: list[int]) -> list[int]:
    """vLLM's default (sha256) block hashes of every full page, no extra keys,
    as 64-bit ints (its default VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)."""
    seed = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")

    def sha(value: object) -> bytes:
        return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    parent, out = sha(seed), []
    for pos in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        parent = sha((parent, tuple(tokens[pos : pos + PAGE]), None))
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


@dataclass
class Received:
    topic: str
    seq: int
    payload: bytes
    batch: Batch


class Subscriber:
    """A vLLM-style KV event consumer: SUB for the stream, DEALER for replay."""

    def __init__(self, endpoint: str, replay: str, topic: str = TOPIC) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.got: list[Received] = []

    def poll(self, until: float) -> None:
        while self.sub.poll(max(0, int((until - time.monotonic()) * 1000))):
            topic, seq, payload = self.sub.recv_multipart()
            batch = DECODER.decode(payload)
            self.got.append(Received(topic.decode(), int.from_bytes(seq, "big"), payload, batch))
            if time.monotonic() >= until:
                return

    def wait_for(self, pred) -> Any:
        """Read until ``pred(topic, event)`` holds; return the event."""
        deadline = time.monotonic() + WAIT_S
        seen = 0
        while time.monotonic() < deadline:
            for r in self.got[seen:]:
                for ev in r.batch.events:
                    if pred(r.topic, ev):
                        return ev
            seen = len(self.got)
            self.poll(min(deadline, time.monotonic() + 0.2))
        raise AssertionError(f"no matching event in {len(self.got)} batches")

    def replay(self, start: int) -> list[tuple[str, int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        try:
            while dealer.poll(int(WAIT_S * 1000)):
                _, topic, seq, payload = dealer.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    return out
                out.append((topic.decode(), int.from_bytes(seq, "big"), payload))
            raise AssertionError("replay ended without its end marker")
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@dataclass
class Server:
    url: str
    endpoint: str
    replay: str
    alpha: Path  # the model folder (its tokenizer, for a router)
    events: Subscriber


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("kv_events")
    alpha = make_tiny_model_dir(root / "alpha", seed=41)
    beta = make_tiny_model_dir(root / "beta", seed=42)
    # tcp://*: vLLM's rule binds an endpoint with a wildcard (routers connect to it).
    pub_port, replay_port = free_port(), free_port()
    config = kv_events_config(
        f"tcp://*:{pub_port}", f"tcp://*:{replay_port}", buffer_steps=1000, topic=TOPIC
    )
    engine = Engine(
        model=[f"{alpha},name=alpha", f"{beta},name=beta"],
        kv_cache_bytes=16 << 20,
        kv_block_bytes=64 << 10,
        page_size=PAGE,
        runner_threads=1,
        dtype="float32",
        kv_events_config=config,
        # The disk tier saving each insert at once: its chunks are STORAGE events.
        kv_disk_bytes=64 << 20,
        kv_disk_dir=str(root / "disk"),
        kv_disk_write_policy="write_through",
        kv_disk_chunk_tokens=2 * PAGE,
    )
    endpoint, replay = f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"
    events = Subscriber(endpoint, replay)
    try:
        yield Server(f"http://127.0.0.1:{engine.args.port}", endpoint, replay, alpha, events)
    finally:
        events.close()
        engine.shutdown()


def generate(url: str, model: str, ids: list[int]) -> None:
    body = {"model": model, "input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text


def stored_for(first: list[int], topic: str = TOPIC, medium: str = "GPU"):
    return lambda got, ev: (
        got == topic
        and isinstance(ev, Stored)
        and ev.medium == medium
        and ev.token_ids[: len(first)] == first
    )


def removed_all(hashes: list[int], medium: str = "GPU"):
    """A predicate true once removals (from ``medium``) covered ``hashes``."""
    removed: set[int] = set()

    def pred(topic: str, ev: Any) -> bool:
        if isinstance(ev, Removed) and ev.medium == medium:
            removed.update(ev.block_hashes)
        return set(hashes) <= removed

    return pred


def test_prompt_pages_are_stored_with_vllm_chained_hashes(server: Server) -> None:
    ids = [101 + i for i in range(10)]  # two full pages and a partial one
    generate(server.url, "alpha", ids)
    ev = server.events.wait_for(stored_for(ids[:4]))
    assert ev.parent_block_hash is None  # from the root
    assert ev.block_size == PAGE and ev.medium == "GPU" and ev.group_idx == 0
    assert ev.lora_id is None and ev.lora_name is None and ev.extra_keys is None
    assert len(ev.token_ids) == PAGE * len(ev.block_hashes)
    assert ev.token_ids[:8] == ids[:8]
    assert ev.block_hashes == vllm_chain(ev.token_ids)


def test_an_extension_chains_on_its_parent(server: Server) -> None:
    base = [201 + i for i in range(8)]
    generate(server.url, "alpha", base)
    server.events.wait_for(stored_for(base))
    longer = [*base, 301, 302, 303, 304, 305]
    generate(server.url, "alpha", longer)
    ev = server.events.wait_for(stored_for(longer[8:12]))
    chain = vllm_chain(longer[:8] + ev.token_ids)
    assert ev.parent_block_hash == chain[1]
    assert ev.block_hashes == chain[2:]


def test_a_shared_topic_reports_a_block_until_its_last_holder_drops_it(server: Server) -> None:
    """On one topic the consumer sees the union of the models: beta storing
    alpha's tokens adds nothing (same vLLM hashes), and alpha dropping them
    removes nothing while beta still holds them."""
    ids = [401 + i for i in range(8)]
    generate(server.url, "alpha", ids)
    stored = server.events.wait_for(stored_for(ids))
    assert stored.block_hashes[:2] == vllm_chain(ids)
    generate(server.url, "beta", ids)
    r = httpx.post(f"{server.url}/models/alpha/invalidate", timeout=30)
    assert r.status_code == 200, r.text
    marker = [451 + i for i in range(4)]
    generate(server.url, "alpha", marker)
    server.events.wait_for(stored_for(marker))
    later = [e for r in server.events.got for e in r.batch.events]
    after = later[later.index(stored) + 1 :]
    assert not any(
        isinstance(e, Stored) and e.medium == "GPU" and e.token_ids[:4] == ids[:4] for e in after
    )
    assert not any(
        isinstance(e, Removed) and set(e.block_hashes) & set(stored.block_hashes) for e in after
    )
    r = httpx.post(f"{server.url}/models/beta/invalidate", timeout=30)
    assert r.status_code == 200, r.text
    server.events.wait_for(removed_all(stored.block_hashes[:2]))


def test_disk_chunks_are_storage_blocks(server: Server) -> None:
    ids = [701 + i for i in range(8)]  # one disk chunk
    generate(server.url, "alpha", ids)
    arena = server.events.wait_for(stored_for(ids))
    disk = server.events.wait_for(stored_for(ids, medium="STORAGE"))
    assert disk.block_hashes == arena.block_hashes[:2] == vllm_chain(ids)
    assert disk.parent_block_hash is None and disk.token_ids == ids
    r = httpx.post(f"{server.url}/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    server.events.wait_for(removed_all(disk.block_hashes, medium="STORAGE"))


def test_a_model_placeholder_gives_each_model_its_topic(tmp_path: Path) -> None:
    """The publisher on its own, fed by a real tree: ``{model}`` in the topic
    sends each served model's batches under its name, so a SUB filters one."""
    cache = RadixCache(KVAllocator(64, 4096, PAGE))
    cache.events = TreeEventLog()
    for name in ("a", "b"):
        cache.register_model(ModelSpec(name, "g", f"pool-{name}", KVLayout(1, 1, 1)))
    endpoint = f"ipc://{tmp_path}/pub"
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, topic="kv/{model}")
    served = {"a": "alpha", "b": "beta"}
    publisher = KVEventPublisher(config, PAGE, served)
    only_beta = Subscriber(endpoint, "", "kv/beta")
    every = Subscriber(endpoint, "", "kv/")
    try:
        time.sleep(0.5)  # the SUBs' connections and subscriptions reach the publisher
        for name in ("a", "b"):
            cache.insert(name, list(range(8)), np.asarray(cache.allocator.alloc(f"pool-{name}", 8)))
        publisher.submit(cache.events.drain(), served)
        every.wait_for(stored_for([0, 1, 2, 3], "kv/alpha"))
        every.wait_for(stored_for([0, 1, 2, 3], "kv/beta"))
        only_beta.wait_for(stored_for([0, 1, 2, 3], "kv/beta"))
        assert {r.topic for r in only_beta.got} == {"kv/beta"}
    finally:
        publisher.close()
        only_beta.close()
        every.close()


def test_flush_and_invalidate_remove_what_was_stored(server: Server) -> None:
    ids = [501 + i for i in range(8)]
    generate(server.url, "beta", ids)
    stored = server.events.wait_for(stored_for(ids))
    r = httpx.post(f"{server.url}/models/beta/invalidate", timeout=30)
    assert r.status_code == 200, r.text
    server.events.wait_for(removed_all(stored.block_hashes))
    generate(server.url, "alpha", ids)
    kept = server.events.wait_for(stored_for(ids))
    r = httpx.post(f"{server.url}/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    server.events.wait_for(removed_all(kept.block_hashes))


def test_sequence_numbers_increase_and_replay_returns_missed_batches(server: Server) -> None:
    generate(server.url, "alpha", [601 + i for i in range(8)])
    server.events.wait_for(stored_for([601, 602, 603, 604]))
    seqs = [r.seq for r in server.events.got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    replayed = server.events.replay(0)
    assert [s for _, s, _ in replayed] == list(range(len(replayed)))
    # The first batch, sent before any subscriber could connect, clears what a
    # previous run of the server published: only the replay has it.
    assert DECODER.decode(replayed[0][2]).events == [Cleared()]
    live = {r.seq: (r.topic, r.payload) for r in server.events.got}
    assert all(live[s] == (t, p) for t, s, p in replayed if s in live)
    assert set(live) <= {s for _, s, _ in replayed}
    tail = server.events.replay(seqs[-1])
    assert [s for _, s, _ in tail] == [seqs[-1]]


def test_capacity_eviction_and_unload_are_recorded_per_page() -> None:
    """The tree's own log (what the publisher hashes): capacity evictions and an
    unloaded model's entries come out as removals of exactly what was stored."""
    cache = RadixCache(KVAllocator(64, 4096, PAGE))
    cache.events = TreeEventLog()
    for name in ("a", "b"):
        cache.register_model(ModelSpec(name, "g", f"pool-{name}", KVLayout(1, 1, 1)))
    for name in ("a", "b"):
        cache.insert(name, list(range(8)), np.asarray(cache.allocator.alloc(f"pool-{name}", 8)))
    stored = cache.events.drain()
    assert [(e.kind, e.models, e.start) for e in stored] == [
        ("stored", ("a",), 0),
        ("stored", ("b",), 0),
    ]
    assert cache.evict(num_tokens=8) == 8
    (gone,) = cache.events.drain()
    assert gone.kind == "removed" and gone.tokens == stored[0].tokens
    cache.unregister_model("b")
    (unloaded,) = cache.events.drain()
    assert (unloaded.kind, unloaded.models, unloaded.tokens) == (
        "removed",
        ("b",),
        stored[1].tokens,
    )


def test_a_scheduled_prompt_is_published_before_it_is_computed() -> None:
    """Pages a batch is about to compute are reported stored when it is
    scheduled (vLLM publishes at allocation), once: the tree's insert after the
    step adds no second BlockStored; pages never computed (an abort) are then
    reported removed, and the computed ones only when the tree drops them."""
    cache = RadixCache(KVAllocator(64, 4096, PAGE))
    cache.events = TreeEventLog()
    cache.register_model(ModelSpec("a", "g", "pool-a", KVLayout(1, 1, 1)))
    kv = KVManager(cache)
    limits = BatchLimits("fcfs", 512, 64, 0.0, 0, 0.0)
    builder = BatchBuilder(kv, limits)
    translator = EventTranslator(BlockHasher(PAGE), lambda m: m.encode())

    def published() -> list[Any]:
        return translator.translate(_Round(0.0, cache.events.drain(), {})).get(b"a", [])

    def req(rid: str, first: int) -> Req:
        ids = np.arange(first, first + 3 * PAGE + 1, dtype=np.int32)
        return Req(rid, "a", ids, SamplingParams(max_new_tokens=2), [], True, 0.0)

    done, aborted = req("done", 100), req("aborted", 200)
    batch = builder.schedule_next_batch(RunnerState("a#0", "a", state="up"), [done, aborted])
    assert batch is not None and batch.chunks == [3 * PAGE + 1] * 2
    kv.hold_scheduled(batch.reqs, batch.chunks)
    early = published()
    assert [type(e) for e in early] == [BlockStored, BlockStored]
    assert [e.token_ids for e in early] == [list(range(100, 112)), list(range(200, 212))]
    # The runner computed the batch; the aborted request's result is dropped.
    done.kv_len += batch.chunks[0]
    kv.cache_progress(done)
    kv.release(aborted, keep=False)
    (gone,) = published()
    assert isinstance(gone, BlockRemoved) and gone.block_hashes == early[1].block_hashes
    done.output_ids.append(7)
    kv.release(done, keep=True)
    assert published() == []  # the tree holds what the hold did: nothing new to say
    assert cache.evict(num_tokens=64) > 0
    removed = [h for e in published() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert set(early[0].block_hashes) <= set(removed)


def test_vllm_router_kv_aware_credits_the_published_prefix(server: Server, tmp_path: Path) -> None:
    """vllm-router's ``kv_aware`` policy, fed by this stream, credits a repeated
    prompt's cached pages: it rebuilt its index from our BlockStored events."""
    if importlib.util.find_spec("vllm_router") is None:
        pytest.skip("vllm-router is not installed (pip install -e '.[dev]')")
    source = EventSource(server.url, server.endpoint, server.replay)
    log = tmp_path / "router.log"
    with kv_aware_router([source], PAGE, "alpha", server.alpha, log) as router:
        body = {"model": "alpha", "prompt": "the cached prefix " * 12, "max_tokens": 1}
        for _ in range(2):
            r = httpx.post(f"{router.base_url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            time.sleep(0.5)  # the store's event reaches the router before the repeat
        credited = credited_prefix_tokens(log)
    assert len(credited) >= 2 and credited[0] == 0 and credited[-1] > 0, credited


def test_the_config_is_vllms_json_and_a_wrong_one_is_named() -> None:
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert config.enabled and config.endpoint == "tcp://*:5557" and config.buffer_steps == 10_000
    null = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert not null.enabled
    assert not parse_kv_events_config("{}").enabled
    # What the cluster recipe's benchmarks and tests give an instance.
    ours = parse_kv_events_config(kv_events_config("tcp://*:6000", "tcp://10.0.0.2:6001"))
    assert ours.enabled and ours.topic == "" and ours.endpoint == "tcp://*:6000"
    assert ours.replay_endpoint == "tcp://10.0.0.2:6001"
    with pytest.raises(ValueError, match="enable_kv_cache_event"):
        ServerArgs(kv_events_config='{"enable_kv_cache_event": true}')
    with pytest.raises(ValueError, match="hwm"):
        parse_kv_events_config('{"hwm": "many"}')
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_kv_events_config("{enable")


def test_the_bytes_are_vllms_own() -> None:
    """With vLLM installed, its own structs encode our batches to the same bytes
    (0.32.0 exactly; 0.33's BlockStored map header is wider, see docs/kv-events.md)."""
    vllm = pytest.importorskip("vllm.distributed.kv_events")
    from radixmux.scheduler import kv_event_format as ours

    def batch(mod: Any) -> bytes:
        events = [
            mod.BlockStored(
                block_hashes=[12345, 2**63 + 5],
                parent_block_hash=None,
                token_ids=list(range(2 * PAGE)),
                block_size=PAGE,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
            ),
            mod.BlockRemoved(block_hashes=[7], medium="STORAGE", group_idx=0),
            mod.AllBlocksCleared(),
        ]
        return msgspec.msgpack.encode(getattr(mod, "KVEventBatch", mod.EventBatch)(1.5, events))

    assert DECODER.decode(batch(ours)) == DECODER.decode(batch(vllm))
    import vllm as package

    if package.__version__.startswith("0.32."):
        assert batch(ours) == batch(vllm)
