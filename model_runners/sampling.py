"""Next-token sampling for a batch, vectorised over sequences.

Order of operations (as in Hugging Face's logits processors): penalties and
logit bias, a grammar's mask, then temperature, top-k, top-p, min-p, then a draw.
Log-probabilities are reported from the penalised, biased distribution before
temperature and filters, so they describe the model rather than the sampler
settings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from radixmux.model_runners import paged_decode
from radixmux.protocol import SamplingParams, pack_bias, unpack_bias

_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass
class Sampled:
    """Tokens for each row, plus log-probabilities where any row asked."""

    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] chosen token's logprob
    top_ids: torch.Tensor | None  # [B, n] most likely ids
    top_logprobs: torch.Tensor | None  # [B, n]


def _column(params: Sequence[SamplingParams], attr: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([getattr(p, attr) for p in params], dtype=dtype)


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], output_ids: Sequence[np.ndarray]
) -> torch.Tensor:
    """Repetition (divide positive / multiply negative logits), frequency and presence penalties.

    Every penalty counts the tokens in each row's ``output_ids``.
    """
    rep = _column(params, "repetition_penalty", torch.float32)
    freq = _column(params, "frequency_penalty", torch.float32)
    pres = _column(params, "presence_penalty", torch.float32)
    active = (rep != 1) | (freq != 0) | (pres != 0)
    longest = max((len(o) for o in output_ids), default=0)
    if not bool(active.any()) or longest == 0:
        return logits
    rows, vocab = logits.shape
    # Pad with an extra "vocab" column that is dropped after counting.
    ids = np.full((rows, longest), vocab, dtype=np.int64)
    for i, out in enumerate(output_ids):
        if active[i]:
            ids[i, : len(out)] = out
    counts = torch.zeros(rows, vocab + 1, dtype=torch.float32)
    counts.scatter_add_(1, torch.from_numpy(ids), torch.ones(rows, longest))
    counts = counts[:, :vocab]
    present = counts > 0
    penalised = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
    logits = torch.where(present, penalised, logits)
    return logits - freq[:, None] * counts - pres[:, None] * present.float()


def apply_logit_bias(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    biases: Sequence[np.ndarray] | None = None,
) -> torch.Tensor:
    """Add each row's logit bias to the logits of its token ids: ``biases[i]``
    (``protocol.BIAS_RECORD`` records, as the runner receives them packed), or
    by default each row's ``params.logit_bias``."""
    if biases is None:
        biases = [unpack_bias(pack_bias(p.logit_bias)) for p in params]
    rows = [i for i, b in enumerate(biases) if len(b)]
    if not rows:
        return logits
    r = np.concatenate([np.full(len(biases[i]), i, dtype=np.int64) for i in rows])
    ids = np.concatenate([biases[i]["id"] for i in rows]).astype(np.int64)
    bias = np.concatenate([biases[i]["value"] for i in rows])
    logits = logits.clone()
    logits.index_put_(
        (torch.from_numpy(r), torch.from_numpy(ids)),
        torch.from_numpy(bias).to(logits.dtype),
        accumulate=True,
    )
    return logits


def _exponential_noise(
    shape: tuple[int, int], params: Sequence[SamplingParams], steps: Sequence[int]
) -> torch.Tensor:
    # Drawing argmax(p / E) with E ~ Exp(1) picks index i with probability p_i.
    noise = torch.empty(shape).exponential_()
    for row, (p, step) in enumerate(zip(params, steps, strict=True)):
        if p.seed is not None:
            # A generator per seeded row keyed by (seed, step): the draw does not
            # depend on what else is in the batch or on earlier requests.
            g = torch.Generator().manual_seed((p.seed * _SEED_MIX + step) % (2**63))
            noise[row] = torch.empty(shape[1]).exponential_(generator=g)
    return noise


def _filtered_draw(
    logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]
) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one draw per row."""
    rows, vocab = logits.shape
    # Noise is drawn per token id (not per sorted rank), so a seeded row picks
    # the same token whichever filters its batch-mates make us use.
    noise = _exponential_noise((rows, vocab), params, steps)
    temp = _column(params, "temperature", torch.float32)
    top_k = _column(params, "top_k", torch.int64)
    top_p = _column(params, "top_p", torch.float32)
    min_p = _column(params, "min_p", torch.float32)
    x = logits / temp[:, None]
    order = None
    if bool((top_k > 0).any() or (top_p < 1).any()):
        # Work in descending order so top-k and top-p are prefix masks. When
        # every row has a top-k, only the largest k are ever kept: topk is much
        # cheaper than sorting a 262k vocabulary.
        if bool((top_k > 0).all()):
            x, order = x.topk(int(top_k.max()), dim=-1)
        else:
            x, order = x.sort(-1, descending=True)
        ranks = torch.arange(x.shape[1])[None, :]
        k = torch.where(top_k > 0, top_k, vocab)
        x = x.masked_fill(ranks >= k[:, None], float("-inf"))
        ps = x.softmax(-1)
        # Keep a token while the mass strictly before it is below top_p (keeps >= 1).
        x = x.masked_fill((ps.cumsum(-1) - ps) >= top_p[:, None], float("-inf"))
    if bool((min_p > 0).any()):
        ps = x.softmax(-1)
        x = x.masked_fill(ps < min_p[:, None] * ps.max(-1, keepdim=True).values, float("-inf"))
    if order is not None:
        noise = noise.gather(1, order)
    pick = (x.softmax(-1) / noise).max(-1).indices  # argmax, faster (see sample)
    return pick if order is None else order.gather(1, pick[:, None])[:, 0]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first index of the largest value, NaN first), as
    ``logits.float().max(-1).indices``. bfloat16 logits go to the kernel
    (``kernels/argmax.cpp``), which widens each value in a register instead of
    copying the block to float first: 0.15 against 1.3 ms at 64 rows of a 49k
    vocabulary."""
    if logits.dtype == torch.bfloat16 and logits.shape[-1] >= 16 and _argmax_kernel():
        return torch.ops.radixmux.argmax_rows(logits)
    return logits.float().max(-1).indices


def _argmax_kernel() -> bool:
    return paged_decode.loaded() and bool(torch.ops.radixmux.has_argmax_rows())


def _greedy(p: SamplingParams) -> bool:
    """Whether a row takes the argmax rather than a draw (the temperature as
    the draw would use it: a float32, so one that rounds to 0 is greedy)."""
    return bool(np.float32(p.temperature) <= 0) or p.top_k == 1


def _only_greedy(
    params: Sequence[SamplingParams],
    output_ids: Sequence[np.ndarray],
    biases: Sequence[np.ndarray] | None,
) -> bool:
    """Whether every row takes the argmax of its raw logits: greedy, nothing
    that changes a logit (penalties over its output so far, a logit bias) and
    no log-probabilities to report."""
    for i, p in enumerate(params):
        if not _greedy(p) or p.logprobs or p.top_logprobs:
            return False
        penalised = p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty
        if penalised and len(output_ids[i]):
            return False
        biased = len(biases[i]) if biases is not None else p.logit_bias
        if biased:
            return False
    return True


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_ids: Sequence[np.ndarray],
    steps: Sequence[int] | None = None,
    biases: Sequence[np.ndarray] | None = None,
    constrain: Callable[[torch.Tensor], None] | None = None,
) -> Sampled:
    """Pick one token per row of ``logits`` ``[B, vocab]``.

    ``output_ids[i]`` are the tokens row ``i`` generated so far (penalties
    count them); ``steps[i]`` how many there are, the step that keys a seeded
    draw (default: ``len(output_ids[i])``, for rows that send no ids when no
    penalty needs them). ``biases``: see :func:`apply_logit_bias`.
    ``constrain`` masks the penalised, biased logits in place (structured
    output) before anything is picked, so the draw and the logprobs are those
    of the masked distribution.
    """
    if constrain is None and _only_greedy(params, output_ids, biases):
        return Sampled(greedy_tokens(logits), None, None, None)
    if steps is None:
        steps = [len(o) for o in output_ids]
    logits = apply_penalties(logits.float(), params, output_ids)
    logits = apply_logit_bias(logits, params, biases)
    if constrain is not None:
        constrain(logits)
    # max(-1).indices is argmax (the first index of the largest value, NaN
    # first) at a third of its time on CPU (greedy_tokens says what greedy
    # rows with nothing else to do take instead).
    tokens = logits.max(-1).indices
    greedy = torch.tensor([_greedy(p) for p in params], dtype=torch.bool)
    if not bool(greedy.all()):
        rows = (~greedy).nonzero()[:, 0]
        sub = [params[i] for i in rows.tolist()]
        tokens[rows] = _filtered_draw(logits[rows], sub, [steps[i] for i in rows.tolist()])

    logprobs = top_ids = top_lp = None
    if any(p.logprobs or p.top_logprobs for p in params):
        lp = logits.log_softmax(-1)
        logprobs = lp.gather(1, tokens[:, None])[:, 0]
        n = max(p.top_logprobs for p in params)
        if n:
            top_lp, top_ids = lp.topk(n, dim=-1)
    return Sampled(tokens, logprobs, top_ids, top_lp)
