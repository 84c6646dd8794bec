"""Starting workers as local child processes: the placement seam (local processes now)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import psutil

from bunkhouse.catalog import CatalogModel
from bunkhouse.supervisor.process import (
    LaunchOptions,
    Spawner,
    WorkerLaunch,
    WorkerProcess,
    spawn_local,
)

log = logging.getLogger(__name__)


_PREFIX = "bunkhouse-"
_OWNER = "owner"  # in each socket directory: "PID START_TIME" of the front that made it


class LocalLauncher:
    """Starts one worker process per call, each on its own socket in a private directory.

    A front that was SIGKILLed cannot remove its directory; the next front removes every
    such directory whose owner is gone (:func:`remove_orphaned_socket_dirs`)."""

    def __init__(self, options: LaunchOptions, spawner: Spawner = spawn_local,
                 tmp_dir: Path | None = None,
                 snapshot_dir: Callable[[str], Path | None] | None = None) -> None:
        """``snapshot_dir(model_id)``: where a model's worker saves and restores slots (the
        KV snapshot store's directory for it; None: this worker saves none); None: workers
        save none."""
        self.options = options
        self._snapshot_dir = snapshot_dir
        self._spawner = spawner
        root = tmp_dir or Path(tempfile.gettempdir())
        remove_orphaned_socket_dirs(root)
        self.socket_dir = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=root))  # mode 0700
        me = psutil.Process()
        (self.socket_dir / _OWNER).write_text(f"{me.pid} {me.create_time()}")
        self._count = 0

    def _next_socket(self) -> Path:
        self._count += 1
        return self.socket_dir / f"w{self._count}.sock"  # short: socket paths max 107 bytes

    async def start(self, model: CatalogModel) -> WorkerProcess:
        """A ready worker for ``model``; raises WorkerLoadFailed quoting its output."""
        o = model.options
        log.info("model %s: starting worker (context %d, %d slots, %d threads)",
                 model.id, o.context, o.parallel, o.threads)
        snapshots = self._snapshot_dir(model.id) if self._snapshot_dir else None
        launch = WorkerLaunch(self._next_socket(), self.options, snapshots)
        worker = WorkerProcess(model, launch, self._spawner)
        await worker.start()
        return worker

    def close(self) -> None:
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def remove_orphaned_socket_dirs(root: Path) -> list[Path]:
    """Remove this user's socket directories under ``root`` whose front is no longer running
    (its pid gone, or reused by another process). Returns what was removed."""
    removed = []
    for path in root.glob(f"{_PREFIX}*"):
        try:
            if not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            pid, started = (path / _OWNER).read_text().split()
        except (OSError, ValueError):
            continue  # not one of ours, or being created right now
        if _running(int(pid), float(started)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed the socket directory %s of a front that is gone (pid %s)", path, pid)
        removed.append(path)
    return removed


def _running(pid: int, started: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - started) < 0.01
    except psutil.Error:
        return False
