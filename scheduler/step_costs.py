"""What a runner's forward passes cost, measured: the time of a decode step and
of each prompt token prefilled, as the scheduler's admission decisions need them.

Costs drift with the batch, the context lengths and whatever else loads the
cores, so they are moving averages of the runner's own recent steps rather than
constants: ``BatchBuilder`` asks them whether new prompts should wait for the
running requests to finish (see ``batch_builder``).
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the newest step in the moving averages: about the last 8 steps count.
EWMA_WEIGHT = 0.25
# Steps prefilling fewer tokens than this say little about the cost per token
# (the decode part and fixed costs dominate them).
MIN_PREFILL_SAMPLE = 32


@dataclass
class StepCosts:
    """Moving averages of one runner's step times (milliseconds)."""

    decode_ms: float = 0.0  # a step that only decodes; 0 until one was seen
    prefill_ms_per_token: float = 0.0  # extra time per prompt token; 0 until seen

    @property
    def known(self) -> bool:
        """Both costs measured at least once."""
        return self.decode_ms > 0 and self.prefill_ms_per_token > 0

    def observe(self, decode_rows: int, prefill_tokens: int, step_ms: float) -> None:
        """Account one finished step: ``decode_rows`` single-token rows and
        ``prefill_tokens`` prompt tokens took ``step_ms``."""
        if step_ms <= 0:
            return
        if prefill_tokens == 0:
            if decode_rows:
                self.decode_ms = _blend(self.decode_ms, step_ms)
            return
        if prefill_tokens < MIN_PREFILL_SAMPLE:
            return
        # The decode rows of a mixed step cost about a decode step; what is
        # left is the prompt's. Without a decode estimate yet, charge it all.
        base = self.decode_ms if decode_rows else 0.0
        per_token = max(step_ms - base, 0.0) / prefill_tokens
        if per_token > 0:
            self.prefill_ms_per_token = _blend(self.prefill_ms_per_token, per_token)

    def prefill_ms(self, tokens: int) -> float:
        """Estimated extra time of a step that prefills ``tokens`` prompt tokens."""
        return tokens * self.prefill_ms_per_token


def _blend(average: float, sample: float) -> float:
    return sample if average <= 0 else average + EWMA_WEIGHT * (sample - average)
