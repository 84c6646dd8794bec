"""The proxy from the front to one worker: bytes stream through as the engine produces them.

A client that disconnects cancels the upstream request: for a stream, Starlette cancels the
body iterator and closing the upstream response closes the socket, which llama.cpp notices at
its next token; for a plain request the upstream call is raced against the disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from bunkhouse.errors import EngineUnavailable, envelope, error_body

log = logging.getLogger(__name__)

_JSON = {"content-type": "application/json"}


def engine_error(status: int, body: bytes) -> JSONResponse:
    """An engine's error answer, re-shaped into the OpenAI envelope (code ``engine_error``)."""
    message, type_ = body.decode("utf-8", errors="replace")[:2000], "server_error"
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        err: Any = json.loads(body)["error"]
        message = str(err.get("message", message))
        type_ = str(err.get("type", type_))
    return JSONResponse(envelope(message, type_, "engine_error"), status_code=status)


def _nothing() -> None:
    pass


async def forward(client: httpx.AsyncClient, path: str, body: bytes, *, stream: bool,
                  request: Request, model_id: str,
                  on_done: Callable[[], None] = _nothing) -> Response:
    """Send ``body`` to the worker behind ``client`` and relay its answer.

    ``on_done`` runs once the upstream exchange is over: for a stream, when the relay ends
    (completed, broken or the client gone), else before the answer is returned. If this
    raises, ``on_done`` may not have run.
    """
    upstream = client.build_request("POST", path, content=body, headers=_JSON)
    if stream:
        return await _forward_stream(client, upstream, model_id, on_done)
    try:
        return await _forward_once(client, upstream, request, model_id)
    finally:
        on_done()


async def _send(client: httpx.AsyncClient, upstream: httpx.Request,
                model_id: str) -> httpx.Response:
    try:
        return await client.send(upstream, stream=True)
    except httpx.TransportError as e:
        raise EngineUnavailable(f"model {model_id!r}: worker unreachable: {e!r}") from e


async def _forward_stream(client: httpx.AsyncClient, upstream: httpx.Request, model_id: str,
                          on_done: Callable[[], None]) -> Response:
    resp = await _send(client, upstream, model_id)
    if resp.status_code >= 400:
        try:
            return engine_error(resp.status_code, await resp.aread())
        finally:
            await resp.aclose()
            on_done()
    return _Relay(resp, model_id, on_done)


class _Relay(StreamingResponse):
    """Streams the worker's answer; closes it and calls ``on_done`` however the send ends,
    even when the client is gone before the first byte (the body iterator never starts)."""

    def __init__(self, upstream: httpx.Response, model_id: str,
                 on_done: Callable[[], None]) -> None:
        super().__init__(
            _relay(upstream, model_id),
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type", "text/event-stream"),
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )
        self._upstream = upstream
        self._on_done = on_done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._upstream.aclose()
            self._on_done()


async def _relay(resp: httpx.Response, model_id: str) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    except httpx.TransportError as e:
        log.warning("model %s: stream from worker broke: %r", model_id, e)
        err = EngineUnavailable(f"model {model_id!r}: worker stream broke: {e!r}")
        yield b"event: error\ndata: " + json.dumps(error_body(err)).encode() + b"\n\n"
    finally:
        await resp.aclose()


async def _forward_once(
    client: httpx.AsyncClient, upstream: httpx.Request, request: Request, model_id: str
) -> Response:
    call = asyncio.create_task(_call(client, upstream, model_id))
    gone = asyncio.create_task(_client_gone(request))
    try:
        done, _ = await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (call, gone):
            task.cancel()
    if call in done:
        return call.result()
    log.info("model %s: client disconnected; upstream request cancelled", model_id)
    await asyncio.gather(call, return_exceptions=True)
    return Response(status_code=499)


async def _call(client: httpx.AsyncClient, upstream: httpx.Request, model_id: str) -> Response:
    resp = await _send(client, upstream, model_id)
    try:
        content = await resp.aread()
    except httpx.TransportError as e:
        raise EngineUnavailable(f"model {model_id!r}: worker answer broke: {e!r}") from e
    finally:
        await resp.aclose()
    if resp.status_code >= 400:
        return engine_error(resp.status_code, content)
    return Response(content, status_code=resp.status_code, headers=_JSON)


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
