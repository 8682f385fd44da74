"""radixmux.scheduler: the scheduler process and its parts (docs/design.md, layer 3).

The loop and what each event does:

- ``scheduler.py``: the process entry (``python -m radixmux.scheduler.scheduler``),
  the poll loop, the ``Scheduler``'s state, event dispatch, sending batches.
- ``bootstrap.py``: the start-up handshake (every runner's ``Ready``) and what
  is built from it (cache, KV manager, batch builder, disk tier).
- ``request_life.py``: a request admitted, aborted, ended, failed or refused.
- ``results.py``: a finished batch applied to its requests.
- ``supervision.py``: hung runners killed, lost runners' requests moved or failed,
  restarted runners taken back.
- ``instances.py``: model instances served, added and removed at run time.
- ``disk_holds.py``: finished disk jobs, batches held for a save, a stalled disk.
- ``fair_share.py``: cores among busy runners, the arena by priority.
- ``control.py``: control operations, the stats report, the invariant walk.
- ``outbox.py``: the one way out (runners, detokenizer, front, launcher).

What they work on:

- ``request.py``, ``outputs.py``: a request as tracked, and its outputs.
- ``runners.py``, ``models.py``: ``RunnerState`` and the roll call, ``ModelState``.
- ``batch_builder.py``, ``policy.py``, ``kv_manager.py``: what a runner computes
  next, in which order, with which KV.
- ``layer_groups.py``: models that share lower layers, cut into layer groups
  stored once for all of them (unless ``--disable-layer-sharing``).
- ``disk_tier.py``, ``warmup.py``, ``dashboard.py``: the disk tier, warm-ups and
  pins, the dashboard's snapshot.
"""
