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

import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from radixmux.memory.allocator import KVAllocator
from radixmux.memory.radix_cache import ModelSpec, RadixCache
from radixmux.model_runners import protocol as RP
from radixmux.model_runners.info import ModelInfo
from radixmux.model_runners.runner_process import cpu_cores
from radixmux.runtime import protocol as P
from radixmux.runtime.ipc import socket
from radixmux.runtime.process import ProcessContext, report, run_process
from radixmux.runtime.server_args import ModelArg, ServerArgs
from radixmux.scheduler.batch_builder import BatchBuilder, BatchLimits, RunnerState, ScheduledBatch
from radixmux.scheduler.kv_manager import KVManager
from radixmux.scheduler.request import Req

log = logging.getLogger("radixmux.scheduler")

READY_TIMEOUT_S = 1800.0


class StartupError(RuntimeError):
    """A runner failed to start; the message names it and says why."""


@dataclass(eq=False)
class ModelState:
    """One served model: its runners (replicas), waiting queue and health."""

    arg: ModelArg
    info: ModelInfo
    runners: list[RunnerState]
    waiting: list[Req] = field(default_factory=list)
    down_reason: str | None = None

    @property
    def name(self) -> str:
        return self.arg.name

    @property
    def up(self) -> bool:
        return any(r.up for r in self.runners)

    def running(self) -> list[Req]:
        return [req for r in self.runners for req in r.running]


def runner_ids(arg: ModelArg) -> list[str]:
    """The runner ids the launcher gives a model's replicas."""
    return [f"{arg.name}#{i}" for i in range(arg.replicas)]


class Scheduler:
    """The scheduling loop and its state (sockets are given, so tests can drive it)."""

    def __init__(self, ctx: ProcessContext, zctx: zmq.Context) -> None:
        assert ctx.arena is not None, "the scheduler needs the arena spec"
        self.ctx = ctx
        self.args: ServerArgs = ctx.args
        ep = ctx.endpoints
        self.inbox = socket(zctx, zmq.PULL, ep.scheduler, bind=True)
        self.runner_sock = socket(zctx, zmq.ROUTER, ep.runners, bind=True)
        self.to_detok = socket(zctx, zmq.PUSH, ep.detokenizer, bind=False)
        self.to_front = socket(zctx, zmq.PUSH, ep.front, bind=False)
        self.inbox_decoder = P.decoder(P.SchedulerInbox)
        self.runner_decoder = P.decoder(RP.RunnerReply)
        self.models: dict[str, ModelState] = {}
        self.runners: dict[str, RunnerState] = {}
        self.requests: dict[str, Req] = {}
        self.cores = cpu_cores()
        self.prompt_tokens_computed = 0
        self.stopping = False
        self.cache: RadixCache | None = None
        self.kv: KVManager | None = None
        self.builder: BatchBuilder | None = None

    # ---- start-up ------------------------------------------------------------------
    def wait_for_runners(self) -> list[P.ServedModel]:
        """Collect every runner's Ready; raise StartupError naming a failed one."""
        expected = {rid: m for m in self.args.models for rid in runner_ids(m)}
        infos: dict[str, ModelInfo] = {}
        poller = zmq.Poller()
        poller.register(self.runner_sock, zmq.POLLIN)
        poller.register(self.inbox, zmq.POLLIN)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(infos) < len(expected):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(expected) - set(infos))
                raise StartupError(f"runners {missing} not ready after {READY_TIMEOUT_S:.0f}s")
            events = dict(poller.poll(min(left, 1.0) * 1000))
            if self.inbox in events:
                msg = self.inbox_decoder.decode(self.inbox.recv())
                if isinstance(msg, P.RunnerDied):
                    raise StartupError(
                        f"runner {msg.runner_id} exited with code {msg.exitcode} while starting"
                    )
                if isinstance(msg, P.ShutdownProcess):
                    raise StartupError("shut down while waiting for runners")
            if self.runner_sock in events:
                ident, raw = self.runner_sock.recv_multipart()
                rid = ident.decode()
                msg = self.runner_decoder.decode(raw)
                if isinstance(msg, RP.Failed):
                    raise StartupError(f"runner {rid} failed to start: {msg.error}")
                if isinstance(msg, RP.Ready) and rid in expected:
                    infos[rid] = msg.info
                    log.info("runner %s ready (pid %d, %.1fs load)", rid, msg.pid, msg.load_seconds)
        return self._build_state(infos)

    def _build_state(self, infos: dict[str, ModelInfo]) -> list[P.ServedModel]:
        args = self.args
        arena = self.ctx.arena
        assert arena is not None
        allocator = KVAllocator(arena.num_blocks, arena.block_bytes, args.page_size)
        self.cache = RadixCache(allocator, eviction_policy=args.eviction_policy)
        specs = []
        served = []
        for arg in args.models:
            ids = runner_ids(arg)
            info = infos[ids[0]]
            keys = {infos[i].kv_share_key for i in ids}
            if len(keys) != 1:
                raise StartupError(f"replicas of {arg.name} loaded different weights: {keys}")
            states = [RunnerState(i, arg.name, up=True) for i in ids]
            self.models[arg.name] = ModelState(arg, info, states)
            self.runners.update({s.runner_id: s for s in states})
            specs.append(
                ModelSpec(
                    name=arg.name,
                    group=info.tokenizer_fingerprint,
                    kv_key=f"{info.kv_share_key}:{info.layout.dtype}",
                    layout=info.layout,
                    priority=arg.priority,
                    cost_per_token=float(info.layout.num_layers),
                )
            )
            served.append(P.ServedModel(arg.name, arg.source, info, arg.replicas, arg.priority))
        if args.kv_partition == "static":
            share = arena.total_bytes // len({s.kv_key for s in specs})
            specs = [_fixed_share(s, share, arena.block_bytes) for s in specs]
        for spec in specs:
            self.cache.register_model(spec)
        self.kv = KVManager(self.cache, use_cache=not args.disable_radix_cache)
        limits = BatchLimits(
            policy=args.schedule_policy,
            chunked_prefill_size=args.chunked_prefill_size,
            max_running_requests=args.max_running_requests,
            conservativeness=args.schedule_conservativeness,
        )
        self.builder = BatchBuilder(self.kv, limits, seed=args.seed)
        return served

    # ---- the loop --------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        poller.register(self.runner_sock, zmq.POLLIN)
        while not self.stopping:
            events = dict(poller.poll(1000))
            if self.inbox in events:
                while self._poll_once(self.inbox):
                    self.handle(self.inbox_decoder.decode(self.inbox.recv()))
            if self.runner_sock in events:
                while self._poll_once(self.runner_sock):
                    ident, raw = self.runner_sock.recv_multipart()
                    self.on_runner_message(ident.decode(), raw)
            if not self.stopping:
                self.dispatch()
        for runner in self.runners.values():
            if runner.up:
                self._send_runner(runner.runner_id, RP.Shutdown())

    @staticmethod
    def _poll_once(sock: zmq.Socket) -> bool:
        return bool(sock.poll(0, zmq.POLLIN))

    def dispatch(self) -> None:
        """Give every idle runner with work its next batch."""
        assert self.builder is not None
        threads = self._threads_per_runner()
        for model in self.models.values():
            for runner in model.runners:
                if not runner.up or runner.inflight is not None:
                    continue
                batch = self.builder.schedule_next_batch(
                    runner, model.waiting, admit_cap=self._fair_share_cap(model)
                )
                if batch is None:
                    continue
                runner.inflight = batch
                self._send_runner(runner.runner_id, batch.to_forward_batch(threads))

    def _threads_per_runner(self) -> int:
        """The cores divided among runners that have work now (0: leave as set).

        Compute follows load as memory does: while one model is idle its
        runner's cores go to the busy ones. A runner mid-batch keeps its count
        until that batch ends, so a newly busy runner briefly shares cores.
        ``--runner-threads N`` fixes every runner at N instead.
        """
        if self.args.runner_threads or len(self.runners) < 2:
            return 0
        busy = sum(
            1
            for m in self.models.values()
            for r in m.runners
            if r.up and (r.inflight is not None or r.running or m.waiting)
        )
        return max(1, self.cores // max(1, busy))

    def _fair_share_cap(self, model: ModelState) -> int | None:
        """Weighted fair share of the arena by priority, in tokens this model
        may still admit while another model has requests waiting (None: no
        bound). The batch builder still lets an idle runner start one request."""
        busy = [m for m in self.models.values() if m.waiting or m.running()]
        if not any(m.waiting for m in busy if m is not model):
            return None
        assert self.ctx.arena is not None
        total_priority = sum(m.arg.priority for m in busy)
        share = self.ctx.arena.total_bytes * model.arg.priority / total_priority
        bpt = model.info.layout.bytes_per_token
        used = sum(len(r.slots) for r in model.running()) * bpt
        return max(0, int(share - used) // bpt)

    def _send_runner(self, runner_id: str, msg: RP.RunnerRequest) -> None:
        self.runner_sock.send_multipart([runner_id.encode(), P.encode(msg)])

    # ---- inbox -----------------------------------------------------------------------
    def handle(self, msg: object) -> None:
        if isinstance(msg, P.TokenizedRequest):
            self.enqueue(msg)
        elif isinstance(msg, P.AbortRequest):
            self.abort(msg.rid, msg.reason)
        elif isinstance(msg, P.ControlRequest):
            self.to_front.send(P.encode(self.control(msg)))
        elif isinstance(msg, P.RunnerDied):
            self.runner_died(msg.runner_id, msg.exitcode)
        elif isinstance(msg, P.ShutdownProcess):
            self.stopping = True

    def _reject(self, rid: str, status: int, message: str, param: str | None = None) -> None:
        log.info("rid=%s rejected %d: %s", rid, status, message)
        self.to_front.send(P.encode(P.RequestError(rid, status, message, param)))

    def enqueue(self, msg: P.TokenizedRequest) -> None:
        model = self.models.get(msg.model)
        if model is None:
            self._reject(msg.rid, 404, f"model {msg.model!r} is not served", "model")
            return
        if not model.up:
            self._reject(msg.rid, 503, f"model {msg.model!r} is down: {model.down_reason}")
            return
        if len(model.waiting) >= self.args.max_queued_requests:
            self._reject(
                msg.rid, 429, f"model {msg.model!r} has {len(model.waiting)} requests queued"
            )
            return
        ids = P.unpack_ids(msg.input_ids).astype(np.int32)
        if len(ids) == 0:
            self._reject(msg.rid, 400, "empty prompt", "prompt")
            return
        need = len(ids) + msg.params.max_new_tokens
        capacity = self._capacity_tokens(model)
        if need > capacity:
            self._reject(
                msg.rid,
                400,
                f"prompt ({len(ids)}) + max_tokens ({msg.params.max_new_tokens}) needs {need} "
                f"tokens of KV; the arena holds at most {capacity} for {msg.model!r}",
                "max_tokens",
            )
            return
        req = Req(
            msg.rid, msg.model, ids, msg.params, msg.stop, msg.skip_special_tokens, msg.arrival
        )
        self.requests[req.rid] = req
        model.waiting.append(req)
        log.info("rid=%s queued for %s: %d prompt tokens", req.rid, msg.model, len(ids))

    def _capacity_tokens(self, model: ModelState) -> int:
        assert self.cache is not None
        return self.cache.allocator.capacity_slots(self.cache.pool_of(model.name))

    def abort(self, rid: str, reason: str) -> None:
        req = self.requests.get(rid)
        if req is None:
            return  # already finished
        model = self.models[req.model]
        if req in model.waiting:
            model.waiting.remove(req)
            self._forget(req)
        elif req.runner is not None:
            runner = self.runners[req.runner]
            if runner.inflight is not None and req in runner.inflight.reqs:
                req.aborted = reason  # its slots are being written: free after the batch
                return
            self._finish(req, keep=True)
        log.info("rid=%s aborted: %s", rid, reason)

    def _forget(self, req: Req) -> None:
        self.requests.pop(req.rid, None)

    def _finish(self, req: Req, keep: bool) -> None:
        """Release a running request's KV and drop it."""
        assert self.kv is not None
        if req.runner is not None:
            runner = self.runners[req.runner]
            if req in runner.running:
                runner.running.remove(req)
        self.kv.release(req, keep=keep)
        self._forget(req)

    def runner_died(self, runner_id: str, code: int) -> None:
        runner = self.runners.get(runner_id)
        if runner is None or not runner.up:
            return
        runner.up = False
        runner.error = f"runner {runner_id} exited with code {code}"
        runner.inflight = None
        model = self.models[runner.model]
        log.error("%s; failing its %d running requests", runner.error, len(runner.running))
        failed = list(runner.running)
        if not model.up:
            model.down_reason = runner.error
            failed += model.waiting
            model.waiting.clear()
        outputs = []
        for req in failed:
            if req.runner is not None:
                self._finish(req, keep=False)
            else:
                self._forget(req)
            outputs.append(self._output(req, [], "error", error=runner.error, status=503))
        if outputs:
            self.to_detok.send(P.encode(P.TokenBatch(outputs)))

    # ---- runner replies ----------------------------------------------------------------
    def on_runner_message(self, runner_id: str, raw: bytes) -> None:
        runner = self.runners.get(runner_id)
        msg = self.runner_decoder.decode(raw)
        if runner is None or not isinstance(msg, RP.ForwardResult):
            log.warning("unexpected message from runner %s: %s", runner_id, type(msg).__name__)
            return
        batch = runner.inflight
        if batch is None or batch.batch_id != msg.batch_id:
            log.warning("runner %s: result for unknown batch %d", runner_id, msg.batch_id)
            return
        runner.inflight = None
        runner.steps += 1
        runner.busy_s += (msg.forward_ms + msg.sample_ms) / 1e3
        runner.threads = msg.threads
        outputs = self.apply_result(batch, msg)
        if outputs:
            self.to_detok.send(P.encode(P.TokenBatch(outputs)))
        if self.args.check_invariants:
            self.check()

    def apply_result(
        self, batch: ScheduledBatch, result: RP.ForwardResult
    ) -> list[P.RequestOutput]:
        """Advance each request of a finished batch; outputs for the detokenizer."""
        assert self.kv is not None
        outputs: list[P.RequestOutput] = []
        if result.error is not None:
            log.error(
                "runner %s batch %d failed: %s",
                batch.runner_id,
                batch.batch_id,
                result.error.splitlines()[0],
            )
            for req in batch.reqs:
                req.aborted = "error"
                self._finish(req, keep=False)
                outputs.append(self._output(req, [], "error", error=result.error, status=500))
            return outputs
        for req, n, out in zip(batch.reqs, batch.chunks, result.outputs, strict=True):
            prompt = len(req.input_ids)
            self.prompt_tokens_computed += max(0, min(req.kv_len + n, prompt) - req.kv_len)
            req.kv_len += n
            if req.aborted:
                self._finish(req, keep=True)
                continue
            if out.token_id < 0:
                self.kv.cache_progress(req)  # a prefill chunk: share it now
                continue
            req.output_ids.append(out.token_id)
            finish = out.finish_reason
            if finish is None and req.num_tokens >= self.models[req.model].info.context_length:
                finish = "length"
            logprobs = None
            if out.logprob is not None:
                logprobs = [P.TokenLogprob(out.token_id, out.logprob, out.top_logprobs)]
            outputs.append(self._output(req, [out.token_id], finish, logprobs=logprobs))
            if finish:
                log.info(
                    "rid=%s finished (%s): %d prompt + %d output tokens, %d cached",
                    req.rid,
                    finish,
                    len(req.input_ids),
                    len(req.output_ids),
                    req.cached_tokens,
                )
                self._finish(req, keep=True)
            elif n > 1:
                self.kv.cache_progress(req)
        return outputs

    def _output(
        self,
        req: Req,
        new: list[int],
        finish: str | None,
        logprobs: list[P.TokenLogprob] | None = None,
        error: str | None = None,
        status: int = 200,
    ) -> P.RequestOutput:
        first = not req.announced
        req.announced = True
        return P.RequestOutput(
            rid=req.rid,
            model=req.model,
            new_token_ids=new,
            prompt_tokens=len(req.input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            finish_reason=finish,
            logprobs=logprobs,
            error=error,
            status=status,
            stop=req.stop if first else None,
            skip_special_tokens=req.skip_special_tokens,
        )

    # ---- control ------------------------------------------------------------------------
    def control(self, msg: P.ControlRequest) -> P.ControlReply:
        assert self.cache is not None
        if msg.op == "stats":
            return P.ControlReply(msg.req_id, True, stats=self.stats())
        if msg.op == "flush_cache":
            freed = self.cache.flush()
            log.info("cache flushed: %d tokens freed", freed)
            return P.ControlReply(msg.req_id, True, f"flushed {freed} cached tokens")
        if msg.op == "invalidate":
            if msg.model not in self.models:
                return P.ControlReply(msg.req_id, False, f"model {msg.model!r} is not served")
            freed = self.cache.invalidate(msg.model)
            log.info("model %s invalidated: %d cached tokens freed", msg.model, freed)
            return P.ControlReply(
                msg.req_id, True, f"invalidated {msg.model}: freed {freed} tokens"
            )
        return P.ControlReply(msg.req_id, False, f"unknown control op {msg.op!r}")

    def stats(self) -> P.SchedulerStats:
        assert self.cache is not None and self.ctx.arena is not None
        cs = self.cache.stats()
        usage = self.cache.allocator.usage()
        models = []
        for m in self.models.values():
            c = cs.per_model[m.name]
            pool = usage.pools[self.cache.pool_of(m.name)]
            models.append(
                P.ModelStatus(
                    name=m.name,
                    up=m.up,
                    error=m.down_reason or next((r.error for r in m.runners if r.error), None),
                    waiting=len(m.waiting),
                    running=len(m.running()),
                    replicas_up=sum(r.up for r in m.runners),
                    cache_hits=c.hits,
                    cache_misses=c.misses,
                    tokens_queried=c.tokens_queried,
                    tokens_matched=c.tokens_matched,
                    cached_tokens=cs.cached_tokens[m.name],
                    arena_bytes=pool.blocks * usage.block_bytes,
                    steps=sum(r.steps for r in m.runners),
                    runner_busy_seconds=sum(r.busy_s for r in m.runners),
                    threads=max((r.threads for r in m.runners), default=0),
                )
            )
        return P.SchedulerStats(
            models=models,
            evicted_tokens=cs.evicted_tokens,
            arena_total_bytes=self.ctx.arena.total_bytes,
            arena_free_bytes=usage.free_blocks * usage.block_bytes,
            arena_fragmented_bytes=usage.fragmented_bytes,
            tree_nodes=cs.nodes,
            steps=sum(r.steps for r in self.runners.values()),
            retractions=self.builder.retractions if self.builder else 0,
            prompt_tokens_computed=self.prompt_tokens_computed,
            invariants=self._invariants() if self.args.check_invariants else None,
        )

    def _invariants(self) -> str:
        try:
            self.check()
        except AssertionError as exc:
            return f"violated: {exc}"
        return "ok"

    def check(self) -> None:
        """The cache's invariants, with every live request's slots."""
        assert self.cache is not None and self.kv is not None
        live = [req for m in self.models.values() for req in m.running()]
        self.cache.check_invariants(held=self.kv.held_slots(live))


def _fixed_share(spec: ModelSpec, share: int, block_bytes: int) -> ModelSpec:
    """``--kv-partition static``: a pool gets exactly ``share`` bytes (whole blocks)."""
    fixed = share // block_bytes * block_bytes
    return ModelSpec(**{**spec.__dict__, "floor_bytes": fixed, "cap_bytes": fixed})


def main(ctx: ProcessContext, zctx: zmq.Context) -> int:
    """Process entry: wait for the runners, report ready, serve until shut down."""
    sched = Scheduler(ctx, zctx)
    try:
        served = sched.wait_for_runners()
    except StartupError as exc:
        log.error("%s", exc)
        report(zctx, ctx.endpoints, P.ProcessFailed(ctx.name, os.getpid(), str(exc)))
        return 1
    report(zctx, ctx.endpoints, P.ProcessReady(ctx.name, os.getpid(), served))
    log.info("serving %s", ", ".join(f"{m.name} x{m.replicas}" for m in served))
    sched.run()
    return 0


if __name__ == "__main__":
    run_process(main)
