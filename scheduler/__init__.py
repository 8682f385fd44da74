"""radixmux.scheduler: the scheduler process and its parts (docs/design.md, layer 3).

- ``scheduler.py``: the process entry (``python -m radixmux.scheduler.scheduler``),
  the poll loop and the ``Scheduler``: admission, aborts, dispatch, runner
  supervision, applying results, models at run time.
- ``bootstrap.py``: the start-up handshake (every runner's ``Ready``) and what
  is built from it (cache, KV manager, batch builder, disk tier).
- ``outbox.py``: the one way out (runners, detokenizer, front, launcher).
- ``runners.py``: runner ids, ``RunnerState``, held batches, the ``RollCall``
  of ``Ready`` / ``Failed`` answers.
- ``models.py``: ``ModelState``, instances still loading, cache specs.
- ``results.py``: request outputs and prompt logprobs.
- ``control.py``: control operations, the stats report, the invariant walk.
- ``batch_builder.py``, ``policy.py``, ``kv_manager.py``, ``request.py``:
  what a runner computes next, in which order, with which KV.
- ``disk_tier.py``, ``warmup.py``, ``dashboard.py``: the disk tier, warm-ups and
  pins, the dashboard's snapshot.
"""
