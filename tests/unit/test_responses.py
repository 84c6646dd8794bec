"""The Responses API's translation (api/responses.py) and its store
(front/response_store.py), on their own."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path
from typing import Any

import pytest

from bunkhouse.api import responses
from bunkhouse.errors import InvalidRequest
from bunkhouse.front.assemble import assemble_chat
from bunkhouse.front.protocols import ResponsesShape
from bunkhouse.front.response_store import ResponseStore, ResponseStoreError


def chat_request(body: dict[str, Any], history: list[dict[str, Any]] | None = None
                 ) -> dict[str, Any]:
    return responses.to_chat(body, responses.check_request(body), history or [])


def test_a_string_input_with_instructions_is_a_system_and_a_user_message() -> None:
    out = chat_request({"model": "m", "input": "hi", "instructions": "Be brief.",
                        "max_output_tokens": 9, "temperature": 0.5, "stream": True})
    assert out["messages"] == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "hi"}]
    assert out["max_tokens"] == 9 and out["temperature"] == 0.5 and out["model"] == "m"
    assert out["stream"] is True and out["stream_options"] == {"include_usage": True}


def test_items_become_messages_after_the_history() -> None:
    history = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "ok"}]
    out = chat_request({"input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]}, history)
    assert out["messages"][:2] == history
    assert out["messages"][2:] == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g",
                                                          "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]


def test_tools_tool_choice_and_text_format_are_translated() -> None:
    out = chat_request({"input": "hi", "tools": [
        {"type": "function", "name": "f", "description": "d",
         "parameters": {"type": "object"}}], "tool_choice": {"type": "function", "name": "f"},
        "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}}}})
    assert out["tools"] == [{"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object"}}}]
    assert out["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert out["parallel_tool_calls"] is False
    assert out["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object"}}}
    assert "response_format" not in chat_request({"input": "x",
                                                  "text": {"format": {"type": "text"}}})


@pytest.mark.parametrize("body,param", [
    ({}, "input"), ({"input": None}, "input"), ({"input": [1]}, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "function_call", "call_id": 1, "name": "f", "arguments": "{}"}]},
     "input.0.call_id"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": "x", "model": 3}, "model"), ({"input": "x", "instructions": []}, "instructions"),
    ({"input": "x", "previous_response_id": 1}, "previous_response_id"),
    ({"input": "x", "top_p": 2}, "top_p"), ({"input": "x", "tools": {}}, "tools"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools.0.name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": []}]},
     "tools.0.parameters"),
    ({"input": "x", "tool_choice": "always"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ({"input": "x", "text": "json"}, "text"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
    ({"input": ["x"] * (responses.MAX_INPUT_ITEMS + 1)}, "input"),
    ({"input": "x", "previous_response_id": ""}, "previous_response_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
     "input.0.arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
     "input.0.call_id"),
])
def test_bad_fields_are_named(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        chat_request(body)
    assert info.value.param == param


def test_an_output_may_answer_a_call_of_the_previous_response() -> None:
    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    out = chat_request({"input": [{"type": "function_call_output", "call_id": "c1",
                                   "output": "ok"}]}, history)
    assert out["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": "ok"}


def chat_answer(content: str | None, finish: str = "stop",
                calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                      "prompt_tokens_details": {"cached_tokens": 2}}}


def test_a_chat_answer_is_a_response_object() -> None:
    echo = responses.Echo({"input": "x", "metadata": {"a": "b"}}, "m")
    out = responses.response_from_chat(chat_answer("Hello"), echo)
    assert out["object"] == "response" and out["id"].startswith("resp_")
    assert out["status"] == "completed" and out["model"] == "m"
    assert out["metadata"] == {"a": "b"} and out["store"] is True
    (item,) = out["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == "Hello"
    assert out["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 2},
                            "output_tokens": 3,
                            "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": 10}
    cut = responses.response_from_chat(chat_answer("Hel", "length"), echo)
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


def test_tool_calls_and_reasoning_are_output_items() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    answer = chat_answer(None, "tool_calls", [call])
    answer["choices"][0]["message"]["reasoning_content"] = "thinking"
    out = responses.response_from_chat(answer, responses.Echo({"input": "x"}, "m"))
    assert [i["type"] for i in out["output"]] == ["reasoning", "function_call"]
    assert out["output"][1]["call_id"] == "call_1" and out["output"][1]["name"] == "f"
    # the next turn continues from the call, without the reasoning
    convo = responses.conversation([], responses.input_items("x"), out)
    assert convo == [{"role": "user", "content": "x"},
                     {"role": "assistant", "content": None, "tool_calls": [call]}]


def stream_events(pieces: list[dict[str, Any]], finish: str = "stop") -> list[dict[str, Any]]:
    chunks = [{"choices": [{"index": 0, "delta": p, "finish_reason": None}]} for p in pieces]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}})
    done: list[dict[str, Any]] = []
    stream = responses.ResponseStream(responses.Echo({"input": "x"}, "m"), done.append)
    events = [e for c in chunks for e in stream.feed(c)] + stream.end()
    assert len(done) == 1 and events[-1]["response"] == done[0]
    whole = assemble_chat(chunks)
    assert [i["type"] for i in done[0]["output"]] == [
        i["type"] for i in responses.response_from_chat(
            whole, responses.Echo({"input": "x"}, "m"))["output"]]
    return events


def test_a_streamed_text_answer_has_openais_event_sequence() -> None:
    events = stream_events([{"role": "assistant", "content": None}, {"content": "Hel"},
                            {"content": "lo"}])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[6]["text"] == "Hello"
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["total_tokens"] == 6
    assert {e["item_id"] for e in events[3:8]} == {events[2]["item"]["id"]}


def _items_done(events: list[dict[str, Any]]) -> list[str]:
    """Every status a finished item has: in output_item.done and in the final response."""
    final = events[-1]["response"]["output"]
    return ([e["item"]["status"] for e in events if e["type"] == "response.output_item.done"]
            + [item["status"] for item in final])


def test_every_streamed_item_is_done_when_it_is_done() -> None:
    text = stream_events([{"content": "Hello"}])
    assert _items_done(text) == ["completed", "completed"]
    reasoned = stream_events([{"reasoning_content": "Think."}, {"content": "Hi"}])
    assert _items_done(reasoned) == ["completed"] * 4
    called = stream_events([{"content": "Calling."}, {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "f", "arguments": "{}"}}]}], "tool_calls")
    assert _items_done(called) == ["completed"] * 4
    cut = stream_events([{"content": "Hel"}], "length")  # max_output_tokens
    assert _items_done(cut) == ["incomplete", "incomplete"]


def test_a_streamed_call_has_argument_deltas() -> None:
    events = stream_events([
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "f", "arguments": "{\"a\""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}], "tool_calls")
    kinds = [e["type"] for e in events]
    assert kinds.count("response.function_call_arguments.delta") == 2
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == "{\"a\": 1}"
    added = next(e for e in events if e["type"] == "response.output_item.added")
    assert added["item"]["name"] == "f" and added["item"]["call_id"] == "call_1"


def test_a_stream_cut_by_max_tokens_is_incomplete_and_a_failure_is_failed() -> None:
    events = stream_events([{"content": "Hel"}], "length")
    assert events[-1]["type"] == "response.incomplete"
    stream = responses.ResponseStream(responses.Echo({"input": "x"}, "m"))
    failed = stream.failed("worker broke", "engine_unavailable")
    assert [e["type"] for e in failed] == ["response.created", "response.in_progress",
                                           "response.failed"]
    assert failed[-1]["response"]["error"] == {"code": "engine_unavailable",
                                               "message": "worker broke"}


def _midway() -> tuple[responses.ResponseStream, list[dict[str, Any]], list[dict[str, Any]]]:
    """A stream two text deltas into its message: the stream, its events, what it reported."""
    done: list[dict[str, Any]] = []
    stream = responses.ResponseStream(responses.Echo({"input": "x"}, "m"), done.append)
    events = [e for piece in ("Hel", "lo") for e in stream.feed(
        {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})]
    return stream, events, done


def test_a_failure_mid_item_closes_the_item_and_reports_the_failed_response() -> None:
    stream, events, done = _midway()
    events += stream.failed("worker broke", "engine_unavailable")
    kinds = [e["type"] for e in events]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-2]["item"]["status"] == "incomplete"
    (final,) = done  # reported, to be stored, as it was sent
    assert final == events[-1]["response"] and final["status"] == "failed"
    assert final["error"] == {"code": "engine_unavailable", "message": "worker broke"}
    assert final["output"][0]["content"][0]["text"] == "Hello"


def test_a_stream_its_client_left_is_reported_incomplete_with_what_was_made() -> None:
    stream, _, done = _midway()
    stream.cut()
    (final,) = done
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": responses.CLIENT_LEFT}
    assert [(i["status"], i["content"][0]["text"]) for i in final["output"]] == [
        ("incomplete", "Hello")]
    unseen: list[dict[str, Any]] = []  # left before response.created: no one knows its id
    responses.ResponseStream(responses.Echo({"input": "x"}, "m"), unseen.append).cut()
    assert unseen == []


def test_input_items_pages() -> None:
    items = [{"id": f"i{n}"} for n in range(5)]
    page = responses.input_items_page(items, limit=2, order="desc", after=None)
    assert [i["id"] for i in page["data"]] == ["i4", "i3"] and page["has_more"]
    page = responses.input_items_page(items, limit=10, order="asc", after="i2")
    assert [i["id"] for i in page["data"]] == ["i3", "i4"] and not page["has_more"]
    assert page["first_id"] == "i3" and page["last_id"] == "i4"
    with pytest.raises(InvalidRequest):
        responses.input_items_page(items, limit=2, order="asc", after="zzz")


def _response(n: int) -> dict[str, Any]:
    return {"id": f"resp_{n}", "object": "response", "output": [], "n": n}


def test_the_store_keeps_responses_privately_across_reopening(tmp_path: Path) -> None:
    path = tmp_path / "data" / "r.db"

    async def run() -> None:
        store = ResponseStore(path)
        assert await store.open() == 0
        store.put("", _response(1), [{"id": "i"}], [{"role": "user", "content": "x"}])
        assert await store.response("resp_1", "") == _response(1)  # read after the queued write
        assert await store.items("resp_1", "") == [{"id": "i"}]
        assert await store.conversation("resp_1", "") == [{"role": "user", "content": "x"}]
        assert await store.response("resp_2", "") is None
        await store.close()
        again = ResponseStore(path)
        assert await again.open() == 1
        again.put("alice", _response(3), [], [])
        assert await again.response("resp_3", "bob") is None  # another client's
        assert not await again.delete("resp_3", "bob")
        assert await again.response("resp_3", None) == _response(3)  # an admin's view
        assert await again.response("resp_3", "alice") == _response(3)
        assert await again.delete("resp_1", "") and not await again.delete("resp_1", "")
        assert await again.response("resp_1", None) is None
        await again.close()

    asyncio.run(run())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with open(path, "rb") as f:
        assert f.read(16) == b"SQLite format 3\x00"


def test_retention_keeps_the_newest_by_count_and_drops_old_ones(tmp_path: Path) -> None:
    path = tmp_path / "r.db"

    async def run() -> None:
        store = ResponseStore(path, max_count=3)
        await store.open()
        for n in range(6):
            store.put("", _response(n), [], [])
            await asyncio.sleep(0.01)
        kept = [n for n in range(6) if await store.response(f"resp_{n}", None)]
        assert kept == [3, 4, 5]
        await store.close()
        # a lower limit, and an age limit, apply at the next start
        aged = ResponseStore(path, max_count=2, max_age_s=3600)
        assert await aged.open() == 2
        await aged.close()
        await asyncio.sleep(0.05)
        young = ResponseStore(path, max_age_s=0.01)
        assert await young.open() == 0
        await young.close()

    asyncio.run(run())


def _files_hold(path: Path, marker: bytes) -> list[str]:
    """Which of the database's files (the file, -wal, -shm, -journal) hold ``marker``."""
    return [f.name for f in path.parent.glob(f"{path.name}*") if marker in f.read_bytes()]


def _marked(n: int, marker: str) -> tuple[dict[str, Any], list[dict[str, Any]],
                                          list[dict[str, Any]]]:
    said = {"role": "user", "content": f"my secret is {marker}"}
    return ({**_response(n), "output": [{"type": "message", "content": marker}]},
            [{"id": "i", **said}], [said, {"role": "assistant", "content": marker}])


def test_a_deleted_or_dropped_response_leaves_every_file_of_the_store(tmp_path: Path) -> None:
    """Deleted is gone: the text of a response deleted by a client, or dropped by count or
    bytes, is in none of the files (database, WAL, shared memory) once the call returns,
    while the store stays open and after later writes."""
    path = tmp_path / "r.db"

    async def run() -> None:
        store = ResponseStore(path, max_count=3, max_bytes=100_000)
        await store.open()
        store.put("", *_marked(1, "MARKER-DELETED-7f3a"))
        store.put("", *_marked(2, "MARKER-KEPT-91bc"))
        assert await store.response("resp_1", "") is not None
        assert _files_hold(path, b"MARKER-DELETED-7f3a")  # it was written somewhere
        assert await store.delete("resp_1", "")
        assert _files_hold(path, b"MARKER-DELETED-7f3a") == []
        assert _files_hold(path, b"MARKER-KEPT-91bc")  # the others stay
        for n in range(3, 6):  # pushes resp_2 out by count
            store.put("", *_marked(n, f"MARKER-LATER-{n}"))
        assert await store.response("resp_2", "") is None
        assert _files_hold(path, b"MARKER-KEPT-91bc") == []
        big = "x" * 15_000  # held 4 times in a row: two rows are over the byte budget
        store.put("", *_marked(6, "MARKER-BIG-6" + big))
        store.put("", *_marked(7, "MARKER-BIG-7" + big))
        assert await store.response("resp_6", "") is None
        assert await store.response("resp_7", "") is not None
        assert _files_hold(path, b"MARKER-BIG-6") == []
        await store.close()

    asyncio.run(run())


def test_the_store_is_bounded_by_bytes_and_a_row_over_them_is_not_stored(
        tmp_path: Path) -> None:
    path = tmp_path / "r.db"

    async def run() -> None:
        store = ResponseStore(path, max_bytes=10_000)
        await store.open()
        with pytest.raises(InvalidRequest) as refused:
            store.check(10_001)  # a request that can never fit: 400 naming store
        assert refused.value.param == "store" and "store: false" in refused.value.message
        store.check(10_000)
        for n in range(20):  # ~2,400 bytes each: at most four fit
            store.put("", _response(n), [{"text": "y" * 800}], [{"content": "z" * 1_500}])
        kept = [n for n in range(20) if await store.response(f"resp_{n}", None)]
        assert kept == [16, 17, 18, 19]
        store.put("", _response(99), [{"text": "w" * 20_000}], [])  # alone over the budget
        assert await store.response("resp_99", None) is None
        assert [n for n in range(20) if await store.response(f"resp_{n}", None)] == kept
        await store.close()

    asyncio.run(run())


def test_an_unusable_path_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")

    async def run() -> None:
        with pytest.raises(ResponseStoreError) as info:
            await ResponseStore(tmp_path / "file" / "r.db").open()
        assert str(tmp_path) not in info.value.message  # a client sees no server path
        assert info.value.detail is not None and "file" in info.value.detail
        assert info.value.status == 503

    asyncio.run(run())


def test_a_file_that_is_not_ours_is_left_untouched(tmp_path: Path) -> None:
    import os
    import sqlite3

    text = tmp_path / "notes.db"
    text.write_text("my notes")
    other = tmp_path / "other.db"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE responses (x)")
    con.commit()
    con.close()
    for path in (text, other):
        os.chmod(path, 0o644)
        before = (path.read_bytes(), path.stat().st_mode)

        async def run(path: Path = path) -> None:
            store = ResponseStore(path)
            with pytest.raises(ResponseStoreError) as info:
                await store.open()
            assert "not a bunkhouse response store" in (info.value.detail or "")
            with pytest.raises(ResponseStoreError):
                store.check()

        asyncio.run(run())
        assert (path.read_bytes(), path.stat().st_mode) == before
        assert not Path(f"{path}-wal").exists()


def test_age_applies_to_lookups_without_a_write(tmp_path: Path) -> None:
    async def run() -> None:
        store = ResponseStore(tmp_path / "r.db", max_age_s=0.2)
        await store.open()
        store.put("", _response(1), [], [])
        assert await store.response("resp_1", "") is not None
        await asyncio.sleep(0.3)
        assert await store.response("resp_1", "") is None
        await store.close()

    asyncio.run(run())


def test_a_failed_write_is_logged_not_raised(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        store = ResponseStore(tmp_path / "r.db")
        await store.open()
        store.put("", {"id": "resp_x", "bad": {1, 2}}, [], [])  # not JSON: the write fails
        assert await store.response("resp_x", None) is None
        await store.close()

    asyncio.run(run())
    assert "not stored" in caplog.text



@pytest.mark.parametrize("chat,ours", [
    ("tools.3.function.parameters", "tools.3.parameters"),
    ("tools.3.function.parameters.properties.x", "tools.3.parameters.properties.x"),
    ("response_format", "text.format"), ("max_tokens", "max_output_tokens"),
    ("messages", "input"), ("messages.4.content", "input"), ("temperature", "temperature"),
    (None, None)])
def test_a_chat_field_a_refusal_names_is_named_as_the_responses_api_names_it(
        chat: str | None, ours: str | None) -> None:
    from bunkhouse.api.fields import renamed
    assert renamed(chat, responses.CHAT_FIELDS) == ours


def test_a_shape_reports_each_stream_once_however_it_ends() -> None:
    done: list[dict[str, Any]] = []
    chunk = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop"}]}
    for ending in ("end", "error", "left"):
        shape = ResponsesShape(responses.Echo({"input": "x"}, "m"), done.append)
        stream = shape.stream()
        stream.feed(chunk)
        if ending == "end":
            stream.end()
        elif ending == "error":
            stream.error({"error": {"message": "broke", "code": "engine_unavailable"}})
        shape.sent()  # the answer's sending is over, whatever happened
        shape.sent()
    assert [r["status"] for r in done] == ["completed", "failed", "incomplete"]
