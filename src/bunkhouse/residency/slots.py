"""A model's slot gate: as many requests run as its worker has slots, ``queue`` more wait,
the rest are refused with 429 ``queue_full``. Models never wait behind each other's queues.

The gate also hands out the worker's slots by id and remembers, per slot, what its KV cache
holds as far as the front knows (:class:`Slot`): a request that continues a conversation goes
to the slot holding it, a new one to the slot whose loss costs least. The KV snapshot keeper
(kvcache/keeper.py) reads and writes that knowledge; the engine is told the slot
(the engine contract's ``slot``) only when snapshots are on.

The gate is part of the model's residency entry: created and removed with it, so that a model
re-registered under the same id never inherits an old gate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from bunkhouse.errors import QueueFull
from bunkhouse.kvcache.store import common_prefix


@dataclass(eq=False)
class Slot:
    """One slot of the current worker, as the front knows it."""

    id: int
    held: tuple[int, ...] | None = ()  # tokens its KV cache holds; None: unknown
    dirty: bool = False  # holds something not saved since
    busy: bool = False
    version: int = 0  # one more at every request it runs
    used: float = 0.0  # monotonic seconds of its last request's start or end
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # a save or restore under way

    def continues(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` this slot holds already, if the request continues what it
        holds (keeps at least half of it); else 0."""
        if not self.held:
            return 0
        shared = common_prefix(self.held, tokens)
        return shared if shared * 2 >= len(self.held) else 0


class SlotGate:
    """``slots`` requests at once, ``queue`` more waiting, the rest refused."""

    def __init__(self, model_id: str, slots: int, queue: int) -> None:
        self.model_id = model_id
        self.queue = queue
        self.slots = slots
        self._free = asyncio.Semaphore(slots)
        self.waiting = 0
        self.running = 0
        self.table = [Slot(i) for i in range(slots)]

    async def enter(self, tokens: Sequence[int] | None = None) -> Slot:
        """Take a slot, waiting in the queue if every slot is busy: the free slot that holds
        most of ``tokens`` (the request's prompt, when known), else the one whose loss costs
        least (empty, then saved, then least recently used).

        Raises QueueFull (429) when the queue is full too."""
        if self._free.locked() and self.waiting >= self.queue:
            raise QueueFull(f"model {self.model_id!r}: every slot is busy and {self.waiting} "
                            "requests are queued; retry shortly")
        self.waiting += 1
        try:
            await self._free.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        slot = self._choose(tokens)
        slot.busy = True
        slot.version += 1
        slot.used = time.monotonic()
        return slot

    def _choose(self, tokens: Sequence[int] | None) -> Slot:
        free = [s for s in self.table if not s.busy]
        if not free:  # a request of a replaced worker still runs: any slot will do
            return Slot(-1)
        if tokens:
            best = max(free, key=lambda s: s.continues(tokens))
            if best.continues(tokens):
                return best
        return min(free, key=lambda s: (s.held != (), s.dirty, s.used))

    def leave(self, slot: Slot) -> None:
        self.running -= 1
        self._free.release()
        if slot.busy:
            slot.busy = False
            slot.dirty = True  # its prompt and what it generated, unsaved
            slot.used = time.monotonic()

    def reset(self) -> None:
        """A new worker: every slot is empty (requests of the old one keep their Slot)."""
        self.table = [Slot(i) for i in range(self.slots)]
