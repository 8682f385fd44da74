"""The soak's hostile-client mode (``python -m bench.soak --hostile``).

Beside the soak's mixed load and runner kills, clients that mean harm:

- ``bound_past`` / ``bound_at``: every bounded list and string of every API
  (stop strings, stop token ids, logit bias, chat messages and content parts,
  prompt batches, ``n`` with a full stop list, metadata, user and other tags,
  model names) just past its bound, which must be a 400 naming the field, and
  at it, which must be served (``admission``: more replicas than cores, 400,
  and a model whose weights cannot fit, 507);
- ``slow_reader``: streams on raw sockets with a small receive buffer, read a
  trickle at a time, never after the headers, or slowly to the end (streamed
  ``/generate`` with ``return_logprob`` and 20 alternatives per token, whose
  logprobs must come as deltas that add up to the answer);
- ``model_change``: an extra tiny model ``h`` loaded with ``POST /models``,
  reloaded and unloaded while ``drain_reader`` clients that never read hold
  long streams on it: each change must end within the drain timeout plus
  slack, and every held stream must end (a 503 event, or cut when its writer
  is stuck on the full socket);
- ``cross_site``: what a web page can send: bodies without a JSON
  Content-Type (415), ``GET /flush_cache`` (405), a foreign ``Host`` (421), a
  foreign ``Origin`` (403) and its CORS preflight; each refused, and, measured
  on the idle server before and after the load, changing no state (cached
  tokens, evictions, pins, requests, models, disk files);
- disk-store traps: the run turns on the disk tier with its store in a
  temporary directory, and plants foreign files, directories, a FIFO and
  symbolic links to canaries outside the store into the store, its ``v1``
  directory and every namespace directory as it appears; flushes, disk
  evictions and, after the load, a restart of the server on the same store
  (its start-up scan) and one more flush follow, and every planted thing and
  canary must be there and unchanged;
- ``stall_probe``: a small greedy request every few seconds. Before the
  load, the hostile clients (all but the model changes) run alone for a
  window, and the probe's median beside them must stay within 3x of the idle
  server's (measured before and after the window); under the whole load it is
  reported too, not judged: the soak's own dozen clients on two cores cost
  the probe more than that by themselves.

Before the load the extra model is loaded and unloaded once: a model's first
load at run time grows the tokenizer worker and the detokenizer once (by its
tokenizer, ~45 MB, kept by the allocator after the unload and reused by every
later load), which the soak's memory check must not read as a leak.

Each class adds a PASS/FAIL row to the soak's checks; the soak's own checks
(answers, probe, idle, invariants, locks, arena, memory, restarts) judge the
hostile run too.
"""
