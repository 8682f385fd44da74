"""Model instances coming and going: registered at start-up, added and removed at run time.

An instance added at run time waits in ``sched.pending`` until every one of
its runners answered the roll call (the same ``RollCall`` the start-up uses);
then it is registered in the cache and serves. A removed instance fails what
it still has, and goes once no batch or disk load writes its KV any more;
with the disk tier on, its cached KV is saved to disk as it goes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixmux import protocol
from radixmux.memory.radix_cache import ModelSpec
from radixmux.protocol import ModelArg, RunnerId, runner_ids
from radixmux.scheduler import request_life
from radixmux.scheduler.layer_groups import join, recuts, register, restart_layers
from radixmux.scheduler.models import (
    ModelState,
    PendingModel,
    StartupError,
    check_replicas,
    model_spec,
)
from radixmux.scheduler.runners import RollCall, RunnerState

if TYPE_CHECKING:
    from radixmux.scheduler.scheduler import Scheduler

log = logging.getLogger("radixmux.scheduler")


def serve(
    sched: Scheduler, arg: ModelArg, roll: RollCall, served_name: str, version: int = 1
) -> protocol.ServedModel:
    """Start serving an instance already registered in the cache."""
    ids = runner_ids(arg)
    info = roll.infos[ids[0]]
    served = protocol.ServedModel(
        served_name, arg.source, info, arg.replicas, arg.priority, version
    )
    states = [RunnerState(i, arg.name, state="up", pid=roll.pids[i]) for i in ids]
    sched.models[arg.name] = ModelState(arg, info, states, served)
    sched.runners.update({s.runner_id: s for s in states})
    return served


def add(sched: Scheduler, msg: protocol.AddModel) -> None:
    """Runners for a new instance are starting: it is registered when all are ready."""
    name = msg.model.name
    if name in sched.models or name in sched.pending:
        sched.outbox.to_launcher(
            protocol.ModelAdded(name, error=f"model {name!r} is already loaded")
        )
        return
    sched.pending[name] = PendingModel(msg, RollCall(set(runner_ids(msg.model))))
    log.info("model %s: waiting for %d runner(s)", name, msg.model.replicas)


def pending_runner(sched: Scheduler, runner_id: str, msg: object) -> bool:
    """Handle a message from a runner of a loading instance; False if it is not one."""
    rid = RunnerId.parse(runner_id)
    pending = sched.pending.get(rid.model) if rid is not None else None
    if pending is None or runner_id not in pending.roll.expected:
        return False
    if not isinstance(msg, protocol.Ready | protocol.Failed):
        return True
    name = pending.add.model.name
    error = pending.roll.answer(runner_id, msg)
    if error is not None:
        del sched.pending[name]
        error = f"runner {runner_id} failed to load {pending.add.model.source}: {error}"
        log.error("model %s: %s", name, error)
        sched.outbox.to_launcher(protocol.ModelAdded(name, error=error))
    elif pending.roll.complete:
        _register(sched, pending)
    return True


def _register(sched: Scheduler, pending: PendingModel) -> None:
    """Every runner of a loading instance is ready: register it and serve."""
    add = pending.add
    name = add.model.name
    del sched.pending[name]
    info = pending.roll.infos[runner_ids(add.model)[0]]
    try:
        check_replicas(add.model, pending.roll)
        spec: ModelSpec = model_spec(add.model, info)
        kv = sched.kv
        if kv.share_layers:  # layer sharing: cut it where it shares the served models' layers
            _recut_idle(sched, info.layer_keys)
            groups = join(sched.cache, kv.groups, spec, info)
            kv.groups[name] = groups
        else:
            sched.cache.register_model(spec)  # ValueError: its KV cannot live in the arena
        served = serve(sched, add.model, pending.roll, add.served, add.version)
    except (StartupError, ValueError) as exc:
        log.error("model %s not added: %s", name, exc)
        sched.outbox.to_launcher(protocol.ModelAdded(name, error=str(exc)))
        return
    log.info("model %s serving as %s (version %d)", name, add.served, add.version)
    sched.outbox.to_launcher(protocol.ModelAdded(name, served=served))


def _recut_idle(sched: Scheduler, chain: list[str]) -> None:
    """Cut served models again where a newcomer shares more of their layers
    than their cuts allow (a base served alone, a fine-tune of it arriving),
    if they are idle: their cached K/V, in the old layout, is dropped. A busy
    one keeps its cuts and the newcomer shares what those allow."""
    kv = sched.kv
    for name, splits in recuts(kv.groups, chain).items():
        model = sched.models.get(name)
        if model is None or not _idle(sched, model):
            log.info("model %s not cut again at layers %s: it is busy", name, list(splits))
            continue
        sched.warmups.pins.drop(name)
        freed = kv.unregister(name)
        kv.groups[name] = register(
            sched.cache,
            model_spec(model.arg, model.info),
            model.info.layer_keys,
            splits,
            restart_layers(model.info),
        )
        log.info(
            "model %s cut at layers %s to share them: %d cached tokens dropped",
            name,
            list(splits),
            freed,
        )


def _idle(sched: Scheduler, model: ModelState) -> bool:
    """No batch in flight and no request holding KV (its layout may change)."""
    if model.name in sched.removing or any(r.inflight is not None for r in model.runners):
        return False
    return not any(
        r.model == model.name and (r.handle is not None or r.lower or len(r.slots))
        for r in sched.requests.values()
    )


def remove(sched: Scheduler, name: str) -> None:
    """Take an instance out: fail what it still has (the front drained it
    first, so normally nothing), then, once no batch or disk load still
    writes its KV, stop its runners and drop its cache entries."""
    if sched.pending.pop(name, None) is not None:
        log.info("model %s: load cancelled", name)
        sched.outbox.to_launcher(protocol.ModelRemoved(name))
        return
    model = sched.models.get(name)
    if model is None:
        sched.outbox.to_launcher(protocol.ModelRemoved(name))
        return
    if name in sched.removing:
        return
    sched.removing.add(name)
    why = f"model {model.served.name!r} was unloaded"
    inflight = {id(req) for r in model.runners if r.inflight is not None for req in r.inflight.reqs}
    for req in [r for r in sched.requests.values() if r.model == name]:
        if id(req) in inflight:  # its slots are being written: freed after the batch
            req.aborted = "unloaded"
            request_life.refuse(sched, req.rid, 503, why)
        else:
            request_life.fail(sched, [req.rid], 503, why)
    finish_removals(sched)


def finish_removals(sched: Scheduler) -> None:
    """Remove each instance being removed that nothing writes KV for any more."""
    disk = sched.disk
    loading = {req.model for req in disk.loading_requests()} if disk else set()
    for name in list(sched.removing):
        model = sched.models[name]
        if name in loading or any(r.up and r.inflight is not None for r in model.runners):
            continue
        sched.removing.discard(name)
        for runner in model.runners:
            if runner.up:
                sched.outbox.to_runner(runner.runner_id, protocol.Shutdown())
            del sched.runners[runner.runner_id]
            sched.held.pop(runner.runner_id, None)
        del sched.models[name]
        sched.warmups.pins.drop(name)
        if disk is not None:  # its KV comes back with a reload of the same weights
            for group in sched.kv.group_names(name):  # (what no sibling keeps)
                disk.save_unloaded(group)
        freed = sched.kv.unregister(name)
        log.info("model %s removed: %d cached tokens freed", name, freed)
        removed = protocol.ModelRemoved(name, freed)
        sched.outbox.to_detokenizer(removed)  # after the instance's last outputs
        sched.outbox.to_launcher(removed)
