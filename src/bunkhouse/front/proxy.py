"""The proxy from the front to one worker: bytes stream through as the engine produces them.

A client that disconnects cancels the upstream request: for a stream, the relay
(front/relay.py) closes the upstream response, which llama.cpp notices at its next token; for
a plain request the upstream call is raced against the disconnect.

The front never holds a whole upstream answer: a plain answer the engine makes in one piece
(embeddings, several choices) is relayed as its bytes arrive, and one assembled from a stream
(front/assemble.py) is folded event by event; an engine's error body is read up to
:data:`MAX_ERROR_BYTES`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from bunkhouse.api.usage import StreamUsage, choices_per_prompt
from bunkhouse.engines.contract import EngineClient
from bunkhouse.errors import BunkhouseError, EngineUnavailable
from bunkhouse.front.assemble import (
    DONE,
    Assembly,
    ChatAssembly,
    CompletionAssembly,
    LineSplitter,
    StreamError,
    data_event,
)
from bunkhouse.front.relay import (
    Bytes,
    LineRewrite,
    Lines,
    OnTimings,
    Pipe,
    Relay,
    Shaped,
    StreamShaper,
    stream_status,
)

log = logging.getLogger(__name__)


class Shape(Protocol):
    """Another protocol's view of a chat completion answer (front/protocols.py)."""

    media_type: str
    """Its stream's content type."""

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]: ...

    def error(self, status: int, body: dict[str, Any]) -> dict[str, Any]:
        """An OpenAI error envelope, re-enveloped for the protocol."""

    def stream(self) -> StreamShaper: ...

MAX_ERROR_BYTES = 1 << 20
"""Most of an engine's error body read (its errors are a few hundred bytes)."""


def _engine_error(engine: EngineClient, status: int, body: bytes, route: str,
                  shape: Shape | None = None) -> JSONResponse:
    """The engine's error answer in the OpenAI envelope, as its adapter shapes it (a refusal
    of the request's input is a 400 naming the field); in ``shape``'s protocol if given."""
    status, content = engine.error(status, body, route)
    if shape is not None:
        content = shape.error(status, content)
    return JSONResponse(content, status_code=status)


def _nothing() -> None:
    pass


def stream_broke(model_id: str, error: Exception) -> BunkhouseError:
    """What a client is told when the worker's stream breaks (the default ``on_broken``)."""
    return EngineUnavailable(f"model {model_id!r}: its worker's answer broke off; retry",
                             detail=repr(error))


def _unreadable(model_id: str, error: Exception) -> BunkhouseError:
    return EngineUnavailable(f"model {model_id!r}: its worker's answer was unreadable; retry",
                             detail=repr(error))


_ASSEMBLERS: dict[str, Callable[[int], Assembly]] = {
    "/v1/chat/completions": ChatAssembly,
    "/v1/completions": CompletionAssembly,
}


async def forward(engine: EngineClient, path: str, body: bytes | dict[str, Any], *,
                  stream: bool, request: Request, model_id: str, slot: int | None = None,
                  on_done: Callable[[], None] = _nothing,
                  on_broken: Callable[[Exception], BunkhouseError] | None = None,
                  on_timings: OnTimings | None = None, shape: Shape | None = None,
                  started: StreamShaper | None = None,
                  prompt_tokens: int | None = None, name: str | None = None) -> Response:
    """Send ``body`` to the worker behind ``engine`` and relay its answer.

    ``path``: a route of :data:`bunkhouse.engines.contract.GENERATION_ROUTES`, or ``/infill``
    (the engine's fill-in-the-middle). ``body`` is raw bytes, sent as they are, or a parsed
    request, serialized by the engine's client: a plain generation request given parsed is
    sent upstream as a stream and its answer assembled here (see front/assemble.py: so that
    a disconnect frees the slot). ``slot``: the slot the front chose for it (a parsed body
    only).
    ``on_done`` runs once the upstream exchange is over: for a stream, when the relay ends
    (completed, broken or the client gone), else before the answer is returned. If this
    raises, ``on_done`` may not have run. ``on_broken(error)`` is called once if a stream the
    worker was sending breaks, and returns the error the client gets as the stream's last
    event (default: 502 ``engine_unavailable``). ``on_timings(timings)`` is called with the
    engine's ``timings`` object of a single answer (streamed or assembled), if it sends one.
    ``shape``: the answer, a stream's events and errors in another protocol (a single chat
    answer only). ``started``: a stream whose first bytes ``shape``'s shaper ``started``
    already sent (front/waiting.py): it goes on with that shaper, and an engine's error is
    its error event, not a status. ``prompt_tokens``: the prompt's count, counted before
    (a stream's shaper that shows it first is told). ``name``: the model an OpenAI answer
    names, where it is not ``model_id``, the worker's (an adapter's id: its base's worker
    answers).
    """
    assembler: Assembler | None = None
    usage: LineRewrite | None = None
    renamed = name if name is not None and name != model_id else None
    if isinstance(body, dict):
        data = body
        fold = _ASSEMBLERS.get(path) if not stream else None
        if fold is not None:
            assembler = functools.partial(fold, choices_per_prompt(data))
            body = {**data, "stream": True, "stream_options": {"include_usage": True}}
        if stream and shape is None and path in _ASSEMBLERS and StreamUsage.needed(path, data):
            usage = StreamUsage(path, data)
        if stream and shape is None and renamed is not None \
                and (path in _ASSEMBLERS or path == "/infill"):
            usage = Renamed(model_id, renamed, usage)
    send: Upstream = functools.partial(_send, engine, path, body, slot)
    if stream:
        broken = on_broken or functools.partial(stream_broke, model_id)
        shaper = started or (shape.stream() if shape else None)
        if shaper is not None and prompt_tokens is not None:
            shaper.prompt(prompt_tokens)
        return await _forward_stream(engine, send, path, model_id, on_done, broken, on_timings,
                                     shape, shaper, started is not None, usage)
    return await _forward_once(engine, send, path, request, model_id, assembler, on_done,
                               on_timings, shape, renamed)


Upstream = Callable[[], Awaitable[httpx.Response]]


async def _send(engine: EngineClient, path: str, body: bytes | dict[str, Any],
                slot: int | None) -> httpx.Response:
    if path == "/infill":
        return await engine.infill(body, slot)
    return await engine.generate(path, body, slot)


async def _forward_stream(engine: EngineClient, send: Upstream, path: str, model_id: str,
                          on_done: Callable[[], None],
                          on_broken: Callable[[Exception], BunkhouseError],
                          on_timings: OnTimings | None, shape: Shape | None,
                          shaper: StreamShaper | None, started: bool,
                          usage: LineRewrite | None = None) -> Response:
    """``shaper``: the stream's, if in another protocol; ``started``: its first bytes were
    sent already (an error is its error event then); ``usage``: the OpenAI stream's lines
    rewritten to its usage rule (api/usage.py), else relayed as bytes."""
    resp = await send()
    if resp.status_code >= 400:
        try:
            if started and shaper is not None:
                _, content = engine.error(resp.status_code, await _read_error(resp), path)
                return StreamingResponse(iter([shaper.error(content)]))
            return _engine_error(engine, resp.status_code, await _read_error(resp), path,
                                 shape)
        finally:
            await resp.aclose()
            on_done()
    pipe: Pipe = (Shaped(engine, path, on_broken, on_timings, shaper) if shaper is not None
                  else Bytes(engine, on_broken, on_timings) if usage is None
                  else Lines(engine, on_broken, on_timings, usage))
    return Relay(resp, pipe, model_id, on_done, shape.media_type if shape else None)


async def _raw(resp: httpx.Response) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive (all at once if the transport read it already, as
    httpx does for a response made from bytes)."""
    if resp.is_stream_consumed:
        yield resp.content
        return
    async for chunk in resp.aiter_raw():
        yield chunk


async def _lines(resp: httpx.Response) -> AsyncIterator[str]:
    """The event stream's lines as they arrive (front/assemble.py LineSplitter)."""
    splitter = LineSplitter()
    async for chunk in _raw(resp):
        for line in splitter.feed(chunk):
            yield line
    for line in splitter.close():
        yield line


async def _read_error(resp: httpx.Response) -> bytes:
    """An error body, at most MAX_ERROR_BYTES of it."""
    content = b""
    async for chunk in _raw(resp):
        content += chunk
        if len(content) >= MAX_ERROR_BYTES:
            break
    return content[:MAX_ERROR_BYTES]


class Renamed:
    """An OpenAI stream's events (or one JSON answer) naming ``name`` where the engine named
    itself (``engine_name``: the worker answers for the adapter's base), then ``inner``'s
    rewrite. The engine writes compact JSON (``"model":"ID"``; a text's own quotes are
    escaped in it): a byte replace of the first, nothing parsed."""

    def __init__(self, engine_name: str, name: str, inner: LineRewrite | None) -> None:
        self._old = b'"model":' + json.dumps(engine_name).encode()
        self._new = b'"model":' + json.dumps(name).encode()
        self._inner = inner

    def line(self, raw: bytes) -> bytes | None:
        raw = raw.replace(self._old, self._new, 1)
        return raw if self._inner is None else self._inner.line(raw)


Assembler = Callable[[], Assembly]
"""A fresh fold of one plain answer (front/assemble.py)."""


async def _forward_once(engine: EngineClient, send: Upstream, path: str, request: Request,
                        model_id: str, assembler: Assembler | None,
                        on_done: Callable[[], None], on_timings: OnTimings | None,
                        shape: Shape | None = None, name: str | None = None) -> Response:
    call = asyncio.create_task(_call(engine, send, path, model_id, assembler, on_done,
                                     on_timings, shape, name))
    gone = asyncio.create_task(client_gone(request))
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


async def _call(engine: EngineClient, send: Upstream, path: str, model_id: str,
                assembler: Assembler | None, on_done: Callable[[], None],
                on_timings: OnTimings | None = None, shape: Shape | None = None,
                name: str | None = None) -> Response:
    """The answer to a plain request. ``on_done`` runs here once the exchange is over, or,
    for an answer relayed as it arrives, when the relay ends."""
    relayed = False
    try:
        resp = await send()
        try:
            if resp.status_code >= 400:
                return _engine_error(engine, resp.status_code, await _read_error(resp), path,
                                     shape)
            if assembler is None and shape is not None:  # a whole answer, reshaped
                try:
                    return JSONResponse(shape.answer(json.loads(await resp.aread())))
                except httpx.TransportError as e:
                    raise stream_broke(model_id, e) from e
                except ValueError as e:
                    raise _unreadable(model_id, e) from e
            if assembler is None and name is not None:  # one JSON answer, small: renamed
                try:
                    content = Renamed(model_id, name, None).line(await resp.aread()) or b""
                except httpx.TransportError as e:
                    raise stream_broke(model_id, e) from e
                return Response(content, status_code=resp.status_code,
                                media_type=resp.headers.get("content-type"))
            if assembler is None:
                relayed = True
                # a plain answer relayed with its length: a break is a short body
                return Relay(resp, Bytes(engine, None, None), model_id, on_done,
                             length=resp.headers.get("content-length"))
            return await _assemble(engine, path, resp, model_id, assembler(), shape, on_timings,
                                   name)
        finally:
            if not relayed:
                await resp.aclose()
    finally:
        if not relayed:
            on_done()


async def _assemble(engine: EngineClient, path: str, resp: httpx.Response, model_id: str,
                    assembly: Assembly, shape: Shape | None = None,
                    on_timings: OnTimings | None = None, name: str | None = None) -> Response:
    """Fold the engine's stream into one answer as it arrives; its figures, once it is
    whole, to ``on_timings``; ``name``: the model it names instead of the engine's."""
    timings = None
    try:
        async for line in _lines(resp):
            event = data_event(line)
            if event == DONE:
                break
            if isinstance(event, dict):
                assembly.add(event)
                timings = engine.timings(event) or timings
    except httpx.TransportError as e:
        raise stream_broke(model_id, e) from e
    except StreamError as e:
        return _engine_error(engine, stream_status(e.body), json.dumps(e.body).encode(), path,
                             shape)
    except ValueError as e:
        raise _unreadable(model_id, e) from e
    if on_timings is not None and timings is not None:
        on_timings(timings)
    result = assembly.result()
    if name is not None:
        result["model"] = name
    return JSONResponse(shape.answer(result) if shape else result)


async def client_gone(request: Request) -> None:
    """Returns once the client has disconnected."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
