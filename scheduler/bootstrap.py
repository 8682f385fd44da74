"""Start-up: wait for every runner's ``Ready``, then build what the scheduler needs.

The cache, the KV manager, the batch builder and the disk tier need the
runners' model layouts, so they are built only once every runner reported:
``build`` returns them all (a ``Startup``), from which ``Scheduler`` is
constructed complete (no half-built state); a failed runner raises
``StartupError`` naming it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

from radixmux import protocol
from radixmux.common.ipc import socket
from radixmux.common.process import ProcessContext
from radixmux.common.server_args import ServerArgs
from radixmux.memory.allocator import KVAllocator
from radixmux.memory.arena import ArenaSpec, KVArena
from radixmux.memory.kv_disk_dir import StoreRefused
from radixmux.memory.kv_disk_store import DiskKVStore
from radixmux.memory.radix_cache import RadixCache
from radixmux.protocol import runner_ids
from radixmux.scheduler.batch_builder import BatchBuilder, BatchLimits
from radixmux.scheduler.disk_tier import DiskTier
from radixmux.scheduler.kv_manager import KVManager
from radixmux.scheduler.layer_groups import plan_splits, register, restart_layers
from radixmux.scheduler.models import StartupError, check_replicas, fixed_share, model_spec
from radixmux.scheduler.outbox import SocketOutbox
from radixmux.scheduler.runners import RollCall

log = logging.getLogger("radixmux.scheduler")

READY_TIMEOUT_S = 1800.0


@dataclass
class SchedulerSockets:
    """What the scheduler receives on: its inbox and the runners' replies."""

    inbox: zmq.Socket
    runner_sock: zmq.Socket


def open_sockets(ctx: ProcessContext, zctx: zmq.Context) -> tuple[SchedulerSockets, SocketOutbox]:
    """The scheduler's receiving sockets and its outbox."""
    ep = ctx.endpoints
    inbox = socket(zctx, zmq.PULL, ep.scheduler, bind=True)
    runner_sock = socket(zctx, zmq.ROUTER, ep.runners, bind=True)
    # A restarted runner reconnects under the same identity: let it take
    # the identity over even if the dead one's pipe is not closed yet.
    runner_sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    return SchedulerSockets(inbox, runner_sock), SocketOutbox(ctx, zctx, runner_sock)


def wait_for_runners(args: ServerArgs, sockets: SchedulerSockets) -> RollCall:
    """Collect every runner's Ready; raise StartupError naming a failed one."""
    roll = RollCall({rid for m in args.models for rid in runner_ids(m)})
    inbox_decoder = protocol.decoder(protocol.SchedulerInbox)
    runner_decoder = protocol.decoder(protocol.RunnerReply)
    poller = zmq.Poller()
    poller.register(sockets.runner_sock, zmq.POLLIN)
    poller.register(sockets.inbox, zmq.POLLIN)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not roll.complete:
        left = deadline - time.monotonic()
        if left <= 0:
            raise StartupError(f"runners {roll.missing()} not ready after {READY_TIMEOUT_S:.0f}s")
        events = dict(poller.poll(min(left, 1.0) * 1000))
        if sockets.inbox in events:
            msg = inbox_decoder.decode(sockets.inbox.recv())
            if isinstance(msg, protocol.RunnerDied):
                raise StartupError(
                    f"runner {msg.runner_id} exited with code {msg.exitcode} while starting"
                )
            if isinstance(msg, protocol.ShutdownProcess):
                raise StartupError("shut down while waiting for runners")
        if sockets.runner_sock in events:
            ident, raw = sockets.runner_sock.recv_multipart()
            rid = ident.decode()
            reply = runner_decoder.decode(raw)
            if isinstance(reply, protocol.Ready | protocol.Failed):
                error = roll.answer(rid, reply)
                if error is not None:
                    raise StartupError(f"runner {rid} failed to start: {error}")
    return roll


@dataclass
class Startup:
    """What start-up built for the scheduler once every runner reported."""

    cache: RadixCache
    kv: KVManager
    builder: BatchBuilder
    disk: DiskTier | None  # None: no disk tier asked for, or it could not open
    roll: RollCall  # the runners' Ready answers


def layer_sharing(args: ServerArgs) -> bool:
    """Whether fine-tunes of one base store their shared layers once: in a
    unified arena, unless turned off, and not in a float8 arena (a lower layer
    group also stores the hidden state it hands on, which float8 would round)."""
    return (
        not args.disable_layer_sharing
        and args.kv_partition == "unified"
        and args.kv_cache_dtype == "auto"
    )


def build(args: ServerArgs, arena: ArenaSpec, roll: RollCall) -> Startup:
    """The cache (every model of ``args`` registered), KV manager, batch
    builder and disk tier for runners that all answered ``roll`` (raises
    StartupError if replicas disagree, ValueError if a model's KV cannot
    live in the arena)."""
    allocator = KVAllocator(arena.num_blocks, arena.block_bytes, args.page_size)
    cache = RadixCache(allocator, eviction_policy=args.eviction_policy)
    infos = {arg.name: roll.infos[runner_ids(arg)[0]] for arg in args.models}
    specs = [model_spec(arg, infos[arg.name]) for arg in args.models]
    if args.kv_partition == "static":
        share = arena.total_bytes // len({s.pool for s in specs})
        specs = [fixed_share(s, share, arena.block_bytes) for s in specs]
    chains = {}
    if layer_sharing(args):
        chains = {name: info.layer_keys for name, info in infos.items()}
    splits = plan_splits(chains)
    groups = {}
    for arg, spec in zip(args.models, specs, strict=True):
        check_replicas(arg, roll)
        groups[arg.name] = register(
            cache,
            spec,
            chains.get(arg.name, ()),
            splits.get(arg.name, ()),
            restart_layers(infos[arg.name]),
        )
    disk = open_disk_tier(args, arena, cache)
    kv = KVManager(cache, use_cache=not args.disable_radix_cache, disk=disk)
    if chains:
        kv.share_layers = True
        kv.groups = groups
    limits = BatchLimits(
        policy=args.schedule_policy,
        chunked_prefill_size=args.chunked_prefill_size,
        prefill_tokens_during_decode=args.prefill_tokens_during_decode,
        prefill_wait_ratio=args.prefill_wait_ratio,
        max_running_requests=args.max_running_requests,
        conservativeness=args.schedule_conservativeness,
    )
    return Startup(cache, kv, BatchBuilder(kv, limits, seed=args.seed), disk, roll)


def open_disk_tier(args: ServerArgs, arena: ArenaSpec, cache: RadixCache) -> DiskTier | None:
    """The disk tier when ``--kv-disk-bytes`` asks for one. A directory
    another server holds, or one that holds what radixmux did not make
    (``StoreRefused``), is a start-up error; one that cannot be created
    or written leaves the tier off (logged) and the server serves from memory."""
    if not args.disk_tier:
        return None
    assert args.kv_disk_dir
    try:
        store = DiskKVStore(args.kv_disk_dir, args.kv_disk_bytes, args.kv_disk_shared)
    except StoreRefused as exc:
        raise StartupError(str(exc)) from None
    except OSError as exc:
        log.error("disk tier off (serving from memory only): %s", exc)
        return None
    return DiskTier(
        cache,
        KVArena.attach(arena),
        store,
        args.kv_disk_chunk_tokens,
        args.kv_disk_write_policy,
        args.kv_disk_min_load_tokens,
    )
