"""A model's slot gate: as many requests run as its worker has slots, ``queue`` more wait,
the rest are refused with 429 ``queue_full``. Models never wait behind each other's queues.

The gate is part of the model's residency entry: created and removed with it, so that a model
re-registered under the same id never inherits an old gate.
"""

from __future__ import annotations

import asyncio

from bunkhouse.errors import QueueFull


class SlotGate:
    """``slots`` requests at once, ``queue`` more waiting, the rest refused."""

    def __init__(self, model_id: str, slots: int, queue: int) -> None:
        self.model_id = model_id
        self.queue = queue
        self.slots = slots
        self._free = asyncio.Semaphore(slots)
        self.waiting = 0
        self.running = 0

    async def enter(self) -> None:
        """Take a slot, waiting in the queue if every slot is busy.

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

    def leave(self) -> None:
        self.running -= 1
        self._free.release()
