"""Plain answers folded from the engine's stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bunkhouse.front.assemble import StreamError, assemble_chat, assemble_completion, sse_events


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
    assert out["object"] == "text_completion" and out["usage"] == {"completion_tokens": 2}
    assert out["choices"] == [{"index": 0, "text": " Paris", "logprobs": None,
                               "finish_reason": "length"}]


def test_an_error_in_the_stream_is_raised() -> None:
    with pytest.raises(StreamError) as info:
        sse_events(["data: {\"error\": {\"message\": \"boom\"}}"])
    assert info.value.body == {"error": {"message": "boom"}}


def test_events_that_are_not_objects_are_skipped() -> None:
    assert sse_events(["data: null", "data: [1, 2]", "data: {\"a\": 1}", "data: [DONE]"]) == [
        {"a": 1}]
