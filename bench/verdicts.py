"""A benchmark target's verdict (PASS, MISS, or n/a when it could not be measured)
and the one line every report prints it in."""

from __future__ import annotations


def verdict_of(passed: bool | None, miss: str = "MISS") -> str:
    """PASS, ``miss`` (MISS for a target, FAIL for a check), or n/a for None."""
    return {True: "PASS", False: miss, None: "n/a"}[passed]


def verdict_line(passed: bool | None, text: str, miss: str = "MISS") -> str:
    """``[PASS] text``: the verdict in brackets, padded so that the texts align."""
    return f"[{verdict_of(passed, miss):<4}] {text}"
