"""Ollama's API <-> OpenAI chat completions and completions, as pure functions
(api/ollama.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bunkhouse.api import ollama
from bunkhouse.errors import InvalidRequest


def test_a_chat_request_with_options_format_and_tools() -> None:
    out = ollama.chat_request({
        "model": "m", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny", "tool_name": "get_weather"}],
        "options": {"temperature": 0.2, "top_k": 5, "num_predict": 30, "stop": ["\n"],
                    "seed": 7, "num_ctx": 4096},
        "format": "json", "tools": [{"type": "function", "function": {"name": "get_weather"}}]})
    assert out["stream"] is True  # Ollama streams unless told not to
    assert out["max_tokens"] == 30 and out["temperature"] == 0.2 and out["top_k"] == 5
    assert out["stop"] == ["\n"] and out["seed"] == 7 and "num_ctx" not in out
    assert out["response_format"] == {"type": "json_object"}
    call = out["messages"][2]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert out["messages"][3] == {"role": "tool", "content": "sunny",
                                  "tool_call_id": call["id"]}


def test_sampling_options_the_engine_takes_are_passed_on_and_num_ctx_is_bounded() -> None:
    """Ollama's sampling options llama.cpp takes reach its adapter (which holds them to the
    engine's ranges, naming the Ollama option); its load options are the server's."""
    out = ollama.chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                               "options": {"repeat_last_n": -2, "mirostat": 3, "num_keep": 5,
                                           "typical_p": 0.5, "num_batch": -1}})
    assert (out["repeat_last_n"], out["mirostat"], out["n_keep"], out["typical_p"]) == (
        -2, 3, 5, 0.5)
    assert "num_batch" not in out and "num_keep" not in out
    with pytest.raises(InvalidRequest) as e:
        ollama.chat_request({"model": "m", "messages": [], "options": {"num_ctx": 2**64}})
    assert e.value.param == "options.num_ctx" and "2147483647" in e.value.message


def test_generate_goes_through_the_template_unless_raw_or_there_is_none() -> None:
    route, out = ollama.generate_request({"model": "m", "prompt": "hi", "system": "S",
                                          "stream": False}, templated=True)
    assert route == "/v1/chat/completions" and "stream" not in out
    assert out["messages"] == [{"role": "system", "content": "S"},
                               {"role": "user", "content": "hi"}]
    for body, templated in (({"model": "m", "prompt": "hi", "raw": True}, True),
                            ({"model": "m", "prompt": "hi"}, False)):
        route, out = ollama.generate_request(body, templated)
        assert route == "/v1/completions" and out["prompt"] == "hi"


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "model"), ({"model": "m", "messages": {}}, "messages"),
    ({"model": "m", "messages": [{"role": "robot"}]}, "messages.0.role"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"model": "m", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
     "messages.0.images"),
    ({"model": "m", "messages": [], "options": {"temperature": "hot"}}, "options.temperature"),
    ({"model": "m", "messages": [], "options": {"top_k": 1.5}}, "options.top_k"),
    ({"model": "m", "messages": [], "options": {"num_predict": "x"}}, "options.num_predict"),
    ({"model": "m", "messages": [], "options": {"stop": "x"}}, "options.stop"),
    ({"model": "m", "messages": [], "options": []}, "options"),
    ({"model": "m", "messages": [], "format": "yaml"}, "format"),
    ({"model": "m", "messages": [], "stream": "yes"}, "stream"),
])
def test_bad_input_names_its_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        ollama.chat_request(body)
    assert info.value.param == param


def test_a_stream_becomes_ollama_objects_then_a_done_one() -> None:
    stream = ollama.OllamaStream("m:latest", chat=True)
    out = []
    for event in ({"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
                  {"choices": [{"index": 0, "delta": {"content": "Pa"}}]},
                  {"choices": [{"index": 0, "delta": {"content": "ris"}}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2},
                   "timings": {"prompt_ms": 12.5, "predicted_ms": 40.0}}):
        out += stream.feed(event)
    out += stream.end()
    assert [o["message"]["content"] for o in out] == ["Pa", "ris", ""]
    assert [o["done"] for o in out] == [False, False, True]
    last = out[-1]
    assert last["model"] == "m:latest" and last["done_reason"] == "stop"
    assert last["prompt_eval_count"] == 9 and last["eval_count"] == 2
    assert last["prompt_eval_duration"] == 12_500_000 and last["eval_duration"] == 40_000_000
    assert all(json.loads(ollama.line(o)) == o for o in out)


def test_whole_answers_for_chat_and_generate() -> None:
    chat = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function",
             "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    out = ollama.answer(chat, "m", chat=True)
    assert out["message"]["tool_calls"] == [{"function": {"name": "f", "arguments": {"a": 1}}}]
    assert out["done"] and out["eval_count"] == 4
    text = {"choices": [{"index": 0, "text": "Paris.", "finish_reason": "length"}]}
    out = ollama.answer(text, "m", chat=False)
    assert out["response"] == "Paris." and out["done_reason"] == "length"


def test_what_is_not_served_says_what_to_do() -> None:
    assert "uploads nothing" in ollama.not_served("push")
    assert "TOML" in ollama.not_served("create")


@pytest.mark.parametrize(("model_id", "name"), [
    ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct:latest"),
    ("gemma3:270m", "gemma3:270m"),
    ("Qwen/Qwen2.5-GGUF:q4_k_m", "Qwen/Qwen2.5-GGUF:q4_k_m"),
    ("host:11434/team/model", "host:11434/team/model:latest"),  # a port is not a tag
])
def test_names_are_listed_and_answered_with_a_tag(model_id: str, name: str) -> None:
    assert ollama.tagged(model_id) == name


@pytest.mark.parametrize(("count", "size"), [
    (630167424, "630.17M"), (268098176, "268.10M"), (494032768, "494.03M"),
    (7_000_000_000, "7B"), (8_030_261_248, "8.0B"), (2_000_000, "2M"), (1500, "2K"),
    (999, "999"), (None, ""),
])
def test_parameter_size_as_ollama_writes_it(count: int | None, size: str) -> None:
    assert ollama.parameter_size(count) == size


def test_show_writes_parameters_and_a_modelfile_as_ollama_does() -> None:
    options = ollama.parameters([("num_ctx", 8192), ("temperature", 0.2),
                                 ("stop", ["<a>", "<b>"]), ("max_tokens", 64)])
    assert options == [("num_ctx", 8192), ("temperature", 0.2), ("stop", "<a>"),
                       ("stop", "<b>"), ("num_predict", 64)]
    text = ollama.parameters_text(options)
    assert text.splitlines()[2] == "stop" + " " * 27 + '"<a>"'
    made = ollama.modelfile("m:latest", "/models/m.gguf", "{{ x }}", options[:1])
    assert made.splitlines()[1:] == ["FROM /models/m.gguf", 'TEMPLATE """{{ x }}"""',
                                     "PARAMETER num_ctx 8192"]
    assert "TEMPLATE" not in ollama.modelfile("m", "/m.gguf", "", [])
