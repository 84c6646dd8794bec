"""``GET /admin/events``: residency's events as Server-Sent Events, with sse-starlette.

Each event is one SSE message: ``id`` is its sequence number, ``data`` its JSON (``seq,
time, model, kind, reason, data``, and ``detail`` for an admin-key caller where the event
has one: a server path, a worker's output). A client that reconnects with ``Last-Event-ID``
(or ``?after=N``) gets what followed from the in-memory ring (residency/events.py), then
live events. If the ring no longer holds them all, or the server restarted (its numbers
begin again at 1), the stream begins with a ``gap`` message (no id) saying which were lost,
so a client knows to re-read the state (``GET /v1/models``). Every stream opens with a
comment line (:data:`OPENED`), sent with its headers at once. A comment line every
``heartbeat_s`` keeps proxies from closing a quiet stream. A reader that falls behind is
dropped (residency never waits for it), and every stream ends when the server stops. At most
:data:`MAX_READERS` streams are open at once, at most a quarter of them by one client (its
key, or its address without keys: bunkhouse/shares.py), so that no client holds them all;
a web page of another site cannot open one (front/site.py). Each event's message is encoded
once, at its emit, whoever sends it.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from bunkhouse.errors import InvalidRequest
from bunkhouse.residency.events import EventLog, Subscription
from bunkhouse.shares import Shares

HEARTBEAT_S = 15.0
"""Seconds of silence before a comment line is sent (as llama.cpp's ``--sse-ping-interval``
and sse-starlette's default ping)."""

MAX_READERS = 64
"""Event streams open at once (a console tab holds one); more get 503 ``server_busy``, as do
more than a client's share of them (a quarter: 16). Each costs a queue and, on resuming, a
write of up to the ring's 1,000 events."""

OPENED = b": connected\n\n"
"""The comment line each stream begins with, sent with its headers: a client (a browser's
``EventSource``, a proxy timing the first byte) sees the stream open at once, not at the
first event or the first heartbeat ``heartbeat_s`` later."""

SEND_TIMEOUT_S = 30.0
"""Seconds one message may take to send before the reader is dropped as stuck."""


def _after(request: Request) -> int | None:
    raw = request.headers.get("last-event-id")
    field = "Last-Event-ID"
    if raw is None:
        raw, field = request.query_params.get("after"), "after"
    if raw is None or raw == "":
        return None
    if not raw.isdigit() or len(raw) > 18:
        raise InvalidRequest(f"{field} must be an event's sequence number (a whole number "
                             f"of at most 18 digits), got {raw[:40]!r}", param=field)
    return int(raw)


class _Subscribed(EventSourceResponse):
    """sse-starlette's response, closing its subscription when it ends (even one whose
    stream never started: its client left first)."""

    def __init__(self, subscription: Subscription, release: Callable[[], None], *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.subscription = subscription
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.subscription.close()
            self.release()


class EventStream:
    def __init__(self, events: EventLog, client_of: Callable[[Request], str],
                 heartbeat_s: float = HEARTBEAT_S,
                 admin: Callable[[Request], bool] = lambda request: False) -> None:
        """``client_of(request)``: who holds a stream (front/auth.py Keys.client_of);
        ``admin(request)``: whether the caller sees events' details (an admin key)."""
        self.events = events
        self.client_of = client_of  # who holds a stream (front/auth.py Keys.client_of)
        self.heartbeat_s = heartbeat_s
        self.open = Shares(MAX_READERS, "event streams")
        self.admin = admin

    async def follow(self, request: Request) -> Response:
        after = _after(request)
        detail = self.admin(request)
        gap = self._gap(after)
        if gap is not None and after is not None and after > self.events.last_seq:
            after = 0  # a restarted server: everything it still holds is new to the client

        client = self.client_of(request)
        self.open.take(client, 1)  # 503 server_busy past the bound or the client's share
        # subscribed in the same step as the count (no await between: the bound holds
        # however many connect at once), both ended when the response ends however it ends
        subscription = self.events.subscribe(after)
        release = functools.partial(self.open.give, client, 1)

        async def messages() -> AsyncIterator[ServerSentEvent | bytes]:
            try:
                yield OPENED  # the first byte now, not at the first event or heartbeat
                if gap is not None:
                    yield ServerSentEvent(data=json.dumps(gap), event="gap")
                if subscription.backlog:  # one write, each message encoded at its emit
                    yield b"".join(e.message(detail) for e in subscription.backlog)
                while (event := await subscription.next()) is not None:
                    yield event.message(detail)  # quiet spells: sse-starlette's ping covers them
            finally:
                subscription.close()

        # at a stop, sse-starlette lets the stream end on its own for a moment: the server's
        # last event ("stopping") is sent, then the log's close ends it
        return _Subscribed(subscription, release, messages(), ping=self.heartbeat_s,
                                   send_timeout=SEND_TIMEOUT_S, shutdown_grace_period=2.0,
                                   headers={"cache-control": "no-cache",
                                            "x-accel-buffering": "no"})

    def _gap(self, after: int | None) -> dict[str, Any] | None:
        """What a resuming client missed, or None."""
        if after is None:
            return None
        last, oldest = self.events.last_seq, self.events.oldest_seq
        if after > last:
            return {"kind": "gap", "time": time.time(), "reason": "the server restarted: "
                    "sequence numbers began again", "after": after, "last_seq": last}
        if oldest is not None and after < oldest - 1:
            return {"kind": "gap", "time": time.time(), "reason": "older events were "
                    "dropped from the ring", "missed_from": after + 1, "missed_to": oldest - 1}
        return None
