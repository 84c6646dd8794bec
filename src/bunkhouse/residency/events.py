"""Residency events: every transition, logged, kept in a bounded ring, and handed to live
subscribers (``GET /admin/events``).

Each event has a sequence number, one more than the last; a subscriber that names the last
one it saw (``Last-Event-ID``) gets what followed from the ring, then live events. A
subscriber is a bounded queue filled without waiting: one that falls :data:`SUBSCRIBER_QUEUE`
events behind is dropped (its stream ends; it may resume by sequence number), so a slow
reader never slows residency.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

log = logging.getLogger("bunkhouse.residency")

SUBSCRIBER_QUEUE = 1000
"""Events a live subscriber may fall behind before it is dropped."""

# The kinds a drain's reason falls in, for counting evictions by reason (a bounded label).
DRAIN_CAUSES = ("room", "idle", "keep_alive", "operator", "removed", "crashed", "node_lost",
                "shutdown", "remount", "other")


def drain_cause(reason: str) -> str:
    """The bounded cause of a drain, from its free-text reason."""
    text = reason.lower()
    for needle, cause in (("re-mounted", "remount"), ("making room", "room"),
                          ("keep_alive", "keep_alive"), ("idle", "idle"), ("operator", "operator"),
                          ("removed", "removed"), ("was lost", "node_lost"),
                          ("crash", "crashed"),
                          ("shutting down", "shutdown"), ("shutdown", "shutdown")):
        if needle in text:
            return cause
    return "other"


@dataclass(frozen=True, slots=True)
class Event:
    """One event. ``reason`` is for any reader: it names no server path and quotes no worker
    output or file contents; those go in ``detail``, which only the log and admin-key
    callers see (docs/security.md, "Errors tell a client no internals")."""

    seq: int
    time: float  # wall clock, seconds since the epoch
    model: str
    kind: str  # the new state (loading, ready, draining, absent, failed) or what happened
    reason: str
    data: dict[str, Any] = field(default_factory=dict)  # figures: bytes, seconds, cause
    detail: str | None = None  # internals: for the log and admins only
    sse: bytes = field(default=b"", repr=False, compare=False)  # its SSE message, made once
    sse_detail: bytes = field(default=b"", repr=False, compare=False)  # with the detail

    def as_dict(self, detail: bool = False) -> dict[str, Any]:
        """The event as JSON data; its ``detail`` only if asked (an admin's read) and set."""
        out = asdict(self)
        del out["sse"], out["sse_detail"]
        if not detail or self.detail is None:
            del out["detail"]
        return out

    def message(self, detail: bool = False) -> bytes:
        """Its SSE message, with the detail or not."""
        return self.sse_detail if detail else self.sse


def _encoded(event: Event) -> Event:
    """The event with its SSE messages (``id`` and one ``data`` line: JSON has no newline),
    without and with its detail, encoded once however many readers send them."""
    def sse(detail: bool) -> bytes:
        body = json.dumps(event.as_dict(detail), default=str)
        return f"id: {event.seq}\ndata: {body}\n\n".encode()

    public = sse(False)
    return replace(event, sse=public,
                   sse_detail=public if event.detail is None else sse(True))


class Subscription:
    """One live reader's queue of events; iterate it, :meth:`close` it when done."""

    def __init__(self, log_: EventLog, backlog: list[Event]) -> None:
        self._log = log_
        self._queue: asyncio.Queue[Event | None] = asyncio.Queue(SUBSCRIBER_QUEUE)
        self.backlog = backlog
        self.dropped = False

    def offer(self, event: Event | None) -> None:
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped = True
            self._log.unsubscribe(self)
            log.warning("an event stream reader fell %d events behind; dropped",
                        SUBSCRIBER_QUEUE)

    async def next(self, timeout_s: float | None = None) -> Event | None:
        """The next event; None at the end (the log closed, or this reader fell behind).
        Raises TimeoutError if none came within ``timeout_s`` (None: wait for one)."""
        if self.dropped and self._queue.empty():
            return None
        return await asyncio.wait_for(self._queue.get(), timeout_s)

    def close(self) -> None:
        self._log.unsubscribe(self)


class EventLog:
    def __init__(self, capacity: int = 1000) -> None:
        self._events: deque[Event] = deque(maxlen=capacity)
        self._seq = 0
        self.by_model: dict[tuple[str, str], int] = {}  # (model, kind) -> count
        self.drains: dict[tuple[str, str], int] = {}  # (model, cause) -> count
        self._totals: dict[str, int] = {}  # kind -> count, forgotten models' included
        self._subscribers: set[Subscription] = set()
        self._listeners: list[Callable[[Event], None]] = []
        self._forgetters: list[Callable[[str], None]] = []
        self.closed = False

    @property
    def counts(self) -> dict[str, int]:
        """Events by kind, all models together (those since removed included)."""
        return dict(self._totals)

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def oldest_seq(self) -> int | None:
        """The oldest event the ring still holds (None: none yet)."""
        return self._events[0].seq if self._events else None

    def emit(self, model: str, kind: str, reason: str, detail: str | None = None,
             **data: Any) -> Event:
        """Publish an event. ``reason``: what any reader may see (no server path, no worker
        output); ``detail``: the internals, for the log and admin-key callers."""
        self._seq += 1
        if kind == "draining":
            data.setdefault("cause", drain_cause(reason))
            key = (model, data["cause"])
            self.drains[key] = self.drains.get(key, 0) + 1
        event = _encoded(Event(self._seq, time.time(), model, kind, reason, data, detail))
        self._events.append(event)
        self.by_model[(model, kind)] = self.by_model.get((model, kind), 0) + 1
        self._totals[kind] = self._totals.get(kind, 0) + 1
        if kind != "load_progress":  # progress has its own, rarer, log line
            # the reason only: a detail (a worker's output) was logged once where its fault
            # happened (a failed load, a crash), not again at each event it explains
            log.info("model %s: %s (%s)", model, kind, reason)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                log.exception("an event listener failed")
        for subscriber in list(self._subscribers):
            subscriber.offer(event)
        return event

    def listen(self, listener: Callable[[Event], None]) -> None:
        """Call ``listener(event)`` with every event as it is emitted (it must not block)."""
        self._listeners.append(listener)

    def on_forget(self, forgetter: Callable[[str], None]) -> None:
        """Call ``forgetter(model_id)`` when a model is gone for good (it must not block)."""
        self._forgetters.append(forgetter)

    def forget(self, model_id: str) -> None:
        """A model is gone for good (deleted, a refused registration, removed from the
        configuration): its counts go, and every part of the front that keeps something per
        model drops it (the ring keeps its events, as it keeps any)."""
        for counts in (self.by_model, self.drains):
            for key in [k for k in counts if k[0] == model_id]:
                del counts[key]
        for forgetter in self._forgetters:
            try:
                forgetter(model_id)
            except Exception:
                log.exception("model %s: forgetting it failed", model_id)

    def recent(self, limit: int = 100) -> list[Event]:
        return list(self._events)[-limit:]

    @property
    def readers(self) -> int:
        """Live readers now."""
        return len(self._subscribers)

    def subscribe(self, after: int | None = None) -> Subscription:
        """A live reader of the events after sequence number ``after`` (None: from now).
        Those still in the ring come first, in :attr:`Subscription.backlog`; if some were
        already dropped from it, the backlog starts with the oldest kept."""
        backlog = [e for e in self._events if after is not None and e.seq > after]
        subscription = Subscription(self, backlog)
        if self.closed:
            subscription.offer(None)
        else:
            self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)

    def close(self) -> None:
        """End every live reader's stream (the front is stopping)."""
        self.closed = True
        for subscriber in list(self._subscribers):
            subscriber.offer(None)
        self._subscribers.clear()
