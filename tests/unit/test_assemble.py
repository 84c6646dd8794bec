"""Plain answers folded from the engine's stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bunkhouse.front.assemble import (
    StreamError,
    assemble_chat,
    assemble_completion,
    sse_events,
    sse_lines,
)


def _lines(*events: dict[str, Any]) -> list[str]:
    return [f"data: {json.dumps(e)}" for e in events] + ["data: [DONE]"]


TOP = {"id": "chatcmpl-1", "created": 7, "model": "m", "system_fingerprint": "b0"}


def test_chat_content_finish_reason_and_usage() -> None:
    events = sse_events(_lines(
        {**TOP, "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
        {**TOP, "choices": [{"index": 0, "delta": {"content": "Par"}}]},
        {**TOP, "choices": [{"index": 0, "delta": {"content": "is."}}]},
        {**TOP, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {**TOP, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                         "total_tokens": 7}, "timings": {"predicted_n": 2}},
    ))
    assert assemble_chat(events) == {
        **TOP, "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "Paris."}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        "timings": {"predicted_n": 2},
    }


def test_chat_tool_calls_and_reasoning_are_merged() -> None:
    events = sse_events(_lines(
        {**TOP, "choices": [{"index": 0, "delta": {"reasoning_content": "think"}}]},
        {**TOP, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"ci"}}]}}]},
        {**TOP, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": "ty\": \"Paris\"}"}}]}}]},
        {**TOP, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ))
    message = assemble_chat(events)["choices"][0]["message"]
    assert message == {
        "role": "assistant", "content": None, "reasoning_content": "think",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get_weather",
                                     "arguments": "{\"city\": \"Paris\"}"}}],
    }


def test_completion_text_is_joined() -> None:
    events = sse_events(_lines(
        {**TOP, "choices": [{"index": 0, "text": " Par"}]},
        {**TOP, "choices": [{"index": 0, "text": "is", "finish_reason": "length"}]},
        {**TOP, "choices": [], "usage": {"completion_tokens": 2}},
    ))
    out = assemble_completion(events)
    assert out["object"] == "text_completion" and out["id"] == "cmpl-1"  # OpenAI's prefix
    assert out["usage"] == {"prompt_tokens": 0, "completion_tokens": 2, "total_tokens": 2}
    assert out["choices"] == [{"index": 0, "text": " Paris", "logprobs": None,
                               "finish_reason": "length"}]


def test_an_error_in_the_stream_is_raised() -> None:
    with pytest.raises(StreamError) as info:
        sse_events(["data: {\"error\": {\"message\": \"boom\"}}"])
    assert info.value.body == {"error": {"message": "boom"}}


def test_events_that_are_not_objects_are_skipped() -> None:
    assert sse_events(["data: null", "data: [1, 2]", "data: {\"a\": 1}", "data: [DONE]"]) == [
        {"a": 1}]


def test_sse_lines_split_only_at_sse_line_ends() -> None:
    # U+2028, U+2029 and U+0085 are legal unescaped in JSON strings; str.splitlines (and so
    # httpx's iter_lines) would cut an event holding one of them in two (found by the fuzz).
    text = "a\u2028b\u2029c\x85d\x1ce"
    data = ("data: " + json.dumps({"choices": [{"index": 0, "text": text}]},
                                  ensure_ascii=False)).encode()
    lines = sse_lines(data + b"\r\n\r\ndata: [DONE]\r\n")
    assert assemble_completion(sse_events(lines))["choices"][0]["text"] == text
    assert sse_lines(b"a\rb\nc\r\nd") == ["a", "b", "c", "d"]
