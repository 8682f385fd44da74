"""Structured output in the runner, on both embedded models: every constrained
output follows its grammar (greedy and at temperature 1, many seeds), a
constrained row leaves its unconstrained batch-mates' tokens unchanged, the
logprobs are those of the masked distribution, and a matcher the runner lost
is rebuilt from the output ids the scheduler sends."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import numpy as np
import pytest

from radixmux.memory.arena import KVArena
from radixmux.protocol import (
    Constraint,
    ForwardBatch,
    SamplingParams,
    SeqOutput,
    pack_ids,
)
from tests.conftest import SlotPool, make_runner, seq

pytestmark = pytest.mark.timeout(600)

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "boolean"},
        "mood": {"enum": ["calm", "busy", "odd"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["answer", "mood", "n"],
    "additionalProperties": False,
}
JSON = Constraint("json", json.dumps(SCHEMA), field="response_format")
REGEX = Constraint("regex", r"(yes|no), [0-9]{1,3}\.", field="regex")
EBNF = Constraint("ebnf", 'root ::= "color: " ("red" | "green" | "blue")', field="ebnf")


@pytest.fixture(scope="module")
def grammar_arena() -> Iterator[KVArena]:
    a = KVArena.create(num_blocks=96, block_bytes=1 << 20)
    try:
        yield a
    finally:
        a.destroy()


def _tokens(outs: list[SeqOutput]) -> list[int]:
    """Every output token: each step's sampled one and those the grammar forced."""
    return [t for o in outs for t in (o.token_id, *(o.forced_ids or ()))]


def _generate(runner, prompts: dict[str, tuple[list[int], SamplingParams]], steps: int, pool):
    """Run ``prompts`` together to the end (or ``steps``), as the scheduler
    would: rid -> each step's output."""
    slots: dict[str, list[int]] = {rid: [] for rid in prompts}
    out: dict[str, list[SeqOutput]] = {rid: [] for rid in prompts}
    new = {rid: list(p) for rid, (p, _) in prompts.items()}
    live = set(prompts)
    for _ in range(steps):
        if not live:
            break
        batch = []
        for rid in sorted(live):
            slots[rid] += pool.take(len(new[rid]))
            done = _tokens(out[rid])
            batch.append(
                seq(
                    rid,
                    new[rid],
                    list(slots[rid]),
                    len(slots[rid]) - len(new[rid]),
                    params=prompts[rid][1],
                    output_ids=pack_ids(done),
                    num_output=len(done),
                )
            )
        result = runner.forward(ForwardBatch(0, batch))
        assert result.error is None, result.error
        for o in result.outputs:
            assert o.error is None, o.error
            out[o.rid].append(o)
            new[o.rid] = [o.token_id, *(o.forced_ids or ())]
            if o.finish_reason is not None:
                live.discard(o.rid)
    return out


def _text(tok, outs: list[SeqOutput]) -> str:
    return tok.decode(_tokens(outs), skip_special_tokens=True)


def _valid(c: Constraint, text: str) -> bool:
    if c is JSON:
        try:
            doc = json.loads(text)
        except ValueError:
            return False
        return (
            set(doc) == {"answer", "mood", "n"}
            and isinstance(doc["answer"], bool)
            and doc["mood"] in ("calm", "busy", "odd")
            and isinstance(doc["n"], int)
            and 0 <= doc["n"] <= 99
        )
    if c is REGEX:
        return re.fullmatch(r"(yes|no), [0-9]{1,3}\.", text) is not None
    return text in ("color: red", "color: green", "color: blue")


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_every_constrained_output_follows_its_grammar(name, real_models, grammar_arena):
    loaded = real_models[name]
    runner = make_runner(loaded, grammar_arena)
    tok = loaded.tokenizer
    prompt = tok("Answer in the format asked. Is the sky blue?").input_ids
    plain = SamplingParams(max_new_tokens=12)
    alone = _generate(runner, {"u": (prompt, plain)}, 12, SlotPool(runner.num_slots, 1))

    work = {"u": (prompt, plain)}
    for k, c in enumerate((JSON, REGEX, EBNF)):
        work[f"greedy{k}"] = (prompt, SamplingParams(max_new_tokens=60, constraint=c))
        for s in range(3):
            hot = SamplingParams(temperature=1.0, seed=s, max_new_tokens=60, constraint=c)
            work[f"t{k}-{s}"] = (prompt, hot)
    out = _generate(runner, work, 60, SlotPool(runner.num_slots, 2))
    # The unconstrained row is the same with or without constrained batch-mates.
    assert _tokens(out["u"]) == _tokens(alone["u"])
    for rid, outs in out.items():
        c = work[rid][1].constraint
        if c is None:
            continue
        text = _text(tok, outs)
        assert outs[-1].finish_reason == "stop", (rid, text)
        assert _valid(c, text), (name, rid, text)


def test_logprobs_are_those_of_the_masked_distribution(real_models, grammar_arena):
    loaded = real_models["smollm2"]
    runner = make_runner(loaded, grammar_arena)
    prompt = loaded.tokenizer("Pick a color.").input_ids
    p = SamplingParams(max_new_tokens=8, logprobs=True, top_logprobs=5, constraint=EBNF)
    out = _generate(runner, {"a": (prompt, p)}, 8, SlotPool(runner.num_slots, 3))["a"]
    first = out[0]  # "color" is forced: all the mass is on the grammar's tokens
    allowed_mass = float(np.exp([lp for _, lp in first.top_logprobs]).sum())
    assert allowed_mass == pytest.approx(1.0, abs=1e-3)
    assert first.logprob == pytest.approx(first.top_logprobs[0][1], abs=1e-5)


def test_jump_forward_appends_forced_tokens_and_saves_steps(real_models, grammar_arena):
    loaded = real_models["gemma3-270m"]
    tok = loaded.tokenizer
    prompt = tok("Answer in the format asked. Is the sky blue?").input_ids
    p = SamplingParams(max_new_tokens=60, constraint=JSON)
    steps = {}
    for jf in (True, False):
        runner = make_runner(loaded, grammar_arena)
        runner.jump_forward = jf
        outs = _generate(runner, {"j": (prompt, p)}, 60, SlotPool(runner.num_slots, 6))["j"]
        assert outs[-1].finish_reason == "stop" and _valid(JSON, _text(tok, outs))
        assert any(o.forced_ids for o in outs) == jf
        steps[jf] = len(outs)
    # '{"answer": ', '"mood": "', '"n": ' and '}' are forced: far fewer steps.
    assert steps[True] < steps[False] - 5, steps
    # A row that asks for logprobs samples every token (a forced one has none).
    runner = make_runner(loaded, grammar_arena)
    lp = SamplingParams(max_new_tokens=60, constraint=JSON, logprobs=True)
    outs = _generate(runner, {"l": (prompt, lp)}, 60, SlotPool(runner.num_slots, 7))["l"]
    assert not any(o.forced_ids for o in outs) and all(o.logprob is not None for o in outs)


def test_a_lost_matcher_is_rebuilt_from_the_output_ids(real_models, grammar_arena):
    loaded = real_models["smollm2"]
    runner = make_runner(loaded, grammar_arena)
    tok = loaded.tokenizer
    prompt = tok("Is it raining?").input_ids
    p = SamplingParams(max_new_tokens=40, constraint=REGEX)
    whole = _tokens(_generate(runner, {"r": (prompt, p)}, 40, SlotPool(runner.num_slots, 4))["r"])
    # A fresh runner (as after a restart) continuing a request two tokens in
    # rebuilds the matcher from the ids and goes on exactly as before.
    again = make_runner(loaded, grammar_arena)
    pool = SlotPool(again.num_slots, 5)
    head = whole[:2]
    ctx = prompt + head
    batch = ForwardBatch(
        1,
        [seq("r", ctx, pool.take(len(ctx)), 0, params=p, output_ids=pack_ids(head), num_output=2)],
    )
    o = again.forward(batch).outputs[0]
    assert o.error is None and o.token_id == whole[2]
    # Output ids that break the grammar fail that row alone, with a reason.
    bad = tok.encode("maybe", add_special_tokens=False)
    ctx = prompt + bad
    batch = ForwardBatch(
        2,
        [
            seq(
                "x", ctx, pool.take(len(ctx)), 0, params=p, output_ids=pack_ids(bad),
                num_output=len(bad),
            )
        ],
    )  # fmt: skip
    o = again.forward(batch).outputs[0]
    assert o.token_id == -1 and "grammar" in (o.error or "")
