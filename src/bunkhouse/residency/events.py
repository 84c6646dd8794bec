"""Residency events: every transition, logged and kept in a bounded in-memory log."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("bunkhouse.residency")


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    time: float  # wall clock, seconds since the epoch
    model: str
    kind: str  # the new state: loading, ready, draining, absent, failed; or pinned, unpinned
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class EventLog:
    def __init__(self, capacity: int = 1000) -> None:
        self._events: deque[Event] = deque(maxlen=capacity)
        self._seq = 0
        self.counts: dict[str, int] = {}

    def emit(self, model: str, kind: str, reason: str) -> Event:
        self._seq += 1
        event = Event(self._seq, time.time(), model, kind, reason)
        self._events.append(event)
        self.counts[kind] = self.counts.get(kind, 0) + 1
        log.info("model %s: %s (%s)", model, kind, reason)
        return event

    def recent(self, limit: int = 100) -> list[Event]:
        return list(self._events)[-limit:]
