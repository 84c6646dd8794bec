"""The worker pool: at most one live worker per model, started on first use.

One owner (this object, on the event loop) holds the id → worker map. Concurrent requests for
a cold model share one start (single flight through a per-model lock). A worker that died is
replaced on the next request for its model.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bunkhouse.catalog import Catalog, CatalogModel
from bunkhouse.supervisor.process import (
    DEFAULT_ENGINE,
    Spawner,
    WorkerLaunch,
    WorkerProcess,
    WorkerState,
    spawn_local,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PoolOptions:
    ready_timeout_s: float = 120.0
    stop_grace_s: float = 10.0
    engine: str = DEFAULT_ENGINE


class SocketDir:
    """A private (0700) directory for worker sockets, removed on close."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="bunkhouse-"))  # mkdtemp makes it 0700
        self._count = 0

    def next_socket(self) -> Path:
        self._count += 1
        return self.path / f"w{self._count}.sock"  # short: Unix socket paths max 107 bytes

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class WorkerPool:
    def __init__(
        self, catalog: Catalog, options: PoolOptions, spawner: Spawner = spawn_local
    ) -> None:
        self.catalog = catalog
        self.options = options
        self._spawner = spawner
        self._sockets = SocketDir()
        self._workers: dict[str, WorkerProcess] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    @property
    def socket_dir(self) -> Path:
        return self._sockets.path

    def worker(self, model_id: str) -> WorkerProcess | None:
        return self._workers.get(model_id)

    def state(self, model_id: str) -> str:
        """absent, loading, ready or failed: the model's state as clients see it."""
        worker = self._workers.get(model_id)
        if worker is None:
            return "absent"
        return {
            WorkerState.NEW: "loading",
            WorkerState.STARTING: "loading",
            WorkerState.READY: "ready",
            WorkerState.FAILED: "failed",
        }.get(worker.state, "absent")

    async def get(self, model: CatalogModel) -> WorkerProcess:
        """A ready worker for ``model``, started (once, whoever asks) if needed."""
        worker = self._workers.get(model.id)
        if worker is not None and worker.state is WorkerState.READY:
            return worker
        lock = self._locks.setdefault(model.id, asyncio.Lock())
        async with lock:
            worker = self._workers.get(model.id)
            if worker is not None and worker.state is WorkerState.READY:
                return worker
            if worker is not None:
                await worker.stop()
            worker = WorkerProcess(model, self._launch(), self._spawner)
            self._workers[model.id] = worker
            log.info(
                "model %s: starting worker (context %d, %d slots, %d threads)",
                model.id,
                model.options.context,
                model.options.parallel,
                model.options.threads,
            )
            await worker.start()
            return worker

    def _launch(self) -> WorkerLaunch:
        return WorkerLaunch(
            socket=self._sockets.next_socket(),
            ready_timeout_s=self.options.ready_timeout_s,
            stop_grace_s=self.options.stop_grace_s,
            engine=self.options.engine,
        )

    async def close(self) -> None:
        """Stop every worker (concurrently) and remove the socket directory."""
        workers = list(self._workers.values())
        self._workers.clear()
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
        self._sockets.remove()
