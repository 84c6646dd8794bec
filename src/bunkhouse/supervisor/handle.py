"""What residency holds of a started worker: a handle, never a pid, pipe or socket path.

A local worker (supervisor/process.py) is one implementation; a worker placed on another
node would be another, behind the same handle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from bunkhouse.engines.contract import EngineClient


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a worker runs, for status and logs: its node and its process there."""

    node: str
    pid: int | None

    def __str__(self) -> str:
        return f"pid {self.pid}" if self.node == "local" else f"pid {self.pid} on {self.node}"


@dataclass(frozen=True, slots=True)
class WorkerMemory:
    """A worker's memory, bytes: resident now, and the most it has been resident (its peak,
    the kernel's high-water mark)."""

    resident: int
    peak: int


class WorkerHandle(Protocol):
    """A started worker. ``alive`` turns false the moment it is known to have exited;
    ``on_exit`` is called once after that."""

    on_exit: Callable[[], None] | None
    exit_cause: str | None

    @property
    def placement(self) -> Placement: ...

    @property
    def alive(self) -> bool: ...

    @property
    def engine(self) -> EngineClient: ...

    def memory(self) -> WorkerMemory | None: ...

    def kill(self) -> None: ...

    async def stop(self) -> None: ...
