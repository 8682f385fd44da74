"""The scheduler process: sole owner of the radix cache and the arena allocator.

One single-threaded loop, blocking in ``zmq.Poller.poll`` (no busy polling),
reacts to two kinds of events:

- inbox messages: tokenized requests, aborts, control operations, runner deaths
  reported by the launcher, shutdown;
- runner replies: ``Ready`` at start-up, then one ``ForwardResult`` per batch.

After each event every idle runner with work gets its next batch, so one slow
runner never holds the others up. Replicas of a model draw from one waiting
queue and share KV (same weights fingerprint, same cache entries).

Run as ``python -m radixmux.scheduler.scheduler '<ProcessContext JSON>'``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterator

import msgspec
import zmq

from radixmux import protocol
from radixmux.common.cpu import cpu_cores
from radixmux.common.kv_events_config import parse_kv_events_config
from radixmux.common.process import ProcessContext, report, run_process
from radixmux.common.server_args import ServerArgs
from radixmux.memory.arena import ArenaSpec
from radixmux.memory.tree_events import TreeEventLog
from radixmux.scheduler import (
    bootstrap,
    control,
    disk_holds,
    fair_share,
    instances,
    request_life,
    results,
    supervision,
    warmup,
)
from radixmux.scheduler.batch_builder import ScheduledBatch
from radixmux.scheduler.bootstrap import SchedulerSockets, Startup
from radixmux.scheduler.control import READ_ONLY_OPS, InvariantWalk
from radixmux.scheduler.disk_events import DiskEvents
from radixmux.scheduler.disk_holds import HeldBatch
from radixmux.scheduler.kv_events import KVEventPublisher
from radixmux.scheduler.models import ModelState, PendingModel, StartupError
from radixmux.scheduler.outbox import Outbox
from radixmux.scheduler.request import Req
from radixmux.scheduler.results import INTERNAL_ERROR
from radixmux.scheduler.runners import RunnerState
from radixmux.scheduler.warmup import Pins, Warmups

log = logging.getLogger("radixmux.scheduler")


class Scheduler:
    """The scheduling loop's state and its reactions to each event (built
    complete from a ``Startup``; every send goes through ``outbox``, so a
    test can drive it in-process with fake runner replies). What each event
    does lives in the modules named in ``handle`` and ``on_runner_message``."""

    def __init__(
        self, args: ServerArgs, arena: ArenaSpec, outbox: Outbox, startup: Startup
    ) -> None:
        self.args = args
        self.arena = arena
        self.outbox = outbox
        self.cache = startup.cache
        self.kv = startup.kv
        self.builder = startup.builder
        self.disk = startup.disk
        self.inbox_decoder = protocol.decoder(protocol.SchedulerInbox)
        self.runner_decoder = protocol.decoder(protocol.RunnerReply)
        self.models: dict[str, ModelState] = {}
        self.runners: dict[str, RunnerState] = {}
        self.requests: dict[str, Req] = {}
        self.cores = cpu_cores()
        self.prompt_tokens_computed = 0
        self.early_aborts: OrderedDict[str, float] = OrderedDict()  # rid -> expiry
        self.aborted_before_arrival = 0
        self.contained_failures = 0
        self.stopping = False
        # Batches built but not sent (by runner id): they would overwrite KV a
        # disk save still reads.
        self.held: dict[str, HeldBatch] = {}
        # Bumped by every event that may change what ``check`` looks at, so a
        # walk's result is known to be current while it has not moved.
        self.version = 0
        self.walk = InvariantWalk()
        self.disk_progress_at = 0.0  # time.monotonic() a disk job last finished
        self.pending: dict[str, PendingModel] = {}  # instances added at run time, loading
        self.removing: set[str] = set()  # instances waiting for their last batch or disk load
        pins = Pins(int(arena.total_bytes * args.max_pinned_fraction))
        pins.cache = self.cache
        pins.group_names = self.kv.group_names
        self.warmups = Warmups(pins)  # warm-ups in flight and pinned prefixes
        for arg in args.models:  # registered in the cache by ``bootstrap.build``
            instances.serve(self, arg, startup.roll, arg.name)
        self.kv_events = self._start_kv_events()

    def _start_kv_events(self) -> KVEventPublisher | None:
        """The KV event publisher when ``--kv-events-config`` enables it; the
        tree (and the disk tier) then log what they store and drop."""
        if self.args.kv_events_config is None:
            return None
        config = parse_kv_events_config(self.args.kv_events_config)
        if not config.enabled:
            return None
        try:
            publisher = KVEventPublisher(config, self.cache.page_size, self.served_names())
        except zmq.ZMQError as exc:
            raise StartupError(f"--kv-events-config: cannot open its sockets: {exc}") from exc
        self.cache.events = TreeEventLog()
        if self.disk is not None:
            self.disk.events = DiskEvents(self.cache, self.cache.events, self.disk.chunk)
        return publisher

    # ---- the loop --------------------------------------------------------------------
    def run(self, sockets: SchedulerSockets) -> None:
        """Serve until a ``ShutdownProcess``: react to each event, then dispatch."""
        inbox, runner_sock = sockets.inbox, sockets.runner_sock
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        poller.register(runner_sock, zmq.POLLIN)
        if self.disk is not None:
            poller.register(self.disk.fileno(), zmq.POLLIN)
        while not self.stopping:
            events = dict(poller.poll(1000))
            if self.disk is not None and self.disk.fileno() in events:
                with self._contained("disk tier results", []):
                    disk_holds.disk_results(self)
            if inbox in events:
                while _ready(inbox):
                    raw = inbox.recv()
                    with self._contained("inbox message", _inbox_rids(raw)):
                        self.handle(self.inbox_decoder.decode(raw))
            if runner_sock in events:
                while _ready(runner_sock):
                    ident, raw = runner_sock.recv_multipart()
                    runner = self.runners.get(ident.decode())
                    rids = (
                        [r.rid for r in runner.inflight.reqs] if runner and runner.inflight else []
                    )
                    with self._contained(f"reply of runner {ident.decode()}", rids):
                        self.on_runner_message(ident.decode(), raw)
            self.after_events()
        if self.disk is not None:
            self.disk.close(flush=True)
        if self.kv_events is not None:
            self.publish_kv_events()
            self.kv_events.close()
        for runner in self.runners.values():
            if runner.up:
                self.outbox.to_runner(runner.runner_id, protocol.Shutdown())

    def after_events(self) -> None:
        """What the loop does after each round of events: time out a stalled
        disk and hung runners, finish removals, give idle runners their next batch."""
        disk_holds.check_stalls(self)
        supervision.check_timeouts(self)
        if self.removing:
            instances.finish_removals(self)
        if not self.stopping:
            self.dispatch()
        if self.kv_events is not None:
            self.publish_kv_events()

    def served_names(self) -> dict[str, str]:
        """Each instance's served model name (what clients and routers ask for)."""
        return {n: m.served.name for n, m in self.models.items()}

    def publish_kv_events(self) -> None:
        """Hand what the tree stored and dropped this round to the KV event publisher."""
        assert self.kv_events is not None and self.cache.events is not None
        events = self.cache.events.drain()
        if events:
            self.kv_events.submit(events, self.served_names())

    @contextlib.contextmanager
    def _contained(self, what: str, rids: list[str]) -> Iterator[None]:
        """Handle one event; if it raises, log it, fail the requests it concerns
        (500, no internals) and keep serving: one bad message never ends the loop."""
        try:
            yield
        except Exception:
            self.contained_failures += 1
            log.exception("error handling %s (rids %s); failing those requests", what, rids)
            request_life.fail(self, rids, 500, INTERNAL_ERROR)

    # ---- events ----------------------------------------------------------------------
    def handle(self, msg: object) -> None:
        """One inbox message."""
        if not (isinstance(msg, protocol.ControlRequest) and msg.op in READ_ONLY_OPS):
            self.version += 1
        if isinstance(msg, protocol.TokenizedRequest):
            request_life.admit(self, msg)
        elif isinstance(msg, protocol.AbortRequest):
            request_life.abort(self, msg.rid, msg.reason, msg.early)
        elif isinstance(msg, protocol.ControlRequest):
            self.outbox.to_front(control.reply(self, msg))
        elif isinstance(msg, protocol.RunnerDied):
            supervision.runner_died(self, msg)
        elif isinstance(msg, protocol.AddModel):
            instances.add(self, msg)
        elif isinstance(msg, protocol.RemoveModel):
            instances.remove(self, msg.name)
        elif isinstance(msg, protocol.WarmupRequest):
            warmup.warm_up(self, msg)
        elif isinstance(msg, protocol.ShutdownProcess):
            self.stopping = True

    def on_runner_message(self, runner_id: str, raw: bytes) -> None:
        """One runner reply: a batch's result, or a (re)started runner's roll call."""
        self.version += 1
        runner = self.runners.get(runner_id)
        msg = self.runner_decoder.decode(raw)
        if runner is None and instances.pending_runner(self, runner_id, msg):
            return
        if runner is not None and isinstance(msg, protocol.Ready) and not runner.up:
            supervision.runner_back(self, runner, msg)
            return
        if runner is not None and isinstance(msg, protocol.Failed):
            log.error("runner %s failed to restart: %s", runner_id, msg.error)
            return  # its exit reaches us as RunnerDied; the launcher decides what next
        if runner is None or not isinstance(msg, protocol.ForwardResult):
            log.warning("unexpected message from runner %s: %s", runner_id, type(msg).__name__)
            return
        batch = runner.inflight
        if batch is None or batch.batch_id != msg.batch_id:
            log.warning("runner %s: result for unknown batch %d", runner_id, msg.batch_id)
            return
        runner.inflight = None
        runner.steps += 1
        runner.busy_s += (msg.forward_ms + msg.sample_ms) / 1e3
        decodes = batch.chunks.count(1)
        runner.costs.observe(decodes, sum(batch.chunks) - decodes, msg.forward_ms + msg.sample_ms)
        runner.threads = msg.threads
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %s", results.describe_step(batch, msg))
        self.send_outputs(results.apply_result(self, batch, msg))
        if self.args.check_invariants:
            result = control.walk_invariants(self)
            if result != "ok":  # contained: fails this batch's requests, logged
                raise AssertionError(result)

    # ---- sending ---------------------------------------------------------------------
    def dispatch(self) -> None:
        """Give every idle runner with work its next batch."""
        threads = fair_share.threads_per_runner(self)
        for model in self.models.values():
            if model.name in self.removing:
                continue
            for runner in model.runners:
                if not runner.up or runner.inflight is not None:
                    continue
                rids = [r.rid for r in runner.running]
                with (
                    self._contained(f"scheduling for runner {runner.runner_id}", rids),
                    self.warmups.real_requests_first(model.waiting),
                ):
                    batch = self.builder.schedule_next_batch(
                        runner, model.waiting, admit_cap=fair_share.admit_cap(self, model)
                    )
                    if batch is None:
                        continue
                    self.version += 1
                    runner.inflight = batch
                    self.kv.hold_scheduled(batch.reqs, batch.chunks)
                    if disk_holds.overwrites_pending_save(self, batch):
                        # Not sent, so not timed as the runner's (check_timeouts).
                        self.held[runner.runner_id] = HeldBatch(batch, time.monotonic())
                    else:
                        self.send_batch(runner, batch, threads)

    def send_batch(self, runner: RunnerState, batch: ScheduledBatch, threads: int = -1) -> None:
        """Send a runner its batch; ``sent_at`` starts its ``--runner-timeout``."""
        if threads < 0:
            threads = fair_share.threads_per_runner(self)
        runner.sent_at = time.monotonic()
        self.outbox.to_runner(
            runner.runner_id, batch.to_forward_batch(threads, self.kv.layer_splits(runner.model))
        )

    def send_outputs(self, outputs: list[protocol.RequestOutput]) -> None:
        """Requests' outputs to the detokenizer in one batch; warm-ups' are
        taken out and answered to the front when complete."""
        outputs, replies = self.warmups.split_outputs(outputs)
        for reply in replies:
            self.outbox.to_front(reply)
        if outputs:
            self.outbox.to_detokenizer(protocol.TokenBatch(outputs))

    def reply_warmup(self, reply: protocol.WarmupReply | None) -> None:
        """A warm-up's answer to the front, once it has one."""
        if reply is not None:
            self.outbox.to_front(reply)


def _ready(sock: zmq.Socket) -> bool:
    return bool(sock.poll(0, zmq.POLLIN))


def _inbox_rids(raw: bytes) -> list[str]:
    """The request an undecodable or failing inbox message was about, if any."""
    with contextlib.suppress(Exception):
        rid = msgspec.msgpack.decode(raw).get("rid")
        if isinstance(rid, str):
            return [rid]
    return []


def main(ctx: ProcessContext, zctx: zmq.Context) -> int:
    """Process entry: wait for the runners, report ready, serve until shut down."""
    args, arena = ctx.args, ctx.arena
    assert arena is not None, "the scheduler needs the arena spec"
    sockets, outbox = bootstrap.open_sockets(ctx, zctx)
    try:
        roll = bootstrap.wait_for_runners(args, sockets)
        sched = Scheduler(args, arena, outbox, bootstrap.build(args, arena, roll))
    except StartupError as exc:
        log.error("%s", exc)
        report(zctx, ctx.endpoints, protocol.ProcessFailed(ctx.name, os.getpid(), str(exc)))
        return 1
    served = [m.served for m in sched.models.values()]
    report(zctx, ctx.endpoints, protocol.ProcessReady(ctx.name, os.getpid(), served))
    log.info("serving %s", ", ".join(f"{m.name} x{m.replicas}" for m in served))
    sched.run(sockets)
    return 0


if __name__ == "__main__":
    run_process(main)
