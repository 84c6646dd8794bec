"""Fakes shared by the unit tests: catalog models without files, a worker handle whose
engine answers through an ``httpx.MockTransport``, a spare pool that records, and ``Host``,
a residency manager over fake workers and a fake clock (no processes, no sleeps: time
moves only when a test advances the clock)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx

from bunkhouse.catalog import CatalogModel
from bunkhouse.config import EngineOptions
from bunkhouse.engines.llamacpp import LlamaCppClient
from bunkhouse.errors import WorkerLoadFailed
from bunkhouse.gguf.meta import GGUFInfo
from bunkhouse.residency.clock import FakeClock
from bunkhouse.residency.manager import ResidencyManager, ResidencyOptions
from bunkhouse.supervisor.handle import Placement, WorkerMemory
from bunkhouse.supervisor.restart import RestartPolicy

GIB = 1024**3
INFO = GGUFInfo("fake", None, 4096, 0, 64, 1, 1, 64, 64, None, None, None, 0)


def model(id: str, gib: float = 4, *, pinned: bool = False,
          ttl_s: float | None = None) -> CatalogModel:
    return CatalogModel(id, Path(f"/models/{id}.gguf"), "config", INFO,
                        EngineOptions(context=4096, parallel=1),
                        int(gib * GIB), pinned=pinned, ttl_s=ttl_s)


class FakeWorker:
    """A worker handle whose engine answers through ``transport`` (default: only liveness
    probes, answered while ``answers`` is true)."""

    def __init__(self, m: CatalogModel, stop_gate: asyncio.Event | None = None,
                 leases: Callable[[], int] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.model = m
        self.adapter_versions: dict[str, str] = {}
        self.placement = Placement("local", 1000 + len(m.id))
        self.stopped = False
        self.stop_gate = stop_gate  # a stop waits for it: a worker slow to exit
        self.leases_at_stop: list[int] = []
        self._leases = leases
        self.engine = LlamaCppClient(transport or httpx.MockTransport(self._slots), m.id)
        self.on_exit: Callable[[], None] | None = None
        self.exit_cause: str | None = None
        self.exit_lost = False
        self.exit_detail: str | None = None
        self.answers = True  # to probes
        self.suspended = False

    def suspend(self) -> None:
        self.suspended = True

    def resume(self) -> None:
        self.suspended = False

    def _slots(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200 if self.answers else 503, json=[])

    def kill(self) -> None:
        self.die("killed")

    def die(self, cause: str) -> None:
        """The process exits on its own (or is killed): as the real watcher reports it."""
        self.stopped = True
        self.exit_cause = cause
        if self.on_exit is not None:
            self.on_exit()

    @property
    def alive(self) -> bool:
        return not self.stopped

    def memory(self) -> WorkerMemory:
        return WorkerMemory(self.model.size_bytes, self.model.size_bytes)

    async def stop(self) -> None:
        if self._leases is not None:
            self.leases_at_stop.append(self._leases())
        if self.stop_gate is not None:
            await self.stop_gate.wait()
        self.stopped = True
        await self.engine.aclose()


FAST_RESTART = RestartPolicy(backoff_s=0.001)


class FakeSpares:
    """A spare pool that records fills and drops; models whose id starts with 'w' run
    another engine (as Whisper's do)."""

    def __init__(self) -> None:
        self.engine: str | None = None
        self.log: list[str] = []

    def engine_of(self, m: CatalogModel) -> str:
        return "whisper" if m.id.startswith("w") else "llama"

    async def fill_spare(self, engine: str, node: str = "local") -> int | None:
        if self.engine != engine:
            self.engine = engine
            self.log.append(f"+{engine}")
        return 4242

    def drop_spare(self, node: str = "local") -> None:
        if self.engine:
            self.log.append(f"-{self.engine}")
        self.engine = None


class Host:
    """A manager over fake workers that records every start and how many overlap."""

    def __init__(self, models: list[CatalogModel], budget_gib: float = 10,
                 admission_wait_s: float = 30, ttl_s: float = 0,
                 restart: RestartPolicy = FAST_RESTART, probe_interval_s: float = 0,
                 spares: FakeSpares | None = None, budget_bytes: int | None = None) -> None:
        self.clock = FakeClock()
        self.starts: list[str] = []
        self.nodes: list[str] = []  # each start's node
        self.running = 0
        self.max_concurrent_starts = 0
        self.workers: list[FakeWorker] = []
        self.fail: set[str] = set()
        self.fail_detail: str | None = None  # the failing worker's output
        self.gate: asyncio.Event | None = None
        self.stop_gate: asyncio.Event | None = None
        self.spares = spares
        options = ResidencyOptions(budget_bytes=budget_bytes or int(budget_gib * GIB),
                                   ttl_s=ttl_s, admission_wait_s=admission_wait_s,
                                   drain_grace_s=1, restart=restart,
                                   probe_interval_s=probe_interval_s)
        self.manager = ResidencyManager(models, options, self.start, clock=self.clock,
                                        spare=spares)
        self.models = {m.id: m for m in models}

    async def start(self, m: CatalogModel, use_spare: bool = False,
                    node: str = "local") -> FakeWorker:
        self.starts.append(m.id)
        self.nodes.append(node)
        if use_spare and self.spares is not None:
            self.spares.engine = None  # the spare became this worker
        self.running += 1
        self.max_concurrent_starts = max(self.max_concurrent_starts, self.running)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(0)
            if m.id in self.fail:
                raise WorkerLoadFailed(f"model {m.id!r} failed to load",
                                       detail=self.fail_detail)
        finally:
            self.running -= 1
        w = FakeWorker(m, self.stop_gate, lambda: self.manager.status(m.id).leases)
        self.workers.append(w)
        return w

    def state(self, id: str) -> str:
        return self.manager.status(id).state

    async def use(self, id: str) -> None:
        (await self.manager.acquire(self.models[id])).release()
        await settle()

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 10))


async def settle(turns: int = 30) -> None:
    """Let every task that can run, run (event-loop turns, not time)."""
    for _ in range(turns):
        await asyncio.sleep(0)


async def until(h: Host, check: Callable[[], bool]) -> None:
    """Wait on the residency loop's steps until ``check`` holds (run() bounds it)."""
    while not check():
        await h.manager.changed(0.05)
