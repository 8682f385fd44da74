"""The end-of-run checks, each one PASS/FAIL line.

Answers, probe, idle, invariants, arena, memory, restarts.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from bench.soak.config import (
    HEALTH_EVERY_S,
    IDLE_GRACE_S,
    IDLE_TIMEOUT_S,
    INTERNALS,
    KILL_MARGIN_S,
    MODEL_INFO_FIELDS,
    OUTAGE_GRACE_S,
    REQUEST_KINDS,
    RSS_BASELINE_S,
    RSS_GROWTH_LIMIT,
    RSS_MIN_WINDOW_S,
    SERVER_INFO_FIELDS,
)
from bench.soak.end import EndState, busy_summary
from bench.soak.monitor import info_models, model_states
from bench.soak.records import CheckResult, Outage, ProcessSeries, RequestRecord, RunState


def outages(run: RunState) -> list[Outage]:
    """When each model was not serving: kill to recovery, and every non-serving health sample."""
    end = run.now()
    out = [
        Outage(k.model, k.t_kill, k.t_serving if k.t_serving is not None else end)
        for k in run.kills
    ]
    for sample in run.health:  # the state held somewhere between the neighbouring polls
        for model, state in sample.states.items():
            if state != "serving":
                out.append(Outage(model, sample.t - HEALTH_EVERY_S, sample.t + HEALTH_EVERY_S))
    return out + run.drains


def in_outage(rec: RequestRecord, windows: Sequence[Outage]) -> bool:
    return any(
        w.model == rec.model
        and rec.t_start <= w.end + OUTAGE_GRACE_S
        and rec.t_end >= w.start - OUTAGE_GRACE_S
        for w in windows
    )


def problems(rec: RequestRecord, windows: Sequence[Outage]) -> list[tuple[str, str]]:
    """(check name, why) for everything wrong with ``rec``'s answer; [] when it is fine."""
    stream = " stream" if rec.stream else ""
    where = f"{rec.kind} {rec.model} {rec.endpoint}{stream} @{rec.t_start:.0f}s"
    if rec.outcome in ("abandoned", "disconnected", "drain_cut"):
        return []
    if rec.outcome == "timeout":
        return [("no_hangs", f"{where}: {rec.detail}")]
    if rec.outcome == "transport":
        return [("no_connection_errors", f"{where}: {rec.detail}")]
    if rec.outcome in ("incomplete", "bad_body"):
        return [("complete_answers", f"{where}: {rec.outcome}: {rec.detail}")]
    found = []
    if rec.outcome in ("error", "stream_error") and INTERNALS.search(rec.detail or ""):
        found.append(("no_internals_in_errors", f"{where}: {rec.detail[:160]!r}"))
    if rec.expected_status is not None:
        return found + bad_input_problems(rec)
    code = rec.status if rec.outcome == "error" else rec.error_code
    if rec.outcome == "ok" or code == 429:
        return found
    if code == 503:
        if not in_outage(rec, windows):
            why = f"{where}: 503 while {rec.model} was serving: {rec.detail[:120]}"
            found.append(("503_only_while_down", why))
        return found
    why = f"{where}: {code} {rec.error_type}: {rec.detail[:160]!r}"
    return [*found, ("status_ok_4xx_429_503", why)]


def bad_input_problems(rec: RequestRecord) -> list[tuple[str, str]]:
    """A malformed request must get exactly its 4xx, as a JSON error naming the field."""
    code = rec.status if rec.outcome == "error" else rec.error_code
    if rec.outcome != "error" or rec.status != rec.expected_status:
        got = f"{rec.status} {rec.outcome}" + (f" code {code}" if code else "")
        return [("bad_input_rejected", f"{rec.case}: got {got}, want {rec.expected_status}")]
    if rec.expected_param is not None and rec.expected_param not in (rec.error_param or ""):
        why = f"{rec.case}: error names {rec.error_param!r}, want {rec.expected_param!r}"
        return [("bad_input_rejected", why)]
    return []


RESPONSE_CHECKS = {
    "status_ok_4xx_429_503": "every answer 200, a 4xx for bad input, 429 or 503; no other status",
    "bad_input_rejected": "every malformed or out-of-range request got its 4xx naming the field",
    "503_only_while_down": "503s only while the model was down or restarting",
    "complete_answers": "no truncated stream without an error event, every body well-formed",
    "no_hangs": "no request past its timeout",
    "no_connection_errors": "the server never refused or dropped a connection",
    "no_internals_in_errors": "no exception text, traceback or path in an error message",
}


def response_checks(run: RunState) -> list[CheckResult]:
    """One check per kind of wrong answer, listing up to three examples each."""
    windows = outages(run)
    found: dict[str, list[str]] = {name: [] for name in RESPONSE_CHECKS}
    for rec in run.records:
        for name, why in problems(rec, windows):
            found[name].append(why)
    out = []
    total = len(run.records)
    for name, what in RESPONSE_CHECKS.items():
        bad = found[name]
        detail = (
            f"{what}: {total - len(bad)}/{total} fine"
            if not bad
            else (f"{len(bad)} of {total}: " + "; ".join(bad[:3]))
        )
        out.append(CheckResult(name, not bad, detail))
    return out


def probe_check(run: RunState) -> CheckResult:
    """Greedy probe answers identical before, during and after, per model."""
    issues: list[str] = []
    summary: list[str] = []
    for model in run.facts:
        mine = [p for p in run.probes if p.model == model]
        answered = [p for p in mine if p.status == 200 and p.outcome == "ok"]
        texts = {p.text for p in answered}
        phases = {p.phase for p in answered}
        for phase in ("before", "during", "after"):
            if phase not in phases:
                issues.append(f"{model}: no 200 answer {phase} the load")
        if len(texts) > 1:
            firsts = [repr(t[:40]) for t in sorted(texts)[:3]]
            issues.append(f"{model}: {len(texts)} different answers ({', '.join(firsts)})")
        unavailable = sum(1 for p in mine if p.status == 503)
        summary.append(f"{model}: {len(answered)}/{len(mine)} answered, {unavailable} 503")
    detail = "; ".join(issues) if issues else "identical; " + ", ".join(summary)
    return CheckResult("probe_identical", not issues, detail)


def idle_checks(end: EndState) -> list[CheckResult]:
    """No orphan work after the load; the idle server reaches idle at all."""
    first, final = end.idle_after_load, end.idle_final
    return [
        CheckResult(
            "idle_after_load",
            first.idle,
            f"idle {first.waited_s:.1f} s after the last client finished"
            if first.idle
            else f"still busy {IDLE_GRACE_S:.0f} s after every client finished "
            f"({busy_summary(first.models)}): requests run for nobody",
        ),
        end.quiet,
        CheckResult(
            "idle_at_end",
            final.idle,
            "server idle for the final checks"
            if final.idle
            else f"not idle after {IDLE_TIMEOUT_S:.0f} s: {busy_summary(final.models)}",
        ),
    ]


def contract_check(end: EndState) -> CheckResult:
    """``/get_server_info`` and ``/health`` carry the fields the checks read."""
    missing = [f"scheduler.{k}" for k in SERVER_INFO_FIELDS if k not in end.sched]
    for name, m in info_models(end.sched).items():
        missing += [f"models[{name}].{k}" for k in MODEL_INFO_FIELDS if k not in m]
    body = end.health_body if isinstance(end.health_body, dict) else {}
    if not isinstance(body.get("models"), dict):
        missing.append("/health models")
    ok = not missing and bool(end.sched)
    detail = "every field present" if ok else "missing: " + ", ".join(missing or ["server info"])
    return CheckResult("server_reports_state", ok, detail)


def serving_check(run: RunState, end: EndState) -> CheckResult:
    """Every model serving at the end, by ``/health`` (200, status ok, all serving)."""
    states = model_states(end.health_status, end.health_body, list(run.facts))
    body = end.health_body if isinstance(end.health_body, dict) else {}
    ok = (
        end.health_status == 200
        and body.get("status") == "ok"
        and isinstance(body.get("models"), dict)
        and all(s == "serving" for s in states.values())
    )
    detail = f"/health {end.health_status} {json.dumps(body)[:200]}"
    return CheckResult("models_serving_at_end", ok, detail)


def scheduler_checks(end: EndState) -> list[CheckResult]:
    """The scheduler's own invariant check, zero locks, zero request-owned slots."""
    s = end.sched
    inv = s.get("invariants")
    locks, owned = s.get("locks_held"), s.get("request_owned_slots")
    return [
        CheckResult("invariants_ok", inv == "ok", f"invariants: {inv!r}"),
        CheckResult(
            "no_locks_or_owned_slots_idle",
            locks == 0 and owned == 0,
            f"locks_held {locks!r}, request_owned_slots {owned!r} on the idle server",
        ),
    ]


def arena_check(end: EndState) -> CheckResult:
    """Every block is free or the tree's: after ``/flush_cache`` on the idle server, all free."""
    before, after = end.sched, end.flushed
    total = after.get("arena_total_bytes")
    free = after.get("arena_free_bytes")
    cached = {n: m.get("cached_tokens") for n, m in info_models(after).items()}
    held = sum(int(m.get("arena_bytes") or 0) for m in info_models(before).values())
    accounted = before.get("arena_free_bytes", -1) + held == before.get("arena_total_bytes")
    ok = (
        end.flush_status == 200
        and total is not None
        and free == total
        and all(c == 0 for c in cached.values())
        and accounted
    )
    detail = (
        f"before flush: free {before.get('arena_free_bytes')} + models {held} of "
        f"{before.get('arena_total_bytes')}; flush {end.flush_status}, then free {free} of "
        f"{total}, cached tokens {cached}"
    )
    return CheckResult("arena_free_or_tree", ok, detail)


def rss_baseline_s(load_s: float) -> float:
    """Minute 2, or the halfway point of a run shorter than four minutes (never vacuous)."""
    return min(RSS_BASELINE_S, load_s / 2)


def rss_growth(series: ProcessSeries, warm_s: float, end_t: float) -> float | None:
    """RSS growth of one process from ``warm_s`` into its own life (never before
    the run's own minute ``warm_s``) to its last sample.

    A runner restarted after a kill is a new process: it is judged over its own
    life, from when it is warm (weights loaded, kernels built) to its death or
    the end. None when that window is shorter than ``RSS_MIN_WINDOW_S``, or
    than ``warm_s`` itself in a run too short for that (the window then as
    long as the warm-up before it: the second half of its life).
    """
    if not series.t:
        return None
    base = max(warm_s, series.t[0] + warm_s)
    last = min(series.t[-1], end_t)
    if last - base < min(RSS_MIN_WINDOW_S, warm_s):
        return None
    i = next(i for i, t in enumerate(series.t) if t >= base)
    j = max(i for i, t in enumerate(series.t) if t <= last)
    return series.rss_kib[j] / series.rss_kib[i] - 1.0


def rss_check(run: RunState) -> tuple[CheckResult, dict[str, Any]]:
    """Every process grew < 5% from minute 2 of its life to its end (or the run's);
    processes that lived too short a warm window are listed apart."""
    base = rss_baseline_s(run.config.load_s)
    end_t = max((s.t[-1] for s in run.rss.values() if s.t), default=0.0)
    compared: dict[str, float] = {}
    others: dict[str, str] = {}
    for s in run.rss.values():
        key = f"{s.role} ({s.pid})"
        g = rss_growth(s, base, end_t)
        if g is None:
            others[key] = f"lived {s.t[0]:.0f}-{s.t[-1]:.0f} s" if s.t else "no sample"
        else:
            compared[key] = round(g, 4)
    over = {k: g for k, g in compared.items() if g >= RSS_GROWTH_LIMIT}
    ok = bool(compared) and not over
    shown = ", ".join(f"{k} {g:+.1%}" for k, g in sorted(compared.items()))
    detail = f"from {base:.0f} s into each process's life to its end: {shown}" + (
        f"; over {RSS_GROWTH_LIMIT:.0%}: {sorted(over)}" if over else ""
    )
    if others:
        detail += f"; not compared: {others}"
    return CheckResult("rss_growth_under_5pct", ok, detail), {
        "baseline_s": base,
        "growth": compared,
        "not_compared": others,
    }


def restart_check(run: RunState, end: EndState) -> CheckResult:
    """Runner restarts equal kills, per model, and every killed model came back."""
    restarts = {n: m.get("restarts") for n, m in info_models(end.sched).items()}
    kills = Counter(k.model for k in run.kills)
    unrecovered = [f"{k.model}@{k.t_kill:.0f}s" for k in run.kills if k.t_serving is None]
    expected_kill = run.config.kill_every_s <= run.config.load_s - KILL_MARGIN_S
    ok = (
        all(restarts.get(n) == kills.get(n, 0) for n in run.facts)
        and not unrecovered
        and (bool(run.kills) or not expected_kill)
    )
    back = [round(k.t_serving - k.t_kill, 1) for k in run.kills if k.t_serving is not None]
    detail = f"kills {dict(kills)}, restarts {restarts}, back serving after {back} s"
    if unrecovered:
        detail += f"; never serving again: {unrecovered}"
    if expected_kill and not run.kills:
        detail += "; no kill happened"
    return CheckResult("restarts_equal_kills", ok, detail)


def server_up_check(run: RunState, end: EndState) -> CheckResult:
    """The launcher lived through the run and stopped cleanly (exit 0, no process left)."""
    ok = run.server_exit is None and end.exit_code == 0 and not end.leftover
    detail = f"launcher exit code {end.exit_code}"
    if run.server_exit is not None:
        detail = f"launcher died at {run.server_exit[0]:.0f} s with code {run.server_exit[1]}"
    if end.leftover:
        detail += f"; still alive after stop: {end.leftover}"
    return CheckResult("server_up_and_clean_stop", ok, detail)


def mix_check(run: RunState, end: EndState) -> CheckResult:
    """The run exercised what it claims: every kind of request, eviction and retraction."""
    kinds = Counter(r.kind for r in run.records)
    missing = [k for k in REQUEST_KINDS if not kinds.get(k)]
    evicted = end.sched.get("evicted_tokens") or {}
    pressure = int(evicted.get("capacity", sum(evicted.values()) if evicted else 0))
    retractions = int(end.sched.get("retractions") or 0)
    ok = not missing and pressure > 0 and retractions > 0
    detail = f"requests {dict(kinds)}; capacity evictions {pressure} tokens, "
    detail += f"retractions {retractions}"
    if missing:
        detail += f"; no {missing}"
    return CheckResult("load_mix_exercised", ok, detail)


def all_checks(run: RunState, end: EndState) -> tuple[list[CheckResult], dict[str, Any]]:
    rss, rss_detail = rss_check(run)
    checks = [
        *response_checks(run),
        probe_check(run),
        *idle_checks(end),
        serving_check(run, end),
        contract_check(end),
        *scheduler_checks(end),
        arena_check(end),
        rss,
        restart_check(run, end),
        server_up_check(run, end),
        mix_check(run, end),
    ]
    return checks, rss_detail
