"""Bounds on HTTP requests as they arrive: head size, header count, the time to send a head
and a body, and bytes the parser holds without progress.

uvicorn's httptools protocol (the one it picks when httptools is installed, as here) bounds
the URL but neither the header block nor the time a client may take to send it: a 64 MB
header was read whole, 200,000 headers were accepted, and connections dribbling a header a
byte at a time stayed open for good (a slowloris). This subclass adds the three bounds that
servers in front of the web have (nginx ``large_client_header_buffers`` and
``client_header_timeout``, Apache ``LimitRequestFieldSize``/``LimitRequestFields``) and
keeps uvicorn's parser and everything else; we write it because uvicorn has no such option
(its h11 protocol bounds the head's size only, and is slower per streamed token).

- a head over :data:`~bunkhouse.defaults.MAX_HEAD_BYTES` gets 431 and the connection closes;
  the parser holds at most that plus one read (asyncio reads at most 256 KiB at a time); so
  do a chunked body's trailers (400), and anything else the parser buffers without making
  progress;
- more than :data:`~bunkhouse.defaults.MAX_HEADERS` header fields: 431;
- a head not complete :data:`~bunkhouse.defaults.HEAD_TIMEOUT_S` after the connection opened
  or its last answer ended: 408 and the connection closes (idle kept-alive connections are
  closed sooner by uvicorn's keep-alive timeout);
- a body not complete :data:`~bunkhouse.defaults.BODY_TIMEOUT_S` after its head, plus a second
  per :data:`~bunkhouse.defaults.BODY_MIN_RATE` bytes received, and at most
  :data:`~bunkhouse.defaults.BODY_MAX_S` after it whatever the rate: the connection closes
  (the app sees the client gone).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from bunkhouse import defaults


@dataclass(frozen=True, slots=True)
class HeadLimits:
    max_bytes: int = defaults.MAX_HEAD_BYTES
    max_headers: int = defaults.MAX_HEADERS
    timeout_s: float = defaults.HEAD_TIMEOUT_S
    body_timeout_s: float = defaults.BODY_TIMEOUT_S
    body_min_rate: int = defaults.BODY_MIN_RATE
    body_max_s: float = defaults.BODY_MAX_S


class _HeadRefused(Exception):
    """Raised inside a parser callback to stop parsing a refused head."""


_REASONS = {400: b"Bad Request", 408: b"Request Timeout",
            431: b"Request Header Fields Too Large"}


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`HeadLimits` (set by :func:`bounded_http`)."""

    limits = HeadLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._awaiting_head = True  # from connect, or an answer's end, to a complete head
        self._unparsed = 0  # bytes fed since the parser last made progress
        self._header_count = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_started = 0.0
        self._body_bytes = 0
        self._refused = False

    # -- the clock ------------------------------------------------------------------------

    def _await_head(self) -> None:
        self._awaiting_head = True
        self._header_count = 0
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.timeout_s, self._head_late)

    def _head_done(self) -> None:
        self._awaiting_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _body_done(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_check(self) -> None:
        """The body's deadline: BODY_TIMEOUT_S after its head, a second more per
        BODY_MIN_RATE bytes received, BODY_MAX_S after its head at most."""
        self._body_timer = None
        deadline = self._body_started + min(
            self.limits.body_timeout_s + self._body_bytes / self.limits.body_min_rate,
            self.limits.body_max_s)
        left = deadline - self.loop.time()
        if left > 0:
            self._body_timer = self.loop.call_later(left, self._body_check)
        elif not self.transport.is_closing():
            self.logger.info("closed a connection whose request body was too slow "
                             "(%d bytes in %.0f s)", self._body_bytes,
                             self.loop.time() - self._body_started)
            self.transport.close()  # the app's receive() sees http.disconnect

    def _head_late(self) -> None:
        self._head_timer = None
        idle = self.cycle is None or self.cycle.response_complete
        if self._awaiting_head and idle and not self.transport.is_closing():
            self._refuse(408, "the request head was not sent in time")

    def _refuse(self, status: int, message: str) -> None:
        if self._refused:
            return
        self._refused = True
        body = message.encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, _REASONS[status], len(body), body))
        self.transport.close()

    # -- uvicorn's protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_done()
        self._body_done()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._unparsed += len(data)
        super().data_received(data)
        if self._unparsed > self.limits.max_bytes and not self._refused:
            if self._awaiting_head:
                self._refuse(431, f"the request head is over {self.limits.max_bytes} bytes")
            else:  # a chunked body's trailers, or a chunk header that never ends
                self._refuse(400, f"over {self.limits.max_bytes} bytes of request framing")

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # a refusal already answered
            super().send_400_response(msg)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._await_head()

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            self._refuse(431, f"more than {self.limits.max_headers} header fields")
            raise _HeadRefused

    def on_headers_complete(self) -> None:
        self._head_done()
        self._unparsed = 0
        super().on_headers_complete()
        self._body_started, self._body_bytes = self.loop.time(), 0
        if self._body_timer is None:
            self._body_timer = self.loop.call_later(
                min(self.limits.body_timeout_s, self.limits.body_max_s), self._body_check)

    def on_body(self, body: bytes) -> None:
        self._unparsed = 0
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._unparsed = 0
        self._body_done()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None
                                                or self.cycle.response_complete):
            self._await_head()


def bounded_http(limits: HeadLimits) -> type[BoundedHttpToolsProtocol]:
    """The protocol class to give uvicorn (``uvicorn.Config(http=...)``) for ``limits``."""
    return type("BoundedHttp", (BoundedHttpToolsProtocol,), {"limits": limits})
