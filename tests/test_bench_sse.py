"""The one SSE parser and the one verdict line every benchmark uses (no server)."""

from __future__ import annotations

import pytest

from bench.sse import SSE_DONE, event_text, finish_reason, sse_data, sse_message
from bench.verdicts import verdict_line, verdict_of


def test_sse_lines_give_payloads_messages_and_the_end() -> None:
    assert sse_data('data: {"a": 1}') == '{"a": 1}'
    assert sse_data(": keep-alive") is None and sse_data("") is None
    assert sse_message("data: [DONE]") is SSE_DONE
    assert sse_message("event: x") is None
    assert sse_message('data: {"choices": []}') == {"choices": []}
    with pytest.raises(ValueError):
        sse_message("data: {not json")


def test_text_and_finish_reason_of_every_api() -> None:
    completion = {"choices": [{"text": "ab", "finish_reason": None}]}
    chat_chunk = {"choices": [{"delta": {"content": "cd"}, "finish_reason": "stop"}]}
    chat_answer = {"choices": [{"message": {"content": "ef"}, "finish_reason": "length"}]}
    generate = {"text": "gh", "meta_info": {"finish_reason": {"type": "stop"}}}
    assert [event_text(m) for m in (completion, chat_chunk, chat_answer, generate)] == [
        "ab",
        "cd",
        "ef",
        "gh",
    ]
    assert [finish_reason(m) for m in (completion, chat_chunk, chat_answer, generate)] == [
        None,
        "stop",
        "length",
        "stop",
    ]
    assert event_text({"choices": []}) == "" and event_text("x") == ""
    assert finish_reason({"usage": {}}) is None and finish_reason(None) is None


def test_verdict_line_aligns_pass_miss_and_unmeasured() -> None:
    assert verdict_of(True) == "PASS" and verdict_of(False) == "MISS" and verdict_of(None) == "n/a"
    assert verdict_of(False, miss="FAIL") == "FAIL"
    assert verdict_line(True, "x") == "[PASS] x"
    assert verdict_line(None, "y") == "[n/a ] y"
