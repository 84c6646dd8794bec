"""A model's slot gate: as many requests run as its worker has slots, ``queue`` more wait,
the rest are refused with 429 ``queue_full``. Models never wait behind each other's queues.

A request takes its place in the line (:meth:`SlotGate.join`) as soon as it names the model,
before its lease: while the model loads (or waits for memory) the line is already counted, so
that a full one refuses at once whatever the model's state, not once its load is over.

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
    # the LoRA adapter setting its last request ran under ("": the base alone; None: not
    # known): KV state computed under one setting is never continued under another
    setting: str | None = None

    def continues(self, tokens: Sequence[int], setting: str = "") -> int:
        """How many of ``tokens`` this slot holds already, if the request continues what it
        holds (keeps at least half of it) under the same adapter ``setting``; else 0."""
        # a slot whose setting is not known holds nothing known (SlotGate.unknown), but on a
        # model without adapters, where every setting is ""
        if not self.held or (self.setting or "") != setting:
            return 0
        shared = common_prefix(self.held, tokens)
        return shared if shared * 2 >= len(self.held) else 0


class Place:
    """A request's place in a model's line (:meth:`SlotGate.join`), held until it takes a
    slot or gives up; :meth:`leave` gives it back (again is harmless)."""

    def __init__(self, gate: SlotGate) -> None:
        self.gate = gate
        self._held = True

    def leave(self) -> None:
        if self._held:
            self._held = False
            self.gate.waiting -= 1


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

    def join(self) -> Place:
        """A place in the line, taken at once (no await): the request counts as queued from
        now until it takes a slot. Raises QueueFull (429) when ``slots`` requests run or
        wait and ``queue`` more wait already, whatever the model's state (loading, waiting
        for memory, busy)."""
        if self.running + self.waiting >= self.slots + self.queue:
            raise QueueFull(f"model {self.model_id!r}: {self.running} requests run and "
                            f"{self.waiting} wait, which fills its {self.slots} slot(s) and "
                            f"its queue of {self.queue}; retry shortly")
        self.waiting += 1
        return Place(self)

    async def enter(self, tokens: Sequence[int] | None = None,
                    place: Place | None = None, setting: str = "") -> Slot:
        """Take a slot, waiting in the queue if every slot is busy: the free slot that holds
        most of ``tokens`` (the request's prompt, when known) under its adapter ``setting``,
        else the one whose loss costs least (empty, then one last run under the same setting,
        then saved, then least recently used). ``place``: the request's place
        in the line, taken by :meth:`join` (one of another gate, an old one of the model's,
        is given back and a new one taken).

        Raises QueueFull (429) when the queue is full too."""
        if place is None or place.gate is not self:
            if place is not None:
                place.leave()
            place = self.join()
        try:
            await self._free.acquire()
        finally:
            place.leave()
        self.running += 1
        slot = self._choose(tokens, setting)
        slot.busy = True
        slot.version += 1
        slot.used = time.monotonic()
        return slot

    def _choose(self, tokens: Sequence[int] | None, setting: str) -> Slot:
        free = [s for s in self.table if not s.busy]
        if not free:  # a request of a replaced worker still runs: any slot will do
            return Slot(-1)
        if tokens:
            best = max(free, key=lambda s: s.continues(tokens, setting))
            if best.continues(tokens, setting):
                return best
        return min(free, key=lambda s: (s.held != (), s.setting != setting, s.dirty, s.used))

    def unknown(self) -> None:
        """The engine chose the slot of a request (not pinned) on a model with adapters: what
        each idle slot holds, and under which setting, is no longer known."""
        for slot in self.table:
            if not slot.busy:
                slot.held, slot.setting = None, None

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
