"""Deterministic serving workloads: shared-prefix groups, multi-turn chats, a shifting model mix.

Every workload is a list of :class:`Session`: one or more turns sent to one
model in order, each turn resending everything before it. Single-shot
workloads are sessions of one turn. Prompts are text built from a word list
taken out of the tokenizer's vocabulary (words that are one token after a
space), so a prompt of N words is about N tokens for SmolLM2 and every peer
receives exactly the same text; the token counts reported come from the
servers' ``usage`` fields, never from this estimate.

The generated-shared-prefix parameters follow SGLang's ``bench_serving``
(``--gsp-num-groups``, ``--gsp-prompts-per-group``, ``--gsp-system-prompt-len``,
``--gsp-question-len``, ``--gsp-output-len``) with defaults scaled to a 2-core CPU.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

WORKLOADS = ("generated-shared-prefix", "multi-turn", "multi-model-shift", "multi-tenant")
_WORD = re.compile(r"[a-z]{3,9}")
# GPT-2 style byte-level BPE marks a leading space with 'Ġ', SentencePiece with '▁'.
_SPACE_MARKS = ("Ġ", "▁")


@dataclass(frozen=True)
class Session:
    """Turns sent to one model one after another; each turn resends the conversation so far."""

    model: str
    system: str
    turns: tuple[str, ...]
    max_tokens: int
    group: int = 0
    phase: int = 0


@dataclass(frozen=True)
class GSPParams:
    """SGLang's generated-shared-prefix knobs plus group popularity and order."""

    num_groups: int = 8
    prompts_per_group: int = 8
    system_prompt_len: int = 512
    question_len: int = 32
    output_len: int = 16
    distribution: str = "uniform"  # or "zipf": request i's group drawn by 1/rank**alpha
    zipf_alpha: float = 1.0
    shuffle: bool = False


@dataclass(frozen=True)
class MultiTurnParams:
    """``num_conversations`` chats of ``turns`` user messages over ``num_groups`` system prompts."""

    num_conversations: int = 8
    turns: int = 4
    num_groups: int = 2
    system_prompt_len: int = 256
    question_len: int = 32
    output_len: int = 16


@dataclass(frozen=True)
class ShiftParams:
    """Two models; phase k sends ``shares[k]`` of its requests to the first model.

    Requests are split evenly over the phases; each model has ``groups_per_model``
    system prompts, drawn uniformly per request.
    """

    num_requests: int = 48
    shares: tuple[float, ...] = (0.8, 0.2)
    groups_per_model: int = 4
    system_prompt_len: int = 384
    question_len: int = 32
    output_len: int = 16


@dataclass(frozen=True)
class TenantParams:
    """N models (fine-tunes of one base, one per tenant) whose popularity moves phase by phase.

    In phase k each request picks its model by zipf rank, the ranking rotated so the
    hottest model moves by ``n / phases`` models per phase (every model is the hottest
    once when ``phases == n``). Each model has ``private_groups`` system prompts of its
    own; with probability ``shared_fraction`` a request instead uses one of
    ``shared_groups`` system prompts that every model receives (the same text: a
    common preamble, whose lower-layer KV fine-tunes with frozen lower layers can share).
    """

    num_requests: int = 96
    phases: int = 4
    zipf_alpha: float = 1.5
    private_groups: int = 3  # + 1 shared: 4 x 384 prefix tokens per model
    shared_groups: int = 1
    shared_fraction: float = 0.3
    system_prompt_len: int = 384
    question_len: int = 32
    output_len: int = 16


@dataclass
class WordSource:
    """Random text from a fixed, sorted word list; one RNG per use keeps workloads independent."""

    words: Sequence[str]
    rng: random.Random = field(default_factory=random.Random)

    def text(self, n: int) -> str:
        """``n`` words, about ``n`` tokens for the tokenizer the list came from."""
        return " ".join(self.rng.choice(self.words) for _ in range(n))


@lru_cache(maxsize=8)
def vocabulary_words(tokenizer_path: str) -> tuple[str, ...]:
    """Lower-case words that the tokenizer at ``tokenizer_path`` holds as one token after a space.

    Sorted, so the same tokenizer always gives the same list (vocab dict order is
    not guaranteed across library versions).
    """
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(tokenizer_path).get_vocab()
    words = sorted(
        {
            tok[1:]
            for tok in vocab
            if tok[:1] in _SPACE_MARKS and _WORD.fullmatch(tok[1:]) is not None
        }
    )
    if len(words) < 256:
        raise ValueError(f"tokenizer {tokenizer_path} has too few whole-word tokens ({len(words)})")
    return tuple(words)


def resolve_tokenizer(source: str) -> Path:
    """A tokenizer folder: an embedded short name (fetched once) or a folder path."""
    path = Path(source)
    if path.is_dir():
        return path
    from radixmux.model_runners.fetch import fetch

    return fetch(source, progress=False)


def zipf_weights(n: int, alpha: float) -> list[float]:
    """Normalised 1/rank**alpha for ranks 1..n (group 0 is the hottest)."""
    if alpha <= 0:
        raise ValueError("zipf alpha must be > 0")
    raw = [1.0 / (rank**alpha) for rank in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def generated_shared_prefix(
    words: Sequence[str], model: str, p: GSPParams, seed: int = 0
) -> list[Session]:
    """SGLang's generated-shared-prefix: ``num_groups`` system prompts, questions per group.

    Uniform popularity gives every group exactly ``prompts_per_group`` requests in
    group order (as SGLang does without shuffling); zipf draws each of the
    ``num_groups * prompts_per_group`` requests' group by rank. ``shuffle`` randomises
    the order, which is what makes schedule policies matter.
    """
    src = WordSource(words, random.Random(seed))
    systems = [src.text(p.system_prompt_len) for _ in range(p.num_groups)]
    total = p.num_groups * p.prompts_per_group
    if p.distribution == "uniform":
        groups = [i // p.prompts_per_group for i in range(total)]
    elif p.distribution == "zipf":
        # Its own RNG, so the prompts' text is identical in both modes.
        pick = random.Random(seed + 1)
        groups = sorted(
            pick.choices(range(p.num_groups), zipf_weights(p.num_groups, p.zipf_alpha), k=total)
        )
    else:
        raise ValueError(f"group distribution must be uniform or zipf, not {p.distribution!r}")
    sessions = [
        Session(model, systems[g], (src.text(p.question_len),), p.output_len, group=g)
        for g in groups
    ]
    if p.shuffle:
        random.Random(seed + 2).shuffle(sessions)
    return sessions


def multi_turn(
    words: Sequence[str], model: str, p: MultiTurnParams, seed: int = 0
) -> list[Session]:
    """Chats: each conversation takes a system prompt round-robin and ``turns`` user messages."""
    src = WordSource(words, random.Random(seed))
    systems = [src.text(p.system_prompt_len) for _ in range(p.num_groups)]
    return [
        Session(
            model,
            systems[c % p.num_groups],
            tuple(src.text(p.question_len) for _ in range(p.turns)),
            p.output_len,
            group=c % p.num_groups,
        )
        for c in range(p.num_conversations)
    ]


def multi_model_shift(
    words: Sequence[str], models: Sequence[str], p: ShiftParams, seed: int = 0
) -> list[Session]:
    """Requests to two models whose share moves phase by phase (e.g. 80/20, then 20/80).

    Exact counts per phase (round(share * phase size) to the first model), shuffled
    within the phase, so two runs with one seed send the same sequence.
    """
    if len(models) != 2:
        raise ValueError(f"multi-model-shift needs two models, got {list(models)}")
    src = WordSource(words, random.Random(seed))
    systems = {
        m: [src.text(p.system_prompt_len) for _ in range(p.groups_per_model)] for m in models
    }
    order = random.Random(seed + 1)
    n_phases = len(p.shares)
    sessions: list[Session] = []
    for phase, share in enumerate(p.shares):
        size = p.num_requests // n_phases + (1 if phase < p.num_requests % n_phases else 0)
        first = round(share * size)
        targets = [models[0]] * first + [models[1]] * (size - first)
        order.shuffle(targets)
        for model in targets:
            g = order.randrange(p.groups_per_model)
            turn = (src.text(p.question_len),)
            sessions.append(Session(model, systems[model][g], turn, p.output_len, g, phase))
    return sessions


def multi_tenant(
    words: Sequence[str], models: Sequence[str], p: TenantParams, seed: int = 0
) -> list[Session]:
    """Requests to ``models`` with per-model and shared system prompts and a rotating hot model.

    Deterministic for one seed. Group ids: ``0..private_groups-1`` a model's own
    prompts, ``private_groups + j`` shared prompt ``j``.
    """
    n = len(models)
    if n < 2 or p.phases < 1:
        raise ValueError(f"multi-tenant needs two models or more and a phase, got {list(models)}")
    src = WordSource(words, random.Random(seed))
    shared = [src.text(p.system_prompt_len) for _ in range(p.shared_groups)]
    private = {m: [src.text(p.system_prompt_len) for _ in range(p.private_groups)] for m in models}
    pick = random.Random(seed + 1)
    ranked = zipf_weights(n, p.zipf_alpha)
    sessions: list[Session] = []
    for phase in range(p.phases):
        hot = phase * n // p.phases
        weights = [ranked[(i - hot) % n] for i in range(n)]
        size = p.num_requests // p.phases + (1 if phase < p.num_requests % p.phases else 0)
        for _ in range(size):
            model = models[pick.choices(range(n), weights)[0]]
            if shared and pick.random() < p.shared_fraction:
                g = pick.randrange(len(shared))
                system, group = shared[g], p.private_groups + g
            else:
                group = pick.randrange(p.private_groups)
                system = private[model][group]
            turn = (src.text(p.question_len),)
            sessions.append(Session(model, system, turn, p.output_len, group, phase))
    return sessions


def warmup_sessions(
    words: Sequence[str], models: Sequence[str], n: int, seed: int
) -> list[Session]:
    """Short prompts with a seed of their own: they load code paths, not the measured prefixes."""
    src = WordSource(words, random.Random(seed + 7919))
    return [Session(models[i % len(models)], "", (src.text(24),), 4, group=-1) for i in range(n)]
