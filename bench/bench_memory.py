"""Where a server's memory goes: every process's RSS, PSS and USS, split by kind.

Starts a real server (``launch.py``, two models by default, as served:
bfloat16, a 512 MiB arena), waits for ``/health``, sends each model a few
greedy completions (a long prompt among them, so prefill-sized calls have
run), then reads ``/proc/PID/smaps`` of the launcher and each child it
started (the names and pids its log prints). PSS is split by mapping into
the shared KV arena (``/dev/shm/radixmux-kv-*``: every process that maps it
gets a share of its touched pages), anonymous memory (heaps, ``mmap``
allocations, stacks), shared libraries, and other files. Each runner's line
carries its model's weight bytes (``/get_server_info``: parameters and
buffers as loaded) and its PSS outside the arena over them.

The greedy texts are saved too: ``--expect`` an earlier result's JSON checks
that a change kept every output the same.

    .venv/bin/python -m bench.bench_memory [--model smollm2 --model gemma3-270m]
        [--expect bench/results/memory-before.json] [--out FILE]

Prints a table, saves ``bench/results/memory-<time>.json`` and a PNG beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.bench_serving import RESULTS_DIR, write_json
from bench.server_process import launch_radixmux
from radixmux.common.server_args import parse_model_arg

START_TIMEOUT_S = 900.0
ARENA_PREFIX = "/dev/shm/radixmux-kv-"
MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")
STARTED = re.compile(r"\[launcher\] started (.+?) \(pid (\d+)\)")
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    # ~1,500 tokens: prefill calls well above any small-batch row limit.
    "Here is a long story about a lighthouse keeper and the sea. " * 120 + "The end of it is",
]
MAX_TOKENS = 24
MB = 1 << 20


@dataclass
class ProcessMemory:
    """One process's memory, in bytes; the ``pss_*`` fields add up to ``pss``."""

    name: str
    pid: int
    rss: int
    pss: int
    uss: int  # private pages (clean and dirty)
    pss_arena: int  # its share of the KV arena's touched pages
    pss_anon: int  # heaps, anonymous mmaps, stacks
    pss_libs: int  # shared objects (.so)
    pss_files: int  # other mapped files (model files, fonts, ...) and other shmem
    weight_bytes: int = 0  # runners: the model's parameters and buffers as loaded

    @property
    def own(self) -> int:
        """PSS outside the arena: what this process costs beyond the KV memory."""
        return self.pss - self.pss_arena


def _kind(path: str) -> str:
    if path.startswith(ARENA_PREFIX):
        return "arena"
    if not path or path.startswith("["):
        return "anon"
    if ".so" in Path(path).name:
        return "libs"
    return "files"


def read_memory(name: str, pid: int) -> ProcessMemory:
    """``pid``'s memory from ``/proc/PID/smaps`` (one pass over its mappings)."""
    sums = {"rss": 0, "pss": 0, "uss": 0, "arena": 0, "anon": 0, "libs": 0, "files": 0}
    kind = "anon"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if MAPPING.match(line):
                parts = line.split(None, 5)
                kind = _kind(parts[5].strip() if len(parts) > 5 else "")
                continue
            key, _, value = line.partition(":")
            if not value.rstrip().endswith("kB"):
                continue
            size = int(value.split()[0]) * 1024
            if key == "Rss":
                sums["rss"] += size
            elif key == "Pss":
                sums["pss"] += size
                sums[kind] += size
            elif key in ("Private_Clean", "Private_Dirty"):
                sums["uss"] += size
    return ProcessMemory(
        name,
        pid,
        sums["rss"],
        sums["pss"],
        sums["uss"],
        sums["arena"],
        sums["anon"],
        sums["libs"],
        sums["files"],
    )


def started_processes(log_text: str) -> dict[str, int]:
    """The launcher's children, name -> pid, from its ``started NAME (pid N)`` lines
    (the last start of a name wins: a restarted runner)."""
    found = {}
    for m in STARTED.finditer(log_text):
        name = m.group(1).removeprefix("runner ")
        found[name] = int(m.group(2))
    return found


def greedy_texts(base_url: str, models: list[str]) -> dict[str, list[str]]:
    """Each model's greedy completion of every prompt."""
    out: dict[str, list[str]] = {}
    with httpx.Client(base_url=base_url, timeout=600, trust_env=False) as client:
        for model in models:
            texts = []
            for prompt in PROMPTS:
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                resp = client.post("/v1/completions", json=body)
                resp.raise_for_status()
                texts.append(resp.json()["choices"][0]["text"])
            out[model] = texts
    return out


def served_weight_bytes(base_url: str) -> dict[str, int]:
    """Served model instance -> its weight bytes (``/get_server_info``)."""
    info = httpx.get(base_url + "/get_server_info", timeout=60, trust_env=False).json()
    out = {}
    for m in info["served_models"]:
        instance = m["name"] if m.get("version", 1) == 1 else f"{m['name']}@v{m['version']}"
        out[instance] = int(m["info"].get("weight_bytes", 0))
    return out


def measure(args: argparse.Namespace, log_path: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    server = launch_radixmux(server_args(args), log_path, START_TIMEOUT_S)
    start_s = time.monotonic() - t0
    try:
        texts = greedy_texts(server.base_url, [parse_model_arg(m).name for m in args.model])
        weights = served_weight_bytes(server.base_url)
        time.sleep(args.settle_s)  # let the processes go idle after the requests
        pids = {"launcher": server.pid, **started_processes(log_path.read_text())}
        procs = [read_memory(name, pid) for name, pid in pids.items()]
    finally:
        server.stop()
    for p in procs:
        p.weight_bytes = weights.get(p.name.partition("#")[0], 0)
    return {
        "command": " ".join(["launch.py", *server_args(args)]),
        "start_seconds": start_s,
        "processes": [{**dataclasses.asdict(p), "own": p.own} for p in procs],
        "texts": texts,
    }


def server_args(args: argparse.Namespace) -> list[str]:
    models = [x for m in args.model for x in ("--model", m)]
    return [
        *models,
        "--dtype",
        args.dtype,
        "--kv-cache-bytes",
        str(args.kv_cache_bytes),
        *args.server_arg,
    ]


def format_table(report: dict[str, Any]) -> str:
    head = "process            RSS     PSS     USS   arena    anon    libs   files  weights  own/w"
    lines = [head]
    for p in report["processes"]:
        ratio = f"{p['own'] / p['weight_bytes']:.2f}" if p["weight_bytes"] else ""
        cells = [p[k] / MB for k in ("rss", "pss", "uss", "pss_arena", "pss_anon")]
        cells += [p[k] / MB for k in ("pss_libs", "pss_files", "weight_bytes")]
        lines.append(f"{p['name']:<16}" + "".join(f"{c:8.0f}" for c in cells) + f"{ratio:>7}")
    total = sum(p["pss"] for p in report["processes"]) / MB
    lines.append(f"total PSS {total:.0f} MB (MB = MiB; own = PSS outside the arena)")
    return "\n".join(lines)


def compare_texts(report: dict[str, Any], expected_path: Path) -> list[str]:
    """Models and prompts whose greedy text differs from an earlier result's."""
    expected = json.loads(expected_path.read_text())["texts"]
    diffs = []
    for model, texts in report["texts"].items():
        for i, (got, want) in enumerate(zip(texts, expected.get(model, []), strict=False)):
            if got != want:
                diffs.append(f"{model} prompt {i}: {got!r} != {want!r}")
    return diffs


def plot(report: dict[str, Any], path: Path) -> None:
    """Stacked PSS per process (arena, anonymous, libraries, files), weights marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    procs = report["processes"]
    names = [p["name"] for p in procs]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottom = [0.0] * len(procs)
    for key, label in (
        ("pss_anon", "anonymous"),
        ("pss_libs", "libraries"),
        ("pss_files", "files"),
        ("pss_arena", "KV arena share"),
    ):
        vals = [p[key] / MB for p in procs]
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, p in enumerate(procs):
        if p["weight_bytes"]:
            w = p["weight_bytes"] / MB
            ax.hlines(w, i - 0.4, i + 0.4, colors="black", linestyles="dashed")
            ax.text(i, w, "weights", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("PSS (MiB)")
    ax.set_title(report["command"], fontsize=8)
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", help="model to serve (repeat); default two")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    p.add_argument(
        "--server-arg", action="append", default=[], help="one more launch.py argument (repeat)"
    )
    p.add_argument("--settle-s", type=float, default=2.0)
    p.add_argument("--expect", type=Path, help="an earlier result: its greedy texts must match")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/memory-<time>.json)")
    args = p.parse_args(argv)
    args.model = args.model or ["smollm2", "gemma3-270m"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    report = measure(args, RESULTS_DIR / f"memory-{stamp}.log")
    print(format_table(report))
    out = write_json(report, args.out, "memory")
    png = out.with_suffix(".png")
    plot(report, png)
    print(f"wrote {out} and {png}")
    if args.expect is not None:
        diffs = compare_texts(report, args.expect)
        print("greedy texts: " + ("all equal to " + str(args.expect) if not diffs else "DIFFER"))
        for d in diffs:
            print("  " + d)
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
