"""Starting workers as local child processes: the placement seam (local processes now)."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from bunkhouse.catalog import CatalogModel
from bunkhouse.supervisor.process import (
    LaunchOptions,
    Spawner,
    WorkerLaunch,
    WorkerProcess,
    spawn_local,
)

log = logging.getLogger(__name__)


class LocalLauncher:
    """Starts one worker process per call, each on its own socket in a private directory."""

    def __init__(self, options: LaunchOptions, spawner: Spawner = spawn_local) -> None:
        self.options = options
        self._spawner = spawner
        self.socket_dir = Path(tempfile.mkdtemp(prefix="bunkhouse-"))  # mode 0700
        self._count = 0

    def _next_socket(self) -> Path:
        self._count += 1
        return self.socket_dir / f"w{self._count}.sock"  # short: socket paths max 107 bytes

    async def start(self, model: CatalogModel) -> WorkerProcess:
        """A ready worker for ``model``; raises WorkerLoadFailed quoting its output."""
        o = model.options
        log.info("model %s: starting worker (context %d, %d slots, %d threads)",
                 model.id, o.context, o.parallel, o.threads)
        launch = WorkerLaunch(self._next_socket(), self.options)
        worker = WorkerProcess(model, launch, self._spawner)
        await worker.start()
        return worker

    def close(self) -> None:
        shutil.rmtree(self.socket_dir, ignore_errors=True)
