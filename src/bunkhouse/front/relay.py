"""The relay of a worker's streamed answer to its client: the front's per-token path.

At GPU rates a worker streams thousands of tokens a second, each its own event, and the front
wakes once per token per stream (docs/benchmarks.md, "The relay at GPU rates"). So that
wake-up does as little as it can:

* the worker's bytes are read straight from aiohttp's reader (engines/transport.py
  ``body_reader``), no iterator layers between;
* an OpenAI stream to an OpenAI client is sent as it arrived, whole reads at once (the
  worker's events stay whole and in order; nothing is held back): only a read that holds
  the engine's ``timings`` is split into lines and parsed;
* a stream another rule rewrites (usage, a renamed model) or another protocol shapes splits
  and parses each read's lines once, and sends what they make as one write;
* a client that stops reading is found by one timer a response, not one per write; a client
  that leaves is found by one task waiting on its connection, which closes the upstream (the
  worker notices at its next token and frees the slot).

Starlette's ``StreamingResponse`` would add an async generator and a task group to each
response, and a send per iterator step; :class:`Relay` is an ASGI response of its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import httpx
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from bunkhouse.engines.contract import EngineClient, Timings
from bunkhouse.engines.transport import body_reader, httpx_error
from bunkhouse.errors import BunkhouseError, error_body
from bunkhouse.front.assemble import DONE, LineSplitter, StreamError, data_event

log = logging.getLogger("bunkhouse.front.proxy")

OnTimings = Callable[[Timings], None]
"""Called with the engine's figures of an answer (engines/contract.py ``Timings``)."""

OnBroken = Callable[[Exception], BunkhouseError]
"""Given the break of a worker's stream; returns the error its client is told."""

SEND_TIMEOUT_S = 60.0
"""Seconds one piece of a streamed answer may wait for the client to read it. A client that
stops reading (its socket buffers full) would otherwise hold its slot, its compute turn and
its model's lease for as long as it keeps the connection open; past this, its answer is
ended and they are freed. The event stream's readers get 30 s (front/watch.py)."""


STALL_CHECK_S = 1.0
"""How often a streamed answer checks whether its client stopped reading, seconds: a timer a
second for each open stream, against one set and cancelled for every write."""


class ReaderStalled(Exception):
    """The client read nothing of its answer for :data:`SEND_TIMEOUT_S`."""


def bounded_send(send: Send, timeout_s: float) -> Send:
    """``send`` that raises ReaderStalled when a message waits ``timeout_s`` for the client
    (for answers of a few messages: a timer per message)."""
    async def send_within(message: Any) -> None:
        try:
            async with asyncio.timeout(timeout_s):  # no task per message
                await send(message)
        except TimeoutError as e:
            raise ReaderStalled from e

    return send_within


class StreamShaper(Protocol):
    """One stream's chat completion events turned into another protocol's bytes."""

    def feed(self, event: dict[str, Any]) -> bytes: ...

    def end(self) -> bytes:
        """The closing events (once, whatever calls it again)."""

    def prompt(self, tokens: int) -> None:
        """The prompt's token count, known before the engine's first event (a protocol
        that shows it at the start of its stream keeps it)."""

    def error(self, body: dict[str, Any]) -> bytes:
        """An error (an OpenAI error object) as the protocol's error event."""

    def keepalive(self) -> bytes:
        """Bytes a client ignores, sent while nothing else can be (answer text held back)."""


class LineRewrite(Protocol):
    def line(self, raw: bytes) -> bytes | None:
        """What to send instead of one SSE line (bytes, no line end); None: nothing."""


class Pipe(Protocol):
    """What a relay sends for the worker's bytes (one pipe per answer)."""

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send for ``chunk``, as soon as it arrived (may be empty)."""

    def close(self) -> bytes:
        """The last bytes, once the worker's answer ended."""

    def broken(self, error: Exception) -> bytes:
        """The bytes ending an answer whose worker broke off (``error``: httpx's)."""


def _error_event(err: BunkhouseError) -> bytes:
    return b"event: error\ndata: " + json.dumps(error_body(err)).encode() + b"\n\n"


class Bytes:
    """The worker's bytes as they are; the engine's figures read out of the one line that
    holds them (its last event). ``on_broken`` None: a plain answer, whose break the client
    sees as a short body."""

    def __init__(self, engine: EngineClient, on_broken: OnBroken | None,
                 on_timings: OnTimings | None) -> None:
        self._engine = engine
        self._on_broken = on_broken
        self._on_timings = on_timings
        self._mark = engine.timings_mark if on_timings is not None else b""
        self._rest = b""  # a line not ended yet, while timings are looked for

    def feed(self, chunk: bytes) -> bytes:
        if self._mark:
            self._look(chunk)
        return chunk

    def _look(self, chunk: bytes) -> None:
        """Lines are split only when the lines ended since the last read hold the engine's
        mark of its figures."""
        data = self._rest + chunk if self._rest else chunk
        end = data.rfind(b"\n") + 1
        if data.find(self._mark, 0, end) >= 0:
            lines = LineSplitter()
            for line in lines.feed(data[:end]) + lines.close():
                timings = self._engine.timings_line(line)
                if timings is not None and self._on_timings is not None:
                    self._on_timings(timings)
        self._rest = data[end:]

    def close(self) -> bytes:
        return b""

    def broken(self, error: Exception) -> bytes:
        return b"" if self._on_broken is None else _error_event(self._on_broken(error))


class Lines:
    """An OpenAI stream's lines as ``rewrite`` rewrites them (only the lines carrying usage
    are parsed), each read's lines sent together."""

    def __init__(self, engine: EngineClient, on_broken: OnBroken,
                 on_timings: OnTimings | None, rewrite: LineRewrite) -> None:
        self._engine = engine
        self._on_broken = on_broken
        self._on_timings = on_timings
        self._rewrite = rewrite
        self._mark = engine.timings_mark if on_timings is not None else b""
        self._lines = LineSplitter()

    def feed(self, chunk: bytes) -> bytes:
        return self._shown(self._lines.feed_raw(chunk))

    def close(self) -> bytes:
        return self._shown(self._lines.close_raw())

    def _shown(self, raw: list[bytes]) -> bytes:
        out = []
        for line in raw:
            if self._mark and self._mark in line:
                timings = self._engine.timings_line(line.decode("utf-8", errors="replace"))
                if timings is not None and self._on_timings is not None:
                    self._on_timings(timings)
            shown = self._rewrite.line(line)
            if shown is not None:
                out.append(shown + b"\n")
        return b"".join(out)

    def broken(self, error: Exception) -> bytes:
        return _error_event(self._on_broken(error))


class Shaped:
    """The stream's events, line by line, through ``shaper`` (another protocol's bytes)."""

    def __init__(self, engine: EngineClient, path: str, on_broken: OnBroken | None,
                 on_timings: OnTimings | None, shaper: StreamShaper) -> None:
        self._engine = engine
        self._path = path
        self._on_broken = on_broken
        self._on_timings = on_timings
        self._shaper = shaper
        self._lines = LineSplitter()

    def feed(self, chunk: bytes) -> bytes:
        return b"".join([self._line(line) for line in self._lines.feed_raw(chunk) if line])

    def close(self) -> bytes:
        out = b"".join([self._line(line) for line in self._lines.close_raw() if line])
        return out + self._shaper.end()

    def broken(self, error: Exception) -> bytes:
        if self._on_broken is None:
            return b""
        return self._shaper.error(error_body(self._on_broken(error)))

    def _line(self, raw: bytes) -> bytes:
        try:
            event = data_event(raw)
        except StreamError as e:  # the engine's error, as its adapter shapes it before a stream
            return self._shaper.error(stream_error(self._engine, e.body, self._path))
        except ValueError:
            return b""
        if event == DONE:
            return self._shaper.end()
        if not isinstance(event, dict):
            return b""
        if self._on_timings is not None:
            timings = self._engine.timings(event)
            if timings is not None:
                self._on_timings(timings)
        return self._shaper.feed(event)


def stream_error(engine: EngineClient, body: dict[str, Any], path: str) -> dict[str, Any]:
    """An error the engine sent in its stream, in the envelope its adapter gives the same
    error answered with a status (the status its body names, else 500)."""
    return engine.error(stream_status(body), json.dumps(body).encode(), path)[1]


def stream_status(body: dict[str, Any]) -> int:
    """The status of an error the engine sent in its stream: the one its body names (as
    llama.cpp's ``code`` does), else 500."""
    err = body.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    numeric = isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600
    return code if numeric and isinstance(code, int) else 500


class Relay(Response):
    """Streams the worker's answer ``upstream`` through ``pipe``; closes it and calls
    ``on_done`` however the send ends, even when the client is gone before the first byte.
    ``length``: the answer's ``content-length`` (a plain answer relayed as it arrives)."""

    def __init__(self, upstream: httpx.Response, pipe: Pipe, model_id: str,
                 on_done: Callable[[], None], media_type: str | None = None,
                 length: str | None = None) -> None:
        super().__init__(status_code=upstream.status_code, media_type=media_type or
                         upstream.headers.get("content-type", "text/event-stream"),
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        if "content-length" in self.headers:  # no body of its own: the worker's
            del self.headers["content-length"]
        if length is not None:
            self.headers["content-length"] = length
        self.upstream = upstream
        self.pipe = pipe
        self.model_id = model_id
        self._on_done = on_done
        self._gone = False  # the client disconnected: the upstream was closed for it
        self._sends = 0  # messages sent so far (the stall timer's progress)
        self._in_send = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(self._watch(receive))
        stall = _StallTimer(self, SEND_TIMEOUT_S)
        try:
            await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
            await self._stream(send)
        except asyncio.CancelledError:
            if not stall.fired:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            log.warning("model %s: the client read nothing of its answer for %.0f s; the "
                        "answer is ended and its slot freed", self.model_id, SEND_TIMEOUT_S)
        finally:
            stall.stop()
            watcher.cancel()
            try:
                await self.upstream.aclose()
            finally:
                self._on_done()

    async def _send(self, send: Send, message: Message) -> None:
        self._sends += 1
        self._in_send = True
        await send(message)
        self._in_send = False

    async def _stream(self, send: Send) -> None:
        read = body_reader(self.upstream) or _iterated(self.upstream)
        pipe = self.pipe
        while True:
            try:
                chunk = await read()
            except Exception as e:
                error = httpx_error(e, self.upstream.request)
                if self._gone:
                    return
                if not isinstance(error, httpx.TransportError):  # not the transport's
                    if error is e:
                        raise
                    raise error from e
                log.warning("model %s: answer from worker broke: %r", self.model_id, error)
                out = pipe.broken(error)
                break
            if not chunk:
                out = pipe.close()
                break
            out = pipe.feed(chunk)
            if out:
                await self._send(send, {"type": "http.response.body", "body": out,
                                        "more_body": True})
        await self._send(send, {"type": "http.response.body", "body": out, "more_body": False})

    async def _watch(self, receive: Receive) -> None:
        """Close the upstream once the client is gone: the relay's next read ends it."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self._gone = True
        stream = self.upstream.stream
        if isinstance(stream, httpx.AsyncByteStream):
            try:
                await stream.aclose()
            except Exception:  # another transport's stream, read meanwhile: ended at its end
                log.debug("model %s: closing a left client's upstream failed", self.model_id,
                          exc_info=True)


class _StallTimer:
    """Cancels ``relay``'s task when one of its messages has waited :data:`SEND_TIMEOUT_S`
    for the client (to within :data:`STALL_CHECK_S`): checked that often, the progress read
    from the relay's count of messages (nothing timed per message)."""

    def __init__(self, relay: Relay, timeout_s: float) -> None:
        self._relay = relay
        self._task = asyncio.current_task()
        self._every = min(STALL_CHECK_S, timeout_s / 4)
        self._limit = timeout_s
        self._seen = -1
        self._since = 0.0
        self.fired = False
        self._handle = asyncio.get_running_loop().call_later(self._every, self._check)

    def _check(self) -> None:
        relay, now = self._relay, time.monotonic()
        if not relay._in_send or relay._sends != self._seen:
            self._seen, self._since = relay._sends, now
        elif now - self._since >= self._limit - self._every / 2 and self._task is not None:
            self.fired = True
            self._task.cancel()
            return
        self._handle = asyncio.get_running_loop().call_later(self._every, self._check)

    def stop(self) -> None:
        self._handle.cancel()


def _iterated(resp: httpx.Response) -> Callable[[], Awaitable[bytes]]:
    """A read of the next bytes of a response another transport made (httpx's own), as
    :func:`bunkhouse.engines.transport.body_reader` reads: ``b""`` at its end."""
    if resp.is_stream_consumed:  # read already (a response made from bytes)
        chunks = iter([resp.content])
    else:
        chunks = None
        raw = resp.aiter_raw()

    async def read() -> bytes:
        if chunks is not None:
            return next(chunks, b"")
        try:
            return await raw.__anext__()
        except StopAsyncIteration:
            return b""

    return read
