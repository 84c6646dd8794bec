"""The one source of time for residency: what time it is, and a timer.

Residency's step is given ``now`` by its run loop, and the run loop arms one timer at the
time the step asks for (``wake_at``); both come from a :class:`Clock`, so unit tests drive
residency with :class:`FakeClock` and no sleeps.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        """Call ``callback`` on the running event loop once ``now() >= when``."""


class RealClock:
    """``time.monotonic`` and the event loop's timers."""

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        delay = max(0.0, when - time.monotonic())
        return asyncio.get_running_loop().call_later(delay, callback)


class _FakeTimer:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """A clock that moves only when told (:meth:`advance`), firing the timers that fall due
    in order. For tests."""

    def __init__(self, now: float = 1000.0) -> None:
        self._now = now
        self._timers: list[tuple[float, int, _FakeTimer, Callable[[], None]]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        timer = _FakeTimer()
        heapq.heappush(self._timers, (when, next(self._order), timer, callback))
        return timer

    def advance(self, seconds: float) -> None:
        """Move time on by ``seconds``, calling every timer due on the way."""
        end = self._now + seconds
        while self._timers and self._timers[0][0] <= end:
            when, _, timer, callback = heapq.heappop(self._timers)
            self._now = max(self._now, when)
            if not timer.cancelled:
                callback()
        self._now = end
