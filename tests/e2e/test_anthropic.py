"""Anthropic's Messages API through `bunkhouse serve`, driven by the real `anthropic` SDK:
create, stream, count_tokens, stop sequences, tool round trips (and the same tool calls on
OpenAI's chat completions), and errors in Anthropic's envelope."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import ollama
import openai
import pytest

from tests.e2e.server import Server
from tests.models import QWEN

GREEDY = {"temperature": 0}  # the SDK has no sampling arguments: sent as extra fields


@pytest.fixture(scope="module")
def server(qwen_server: Server) -> Server:
    return qwen_server  # tests/e2e/conftest.py: one server for the modules that share it


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                             timeout=300) as sdk:
        yield sdk


def test_create_stream_and_count_tokens(client: anthropic.Anthropic) -> None:
    messages: list[anthropic.types.MessageParam] = [
        {"role": "user", "content": "What is the capital of France? Answer in one word."}]
    made = client.messages.create(model=QWEN, max_tokens=16, extra_body=GREEDY,
                                  system="You are terse.", messages=messages)
    assert made.type == "message" and made.role == "assistant" and made.model == QWEN
    text = "".join(b.text for b in made.content if b.type == "text")
    assert "Paris" in text
    assert made.stop_reason in ("end_turn", "max_tokens")
    assert made.usage.input_tokens > 0 and made.usage.output_tokens > 0

    with client.messages.stream(model=QWEN, max_tokens=16, extra_body=GREEDY,
                                system="You are terse.", messages=messages) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == made.stop_reason
    assert final.usage.input_tokens == made.usage.input_tokens  # sent with message_delta

    counted = client.messages.count_tokens(model=QWEN, system="You are terse.",
                                           messages=messages)
    assert counted.input_tokens == made.usage.input_tokens

    # max_tokens is a ceiling, as agents send it (32,000), far above the 2,048-token slot
    capped = client.messages.create(model=QWEN, max_tokens=32_000, extra_body=GREEDY,
                                    system="You are terse.", messages=messages)
    assert "".join(b.text for b in capped.content if b.type == "text") == text

    stopped = client.messages.create(model=QWEN, max_tokens=32, extra_body=GREEDY,
                                     messages=[{"role": "user",
                                                "content": "Count from 1 to 10 with commas."}],
                                     stop_sequences=["5"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "5"


WEATHER_TOOL: anthropic.types.ToolParam = {
    "name": "get_weather", "description": "Get the current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]}}
ASK = "What is the weather in Paris?"
RESULT = "Sunny, 18 degrees Celsius"


def test_usage_is_each_apis_own_at_every_point(client: anthropic.Anthropic,
                                              server: Server) -> None:
    """One prompt through every protocol: each usage object has its reference's fields, and
    they all count the same prompt: Anthropic's message_start (before any answer), its
    message_delta and count_tokens; OpenAI's chat stream (include_usage) and a Responses
    stream's response.completed (null in response.created and in_progress); Ollama's last
    chunk (counts, durations in ns)."""
    system, ask = "You are terse.", "Name one colour. One word."
    counted = client.messages.count_tokens(model=QWEN, system=system,
                                           messages=[{"role": "user", "content": ask}])
    prompt = counted.input_tokens
    with client.messages.stream(model=QWEN, max_tokens=8, extra_body=GREEDY, system=system,
                                messages=[{"role": "user", "content": ask}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start").message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    assert start.input_tokens == delta.input_tokens == final.usage.input_tokens == prompt
    assert start.cache_read_input_tokens == delta.cache_read_input_tokens == 0
    assert delta.output_tokens == final.usage.output_tokens > 0
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=300) as sdk:
        chunks = list(sdk.chat.completions.create(
            model=QWEN, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "system", "content": system}, {"role": "user", "content": ask}]))
        usage = chunks[-1].usage
        assert usage is not None and not chunks[-1].choices
        assert usage.prompt_tokens == prompt and usage.completion_tokens > 0
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens is not None
        assert all(c.usage is None for c in chunks[:-1])
        with sdk.responses.stream(model=QWEN, input=ask, instructions=system,
                                  temperature=0, max_output_tokens=16) as answer:
            kinds = {e.type: e for e in answer}
        assert kinds["response.created"].response.usage is None  # type: ignore[attr-defined]
        assert kinds["response.in_progress"].response.usage is None  # type: ignore[attr-defined]
        done = kinds["response.completed"].response.usage  # type: ignore[attr-defined]
        assert done.input_tokens == prompt and done.output_tokens > 0
        assert done.total_tokens == done.input_tokens + done.output_tokens
        assert done.input_tokens_details.cached_tokens >= 0
        assert done.output_tokens_details.reasoning_tokens == 0
    local = ollama.Client(host=server.url, timeout=300)
    try:
        *_, last = local.chat(model=QWEN, stream=True, options={"temperature": 0,
                                                                "num_predict": 8},
                              messages=[{"role": "system", "content": system},
                                        {"role": "user", "content": ask}])
    finally:
        local._client.close()  # the client keeps its connections open until told
    assert last.done and last.prompt_eval_count == prompt and (last.eval_count or 0) > 0
    assert all(isinstance(getattr(last, f), int) for f in (
        "total_duration", "load_duration", "prompt_eval_duration", "eval_duration"))
    assert (last.total_duration or 0) >= (last.eval_duration or 0) > 0


def test_a_required_tool_call_and_its_result_round_trip(client: anthropic.Anthropic) -> None:
    question: list[anthropic.types.MessageParam] = [{"role": "user", "content": ASK}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        made = client.messages.create(model=QWEN, max_tokens=64, extra_body=GREEDY,
                                      messages=question, tools=[WEATHER_TOOL],
                                      tool_choice=choice)  # type: ignore[arg-type]
        assert made.stop_reason == "tool_use", made.content
        (call,) = [b for b in made.content if b.type == "tool_use"]
        assert call.name == "get_weather" and call.input == {"city": "Paris"}
        assert call.id

    with client.messages.stream(model=QWEN, max_tokens=64, extra_body=GREEDY,
                                messages=question, tools=[WEATHER_TOOL],
                                tool_choice={"type": "any"}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed.input == {"city": "Paris"}

    turns: list[anthropic.types.MessageParam] = [
        *question, {"role": "assistant", "content": made.content},  # type: ignore[typeddict-item]
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": RESULT}]}]
    # (with the tools still offered, the 0.5B model repeats its call instead of answering)
    answer = client.messages.create(model=QWEN, max_tokens=48, extra_body=GREEDY,
                                    messages=turns)
    asked = client.messages.count_tokens(model=QWEN, messages=question)
    assert answer.usage.input_tokens > asked.input_tokens  # the call and its result were read
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert "18" in text, answer.content  # the packaged model quotes the result
    failed = [*turns[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": "no such city",
         "is_error": True}]}]
    assert client.messages.create(model=QWEN, max_tokens=8, extra_body=GREEDY,
                                  messages=failed).content  # type: ignore[arg-type]


def test_tool_calls_on_openai_chat_completions(server: Server) -> None:
    tools: list[openai.types.chat.ChatCompletionToolParam] = [{
        "type": "function", "function": {"name": "get_weather",
                                         "parameters": WEATHER_TOOL["input_schema"]}}]
    ask: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": ASK}]
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=300) as sdk:
        for choice in ("required", "auto"):
            made = sdk.chat.completions.create(model=QWEN, messages=ask, tools=tools,
                                               tool_choice=choice, temperature=0,
                                               max_tokens=64)
            assert made.choices[0].finish_reason == "tool_calls"
            message = made.choices[0].message
            assert message.content is None and message.tool_calls
            call = message.tool_calls[0]
            assert call.type == "function" and call.function.name == "get_weather"
            assert call.function.arguments == '{"city": "Paris"}'
            chunks = list(sdk.chat.completions.create(
                model=QWEN, messages=ask, tools=tools, tool_choice=choice, temperature=0,
                max_tokens=64, stream=True))
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            assert not "".join(d.content or "" for d in deltas)
            (streamed,) = [t for d in deltas for t in d.tool_calls or []]
            assert streamed.function and streamed.function.arguments == '{"city": "Paris"}'
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        answer = sdk.chat.completions.create(model=QWEN, temperature=0, max_tokens=48, messages=[
            *ask, message.model_dump(exclude_none=True),  # type: ignore[list-item]
            {"role": "tool", "tool_call_id": call.id, "content": RESULT}])
        assert "18" in (answer.choices[0].message.content or "")
        # a schema with references keeps them when the call is forced
        order = {"type": "object", "$defs": {"Item": {
            "type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]}},
            "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
            "required": ["items"]}
        forced = sdk.chat.completions.create(
            model=QWEN, temperature=0, max_tokens=64, tool_choice="required",
            messages=[{"role": "user", "content": "Order two apples, sku A1."}],
            tools=[{"type": "function", "function": {"name": "order", "parameters": order}}])
        (placed,) = forced.choices[0].message.tool_calls or []
        assert placed.function.name == "order"  # type: ignore[union-attr]
        assert "items" in json.loads(placed.function.arguments)  # type: ignore[union-attr]
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(model=QWEN, messages=ask, tools=tools, max_tokens=8,
                                        tool_choice={"type": "function",
                                                     "function": {"name": "nope"}})
        assert "tool_choice" in str(info.value)


def test_errors_come_in_anthropics_envelope(client: anthropic.Anthropic,
                                            server: Server, tmp_path: Path) -> None:
    import httpx

    resp = httpx.post(f"{server.url}/v1/messages", json={
        "model": QWEN, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 400
    assert resp.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens is required: a positive integer"}}
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="no-such-model", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 404
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=QWEN, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url",
                                                                      "url": "x"}}]}])
    bad = httpx.post(f"{server.url}/v1/messages", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    # counted past one slot (2,048 tokens here), as agents count to decide when to compact
    notes = "".join(f"Note {i}: the shelf {i} holds {i * 3} jars.\n" for i in range(250))
    counted = client.messages.count_tokens(model=QWEN, messages=[
        {"role": "user", "content": notes}])
    assert counted.input_tokens > 2048
    # a prompt past the model's trained context is refused, not tokenized (megabytes of it
    # took the worker gigabytes)
    words = " ".join(f"w{i}x" for i in range(1_000_000))
    with pytest.raises(anthropic.BadRequestError) as too_long:
        client.messages.count_tokens(model=QWEN, messages=[{"role": "user", "content": words}])
    assert "do not fit" in str(too_long.value)
    bomb = {"name": "f", "input_schema": {"type": "object", "properties": {
        f"k{i}": {"type": "string"} for i in range(2000)}}}
    with pytest.raises(anthropic.BadRequestError):  # would stall the engine for everyone
        client.messages.create(model=QWEN, max_tokens=4, tools=[bomb],  # type: ignore[list-item]
                               messages=[{"role": "user", "content": "hi"}])
    cross = httpx.post(f"{server.url}/v1/messages", content=b"{}",
                       headers={"content-type": "text/plain", "origin": "http://evil.example",
                                "sec-fetch-site": "cross-site"})
    assert cross.status_code == 403 and cross.json()["type"] == "error"  # Anthropic's too
