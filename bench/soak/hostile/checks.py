"""The hostile mode's checks (one PASS/FAIL row each) and its part of the report."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from bench.soak.checks import bad_input_problems, in_outage, outages
from bench.soak.hostile.client import code_of
from bench.soak.hostile.config import (
    DRAIN_SLACK_S,
    EXTRA,
    HOSTILE_KINDS,
    STALL_LIMIT,
    STALL_TOKENS,
    TOP,
)
from bench.soak.hostile.records import HostileRun
from bench.soak.monitor import by_status
from bench.soak.records import CheckResult, RequestRecord, RunState
from bench.soak.report import percentile


def _mine(run: RunState, *kinds: str) -> list[RequestRecord]:
    return [r for r in run.records if r.kind in kinds]


def _examples(bad: Sequence[str]) -> str:
    return f"{len(bad)} wrong: " + "; ".join(bad[:3])


def bounds_check(run: RunState) -> CheckResult:
    """Past every bound: the 400 naming the field (admission: 400 / 507 naming it)."""
    recs = _mine(run, "bound_past", "admission")
    bad = []
    for rec in recs:
        problems = bad_input_problems(rec)
        if not problems and rec.error_param != rec.expected_param:
            problems = [("", f"{rec.case}: names {rec.error_param!r}, want {rec.expected_param!r}")]
        bad += [why for _, why in problems]
    cases = Counter(r.case for r in recs)
    endpoints = sorted({r.endpoint for r in recs})
    ok = not bad and {"bound_past", "admission"} <= {r.kind for r in recs}
    detail = (
        f"{len(recs)} requests past a bound ({len(cases)} cases on {', '.join(endpoints)}): "
        f"each its 4xx naming the field; statuses {dict(Counter(r.status for r in recs))}"
    )
    return CheckResult("hostile_bounds_refused", ok, detail if not bad else _examples(bad))


def at_bound_check(run: RunState) -> CheckResult:
    """At every bound: served (or the one documented answer past the bound's check)."""
    windows = outages(run)
    recs = _mine(run, "bound_at")
    bad, served, unavailable = [], 0, 0
    for rec in recs:
        if rec.expected_status is not None:
            bad += [why for _, why in bad_input_problems(rec)]
        elif rec.outcome == "ok":
            served += 1
        elif code_of(rec) == 503 and in_outage(rec, windows):
            unavailable += 1
        else:
            bad.append(
                f"{rec.case}: {rec.status} {rec.outcome} {rec.error_param} {rec.detail[:80]}"
            )
    ok = served > 0 and not bad
    detail = (
        f"{served} of {len(recs)} at-bound requests served, "
        f"{len(recs) - served - unavailable} answered as documented past the bound's check "
        f"(a 1,024-character model name: 404; 4,096 messages: over the context), "
        f"{unavailable} 503 while their model restarted"
    )
    return CheckResult("hostile_at_bound_served", ok, detail if not bad else _examples(bad))


def no_5xx_check(run: RunState) -> CheckResult:
    """No hostile request got a 5xx but the documented ones: 503 while its model was
    down or draining, 507 for a load that cannot fit."""
    windows = outages(run)
    recs = _mine(run, *HOSTILE_KINDS)
    bad, documented = [], Counter()
    for rec in recs:
        code = code_of(rec)
        if code is None or code < 500:
            continue
        if (code == 503 and in_outage(rec, windows)) or (code == 507 and rec.kind == "admission"):
            documented[code] += 1
            continue
        bad.append(f"{rec.kind} {rec.case or rec.endpoint}: {code} {rec.detail[:100]}")
    detail = f"{len(recs)} hostile requests; 5xx only as documented: {dict(documented)}"
    return CheckResult(
        "hostile_no_5xx", bool(recs) and not bad, detail if not bad else _examples(bad)
    )


def cross_site_check(run: RunState) -> CheckResult:
    """Every cross-site shape refused with its status naming the field, and none
    changed any state on the idle server."""
    hs: HostileRun = run.hostile
    recs = _mine(run, "cross_site")
    bad = [why for rec in recs for _, why in bad_input_problems(rec)]
    for s in hs.states:
        if s.changed:
            bad.append(f"state changed ({s.when}): {json.dumps(s.changed)[:200]}")
        if not s.settled:
            bad.append(f"state never settled before the check ({s.when})")
    ok = bool(recs) and len(hs.states) == 2 and not bad
    shapes = Counter(r.case for r in recs)
    detail = (
        f"{len(recs)} requests of {len(shapes)} shapes, statuses "
        f"{dict(sorted(Counter(r.status for r in recs).items()))}; state unchanged by every shape "
        f"before and after the load ({', '.join(s.when for s in hs.states)}: cached tokens, "
        "evictions, pins, requests served, models, disk files)"
    )
    return CheckResult("hostile_cross_site_refused", ok, detail if not bad else _examples(bad))


def slow_reader_check(run: RunState) -> CheckResult:
    """Slow readers: each served (or held and hung up on by its client); a stream read
    to its end complete, its ``/generate`` logprobs deltas adding up to the answer."""
    hs: HostileRun = run.hostile
    windows = outages(run)
    recs = _mine(run, "slow_reader")
    bad = []
    for rec in recs:
        fine = rec.outcome in ("ok", "abandoned") or (
            code_of(rec) == 503 and in_outage(rec, windows)
        )
        if not fine:
            bad.append(f"{rec.case} {rec.model} {rec.endpoint}: {rec.outcome} {rec.detail[:80]}")
    for s in hs.streams:
        if s.logprob_entries != s.tokens or s.widest_top > TOP:
            bad.append(
                f"/generate {s.rid}: {s.logprob_entries} logprob entries for {s.tokens} tokens"
                f" (widest top {s.widest_top})"
            )
    modes = Counter(f"{r.case}:{r.outcome}" for r in recs)
    per_token = [s.bytes / s.tokens for s in hs.streams if s.tokens]
    ok = bool(hs.streams) and not bad and {"never", "trickle", "slow"} <= {r.case for r in recs}
    detail = (
        f"{len(recs)} slow readers {dict(sorted(modes.items()))}; {len(hs.streams)} /generate "
        f"streams with {TOP} alternatives read to the end, logprobs as deltas adding up to the "
        f"tokens, {statistics.median(per_token) / 1024 if per_token else 0:.1f} KiB a token"
    )
    if not hs.streams:
        detail += "; no /generate logprob stream was read to its end"
    return CheckResult("hostile_slow_readers", ok, detail if not bad else _examples(bad))


def drain_check(run: RunState) -> CheckResult:
    """Every reload and unload under streams that are never read ends within the
    drain timeout plus slack; every held stream ends; the extra model is gone."""
    hs: HostileRun = run.hostile
    limit = hs.profile.drain_timeout_s + DRAIN_SLACK_S
    bad = []
    drained = [c for c in hs.changes if c.op in ("reload", "unload")]
    for c in hs.changes:
        if c.status != 200:
            bad.append(f"{c.op} at {c.t:.0f} s: {c.status}")
        elif c.op != "load" and c.seconds > limit:
            bad.append(f"{c.op} at {c.t:.0f} s took {c.seconds:.0f} s > {limit:g} s")
    readers = _mine(run, "drain_reader")
    windows = outages(run)
    for rec in readers:
        if not (
            rec.outcome in ("ok", "drain_cut") or (code_of(rec) == 503 and in_outage(rec, windows))
        ):
            bad.append(f"held stream {rec.endpoint}: {rec.outcome} {rec.detail[:80]}")
    served = hs.states[-1].served if hs.states else None
    if served is None or EXTRA in served:
        bad.append(f"{EXTRA} still served at the end")
    # Not vacuous: some drain must have met held streams still in flight and ended them.
    timed_out = [c for c in drained if c.aborted]
    ok = bool(timed_out) and not bad
    ends = Counter(r.outcome if r.outcome != "stream_error" else "503 event" for r in readers)
    secs = [round(c.seconds, 1) for c in drained]
    detail = (
        f"{len(drained)} reloads and unloads of {EXTRA} under {len(readers)} streams that never "
        f"read (drain timeout {hs.profile.drain_timeout_s:g} s): each ended in {min(secs or [0])}-"
        f"{max(secs or [0])} s (limit {limit:g} s), {len(timed_out)} after their drain timed out "
        f"(aborted {sum(c.aborted or 0 for c in drained)}); the streams ended: {dict(ends)}"
    )
    if not timed_out:
        detail += "; no drain met a stream still in flight"
    return CheckResult("hostile_drains_end", ok, detail if not bad else _examples(bad))


def disk_trap_check(run: RunState) -> CheckResult:
    """Everything planted in the store, and the canaries outside it, are intact
    after flushes, evictions, a restart's scan and a last flush."""
    hs: HostileRun = run.hostile
    r = hs.restart
    namespaces = len(hs.trapped) - 2  # the store and v1 themselves
    bad = list(hs.trap_problems)
    bad += [f"after the restart's scan: {p}" for p in r.get("traps_after_scan") or []]
    if not r.get("ready"):
        bad.append(f"the restart on the same store failed: {r.get('error')}")
    else:
        for key in ("flush", *(f"serve_{m}" for m in run.facts)):
            if r.get(key) != 200:
                bad.append(f"after the restart: {key} {r.get(key)}")
        if r.get("get_flush") != 405:
            bad.append(f"after the restart: GET /flush_cache {r.get('get_flush')}")
    if r.get("exit_code") != 0:
        bad.append(f"the restarted server stopped with {r.get('exit_code')}")
    if namespaces < 1:
        bad.append("no namespace directory appeared to plant in")
    flushes = sum(1 for rec in run.records if rec.kind == "flush" and rec.outcome == "ok")
    detail = (
        f"{len(hs.traps)} things planted (files, directories, FIFOs, links to canaries) in the "
        f"store, v1 and {namespaces} namespace directories; after {flushes} flushes during the "
        f"load, disk evictions, a restart (its scan found {r.get('store_chunks_after_scan')} "
        f"chunks) and a flush: all intact, canaries unchanged"
    )
    return CheckResult("hostile_disk_traps_intact", not bad, detail if not bad else _examples(bad))


def stall_figures(run: RunState) -> dict[str, Any]:
    """The stall probe's latency (median, p90, count) per phase: idle before and
    after the hostile window, beside the hostile clients alone, under the whole
    load (restart windows excluded). The idle figure is the lower of the two idle
    medians: the machine's other work (a shared machine) only ever adds latency."""
    windows = outages(run)
    probes = [r for r in _mine(run, "stall_probe") if r.outcome == "ok"]
    out: dict[str, Any] = {}
    for phase in ("idle", "idle_after", "hostile", "load"):
        e2e = [r.e2e for r in probes if r.case == phase and not in_outage(r, windows)]
        if e2e:
            out[phase] = {
                "n": len(e2e),
                "median_ms": round(1e3 * statistics.median(e2e), 1),
                "p90_ms": round(1e3 * percentile(e2e, 0.9), 1),
            }
    idles = [out[k]["median_ms"] for k in ("idle", "idle_after") if k in out]
    if idles:
        out["idle_ms"] = min(idles)
        for phase in ("hostile", "load"):
            if phase in out:
                out[phase]["x_idle"] = round(out[phase]["median_ms"] / out["idle_ms"], 2)
    return out


def stall_check(run: RunState) -> CheckResult:
    """The small probe's median latency beside the hostile clients within 3x of the
    idle server's (under the soak's own load as well: reported, not judged, since
    a dozen ordinary clients sharing two cores cost more than that by themselves)."""
    f = stall_figures(run)
    if "idle_ms" not in f or "hostile" not in f:
        return CheckResult("hostile_stall_ratio", False, f"too few probes answered: {f}")
    hostile, load = f["hostile"], f.get("load")
    idles = ", ".join(
        f"{k.replace('_', ' ')} {f[k]['median_ms']:.0f} ms ({f[k]['p90_ms']:.0f}, {f[k]['n']})"
        for k in ("idle", "idle_after")
        if k in f
    )
    detail = (
        f"{STALL_TOKENS}-token greedy probe, median (p90, n): {idles}; beside the hostile "
        f"clients alone {hostile['median_ms']:.0f} ms ({hostile['p90_ms']:.0f}, {hostile['n']}) = "
        f"{hostile['x_idle']:.2f}x idle (limit {STALL_LIMIT:g}x)"
    )
    if load:
        detail += (
            f"; with the soak's load too {load['median_ms']:.0f} ms ({load['p90_ms']:.0f}, "
            f"{load['n']}) = {load['x_idle']:.2f}x"
        )
    return CheckResult("hostile_stall_ratio", hostile["x_idle"] < STALL_LIMIT, detail)


def checks(run: RunState) -> list[CheckResult]:
    return [
        bounds_check(run),
        at_bound_check(run),
        no_5xx_check(run),
        cross_site_check(run),
        slow_reader_check(run),
        drain_check(run),
        disk_trap_check(run),
        stall_check(run),
    ]


def report(run: RunState) -> dict[str, Any]:
    """The hostile part of the JSON report."""
    hs: HostileRun = run.hostile
    recs = _mine(run, *HOSTILE_KINDS)
    by_kind: dict[str, dict[str, int]] = {}
    for kind in HOSTILE_KINDS:
        by_kind[kind] = by_status([r for r in recs if r.kind == kind])
    return {
        "profile": dataclasses.asdict(hs.profile),
        "requests_by_kind_and_status": by_kind,
        "cases": dict(sorted(Counter(f"{r.kind} {r.case}" for r in recs).items())),
        "stall": stall_figures(run),
        "changes": [dataclasses.asdict(c) for c in hs.changes],
        "state_checks": [dataclasses.asdict(s) for s in hs.states],
        "generate_logprob_streams": [dataclasses.asdict(s) for s in hs.streams],
        "traps": len(hs.traps),
        "trapped_directories": sorted(hs.trapped),
        "trap_problems": hs.trap_problems,
        "restart": hs.restart,
    }
