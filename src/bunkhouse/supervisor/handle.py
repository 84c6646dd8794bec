"""What residency holds of a started worker: a handle, never a pid, pipe or socket path.

A local worker (supervisor/process.py) is one implementation; a worker placed on another
node would be another, behind the same handle.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import psutil

from bunkhouse.engines.contract import EngineClient

if TYPE_CHECKING:
    from bunkhouse.catalog import CatalogModel


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


def process_memory(pid: int) -> WorkerMemory | None:
    """A local process's resident memory now and its high-water mark, from one read of
    ``/proc/PID/status`` (Linux); elsewhere psutil's RSS stands for both. None if the
    process is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
        resident = int(fields["VmRSS"].split()[0]) * 1024
        return WorkerMemory(resident, max(resident, int(fields["VmHWM"].split()[0]) * 1024))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, IndexError):
        try:
            rss = int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            return None
        return WorkerMemory(rss, rss)
    return None


def file_version(path: Path) -> str:
    """A file as it is now, for a key: its size and modification time ("missing" if it
    cannot be read)."""
    try:
        st = os.stat(path)
    except OSError:
        return "missing"
    return f"{st.st_size}|{st.st_mtime_ns}"


class WorkerHandle(Protocol):
    """A started worker. ``alive`` turns false the moment it is known to have exited;
    ``on_exit`` is called once after that."""

    on_exit: Callable[[], None] | None

    @property
    def adapter_versions(self) -> Mapping[str, str]:
        """Its LoRA adapters' files (by path) as they were when it was started
        (:func:`file_version`): what its KV state was computed under, whatever the files
        are now."""
    exit_cause: str | None  # why it exited, for any caller (no output, no paths)
    exit_detail: str | None  # its last output: for the log and admin-key callers
    exit_lost: bool  # it went with its host (a cluster node's), not by a fault of its own

    @property
    def placement(self) -> Placement: ...

    @property
    def alive(self) -> bool: ...

    @property
    def engine(self) -> EngineClient: ...

    def memory(self) -> WorkerMemory | None: ...

    def kill(self) -> None: ...

    def suspend(self) -> None:
        """Stop its computing where it is (SIGSTOP): the compute gate's time slice."""

    def resume(self) -> None:
        """Let a suspended worker go on (SIGCONT); harmless on a running one."""

    async def stop(self) -> None: ...


class SparePool(Protocol):
    """Spare workers (supervisor/launcher.py): an engine imported, no model, for the next
    load. Residency decides when one is kept, counts its share of the budget and says
    which load becomes it; the pool makes, hands over and kills it. One spare per node
    (residency's node id: ``local`` on one machine, a cluster's otherwise)."""

    def engine_of(self, model: CatalogModel) -> str:
        """The worker engine a worker for ``model`` runs (module:Class)."""

    async def fill_spare(self, engine: str, node: str) -> int | None:
        """Start a spare for ``engine`` on ``node`` unless there is one; its process id
        (None: none was made)."""

    def drop_spare(self, node: str) -> None:
        """Kill ``node``'s spare, if any."""
