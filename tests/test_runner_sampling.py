"""Sampling: greedy, temperature, top-k/p, min-p, penalties, seeds, logprobs, stops."""

from __future__ import annotations

import numpy as np
import torch
from conftest import SlotPool, make_runner, seq, tiny_model

from radixmux.model_runners import paged_decode
from radixmux.model_runners.sampling import apply_penalties, greedy_tokens, sample
from radixmux.protocol import ForwardBatch, SamplingParams

EMPTY = np.zeros(0, dtype=np.int64)


def draw(logits, params, outs=None):
    rows = logits.shape[0]
    return sample(logits, [params] * rows, outs or [EMPTY] * rows)


def test_greedy_and_top_k_one_pick_argmax():
    logits = torch.randn(64, 500)
    assert torch.equal(draw(logits, SamplingParams()).tokens, logits.argmax(-1))
    hot = SamplingParams(temperature=1.5, top_k=1)
    assert torch.equal(draw(logits, hot).tokens, logits.argmax(-1))


def test_greedy_bfloat16_rows_pick_what_float_argmax_picks():
    """Greedy rows with nothing else to do take the argmax of the bfloat16
    logits without widening them to float first (the kernel where it is
    built): the same index as the float path, ties to the first, -0 equal to
    +0, the first NaN over anything, whatever the vocabulary's length."""
    assert paged_decode.load()
    g = torch.Generator().manual_seed(0)
    for rows, vocab in [(1, 16), (3, 17), (15, 49152), (64, 4099)]:
        logits = (torch.randn(rows, vocab, generator=g) * 4).to(torch.bfloat16)
        expected = logits.float().max(-1).indices
        assert torch.equal(greedy_tokens(logits), expected), (rows, vocab)
        assert torch.equal(draw(logits, SamplingParams()).tokens, expected), (rows, vocab)
    odd = torch.zeros(6, 100, dtype=torch.bfloat16)
    odd[0, 50] = odd[0, 70] = 1  # a tie: the first
    odd[1] = -0.0
    odd[1, 40] = 0.0  # -0 == +0: index 0
    odd[2, 10] = float("inf")
    odd[2, 33] = odd[2, 90] = float("nan")  # NaN over inf, the first NaN
    odd[3] = float("-inf")  # all -inf: index 0
    odd[4, 99] = float("nan")  # in the tail past the last whole vector
    odd[5, 97] = odd[5, 98] = 5  # a tie in the tail
    assert greedy_tokens(odd).tolist() == [50, 0, 33, 0, 99, 97]
    assert torch.equal(greedy_tokens(odd), odd.float().max(-1).indices)
    # Strided rows (a slice of a batch's logits) read in place.
    assert torch.equal(greedy_tokens(logits[::2]), logits[::2].float().max(-1).indices)


def test_only_plain_greedy_rows_skip_the_float_path():
    """A penalty with outputs to count, a logit bias, logprobs or a sampled row
    send the batch through the float path, which must then change the pick."""
    logits = torch.tensor([[4.0, 3.9, -1.0, 0.5]], dtype=torch.bfloat16)
    outs = [np.array([0], dtype=np.int64)]
    assert sample(logits, [SamplingParams()], outs).tokens.tolist() == [0]
    assert sample(logits, [SamplingParams(presence_penalty=1.0)], outs).tokens.tolist() == [1]
    biased = SamplingParams(logit_bias=[(3, 9.0)])
    assert sample(logits, [biased], [EMPTY]).tokens.tolist() == [3]
    with_lp = sample(logits, [SamplingParams(logprobs=True)], [EMPTY])
    assert with_lp.tokens.tolist() == [0] and with_lp.logprobs is not None


def test_temperature_draws_follow_softmax():
    base = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    tokens = draw(base.repeat(20000, 1), SamplingParams(temperature=1.0)).tokens
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    assert (freq - base.softmax(-1)).abs().max() < 0.015
    # A low temperature sharpens towards the argmax.
    cold = draw(base.repeat(20000, 1), SamplingParams(temperature=0.3)).tokens
    assert (cold == 0).float().mean() > 0.95 > freq[0]


def test_top_k_top_p_min_p_restrict_support():
    base = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    probs = base.softmax(-1)
    many = base.repeat(5000, 1)
    k2 = draw(many, SamplingParams(temperature=1.0, top_k=2)).tokens
    assert set(k2.tolist()) == {0, 1}
    # top_p: smallest prefix whose mass reaches p.
    p = float(probs[:2].sum()) + 0.01
    tp = draw(many, SamplingParams(temperature=1.0, top_p=p)).tokens
    assert set(tp.tolist()) == {0, 1, 2}
    mp = draw(many, SamplingParams(temperature=1.0, min_p=0.5)).tokens
    allowed = set((probs >= 0.5 * probs.max()).nonzero()[:, 0].tolist())
    assert set(mp.tolist()) == allowed and len(allowed) < 6


def test_seed_is_deterministic_and_batch_independent():
    logits = torch.randn(1, 1000)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [int(draw(logits, seeded).tokens[0]) for _ in range(3)]
    assert len(set(alone)) == 1
    # The same request inside a batch of other (unseeded) requests.
    mixed = torch.cat([torch.randn(5, 1000), logits])
    params = [SamplingParams(temperature=1.0)] * 5 + [seeded]
    in_batch = sample(mixed, params, [EMPTY] * 6).tokens[-1]
    assert int(in_batch) == alone[0]
    # ...also when batch-mates use top-k / top-p (sorted or top-k code paths).
    for mate in (
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=5),
    ):
        pair = sample(torch.cat([logits, logits]), [mate, seeded], [EMPTY] * 2).tokens
        assert int(pair[1]) == alone[0]
    # The same seed with a filter of its own stays reproducible.
    topk_seeded = SamplingParams(temperature=1.0, top_k=50, seed=99)
    assert len({int(draw(logits, topk_seeded).tokens[0]) for _ in range(3)}) == 1
    # Other seeds (or steps) give other draws across many tries.
    flat = torch.zeros(1, 1000)
    picks = {int(draw(flat, SamplingParams(temperature=1.0, seed=s)).tokens[0]) for s in range(20)}
    assert len(picks) > 10
    steps = {
        int(sample(flat, [seeded], [np.zeros(n, dtype=np.int64)]).tokens[0]) for n in range(20)
    }
    assert len(steps) > 10


def test_penalties():
    logits = torch.tensor([[4.0, 3.0, -1.0, 0.5]])
    outs = [np.array([0, 0, 2])]
    rep = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], outs)
    assert torch.allclose(rep, torch.tensor([[2.0, 3.0, -2.0, 0.5]]))
    freq = apply_penalties(logits, [SamplingParams(frequency_penalty=1.5)], outs)
    assert torch.allclose(freq, torch.tensor([[1.0, 3.0, -2.5, 0.5]]))
    pres = apply_penalties(logits, [SamplingParams(presence_penalty=1.5)], outs)
    assert torch.allclose(pres, torch.tensor([[2.5, 3.0, -2.5, 0.5]]))
    # Greedy picks change accordingly; rows without penalties are untouched.
    both = torch.cat([logits, logits])
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams()]
    assert sample(both, params, [outs[0], outs[0]]).tokens.tolist() == [1, 0]


def test_logit_bias_moves_only_its_rows_tokens():
    logits = torch.tensor([[4.0, 3.0, -1.0, 0.5]]).repeat(3, 1)
    params = [
        SamplingParams(logit_bias=[(2, 10.0)]),  # greedy now picks token 2
        SamplingParams(),  # untouched
        SamplingParams(logit_bias=[(0, -100.0), (1, -100.0)], logprobs=True),
    ]
    out = sample(logits, params, [EMPTY] * 3)
    assert out.tokens.tolist() == [2, 0, 3]
    # Logprobs describe the biased distribution the token was drawn from.
    biased = torch.tensor([-96.0, -97.0, -1.0, 0.5]).log_softmax(-1)
    assert torch.allclose(out.logprobs[2], biased[3])
    assert torch.equal(logits[0], torch.tensor([4.0, 3.0, -1.0, 0.5]))  # input not modified
    # A sampled row never draws a token biased to -100.
    hot = SamplingParams(temperature=1.0, logit_bias=[(0, -100.0)])
    assert 0 not in draw(logits[:1].repeat(2000, 1), hot).tokens.tolist()


def test_logprobs_and_top_logprobs():
    logits = torch.randn(3, 50)
    params = [SamplingParams(logprobs=True, top_logprobs=4)] * 3
    out = sample(logits, params, [EMPTY] * 3)
    lp = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, lp.max(-1).values)
    assert torch.equal(out.top_ids, lp.topk(4).indices)


def test_stop_tokens_and_max_new_tokens(arena):
    loaded = tiny_model("llama", seed=3)
    runner = make_runner(loaded, arena)
    pool = SlotPool(runner.num_slots)
    ids = torch.randint(0, 211, (10,)).tolist()
    slots = pool.take(10)
    first = runner.forward(ForwardBatch(1, [seq("a", ids, slots, 0)])).outputs[0]
    stop = SamplingParams(stop_token_ids=[first.token_id])
    length = SamplingParams(max_new_tokens=3)
    res = runner.forward(
        ForwardBatch(
            2,
            [
                seq("stop", ids, slots, 0, params=stop),
                seq("len", ids, slots, 0, params=length, output_ids=b"\x01\x00\x00\x00" * 2),
                seq("more", ids, slots, 0, params=length, output_ids=b"\x01\x00\x00\x00"),
                seq("quiet", ids, slots, 0, sample=False),
            ],
        )
    )
    reasons = [o.finish_reason for o in res.outputs]
    assert reasons == ["stop", "length", None, None]
    assert res.outputs[3].token_id == -1 and res.outputs[0].token_id == first.token_id


def test_prompt_logprobs_match_plain_forward_across_chunks_and_a_cached_prefix(arena):
    """Prompt logprobs (each token scored by the position before it) equal
    log_softmax of transformers' own logits: a prompt split in two chunks (the
    first scores the second's first token through ``next_token``) behind a
    prefix already in the arena, in one batch with a plain request."""
    from conftest import reference_logits

    loaded = tiny_model("gemma3")  # soft-capped final logits: checks the kept rows get it
    runner = make_runner(loaded, arena)
    pool = SlotPool(runner.num_slots)
    ids = torch.randint(0, 211, (29,)).tolist()
    slots = pool.take(len(ids))
    ref = torch.log_softmax(reference_logits(loaded.model, ids), dim=-1)
    cached, cut = 6, 17  # prefix in the arena; first chunk [6, 17), second [17, 29)
    runner.forward(ForwardBatch(0, [seq("pre", ids[:cached], slots[:cached], 0, sample=False)]))
    asked = SamplingParams(logprobs=True, top_logprobs=3, prompt_logprobs_start=cached)
    other = pool.take(5)
    first = runner.forward(
        ForwardBatch(
            1,
            [
                seq(
                    "p",
                    ids[cached:cut],
                    slots[:cut],
                    cached,
                    False,
                    params=asked,
                    next_token=ids[cut],
                ),
                seq("q", [5, 6, 7, 8, 9], other, 0),
            ],
        )
    )
    second = runner.forward(ForwardBatch(2, [seq("p", ids[cut:], slots, cut, params=asked)]))
    p1, q, p2 = first.outputs[0], first.outputs[1], second.outputs[0]
    assert q.prompt_logprobs is None and p1.token_id == -1 and p2.token_id >= 0
    got = (p1.prompt_logprobs or []) + (p2.prompt_logprobs or [])
    # Positions 6..27 score tokens 7..28: 11 from the first chunk, 11 from the second.
    assert len(p1.prompt_logprobs or []) == cut - cached and len(got) == len(ids) - 1 - cached
    want = [ref[pos, ids[pos + 1]].item() for pos in range(cached, len(ids) - 1)]
    assert np.allclose(got, want, atol=1e-4), np.abs(np.array(got) - want).max()
    tops = (p1.prompt_top_logprobs or []) + (p2.prompt_top_logprobs or [])
    for pos, top in zip(range(cached, len(ids) - 1), tops, strict=True):
        vals, idx = ref[pos].topk(3)
        assert [t for t, _ in top] == idx.tolist()
        assert np.allclose([v for _, v in top], vals.tolist(), atol=1e-4)
    # The sampled token after the prompt is what it is without prompt logprobs.
    assert p2.token_id == int(ref[-1].argmax()) and p2.logprob is not None
