"""``vs_vllm --sweep``: seeded random shapes over the issue's ranges, and their worst rows.

A fixed grid only shows the shapes somebody picked. The sweep draws ``N``
shapes from a seed (``random.Random(seed)``, so the same seed gives the same
shapes on every machine) over the ranges the goal is stated for:

* the dataset, vLLM's ``prefix_repetition`` or ``random``, each with
  probability 1/2;
* concurrency 1-64, prompt length 128-4,000 tokens and output length 16-512
  tokens, each log-uniform (as many shapes below 8 clients as from 8 to 64);
* for ``prefix_repetition``: the shared prefix a uniform 50-95% of the
  prompt (the rest is each request's own suffix) and 1, 2, 4 or 8 prefixes.

A shape is drawn again, whole, until it fits the server: prompt + output
within the model's context, and the K/V of a full batch within
``KV_FILL`` of the KV bytes (``prefix_repetition``'s prefixes counted once
each, as both engines cache them; every sequence's own tokens and output
per client).

Prompts per row (``num_prompts``): two per client and at least
``MIN_PROMPTS``, cut so that the row's tokens (prompt tokens not shared,
``prefix_repetition``'s prefixes once, plus every output token) stay within
``TOKEN_BUDGET``, but never below one per client (fewer would not load every
client); ``--quick`` takes one per client (at least 2). For
``prefix_repetition`` it is then rounded up to a multiple of the prefix
count (vLLM sends ``num_prompts // num_prefixes`` per prefix).

The goal per row is the issue's: output throughput at least
``THROUGHPUT_GOALS`` x vLLM's, TPOT p50 and TTFT p50 not above vLLM's; the
report names the worst row per ratio, with its shape.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from bench.verdicts import verdict_line, verdict_of

DATASET_KINDS = ("prefix_repetition", "random")
THROUGHPUT_GOALS = {"prefix_repetition": 1.5, "random": 1.2}
CONCURRENCY_RANGE = (1, 64)
PROMPT_RANGE = (128, 4000)
OUTPUT_RANGE = (16, 512)
PREFIX_SHARE_RANGE = (0.5, 0.95)
NUM_PREFIXES = (1, 2, 4, 8)
# K/V of a full batch at most this share of the KV bytes: block rounding and
# the tokens the client's decode/re-encode adds stay inside.
KV_FILL = 0.8
MIN_PROMPTS = 8
# ~1-3 minutes a row per engine on 2 cores (prefill ~1k tok/s, decode the rest).
TOKEN_BUDGET = 32_768
MAX_DRAWS = 10_000  # redraws of one shape before the limits are called too tight


@dataclass(frozen=True)
class ShapeLimits:
    """What a drawn shape must fit: the model's context and the KV cache, in tokens."""

    context: int
    kv_tokens: int


@dataclass(frozen=True)
class SweepShape:
    """One drawn row of the sweep: vLLM's dataset, its lengths, the load."""

    index: int
    dataset: str  # vLLM's --dataset-name: "prefix_repetition" or "random"
    concurrency: int
    prompt_len: int  # tokens of each prompt (prefix + suffix for prefix_repetition)
    output_len: int
    prefix_len: int  # the shared part (0 for random)
    num_prefixes: int  # distinct prefixes (0 for random)
    num_prompts: int
    quick_prompts: int

    @property
    def name(self) -> str:
        """The row's name in tables and result files (unique within a sweep)."""
        return f"s{self.index:02d}_{'prefix' if self.num_prefixes else 'random'}"

    @property
    def suffix_len(self) -> int:
        return self.prompt_len - self.prefix_len

    @property
    def throughput_goal(self) -> float:
        return THROUGHPUT_GOALS[self.dataset]

    def describe(self, quick: bool = False) -> str:
        """The shape in one phrase, e.g. ``prefix_repetition c=8 in 4x900+300 out 64 n=16``
        (``n``: the prompts a run sends, ``quick`` or not)."""
        prompt = (
            f"{self.num_prefixes}x{self.prefix_len}+{self.suffix_len}"
            if self.num_prefixes
            else str(self.prompt_len)
        )
        n = self.quick_prompts if quick else self.num_prompts
        return f"{self.dataset} c={self.concurrency} in {prompt} out {self.output_len} n={n}"


def _shared_and_own(prompt: int, output: int, prefix: int, prefixes: int) -> tuple[int, int]:
    """Tokens held once (the prefixes) and per request (own prompt tokens and output)."""
    return prefixes * prefix, prompt - prefix + output


def fits(shape: SweepShape, limits: ShapeLimits) -> bool:
    """Prompt + output within the context, a full batch's K/V within ``KV_FILL``."""
    shared, own = _shared_and_own(
        shape.prompt_len, shape.output_len, shape.prefix_len, shape.num_prefixes
    )
    live = shared + shape.concurrency * own
    return (
        shape.prompt_len + shape.output_len <= limits.context and live <= KV_FILL * limits.kv_tokens
    )


def num_prompts(concurrency: int, shared: int, own: int, prefixes: int, quick: bool) -> int:
    """Prompts of one row by the module's rule: ``shared`` tokens are prefilled once
    per row, ``own`` per request (its own prompt tokens and its output)."""
    if quick:
        n = max(concurrency, 2)
    else:
        budget = max(0, TOKEN_BUDGET - shared) // max(own, 1)
        n = max(concurrency, min(max(2 * concurrency, MIN_PROMPTS), budget))
    step = max(prefixes, 1)
    return -(-n // step) * step


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


def _draw_one(rng: random.Random, index: int) -> SweepShape:
    dataset = rng.choice(DATASET_KINDS)
    concurrency = _log_uniform(rng, *CONCURRENCY_RANGE)
    prompt = _log_uniform(rng, *PROMPT_RANGE)
    output = _log_uniform(rng, *OUTPUT_RANGE)
    prefix = prefixes = 0
    if dataset == "prefix_repetition":
        prefix = min(prompt - 1, round(prompt * rng.uniform(*PREFIX_SHARE_RANGE)))
        prefixes = rng.choice(NUM_PREFIXES)
    shared, own = _shared_and_own(prompt, output, prefix, prefixes)
    return SweepShape(
        index=index,
        dataset=dataset,
        concurrency=concurrency,
        prompt_len=prompt,
        output_len=output,
        prefix_len=prefix,
        num_prefixes=prefixes,
        num_prompts=num_prompts(concurrency, shared, own, prefixes, quick=False),
        quick_prompts=num_prompts(concurrency, shared, own, prefixes, quick=True),
    )


def draw_shapes(count: int, seed: int, limits: ShapeLimits) -> list[SweepShape]:
    """``count`` shapes from ``seed``, each redrawn until it ``fits`` ``limits``.

    Raises ValueError when no shape fits after ``MAX_DRAWS`` tries (KV bytes
    too small for even the smallest shapes).
    """
    rng = random.Random(seed)
    shapes = []
    for index in range(count):
        for _ in range(MAX_DRAWS):
            shape = _draw_one(rng, index)
            if fits(shape, limits):
                shapes.append(shape)
                break
        else:
            raise ValueError(f"no shape fits {limits} after {MAX_DRAWS} draws")
    return shapes


# ---- the report -----------------------------------------------------------------------
class RowVerdict(Protocol):
    """What the summary reads of one radixmux configuration's verdict on one row."""

    dataset: str
    engine: str
    throughput_ratio: float
    ttft_ratio: float
    tpot_ratio: float
    passed: bool | None
    misses: list[str]  # why it missed (or could not be judged)


# (title, attribute, worst is the highest): the ratios the goal bounds.
RATIOS = (
    ("output tok/s", "throughput_ratio", False),
    ("TPOT p50", "tpot_ratio", True),
    ("TTFT p50", "ttft_ratio", True),
)


@dataclass(frozen=True)
class WorstRow:
    """The row farthest on the wrong side of one ratio, for one radixmux configuration."""

    metric: str  # a title of RATIOS (the throughput's with its dataset)
    ratio: float
    row: RowVerdict


def worst_rows(shapes: Sequence[SweepShape], verdicts: Sequence[RowVerdict]) -> list[WorstRow]:
    """Per radixmux configuration and ratio, the worst row (rows without that figure
    left out): the lowest throughput ratio per dataset (each has its own goal), the
    highest TPOT and TTFT ratios over all rows."""
    kind = {s.name: s.dataset for s in shapes}
    out = []
    for engine in dict.fromkeys(v.engine for v in verdicts):
        mine = [v for v in verdicts if v.engine == engine]
        for title, attr, highest in RATIOS:
            groups = [(title, mine)]
            if attr == "throughput_ratio":
                groups = [
                    (f"{title} ({k})", [v for v in mine if kind[v.dataset] == k])
                    for k in DATASET_KINDS
                ]
            for label, rows in groups:
                rows = [v for v in rows if not math.isnan(getattr(v, attr))]
                if rows:
                    pick = max if highest else min
                    row = pick(rows, key=lambda v, a=attr: getattr(v, a))
                    out.append(WorstRow(label, getattr(row, attr), row))
    return out


def overall(verdicts: Sequence[RowVerdict]) -> bool | None:
    """MISS if any row misses, else n/a if any row could not be judged, else PASS."""
    if any(v.passed is False for v in verdicts):
        return False
    return None if not verdicts or any(v.passed is None for v in verdicts) else True


def _x(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}x"


def format_sweep(
    shapes: Sequence[SweepShape], verdicts: Sequence[RowVerdict], quick: bool = False
) -> str:
    """Each row's shape, ratios and verdict (a row vLLM did not run: its shape alone);
    then the worst rows and the overall verdict per radixmux configuration."""
    by_name = {s.name: s for s in shapes}
    head = f"{'row':<10} {'shape':<50} {'engine':<24} {'tok/s':>7} {'TPOT':>7} {'TTFT':>7}  goal"
    lines = [head, "-" * len(head)]
    for shape in shapes:
        mine = [v for v in verdicts if v.dataset == shape.name]
        if not mine:
            lines.append(f"{shape.name:<10} {shape.describe(quick):<50} (not compared)")
        for v in mine:
            lines.append(
                f"{v.dataset:<10} {shape.describe(quick)[:50]:<50} {v.engine[:24]:<24} "
                f"{_x(v.throughput_ratio):>7} {_x(v.tpot_ratio):>7} {_x(v.ttft_ratio):>7}  "
                f"{verdict_of(v.passed)} (>= {shape.throughput_goal:.1f}x)"
                + (f": {'; '.join(v.misses)}" if v.misses else "")
            )
    if verdicts:
        lines.append("")
    for w in worst_rows(shapes, verdicts):
        lines.append(
            f"worst {w.metric:<32} {_x(w.ratio):>7}  {w.row.engine}: {w.row.dataset} "
            f"({by_name[w.row.dataset].describe(quick)}) {verdict_of(w.row.passed)}"
        )
    for engine in dict.fromkeys(v.engine for v in verdicts):
        mine = [v for v in verdicts if v.engine == engine]
        passed = sum(v.passed is True for v in mine)
        lines.append(
            verdict_line(overall(mine), f"sweep, {engine}: {passed} of {len(mine)} rows pass")
        )
    return "\n".join(lines)


def plot_ratios(
    shapes: Sequence[SweepShape], verdicts: Sequence[RowVerdict], path: Path
) -> Path | None:
    """One panel per ratio, one bar per row and radixmux configuration, the goal
    drawn over each row (a bar on the wrong side of its mark misses)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s.name for s in shapes if any(v.dataset == s.name for v in verdicts)]
    if not names:
        return None
    goals = {s.name: s.throughput_goal for s in shapes}
    engines = list(dict.fromkeys(v.engine for v in verdicts))
    fig, axes = plt.subplots(len(RATIOS), 1, figsize=(max(8, 0.5 * len(names) + 3), 9))
    width = 0.8 / len(engines)
    for ax, (title, attr, _) in zip(axes, RATIOS, strict=True):
        for k, engine in enumerate(engines):
            by_row = {v.dataset: getattr(v, attr) for v in verdicts if v.engine == engine}
            xs = [i + (k - (len(engines) - 1) / 2) * width for i in range(len(names))]
            ys = [0.0 if math.isnan(by_row.get(n, math.nan)) else by_row[n] for n in names]
            ax.bar(xs, ys, width=width, label=engine)
        marks = [goals[n] for n in names] if attr == "throughput_ratio" else [1.0] * len(names)
        ax.scatter(
            range(len(names)), marks, marker="_", s=400, color="black", label="goal", zorder=3
        )
        if attr == "ttft_ratio":
            ax.set_yscale("log")  # queueing spreads TTFT ratios over orders of magnitude
        ax.set_xticks(range(len(names)), names, rotation=60, fontsize=7)
        ax.set_title(f"radixmux / vLLM {title} per row", fontsize=10)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
