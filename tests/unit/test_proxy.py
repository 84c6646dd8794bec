"""The proxy against httpx.MockTransport: pass-through, error re-shaping, broken workers."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from bunkhouse.engines.contract import Timings
from bunkhouse.engines.llamacpp import LlamaCppClient
from bunkhouse.errors import BunkhouseError, error_body
from bunkhouse.front.assemble import LineSplitter, sse_lines
from bunkhouse.front.protocols import AnthropicShape
from bunkhouse.front.proxy import forward
from bunkhouse.front.relay import Relay
from tests.helpers import asgi_messages

Handler = Callable[[httpx.Request], httpx.Response]


def _front(handler: Handler) -> TestClient:
    upstream = LlamaCppClient(httpx.MockTransport(handler), "m")

    async def route(request: Request) -> Response:
        body = await request.body()
        try:
            return await forward(upstream, "/v1/chat/completions", body,
                                 stream=json.loads(body).get("stream", False),
                                 request=request, model_id="m")
        except BunkhouseError as e:
            return JSONResponse(error_body(e), status_code=e.status)

    return TestClient(Starlette(routes=[Route("/c", route, methods=["POST"])]))


def test_plain_answer_passes_through_unchanged() -> None:
    seen: list[bytes] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req.content)
        return httpx.Response(200, json={"choices": [{"message": {"content": "Paris"}}]})

    body = b'{"messages": [], "unknown_field": 1}'
    resp = _front(handler).post("/c", content=body)
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["message"]["content"] == "Paris"
    assert seen == [body]  # the body reaches the engine byte for byte


def test_stream_passes_through_chunk_by_chunk() -> None:
    events = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]

    async def body() -> AsyncIterator[bytes]:
        for e in events:
            yield e

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    with _front(handler).stream("POST", "/c", content=b'{"stream": true}') as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert b"".join(resp.iter_raw()) == b"".join(events)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_errors_become_envelopes(stream: bool) -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        err = {"code": 400, "message": "context too long", "type": "exceed_context_size_error"}
        return httpx.Response(400, json={"error": err})

    resp = _front(handler).post("/c", json={"stream": stream})
    assert resp.status_code == 400
    assert resp.json() == {"error": {
        "message": "the engine refused the request: context too long",
        "code": "invalid_request", "type": "invalid_request_error", "param": None}}


@pytest.mark.parametrize("message", [
    "image input is not supported - hint: if this is unexpected, you may need to provide the "
    "mmproj",
    "input (702 tokens) is too large to process. increase the physical batch size (current "
    "batch size: 512)",
    "[json.exception.type_error.302] type must be number, but is string",
])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_refusals_answered_with_a_500_are_400(stream: bool, message: str) -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"error": {"code": 500, "message": message,
                                                   "type": "server_error"}})

    resp = _front(handler).post("/c", json={"stream": stream})
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "invalid_request"


def test_an_engine_refusal_naming_a_field_names_it_as_param() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {
            "code": 400, "message": "Field 'n': Value must be between 1 <= value <= 4",
            "type": "invalid_request_error"}})

    resp = _front(handler).post("/c", json={})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"


def test_non_json_engine_error_keeps_its_text() -> None:
    resp = _front(lambda req: httpx.Response(500, text="boom")).post("/c", json={})
    assert resp.status_code == 500
    assert resp.json()["error"]["message"] == "boom"


@pytest.mark.parametrize("stream", [False, True])
def test_unreachable_worker_is_502(stream: bool) -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("no such socket", request=req)

    resp = _front(handler).post("/c", json={"stream": stream})
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "engine_unavailable"


def test_stream_that_breaks_ends_with_an_error_event() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b'data: {"n": 1}\n\n'
        raise httpx.ReadError("worker died")

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    with _front(handler).stream("POST", "/c", json={"stream": True}) as resp:
        text = b"".join(resp.iter_raw()).decode()
    first, error = text.strip().split("\n\n")
    assert first == 'data: {"n": 1}'
    assert error.startswith("event: error\ndata: ")
    payload = json.loads(error.split("data: ", 1)[1])
    assert payload["error"]["code"] == "engine_unavailable"


def test_an_assembled_answer_that_breaks_names_no_transport_detail() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
        raise httpx.RemoteProtocolError("peer closed connection without sending complete "
                                        "message body: incomplete chunked read")

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    upstream = LlamaCppClient(httpx.MockTransport(handler), "m")

    async def route(request: Request) -> Response:
        try:
            return await forward(upstream, "/v1/chat/completions", {"messages": []},
                                 stream=False, request=request, model_id="m")
        except BunkhouseError as e:
            return JSONResponse(error_body(e), status_code=e.status)

    client = TestClient(Starlette(routes=[Route("/c", route, methods=["POST"])]))
    resp = client.post("/c", content=b"{}")
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["code"] == "engine_unavailable"
    assert error["message"] == "model 'm': its worker's answer broke off; retry"


def test_plain_answer_holding_unicode_line_separators_is_assembled_whole() -> None:
    # Found by the fuzz against a real worker: a generated U+2028 split an SSE event in two
    # and the plain answer became a 500.
    text = "one\u2028two\x85three"

    def handler(req: httpx.Request) -> httpx.Response:
        assert json.loads(req.content)["stream"] is True  # sent upstream as a stream
        event = json.dumps({"choices": [{"index": 0, "delta": {"content": text},
                                         "finish_reason": "stop"}]}, ensure_ascii=False)
        return httpx.Response(200, content=f"data: {event}\n\ndata: [DONE]\n\n".encode(),
                              headers={"content-type": "text/event-stream"})

    upstream = LlamaCppClient(httpx.MockTransport(handler), "m")

    async def route(request: Request) -> Response:
        body = await request.body()
        return await forward(upstream, "/v1/chat/completions", json.loads(body), stream=False,
                             request=request, model_id="m")

    client = TestClient(Starlette(routes=[Route("/c", route, methods=["POST"])]))
    resp = client.post("/c", json={"messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["message"]["content"] == text


@pytest.mark.parametrize(("message", "param"), [
    ("Failed to initialize samplers: failed to parse grammar", "grammar"),
    ("JSON schema conversion failed: cannot resolve $ref #/nope", "response_format"),
    ("Prompt contains invalid tokens", "messages"),  # the route here is chat
])
def test_an_engine_refusal_about_a_field_names_it(message: str, param: str) -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"code": 400, "message": message,
                                                   "type": "invalid_request_error"}})

    resp = _front(handler).post("/c", json={})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param


def _never_disconnects() -> Request:
    async def receive() -> dict[str, object]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/embeddings", {"input": ["a", "b"]}),  # one piece from the engine
])
def test_a_plain_answer_the_engine_sends_whole_is_relayed_as_it_arrives(
        path: str, body: dict[str, object]) -> None:
    """The front hands the client the first bytes while the engine is still sending: it
    never holds the whole answer (it would wait forever here if it did)."""
    async def run() -> None:
        rest = asyncio.Event()

        async def upstream_body() -> AsyncIterator[bytes]:
            yield b'{"data": ['
            await rest.wait()
            yield b"1]}"

        def handler(req: httpx.Request) -> httpx.Response:
            return httpx.Response(200, content=upstream_body(),
                                  headers={"content-type": "application/json",
                                           "content-length": "14"})

        done: list[bool] = []
        upstream = LlamaCppClient(httpx.MockTransport(handler), "m")
        resp = await asyncio.wait_for(
            forward(upstream, path, body, stream=False, request=_never_disconnects(),
                    model_id="m", on_done=lambda: done.append(True)), 60)
        assert isinstance(resp, Relay)
        assert resp.headers["content-length"] == "14" and not done
        sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        relaying = asyncio.create_task(asgi_messages(resp, sent))
        assert (await sent.get())["type"] == "http.response.start"
        assert (await sent.get())["body"] == b'{"data": ['
        rest.set()
        await relaying
        rest_body = b""
        while not sent.empty():
            rest_body += sent.get_nowait()["body"]
        assert rest_body == b"1]}" and done

    asyncio.run(run())


@pytest.mark.parametrize("cuts", [[1], [5, 6], [3, 17, 18, 40], list(range(1, 80))])
def test_lines_split_across_chunks_are_joined(cuts: list[int]) -> None:
    data = ('data: {"text": "é\u2028x"}\r\n\r\ndata: {"n": 2}\r\rdata: [DONE]\n').encode()
    edges = [0, *[c for c in cuts if c < len(data)], len(data)]
    splitter, lines = LineSplitter(), []
    for a, b in itertools.pairwise(edges):
        lines += splitter.feed(data[a:b])
    lines += splitter.close()
    assert [ln for ln in lines if ln] == [ln for ln in sse_lines(data) if ln]


@pytest.mark.parametrize("stream", [False, True])
def test_the_engines_timings_reach_an_observer_streamed_or_assembled(stream: bool) -> None:
    final = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
             "timings": {"prompt_n": 3, "cache_n": 2990}}
    raw = (b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
           + f"data: {json.dumps(final)}\n\n".encode() + b"data: [DONE]\n\n")
    seen: list[Timings] = []

    async def body() -> AsyncIterator[bytes]:
        for i in range(0, len(raw), 7):  # lines cut anywhere
            yield raw[i:i + 7]

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    upstream = LlamaCppClient(httpx.MockTransport(handler), "m")

    async def route(request: Request) -> Response:
        data = {"messages": [], "stream": stream}
        return await forward(upstream, "/v1/chat/completions", data, stream=stream,
                             request=request, model_id="m", on_timings=seen.append)

    client = TestClient(Starlette(routes=[Route("/c", route, methods=["POST"])]))
    resp = client.post("/c", content=b"{}")
    assert resp.status_code == 200
    assert seen == [Timings(prompt_tokens=3, cached_tokens=2990, generated_tokens=0)]
    if not stream:
        assert resp.json()["choices"][0]["message"]["content"] == "hi"


def test_a_client_that_stops_reading_ends_its_answer_and_frees_what_it_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed answer whose client reads nothing for SEND_TIMEOUT_S is ended: the
    upstream is closed and ``on_done`` (its slot, compute turn and lease) runs."""
    from bunkhouse.front import relay

    monkeypatch.setattr(relay, "SEND_TIMEOUT_S", 0.2)

    async def tokens() -> AsyncIterator[bytes]:
        for n in itertools.count():
            yield f'data: {{"n": {n}}}\n\n'.encode()
            await asyncio.sleep(0)

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=tokens())

    async def go() -> None:
        upstream = LlamaCppClient(httpx.MockTransport(handler), "m")
        done: list[bool] = []
        request = Request({"type": "http", "method": "POST", "path": "/", "headers": []})
        response = await forward(upstream, "/v1/chat/completions", b'{"stream": true}',
                                 stream=True, request=request, model_id="m",
                                 on_done=lambda: done.append(True))
        sent: list[dict[str, object]] = []

        async def stuck(message: dict[str, object]) -> None:
            sent.append(message)
            if len(sent) > 3:  # its socket buffers are full: the send never completes
                await asyncio.Event().wait()

        async def receive() -> dict[str, object]:
            await asyncio.Event().wait()  # never disconnects
            return {}

        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        await asyncio.wait_for(response(scope, receive, stuck), 60)  # type: ignore[arg-type]
        assert done == [True] and len(sent) == 4

    asyncio.run(go())


@pytest.mark.parametrize(("error", "kind"), [
    ({"code": 500, "message": "decode failed", "type": "server_error"}, "api_error"),
    ({"code": 400, "message": "the request exceeds the available context size",
      "type": "exceed_context_size_error"}, "invalid_request_error")])
def test_an_engine_error_has_one_type_before_a_stream_and_in_it(error: dict[str, object],
                                                                kind: str) -> None:
    """Anthropic's shape: the engine's error answered with its status, and the same error
    sent inside its stream (after an answer began), are one type."""
    def route_with(handler: Handler) -> TestClient:
        upstream = LlamaCppClient(httpx.MockTransport(handler), "m")

        async def route(request: Request) -> Response:
            return await forward(upstream, "/v1/chat/completions", await request.body(),
                                 stream=True, request=request, model_id="m",
                                 shape=AnthropicShape("m"))

        return TestClient(Starlette(routes=[Route("/c", route, methods=["POST"])]))

    before = route_with(lambda req: httpx.Response(int(str(error["code"])),
                                                   json={"error": error}))
    assert before.post("/c", content=b"{}").json()["error"]["type"] == kind
    events = [b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n',
              b"data: " + json.dumps({"error": error}).encode() + b"\n\n"]
    during = route_with(lambda req: httpx.Response(200, content=b"".join(events), headers={
        "content-type": "text/event-stream"}))
    text = during.post("/c", content=b"{}").text
    last = json.loads(text.strip().split("\n\n")[-1].split("data: ", 1)[1])
    assert "message_start" in text and last["type"] == "error"
    assert last["error"]["type"] == kind
