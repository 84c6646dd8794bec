"""Starting workers as local child processes: the placement seam (local processes now).

A spare worker (``python -m bunkhouse.worker --spare``, worker/main.py) is a worker process
with its engine imported and no model: the next load of a single-file model on that engine
becomes it, so the load pays only for the model (the interpreter's start and the engine's
import, about 0.3 s of a small model's 1.3-2 s cold start, are already paid). The residency
manager decides when one is kept, counts its share of the budget and says which load becomes
it (residency/step.py); this module makes, hands over and kills it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from bunkhouse.catalog import CatalogModel
from bunkhouse.engines import engine_for
from bunkhouse.residency.state import LOCAL
from bunkhouse.supervisor.process import (
    LaunchOptions,
    Spawner,
    WorkerLaunch,
    WorkerProcess,
    spawn_local,
    worker_engine,
)
from bunkhouse.worker.main import SPARE_FLAG

log = logging.getLogger(__name__)



class _Spare:
    """One spare worker process and the front's end of its control socket."""

    def __init__(self, engine: str, proc: asyncio.subprocess.Process,
                 control: socket.socket) -> None:
        self.engine = engine
        self.proc = proc
        self.control = control

    def kill(self) -> None:
        self.control.close()
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()


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
        self.socket_dir = owned_socket_dir(tmp_dir or Path(tempfile.gettempdir()))
        self._count = 0
        self._spare: _Spare | None = None
        self._filling = 0  # fills under way: one at a time
        self._drops = 0  # a fill that a drop overtook kills what it made
        self._closed = False

    def _next_socket(self) -> Path:
        self._count += 1
        return self.socket_dir / f"w{self._count}.sock"  # short: socket paths max 107 bytes

    async def start(self, model: CatalogModel, use_spare: bool = False) -> WorkerProcess:
        """A ready worker for ``model``; raises WorkerLoadFailed quoting its output.
        ``use_spare``: residency counted the spare for this load: it becomes the worker if
        it still can (else a process is spawned)."""
        log.info("model %s: starting worker (%s)", model.id,
                 " ".join(engine_for(model).worker_args(model)))
        snapshots = self._snapshot_dir(model.id) if self._snapshot_dir else None
        launch = WorkerLaunch(self._next_socket(), self.options, snapshots)
        worker = WorkerProcess(model, launch, self.spawner(use_spare))
        await worker.start()
        return worker

    # -- the spare worker --------------------------------------------------------------

    def engine_of(self, model: CatalogModel) -> str:
        """The worker engine (module:Class) a worker for ``model`` runs."""
        return worker_engine(model, self.options)

    @property
    def spare_pid(self) -> int | None:
        return self._spare.proc.pid if self._spare is not None else None

    async def fill_spare(self, engine: str, node: str = LOCAL) -> int | None:
        """Start a spare worker for ``engine`` (module:Class), unless one is there already;
        one with another engine is replaced. Only with the real spawner (a test's spawner
        starts no spares). Returns its pid (None: none). ``node``: this machine's."""
        await self._fill(engine)
        return self.spare_pid

    async def _fill(self, engine: str) -> None:
        if self._closed or self._spawner is not spawn_local or self._filling or not engine:
            return  # (no engine: the model's worker is the engine's own program)
        if self._spare is not None:
            if self._spare.engine == engine and self._spare.proc.returncode is None:
                return
            self.drop_spare()
        drops = self._drops
        self._filling += 1
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = await spawn_local(
                [sys.executable, "-m", "bunkhouse.worker", SPARE_FLAG, engine,
                 "--parent-pid", str(os.getpid())], stdin=theirs.fileno())
        except OSError as e:
            ours.close()
            log.warning("no spare worker: %s", e)
            return
        finally:
            theirs.close()
            self._filling -= 1
        if self._closed or self._drops != drops:  # closed, or dropped, while we spawned
            _Spare(engine, proc, ours).kill()
            return
        self._spare = _Spare(engine, proc, ours)
        log.info("spare worker pid %d started (%s)", proc.pid, engine)

    def drop_spare(self, node: str = LOCAL) -> None:
        """Kill the spare worker, if there is one (its budget share is free at once: it held
        no model). ``node``: this machine's."""
        spare, self._spare = self._spare, None
        self._drops += 1
        if spare is not None:
            log.info("spare worker pid %d dropped", spare.proc.pid)
            spare.kill()

    def spawner(self, use_spare: bool) -> Spawner:
        """What spawns a worker's process: the spare, if ``use_spare`` and it can become
        it, else a new process."""
        return functools.partial(self._spawn_or_adopt, use_spare)

    async def _spawn_or_adopt(self, use_spare: bool, argv: Sequence[str],
                              pass_fds: Sequence[int]) -> asyncio.subprocess.Process:
        """The spare becomes this worker if asked and it can (its engine, one descriptor);
        else a new process is spawned."""
        spare = self._spare
        if "--engine" not in argv:  # the engine's own program: no spare can become it
            return await self._spawner(argv, pass_fds)
        engine = argv[list(argv).index("--engine") + 1]
        if (not use_spare or spare is None or spare.engine != engine or len(pass_fds) != 1
                or spare.proc.returncode is not None or self._spawner is not spawn_local):
            return await self._spawner(argv, pass_fds)
        self._spare = None
        args = list(argv)[list(argv).index("bunkhouse.worker") + 1:]
        message = json.dumps({"argv": args, "fd": pass_fds[0]}).encode()
        try:
            socket.send_fds(spare.control, [message], [pass_fds[0]])
        except OSError as e:
            log.warning("spare worker pid %d could not take the model (%s); spawning one",
                        spare.proc.pid, e)
            spare.kill()
            return await self._spawner(argv, pass_fds)
        spare.control.close()
        log.info("spare worker pid %d takes the model", spare.proc.pid)
        return spare.proc

    def close(self) -> None:
        self._closed = True
        self.drop_spare()
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def owned_socket_dir(root: Path, prefix: str = _PREFIX) -> Path:
    """A new private directory (mode 0700) under ``root`` that names this process as its
    owner, after removing those whose owner is gone (:func:`remove_orphaned_socket_dirs`):
    a process killed outright cannot remove its own."""
    remove_orphaned_socket_dirs(root)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    me = psutil.Process()
    (path / _OWNER).write_text(f"{me.pid} {me.create_time()}")
    return path


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
