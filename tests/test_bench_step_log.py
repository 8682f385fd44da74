"""``bench.step_log`` reads the step lines the scheduler writes (the format
comes from ``results.describe_step`` on a real batch, so the two cannot drift)."""

from __future__ import annotations

import logging

from test_batch_builder import builder, request, run

from radixmux.bench.step_log import parse_steps, summarize
from radixmux.protocol import ForwardResult
from radixmux.scheduler.results import describe_step
from radixmux.scheduler.runners import RunnerState


def test_step_lines_round_trip_through_the_summary() -> None:
    b = builder(chunked=64)
    runner = RunnerState("m#0", "m", state="up")
    waiting = [request("a", list(range(1, 21)))]
    run(b, runner, waiting)  # a prefilled: it decodes from now on
    waiting.append(request("b", list(range(100, 200))))
    batch = b.schedule_next_batch(runner, waiting)
    assert batch is not None and sorted(batch.chunks) == [1, 63]  # the decode is a row of 64
    line = describe_step(batch, ForwardResult(batch.batch_id, forward_ms=12.5))
    record = logging.makeLogRecord({"msg": "step %s", "args": (line,)}).getMessage()
    (step,) = parse_steps(["2026-12-01 12:00:00 DEBUG scheduler " + record, "unrelated line"])
    assert step.kind == "mixed" and step.decodes == 1 and step.decode_context == 21
    assert step.chunks == ((63, 0),) and step.forward_ms == 12.5
    summary = summarize([step, step])
    assert summary["mixed"].steps == 2 and summary["all"].prefill_tokens == 126
    assert summary["decode"].steps == 0
