"""OpenAI's Responses API through `bunkhouse serve`, driven by the real `openai` SDK: create,
stream, a three-turn chain by previous_response_id, retrieve, input items, delete, a tool
round trip, structured output; a chain continued after SIGKILL of the worker and after a
restart of the front; bad input in OpenAI's envelope."""

from __future__ import annotations

import json
import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.server import Server, serve
from tests.helpers import wait_for
from tests.models import QWEN

TERSE = "You are terse. Answer in a few words."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("responses"), "--preload", QWEN,
               "--responses-max", "4MiB") as running:
        yield running


def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=300)


def ask(client: openai.OpenAI, text: str, previous: str | None = None,
        **extra: Any) -> openai.types.responses.Response:
    given: dict[str, Any] = {"max_output_tokens": 24, **extra}
    return client.responses.create(model=QWEN, input=text, instructions=TERSE, temperature=0,
                                   previous_response_id=previous or openai.NOT_GIVEN, **given)


LONG = {"model": QWEN, "input": "Count from 1 to 300, separated by commas.",
        "max_output_tokens": 600, "temperature": 0, "stream": True}


def events_of(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """A Responses stream's events, as they arrive."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line[6:])


def stored(server: Server, response_id: str) -> dict[str, Any] | None:
    got = httpx.get(f"{server.url}/v1/responses/{response_id}", timeout=60)
    return got.json() if got.status_code == 200 else None  # type: ignore[no-any-return]


def test_a_stream_its_client_leaves_is_stored_incomplete_with_what_was_made(
        server: Server) -> None:
    seen = ""
    with httpx.stream("POST", f"{server.url}/v1/responses", json=LONG, timeout=300) as answer:
        for event in events_of(answer):
            if event["type"] == "response.created":
                response_id = event["response"]["id"]
            if event["type"] == "response.output_text.delta":
                seen += event["delta"]
                if len(seen) >= 8:
                    break  # the client leaves mid-answer
    kept = wait_for(lambda: stored(server, response_id), 60, "the cut response stored")
    assert kept["status"] == "incomplete"
    assert kept["incomplete_details"] == {"reason": "client_disconnected"}
    (message,) = kept["output"]
    assert message["status"] == "incomplete"
    assert message["content"][0]["text"].startswith(seen)


def test_create_stream_a_chain_retrieve_and_delete(server: Server) -> None:
    with sdk(server) as client:
        first = ask(client, "My name is Ada. Reply with just: OK")
        assert first.status == "completed" and first.object == "response"
        assert first.model == QWEN and first.output_text.strip()
        assert first.usage is not None and first.usage.input_tokens > 0
        second = ask(client, "My favourite colour is green. Reply with just: OK", first.id)
        assert second.previous_response_id == first.id
        # the third turn, streamed, knows both earlier turns
        with client.responses.stream(model=QWEN, input="What is my name?",
                                     instructions=TERSE, temperature=0, max_output_tokens=24,
                                     previous_response_id=second.id) as stream:
            events = list(stream)
            third = stream.get_final_response()
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "Ada" in third.output_text
        streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert streamed == third.output_text
        (message,) = third.output
        assert message.type == "message" and len(message.content) == 1
        # every item done is done: in output_item.done, the final response, the stored copy
        assert [e.item.status for e in events if e.type == "response.output_item.done"
                ] == [message.status] == ["completed"]
        # max_output_tokens is a ceiling: far above the slot, the answer is the same
        capped = ask(client, "What is my name?", second.id, max_output_tokens=100_000)
        assert capped.output_text == third.output_text

        kept = client.responses.retrieve(third.id)
        assert kept.output_text == third.output_text and kept.status == "completed"
        assert [item.status for item in kept.output] == ["completed"]  # type: ignore[union-attr]
        items = client.responses.input_items.list(third.id)
        assert [i.type for i in items.data] == ["message"]  # this turn's input only
        assert items.data[0].content[0].text == "What is my name?"  # type: ignore[union-attr]

        client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        # a later turn holds its whole conversation: deleting an earlier one breaks nothing
        colour = ask(client, "What is my favourite colour?", third.id)
        assert "green" in colour.output_text.lower()

        unstored = ask(client, "Say hi.", store=False)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unstored.id)


def test_a_function_call_round_trip_and_structured_output(server: Server) -> None:
    weather = {"type": "function", "name": "get_weather",
               "description": "Get the current weather for a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}}
    with sdk(server) as client:
        called = client.responses.create(model=QWEN, input="What is the weather in Paris?",
                                         tools=[weather],  # type: ignore[list-item]
                                         tool_choice="required", temperature=0)
        (call,) = called.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.arguments == '{"city": "Paris"}' and call.call_id
        with client.responses.stream(model=QWEN, input="What is the weather in Paris?",
                                     tools=[weather],  # type: ignore[list-item]
                                     tool_choice="required", temperature=0) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_response()
        assert "response.function_call_arguments.done" in kinds
        assert final.output[0].type == "function_call"
        answered = client.responses.create(
            model=QWEN, previous_response_id=called.id, temperature=0, max_output_tokens=48,
            input=[{"type": "function_call_output", "call_id": call.call_id,
                    "output": "Sunny, 18 degrees Celsius"}])
        assert "18" in answered.output_text  # the packaged model quotes the result

        person = client.responses.create(
            model=QWEN, input="Describe a person named Bob, aged 30.", temperature=0,
            text={"format": {"type": "json_schema", "name": "person", "schema": {
                "type": "object", "properties": {"name": {"type": "string"},
                                                 "age": {"type": "integer"}},
                "required": ["name", "age"]}}})
        import json
        assert json.loads(person.output_text) == {"name": "Bob", "age": 30}


@pytest.mark.parametrize("body,param", [
    ({"model": QWEN}, "input"),
    ({"model": QWEN, "input": 5}, "input"),
    ({"model": QWEN, "input": []}, "input"),
    ({"model": QWEN, "input": [{"type": "message", "role": "robot", "content": "x"}]},
     "input.0.role"),
    ({"model": QWEN, "input": [{"type": "input_image"}]}, "input.0.type"),
    ({"model": QWEN, "input": "hi", "temperature": "hot"}, "temperature"),
    ({"model": QWEN, "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": QWEN, "input": "hi", "tools": [7]}, "tools.0"),  # web_search: skipped
    ({"model": QWEN, "input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"model": QWEN, "input": "hi", "store": "yes"}, "store"),
    ({"model": QWEN, "input": "hi", "background": True}, "background"),
    ({"model": QWEN, "input": "hi", "metadata": {"k": 1}}, "metadata"),
    # hostile: more items than the bound, a megabyte type name, a tool flood
    ({"model": QWEN, "input": [{"role": "user", "content": "x"}] * 10_001}, "input"),
    ({"model": QWEN, "input": [{"type": "x" * 1_000_000}]}, "input.0.type"),
    ({"model": QWEN, "input": "hi", "tools": [{"type": "function", "name": "f"}] * 513},
     "tools"),
    # a schema the engine would stall on: 2,000 optional properties
    ({"model": QWEN, "input": "go", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {
            f"k{i}": {"type": "string"} for i in range(2000)}}}}}, "text.format"),
    ({"model": QWEN, "input": "go", "tools": [{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(2000)}}}]},
     "tools.0.parameters"),
])
def test_bad_input_is_a_400_naming_the_field(server: Server, body: dict[str, Any],
                                             param: str) -> None:
    resp = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert len(error["message"]) < 1000  # a client's value is quoted cut short


def test_a_deleted_response_leaves_every_file_of_the_store(server: Server) -> None:
    """Deleted is gone: once DELETE answers, no file of the database (the file, its WAL,
    its shared memory) holds the response's text, with the server still running."""
    marker = "quokka-7d41e9-marmalade"
    db = server.log.parent / "responses.db"

    def holding() -> list[str]:
        return [f.name for f in db.parent.glob("responses.db*")
                if marker.encode() in f.read_bytes()]

    with sdk(server) as client:
        made = ask(client, f"Repeat this word: {marker}", max_output_tokens=4)
        client.responses.retrieve(made.id)  # after the store's queued write
        assert holding()
        client.responses.delete(made.id)
        assert holding() == []
        ask(client, "Say hi.")  # later writes bring nothing back
        assert holding() == []


def test_a_response_too_large_to_store_is_a_400_naming_store(server: Server) -> None:
    """The store is bounded by bytes (here --responses-max 4MiB): a request whose stored
    answer could never fit is refused before any work, naming store."""
    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "string", "description": "d" * 5_000_000}}}
    resp = httpx.post(f"{server.url}/v1/responses", timeout=120, json={
        "model": QWEN, "input": "go", "max_output_tokens": 2,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}})
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert error["param"] == "store" and "store: false" in error["message"]


def test_unknown_ids_are_404s(server: Server) -> None:
    resp = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "model": QWEN, "input": "hi", "previous_response_id": "resp_nope"})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "previous_response_not_found"
    assert resp.json()["error"]["param"] == "previous_response_id"
    for method, path in (("GET", "/v1/responses/resp_nope"),
                         ("DELETE", "/v1/responses/resp_nope"),
                         ("GET", "/v1/responses/resp_nope/input_items")):
        got = httpx.request(method, f"{server.url}{path}", timeout=60)
        assert got.status_code == 404 and got.json()["error"]["code"] == "response_not_found"
    with sdk(server) as client:
        made = ask(client, "Say hi.")
    bad = httpx.get(f"{server.url}/v1/responses/{made.id}/input_items?limit=0", timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def test_a_chain_outlives_a_killed_worker_and_a_restarted_front(tmp_path: Path) -> None:
    db = tmp_path / "private" / "responses.db"
    with serve(tmp_path / "first", "--preload", QWEN, "--responses-db", str(db)) as server, \
            sdk(server) as client:
        first = ask(client, "My name is Ada. Reply with just: OK")
        pid = server.model(QWEN)["pid"]
        failed = kill_mid_stream(server, pid)
        wait_for(lambda: server.model(QWEN)["pid"] != pid, 120, "the killed worker noticed")
        assert failed["status"] == "failed" and failed["error"]["message"]
        # kept as it was sent: its items closed, its error, what was made before it
        assert stored(server, failed["id"]) == failed
        second = ask(client, "What is my name?", first.id)
        assert "Ada" in second.output_text
    assert stat.S_IMODE(db.stat().st_mode) == 0o600
    assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700
    with serve(tmp_path / "second", "--responses-db", str(db)) as server, \
            sdk(server) as client:
        third = ask(client, "What is my name, once more?", second.id)
        assert "Ada" in third.output_text
        assert client.responses.retrieve(first.id).output_text == first.output_text


def kill_mid_stream(server: Server, pid: int) -> dict[str, Any]:
    """SIGKILL of the worker ``pid`` while it streams a long answer: the failed response,
    after every item it opened was closed as incomplete."""
    with httpx.stream("POST", f"{server.url}/v1/responses", json=LONG, timeout=300) as answer:
        kinds: list[str] = []
        for event in events_of(answer):
            kinds.append(event["type"])
            if event["type"] == "response.output_text.delta" and kinds.count(
                    "response.output_text.delta") == 3:
                os.kill(pid, signal.SIGKILL)
            if event["type"] == "response.output_item.done":
                assert event["item"]["status"] == "incomplete"
            if event["type"] == "response.failed":
                assert kinds[-4:-1] == ["response.output_text.done",
                                        "response.content_part.done",
                                        "response.output_item.done"]
                return event["response"]  # type: ignore[no-any-return]
    raise AssertionError(f"no response.failed after the kill: {kinds[-5:]}")


def test_one_clients_stored_responses_are_not_anothers(tmp_path: Path) -> None:
    with serve(tmp_path, "--preload", QWEN, env={"BUNKHOUSE_API_KEYS": "alice-key,bob-key",
                                                 "BUNKHOUSE_ADMIN_KEYS": "admin-key"}) as server:
        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0,
                                 timeout=300)

        with client("alice-key") as alice, client("bob-key") as bob, \
                client("admin-key") as admin:
            made = ask(alice, "My name is Ada. Reply with just: OK")
            with pytest.raises(openai.NotFoundError):
                bob.responses.retrieve(made.id)
            with pytest.raises(openai.NotFoundError):
                bob.responses.input_items.list(made.id)
            with pytest.raises(openai.NotFoundError):
                ask(bob, "What is my name?", made.id)
            with pytest.raises(openai.NotFoundError):
                bob.responses.delete(made.id)
            assert admin.responses.retrieve(made.id).id == made.id
            assert "Ada" in ask(alice, "What is my name?", made.id).output_text
            alice.responses.delete(made.id)
            with pytest.raises(openai.NotFoundError):
                admin.responses.retrieve(made.id)


def test_a_store_that_cannot_be_used_is_a_503_and_no_file_of_yours_is_touched(
        tmp_path: Path) -> None:
    notes = tmp_path / "notes.db"
    notes.write_text("my notes")
    notes.chmod(0o644)
    with serve(tmp_path / "srv", "--preload", QWEN, "--responses-db", str(notes)) as server, \
            sdk(server) as client:
        with pytest.raises(openai.InternalServerError) as info:
            ask(client, "Say hi.")
        assert info.value.status_code == 503 and str(tmp_path) not in str(info.value)
        assert ask(client, "Say hi.", store=False).store is False  # served, not stored
    assert notes.read_text() == "my notes" and stat.S_IMODE(notes.stat().st_mode) == 0o644
    with serve(tmp_path / "off", "--preload", QWEN, "--responses-keep", "0") as server, \
            sdk(server) as client:
        assert ask(client, "Say hi.").store is False
