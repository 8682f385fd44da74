"""Soak and chaos harness: the real two-model server under mixed, hostile load.

Starts ``launch.py`` with two models (``a`` and ``b``) on a small KV arena, so
eviction and retraction happen all the time, and for ``--minutes`` drives it
from several asyncio client tasks with fixed seeds:

- ``shared_prefix``: a few long system prompts x questions, both models, every
  API (OpenAI completions and chat, SGLang ``/generate``), streamed or not;
- ``multi_turn``: conversations growing turn by turn (chat where the model has a
  template, the conversation as plain text otherwise);
- ``abandon``: streams closed after a random number of events;
- ``burst``: now and then a dozen long greedy streams at once, whose decodes
  outgrow the arena (retraction);
- ``disconnect``: a long prompt sent on a raw socket that is closed at once,
  while the server is still tokenizing it;
- ``bad_input``: malformed and out-of-range requests, each expecting one 4xx
  JSON error that names the field;
- ``invalidate`` / ``flush``: per-model cache invalidations and whole-cache flushes;
- the killer: SIGKILL to one model's runner every ``--kill-every`` seconds,
  models in turn;
- ``probe``: one fixed greedy prompt per model before, during and after the load.

Meanwhile it samples the resident memory of every server process and the
models' states. At the end it stops the load, waits until the server is idle
and checks (one PASS/FAIL line each):

- every answer: 200 and complete, a 4xx JSON error naming the field for bad
  input, 429, or a 503 JSON error while its model was down; no other status,
  no hang past the request timeout, no stream cut without an error event, no
  connection error, no exception text or path in an error message;
- the greedy probe answers identical before, during and after the load;
- nothing running for nobody: idle right after the load, and right after
  clients hang up during tokenization on the idle server;
- every model serving; the scheduler's invariant check "ok"; zero locks and
  zero request-owned slots; after ``/flush_cache`` every arena block free;
- RSS growth < 5% from minute 2 (the halfway point of runs under 4 minutes)
  to the end for every process that lived through it warm;
- runner restarts equal kills, per model, and every killed model back serving;
- the launcher alive throughout and stopping cleanly;
- the load exercised what it claims (every kind of request, eviction, retraction).

``--hostile`` adds hostile clients beside this load (``bench/soak/hostile/``:
lists at and past every bound, slow and stalled readers, model changes under
them, cross-site request shapes, traps planted in the disk tier's store) and
their checks.

It writes ``bench/results/soak.json`` (checks, summaries, every request),
``soak.png`` (requests by status and TTFT p50/p99 per minute, RSS per process,
kill markers) and ``soak-server.log``, and exits 1 when a check fails.

    .venv/bin/python -m bench.soak --minutes 30                # the README run (real models)
    .venv/bin/python -m bench.soak --minutes 1 --tiny          # what tests/test_soak.py runs
    .venv/bin/python -m bench.soak --minutes 30 --hostile      # with hostile clients
"""
