"""Anthropic Messages <-> OpenAI chat completions, as pure functions (api/anthropic.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bunkhouse.api.anthropic import MessageStream, error_envelope, message_from_chat, to_chat
from bunkhouse.errors import (
    InsufficientMemory,
    InvalidRequest,
    NotFound,
    Unauthorized,
    WorkerLoadFailed,
)


def test_a_request_becomes_a_chat_request() -> None:
    chat = to_chat({
        "model": "qwen", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me compute."},
                {"type": "tool_use", "id": "toolu_1", "name": "add",
                 "input": {"a": 2, "b": 2}},
                {"type": "tool_use", "id": "toolu_2", "name": "mul", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "4"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "no such tool"}]}]},
        ],
        "tools": [{"name": "add", "description": "Add two numbers", "input_schema": {
            "type": "object", "properties": {"a": {"type": "number"}}}}],
        "tool_choice": {"type": "any"}, "stop_sequences": ["END"], "temperature": 0.5,
        "top_k": 5, "metadata": {"user_id": "u"}, "stream": True,
    })
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 2})}},
            {"id": "toolu_2", "type": "function",
             "function": {"name": "mul", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "4"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such tool"},
    ]
    assert chat["tools"][0]["function"]["name"] == "add"
    assert chat["tool_choice"] == "required" and chat["stop"] == ["END"]
    assert chat["max_tokens"] == 64 and chat["top_k"] == 5 and chat["temperature"] == 0.5
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert to_chat({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                    "tool_choice": {"type": "tool", "name": "add"}})["tool_choice"] == {
        "type": "function", "function": {"name": "add"}}


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": "5", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages.0.content.0.type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 3},
     "temperature"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
     "stream"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "stop_sequences": "END"}, "stop_sequences"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "system": 7},
     "system"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": []}]}, "messages.0.content"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": ""}]}, "messages.0.content"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "4"}]}]},
     "messages.0.content.0.tool_use_id"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "tools.0.name"),
    ({"max_tokens": 5, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": "never mind"}]}, "messages.2.content"),
])
def test_bad_input_names_its_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        to_chat(body)
    assert info.value.param == param


def test_a_final_assistant_turn_may_be_empty() -> None:
    chat = to_chat({"max_tokens": 5, "messages": [{"role": "user", "content": "x"},
                                                  {"role": "assistant", "content": ""}]})
    assert chat["messages"][-1] == {"role": "assistant", "content": ""}


def test_an_answer_becomes_a_message() -> None:
    answer = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Calling.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": "{\"a\": 1}"}}]}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 7}}
    message = message_from_chat(answer, "qwen")
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"] == [{"type": "text", "text": "Calling."},
                                  {"type": "tool_use", "id": "toolu_c1", "name": "add",
                                   "input": {"a": 1}}]
    assert message["stop_reason"] == "tool_use" and message["stop_sequence"] is None
    assert message["usage"] == {"input_tokens": 12, "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": 0, "output_tokens": 7}
    stopped = message_from_chat({"choices": [{"finish_reason": "stop", "message": {
        "content": "one two"}}]}, "qwen", ["three"])
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "three")
    long = message_from_chat({"choices": [{"finish_reason": "length", "message": {
        "content": "x"}}]}, "qwen")
    assert long["stop_reason"] == "max_tokens"


def test_a_stream_becomes_anthropic_events_block_by_block() -> None:
    stream = MessageStream("qwen")
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "c1", "function": {"name": "add", "arguments": "{\"a\""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": ": 1}"}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}},
    ]
    events = [e for chunk in chunks for e in stream.feed(chunk)] + stream.end()
    names = [name for name, _ in events]
    assert names == ["message_start", "content_block_start", "content_block_delta",
                     "content_block_delta", "content_block_stop", "content_block_start",
                     "content_block_delta", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    data = [d for _, d in events]
    assert data[1]["index"] == 0 and data[5]["index"] == 1
    assert data[5]["content_block"] == {"type": "tool_use", "id": "toolu_c1", "name": "add",
                                        "input": {}}
    assert "".join(d["delta"].get("partial_json", "") for d in data[6:8]) == "{\"a\": 1}"
    assert data[9]["delta"]["stop_reason"] == "tool_use"
    assert data[9]["usage"] == {"input_tokens": 9, "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": 0, "output_tokens": 4}


def test_message_start_says_the_prompts_count_and_every_usage_is_the_references() -> None:
    stream = MessageStream("qwen")
    stream.prompt(33)  # counted before the answer (front/pipeline.py)
    events = stream.feed({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
    events += stream.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    events += stream.feed({"choices": [], "usage": {"prompt_tokens": 33,
                                                    "completion_tokens": 2}})
    events += stream.end()
    usages = {name: data.get("usage") or data.get("message", {}).get("usage")
              for name, data in events if name in ("message_start", "message_delta")}
    fields = {"input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens",
              "output_tokens"}
    assert set(usages["message_start"]) == set(usages["message_delta"]) == fields
    assert usages["message_start"]["input_tokens"] == 33
    assert usages["message_delta"] == {**usages["message_start"], "output_tokens": 2}


def test_errors_use_anthropics_envelope_and_types() -> None:
    assert error_envelope(InvalidRequest("max_tokens is required")) == {
        "type": "error", "error": {"type": "invalid_request_error",
                                   "message": "max_tokens is required"}}
    assert error_envelope(Unauthorized("key"))["error"]["type"] == "authentication_error"
    assert error_envelope(NotFound("x"))["error"]["type"] == "not_found_error"
    assert error_envelope(InsufficientMemory("x"))["error"]["type"] == "overloaded_error"
    # a model that failed to load is the server's failure, not a lack of capacity
    assert error_envelope(WorkerLoadFailed("x"))["error"]["type"] == "api_error"


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": -5},
                                      {"type": "enabled"}, {"type": "sometimes"}, 5,
                                      {"type": "enabled", "budget_tokens": 2**64}])
def test_thinking_is_checked_as_anthropic_shapes_it(thinking: Any) -> None:
    body = {"model": "m", "max_tokens": 4096, "thinking": thinking,
            "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(InvalidRequest) as e:
        to_chat(body)
    assert (e.value.param or "").startswith("thinking"), e.value.message


def test_thinking_in_its_shapes_is_taken() -> None:
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"},
                     {"type": "adaptive"}):
        to_chat({"model": "m", "max_tokens": 4096, "thinking": thinking,
                 "messages": [{"role": "user", "content": "hi"}]})
