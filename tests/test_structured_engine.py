"""Structured output through the whole runtime (tokenizer workers compile and
gate, the scheduler ships the constraint, runners mask), driven with the Python
client's ``constraint=``: outputs follow their grammars alongside unconstrained
requests, and a bad or slow grammar is a 400 naming its field while the
server keeps serving."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench.tiny_models import make_tiny_model_dir
from radixmux.protocol import Constraint
from radixmux.runtime.client.client import ClientError
from radixmux.runtime.client.engine import Engine

pytestmark = pytest.mark.timeout(600)

PATTERN = r"(yes|no), [0-9]{1,3}\."
REGEX = Constraint("regex", PATTERN, field="regex")
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["a", "b", "c"]}},
    "required": ["ok", "pick"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    folder: Path = make_tiny_model_dir(tmp_path_factory.mktemp("structured") / "tiny", seed=7)
    eng = Engine(
        model=[f"{folder},name=tiny"],
        kv_cache_bytes=16 << 20,
        kv_block_bytes=64 << 10,
        dtype="float32",
        # Ample for the grammars here (milliseconds; the tokenizer's tables,
        # built once, do not count), far short of the slow one below (seconds).
        grammar_compile_timeout=1.0,
    )
    try:
        yield eng
    finally:
        eng.shutdown()


def test_constrained_requests_follow_their_grammar_beside_plain_ones(engine: Engine) -> None:
    plain = {"max_tokens": 16, "temperature": 0.0}
    alone = engine.generate("The weather today", plain)[0]
    schema = Constraint("json", json.dumps(SCHEMA), field="response_format")
    prompts, params = ["The weather today"], [plain]
    for seed in range(6):
        c = REGEX if seed % 2 else schema
        prompts.append(f"Question {seed}:")
        params.append({"max_tokens": 40, "temperature": 1.0, "seed": seed, "constraint": c})
    outs = engine.generate(prompts, params)
    assert outs[0].text == alone.text  # batch-mates with grammars change nothing
    for p, out in zip(params[1:], outs[1:], strict=True):
        assert out.finish_reason == "stop", out
        if p["constraint"] is REGEX:
            assert re.fullmatch(PATTERN, out.text), out.text
        else:
            doc = json.loads(out.text)
            assert (
                isinstance(doc["ok"], bool) and doc["pick"] in "abc" and set(doc) == {"ok", "pick"}
            )


@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        (Constraint("regex", "[a-", field="regex"), "Unclosed"),
        (Constraint("ebnf", "root ::= missing", field="ebnf"), "not defined"),
        (Constraint("json", '{"type": "nonsense"}', field="json_schema"), "nonsense"),
    ],
)
def test_a_bad_grammar_is_a_400_naming_its_field(
    engine: Engine, constraint: Constraint, says: str
) -> None:
    with pytest.raises(ClientError) as err:
        engine.generate("x", {"max_tokens": 4, "constraint": constraint})
    assert err.value.status == 400 and err.value.param == constraint.field
    assert says in err.value.message


def test_a_grammar_too_slow_to_compile_is_refused_and_others_go_on(engine: Engine) -> None:
    # 100,000 alternatives: xgrammar needs several seconds for this automaton.
    words = "|".join(f"w{i:05d}x" for i in range(100_000))
    slow = Constraint("regex", f"({words})", field="regex")
    with ThreadPoolExecutor(1) as pool:
        refused = pool.submit(engine.generate, "x", {"max_tokens": 4, "constraint": slow})
        # The worker does not wait on the compile: plain requests go on meanwhile.
        plain = engine.generate(["still serving"] * 2, {"max_tokens": 4})
        assert all(p.finish_reason in ("length", "stop") for p in plain)
        with pytest.raises(ClientError) as err:
            refused.result(timeout=120)
    assert err.value.status == 400 and err.value.param == "regex"
    assert "longer than 1 s to compile" in err.value.message


def test_both_embedded_models_constrained_at_once() -> None:
    """SmolLM2 (49k tokens) and Gemma 3 (262k) each mask with their own
    tokenizer's grammar, in the same scheduler steps (a row given the other
    model's mask would produce ids outside the grammar, or text that fails it)."""
    schema = Constraint("json", json.dumps(SCHEMA), field="response_format")
    work = [("smollm2", REGEX), ("gemma", schema), ("smollm2", schema), ("gemma", REGEX)]
    with Engine(
        model=["smollm2", "gemma3-270m,name=gemma"],
        kv_cache_bytes=256 << 20,
        dtype="float32",
    ) as eng:

        def one(i: int) -> str:
            name, c = work[i]
            out = eng.generate("Answer briefly:", {"max_tokens": 48, "constraint": c}, model=name)
            assert out[0].finish_reason == "stop", out[0]
            return out[0].text

        with ThreadPoolExecutor(len(work)) as pool:
            together = list(pool.map(one, range(len(work))))
    for (_, c), text in zip(work, together, strict=True):
        if c is REGEX:
            assert re.fullmatch(PATTERN, text), text
        else:
            doc = json.loads(text)
            assert set(doc) == {"ok", "pick"} and doc["pick"] in ("a", "b", "c")
