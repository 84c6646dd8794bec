"""Tool calls read out of an answer's text (api/tool_calls.py): forcing a required call by a
JSON schema, recovering a call written as text, whole answers and streams."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bunkhouse.api import responses
from bunkhouse.api.tool_calls import (
    ToolCallReader,
    calls_from_text,
    check_tool_choice,
    forced_request,
)
from bunkhouse.front.assemble import assemble_chat

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def request(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [WEATHER, TIME], **extra}


def test_required_becomes_a_schema_of_one_call_of_any_tool() -> None:
    sent = forced_request(request(tool_choice="required"))
    assert sent is not None and sent["tool_choice"] == "none" and sent["tools"]
    schema = sent["response_format"]["json_schema"]["schema"]
    names = [o["properties"]["name"]["const"] for o in schema["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert schema["anyOf"][0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    assert schema["anyOf"][1]["properties"]["arguments"] == {"type": "object"}


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_time"}},
                                    {"type": "function", "name": "get_time"}])
def test_a_named_function_is_the_only_one_the_schema_admits(choice: Any) -> None:
    sent = forced_request(request(tool_choice=choice))
    assert sent is not None
    schema = sent["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["name"] == {"const": "get_time"}


@pytest.mark.parametrize("extra", [
    {"tool_choice": "auto"}, {"tool_choice": "none"}, {},
    {"tool_choice": "required", "response_format": {"type": "json_object"}},
    {"tool_choice": "required", "n": 2},
    {"tool_choice": {"type": "function", "function": {"name": "nope"}}}])
def test_nothing_is_forced_unless_a_declared_call_is_required_alone(extra: Any) -> None:
    assert forced_request(request(**extra)) is None


@pytest.mark.parametrize("data,words", [
    (request(tool_choice={"type": "function", "function": {"name": "nope"}}), "'nope'"),
    (request(tool_choice={"type": "function"}), "must be"),
    (request(tool_choice={"type": "function", "function": {"name": 5}}), "must be"),
    ({"messages": [], "tool_choice": "required"}, "no tools"),
    ({"messages": [], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "no tools"),
])
def test_a_tool_choice_that_cannot_be_met_is_a_400(data: dict[str, Any], words: str) -> None:
    from bunkhouse.errors import InvalidRequest
    with pytest.raises(InvalidRequest) as info:
        check_tool_choice(data)
    assert info.value.param == "tool_choice" and words in info.value.message


def test_two_tools_of_one_name_are_a_400() -> None:
    from bunkhouse.errors import InvalidRequest
    with pytest.raises(InvalidRequest) as info:
        check_tool_choice(request(tools=[WEATHER, TIME, WEATHER]))
    assert info.value.param == "tools" and "get_weather" in info.value.message
    for choice in ("auto", "none", "required", None):
        check_tool_choice(request(tool_choice=choice))


def test_a_forced_call_is_not_cut_by_a_stop_word() -> None:
    sent = forced_request(request(tool_choice="required", stop=["city"]))
    assert sent is not None and "stop" not in sent


@pytest.mark.parametrize("text", [
    CALL, f"  {CALL}\n", f"```json\n{CALL}\n```", f"```\n{CALL}```",
    f"<tool_call>\n{CALL}\n</tool_call>", f"[{CALL}]",
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
    '{"name": "get_weather", "parameters": {"city": "Paris"}}'])
def test_a_call_written_as_text_is_read(text: str) -> None:
    calls = calls_from_text(text, ["get_weather"])
    assert calls is not None and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


def test_several_tagged_calls_are_several_calls() -> None:
    text = f"<tool_call>{CALL}</tool_call>\n<tool_call>{CALL}</tool_call>"
    calls = calls_from_text(text, ["get_weather"])
    assert calls is not None and len(calls) == 2
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("text", [
    "", "Paris is sunny.", '{"name": "other", "arguments": {}}', '{"city": "Paris"}',
    f"Sure! {CALL}", f"{CALL}\nDone.", f"<tool_call>{CALL}</tool_call> and more",
    '{"name": "get_weather", "arguments": [1]}', '{"name": "get_weather", "arguments": "x"}',
    "```python\nprint(1)\n```", "[]"])
def test_anything_else_is_text(text: str) -> None:
    assert calls_from_text(text, ["get_weather"]) is None


def chat(text: str, finish: str = "stop") -> dict[str, Any]:
    return {"object": "chat.completion", "choices": [{
        "index": 0, "message": {"role": "assistant", "content": text},
        "finish_reason": finish}], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}


def test_a_whole_answer_made_of_a_call_becomes_a_tool_call() -> None:
    out = ToolCallReader(["get_weather"], forced=True).answer(chat(CALL))
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 5}
    plain = chat("It is sunny.")
    assert ToolCallReader(["get_weather"], forced=False).answer(plain) == plain


def chunks(pieces: list[str], finish: str = "stop") -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [{"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}]}]
    events += [{"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": p}, "finish_reason": None}]} for p in pieces]
    events.append({"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {}, "finish_reason": finish}]})
    events.append({"object": "chat.completion.chunk", "choices": [],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 5}})
    return events


def read(reader: ToolCallReader, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [e for event in events for e in reader.feed(event)]
    return out + reader.end()


def test_a_streamed_call_is_held_and_sent_as_one_tool_call_delta() -> None:
    pieces = ['{"name"', ': "get_weather", ', '"arguments": {"city": ', '"Paris"}}']
    out = read(ToolCallReader(["get_weather"], forced=False), chunks(pieces))
    assert not any((c.get("delta") or {}).get("content")
                   for e in out for c in e["choices"])
    whole = assemble_chat(out)
    message = whole["choices"][0]["message"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert whole["usage"]["completion_tokens"] == 5


def test_streamed_text_goes_out_once_it_cannot_be_a_call() -> None:
    reader = ToolCallReader(["get_weather"], forced=False)
    events = chunks(["  ", "Paris", " is sunny."])
    sent = [reader.feed(e) for e in events]
    assert sent[1] == [] or not sent[1][0]["choices"][0]["delta"].get("content")
    assert sent[2][0]["choices"][0]["delta"]["content"] == "  Paris"  # released with what held it
    assert sent[3][0]["choices"][0]["delta"]["content"] == " is sunny."
    assert assemble_chat([e for s in sent for e in s])["choices"][0]["message"]["content"] \
        == "  Paris is sunny."


def test_held_text_that_is_no_call_after_all_is_sent_at_the_finish() -> None:
    pieces = ['{"city": ', '"Paris"}']
    whole = assemble_chat(read(ToolCallReader(["get_weather"], forced=False), chunks(pieces)))
    assert whole["choices"][0]["message"]["content"] == '{"city": "Paris"}'
    assert whole["choices"][0]["finish_reason"] == "stop"


def test_a_forced_call_cut_by_max_tokens_stays_text() -> None:
    pieces = ['{"name": "get_weather", "argu']
    whole = assemble_chat(read(ToolCallReader(["get_weather"], forced=True),
                               chunks(pieces, "length")))
    assert whole["choices"][0]["message"]["content"] == pieces[0]
    assert whole["choices"][0]["finish_reason"] == "length"


def test_calls_the_engine_parsed_itself_pass_untouched() -> None:
    engine_call = {"index": 0, "id": "x", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{}"}}
    events = chunks([])
    events.insert(1, {"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"tool_calls": [engine_call]}, "finish_reason": None}]})
    out = read(ToolCallReader(["get_weather"], forced=False), events)
    assert out == events


def test_a_stream_cut_before_its_finish_still_sends_what_was_held() -> None:
    reader = ToolCallReader(["get_weather"], forced=False)
    for event in chunks(['{"na'])[:2]:
        reader.feed(event)
    assert reader.end()[0]["choices"][0]["delta"]["content"] == '{"na'
    assert reader.end() == []


@pytest.mark.parametrize("extra,forced", [
    ({"tool_choice": "required"}, True), ({"tool_choice": "auto"}, False), ({}, False)])
def test_the_reader_for_a_request(extra: Any, forced: bool) -> None:
    sent, reader = ToolCallReader.for_request(request(**extra))
    assert reader is not None and reader.forced is forced
    assert (sent.get("tool_choice") == "none") is forced


@pytest.mark.parametrize("data", [
    request(tool_choice="none"), request(n=2), {"model": "m", "messages": []},
    request(response_format={"type": "json_object"})])
def test_no_reader_where_there_is_nothing_to_read(data: dict[str, Any]) -> None:
    assert ToolCallReader.for_request(data) == (data, None)


@pytest.mark.parametrize("text", [
    "", "  ", "<", "<tool_", "<tool_call>\n{", "`", "```", "```js", "```json", "```json\n",
    "```json\n{", "```\n{\"na", "{", "{\"", "{\"na", "{\"name\"", "[", "[{\"name",
    "{\"arguments\": {", " {\"parameters"])
def test_text_that_may_still_be_a_call_is_held(text: str) -> None:
    from bunkhouse.api.tool_calls import _may_become_call
    assert _may_become_call(text)


@pytest.mark.parametrize("text", [
    "Sure", "```python\n", "```py", "{\"city\"", "{1", "[1", "```json\n[2", "<b>",
    "{\"nam\"", "The answer"])
def test_text_that_cannot_be_a_call_goes_out_at_once(text: str) -> None:
    from bunkhouse.api.tool_calls import _may_become_call
    assert not _may_become_call(text)


def test_a_fenced_code_answer_streams_without_waiting_for_its_end() -> None:
    reader = ToolCallReader(["get_weather"], forced=False)
    sent = [reader.feed(e) for e in chunks(["```", "python\n", "print(1)\n", "```"])]
    assert sent[2][0]["choices"][0]["delta"]["content"] == "```python\n"
    assert sent[3][0]["choices"][0]["delta"]["content"] == "print(1)\n"


def test_json_that_names_a_tool_but_misses_its_required_arguments_is_text() -> None:
    schemas = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"], "additionalProperties": False}}
    assert calls_from_text('{"name": "get_weather", "arguments": {"town": 5}}', schemas) is None
    assert calls_from_text('{"name": "get_weather", "arguments": {"city": "P", "x": 1}}',
                           schemas) is None
    assert calls_from_text(CALL, schemas) is not None
    assert calls_from_text(CALL, {"get_weather": None}) is not None


def test_calls_one_per_line_are_parallel_calls() -> None:
    other = '{"name": "get_time", "arguments": {}}'
    calls = calls_from_text(f"{CALL}\n{other}\n", ["get_weather", "get_time"])
    assert calls is not None
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]


def test_a_stream_of_calls_is_held_and_text_after_them_released() -> None:
    from bunkhouse.api.tool_calls import _may_become_call
    names = ["get_weather", "get_time"]
    assert _may_become_call(f"{CALL}\n", names)
    assert _may_become_call(f"{CALL}\n{{\"name\": \"get_t", names)
    assert not _may_become_call(f"{CALL}\nSo the weather", names)
    assert not _may_become_call('{"name": "other", "arguments": {}}\n', names)


def test_a_required_call_keeps_its_tools_references() -> None:
    from bunkhouse.api.tool_calls import call_schema
    params = {"type": "object",
              "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string"}}}},
              "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
                             "again": {"$ref": "#"}, "first": {"$ref": "#/properties/items"}}}
    tool = {"type": "function", "function": {"name": "order", "parameters": params}}
    schema = call_schema([WEATHER, tool])
    assert schema["anyOf"][1]["properties"]["arguments"] == {"$ref": "#/$defs/tool1"}
    hoisted = schema["$defs"]["tool1"]
    assert "$defs" not in hoisted
    assert hoisted["properties"]["items"]["items"] == {"$ref": "#/$defs/tool1__Item"}
    assert hoisted["properties"]["again"] == {"$ref": "#/$defs/tool1"}
    assert hoisted["properties"]["first"] == {"$ref": "#/$defs/tool1/properties/items"}
    assert schema["$defs"]["tool1__Item"] == params["$defs"]["Item"]
    assert "$defs" not in call_schema([WEATHER])  # no references: as it was


def test_a_client_gets_keepalives_while_text_is_held_back(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    from bunkhouse.front import protocols
    monkeypatch.setattr(protocols, "KEEPALIVE_S", 0.0)
    pieces = ['{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}']
    for inner, ping in ((protocols.AnthropicShape("m"), b"event: ping"),
                        (protocols.ChatShape(), b": waiting"),
                        (protocols.ResponsesShape(responses.Echo({"input": "x"}, "m")),
                         b": waiting")):
        shaper = protocols.ToolCallShape(ToolCallReader(["get_weather"], forced=False),
                                         inner).stream()
        sent = [shaper.feed(e) for e in chunks(pieces)]
        assert all(ping in out for out in sent[2:4]), sent  # held: a keepalive each
        assert ping not in sent[-2] and sent[-2]  # the call itself


def test_a_failed_responses_stream_keeps_what_it_streamed() -> None:
    stream = responses.ResponseStream(responses.Echo({"input": "x"}, "m"))
    for chunk in ({"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
                  {"choices": [{"index": 0, "delta": {"content": "lo"}}]}):
        stream.feed(chunk)
    final = stream.failed("worker broke")[-1]["response"]
    assert final["status"] == "failed"
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["output"][0]["status"] == "incomplete"
