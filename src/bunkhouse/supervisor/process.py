"""One worker process: spawn, health gate, stderr capture, stop, and its lifecycle state.

The lifecycle is an enum plus a transition table; ``_set_state`` is the one writer and checks
every transition. Callers use :meth:`WorkerProcess.start` and :meth:`WorkerProcess.stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import shutil
import signal
import stat
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bunkhouse import defaults
from bunkhouse.catalog import CatalogModel
from bunkhouse.catalog.catalog import model_files
from bunkhouse.engines import engine_for
from bunkhouse.engines.contract import EngineClient, WorkerSpawn
from bunkhouse.engines.transport import WorkerTransport
from bunkhouse.errors import GGUFError, WorkerLoadFailed
from bunkhouse.supervisor.handle import Placement, WorkerMemory, file_version, process_memory
from bunkhouse.worker.lifeline import die_with_parent
from bunkhouse.worker.main import READY_LINE

log = logging.getLogger(__name__)

_STDERR_LINES = 200
_QUOTED_LINES = 12


class WorkerState(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"  # stopped on request
    EXITED = "exited"  # died on its own (crash, OOM kill, parent's SIGKILL of it)
    FAILED = "failed"  # never became ready


_TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.NEW: frozenset({WorkerState.STARTING, WorkerState.STOPPING}),
    WorkerState.STARTING: frozenset({WorkerState.READY, WorkerState.FAILED, WorkerState.STOPPING}),
    WorkerState.READY: frozenset({WorkerState.STOPPING, WorkerState.EXITED}),
    WorkerState.STOPPING: frozenset({WorkerState.STOPPED}),
    WorkerState.STOPPED: frozenset(),
    WorkerState.EXITED: frozenset({WorkerState.STOPPING}),
    WorkerState.FAILED: frozenset({WorkerState.STOPPING}),
}


class IllegalTransition(RuntimeError):
    pass


Spawner = Callable[[Sequence[str], Sequence[int]], Awaitable[asyncio.subprocess.Process]]
"""Starts ``argv`` with the file descriptors ``pass_fds`` inherited at the same numbers."""


async def spawn_local(argv: Sequence[str], pass_fds: Sequence[int] = (),
                      stdin: int = asyncio.subprocess.DEVNULL) -> asyncio.subprocess.Process:
    """Start a worker as a local child process (the placement seam: local processes now).
    ``stdin``: a descriptor for its standard input (a spare worker's control socket).

    The child is killed when the front dies: Linux's parent-death signal is armed between
    fork and exec (it survives exec), so that a worker which is an engine's own program (no
    lifeline thread of ours in it) never outlives a SIGKILLed front."""
    return await asyncio.create_subprocess_exec(
        *argv,
        stdin=stdin,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # a ^C at the terminal reaches the front, which stops workers
        pass_fds=tuple(pass_fds),
        preexec_fn=die_with_parent(os.getpid()),
    )


@dataclass(frozen=True, slots=True)
class OpenedModel:
    """A model's files opened by the front for one worker start."""

    fds: tuple[int, ...]
    worker_path: str  # what the worker opens: a path to the descriptors it inherits
    link_dir: Path | None = None  # a split model's links to them, removed with close()

    def close_descriptors(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        self.close_descriptors()
        if self.link_dir is not None:
            shutil.rmtree(self.link_dir, ignore_errors=True)


def _check_draft(model: CatalogModel) -> None:
    """WorkerLoadFailed naming the draft model if its file is gone or changed since the
    catalog checked it (its vocabulary against the model's, its size for the estimate)."""
    draft = model.draft
    if draft is None:
        return
    try:
        st = os.stat(draft.path)
    except OSError as e:
        raise WorkerLoadFailed(f"model {model.id!r}: its draft model {draft.name!r} cannot be "
                               f"opened ({e.strerror}); restore the file, or change the "
                               "model's draft and reload", param="model") from e
    whole = draft.info.split_count > 1 or st.st_size == draft.bytes
    if not whole or st.st_mtime_ns != draft.mtime_ns:
        raise WorkerLoadFailed(f"model {model.id!r}: its draft model {draft.name!r} was "
                               "replaced since it was checked; reload the configuration "
                               "(POST /admin/reload) or register the model again, so that it "
                               "is checked anew", param="model")


def open_model_file(model: CatalogModel, link_dir: Path | None = None) -> OpenedModel:
    """Open ``model``'s files for a worker and check, on each opened file itself, that it is
    the file the catalog checked when the model was registered: the same real path (no file
    or directory swapped for a symlink since: that is how a path inside the allowed roots
    is turned into one outside), a regular file (a FIFO would block), the same total size
    (the memory estimate was made from it). The worker is handed the descriptors, so what it
    maps is what was checked: ``/proc/self/fd/N`` for one file; for a model split into
    several files (the engine finds the parts by name), ``link_dir`` gets links named as the
    parts, each to ``/proc/self/fd/N``, which the worker resolves to its own inherited copy.

    A model that is a directory (a Whisper or an MLX model) is opened as one: the worker
    reads its files through ``/proc/self/fd/N/``, and their sizes together must still be the
    catalogued size; a link in it (a hub cache snapshot's) must still lead to the file it led
    to when catalogued.

    Raises WorkerLoadFailed: the message names no path; the detail (log, admins) does."""
    if model.directory:
        return _open_directory(model)
    try:
        files = model_files(model.path, model.info.split_count)
    except GGUFError as e:
        raise WorkerLoadFailed(f"model {model.id!r}: a part of its files is missing",
                               detail=e.message) from e
    fds: list[int] = []
    try:
        size = 0
        for i, path in enumerate(files):
            fd = _open_checked(model, path, model.resolved[i] if model.resolved else path)
            fds.append(fd)
            size += os.fstat(fd).st_size
        if size != model.size_bytes:
            raise WorkerLoadFailed(
                f"model {model.id!r}: its file changed since it was catalogued (size "
                f"{model.size_bytes} -> {size} bytes); restart the server, or delete "
                "and register the model again, so that its memory estimate is remade",
                detail=str(model.path))
        if len(fds) == 1:
            return OpenedModel((fds[0],), f"/proc/self/fd/{fds[0]}")
        if link_dir is None:
            raise WorkerLoadFailed(f"model {model.id!r}: a split model needs a link directory")
        link_dir.mkdir(mode=0o700)
        for path, fd in zip(files, fds, strict=True):
            (link_dir / path.name).symlink_to(f"/proc/self/fd/{fd}")
        return OpenedModel(tuple(fds), str(link_dir / files[0].name), link_dir)
    except BaseException:
        OpenedModel(tuple(fds), "", link_dir if len(fds) > 1 else None).close()
        raise


def _open_directory(model: CatalogModel) -> OpenedModel:
    fd = _open_checked(model, model.path, model.path, directory=True)
    try:
        size = 0
        for name in os.listdir(fd):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode) and model.resolved:  # a hub cache snapshot's link
                real = Path(os.path.realpath(f"/proc/self/fd/{fd}/{name}"))
                if real not in model.resolved:
                    raise WorkerLoadFailed(
                        f"model {model.id!r}: a file of its directory is no longer the file "
                        "that was checked when the model was registered; refused",
                        detail=f"{model.path}/{name} now leads to {real}")
                st = os.stat(name, dir_fd=fd)
            if stat.S_ISREG(st.st_mode):
                size += st.st_size
        if size != model.size_bytes:
            raise WorkerLoadFailed(
                f"model {model.id!r}: its files changed since it was catalogued (size "
                f"{model.size_bytes} -> {size} bytes); restart the server so that its memory "
                "estimate is remade", detail=str(model.path))
    except OSError as e:
        os.close(fd)
        raise WorkerLoadFailed(f"model {model.id!r}: its directory cannot be read "
                               f"({e.strerror})", detail=f"{model.path}: {e}") from e
    except BaseException:
        os.close(fd)
        raise
    return OpenedModel((fd,), f"/proc/self/fd/{fd}")


def _open_checked(model: CatalogModel, path: Path, real_path: Path,
                  directory: bool = False) -> int:
    """``path`` opened for reading, if it is still the regular file (or, with
    ``directory``, the directory) registered (at ``real_path``)."""
    what = "directory" if directory else "file"
    # O_NONBLOCK: a FIFO swapped in must not block the front; cleared below for a file
    kind = os.O_DIRECTORY if directory else os.O_NONBLOCK
    try:
        fd = os.open(path, os.O_RDONLY | kind | os.O_CLOEXEC)
    except OSError as e:
        raise WorkerLoadFailed(f"model {model.id!r}: its {what} cannot be opened "
                               f"({e.strerror}); the server log has the path",
                               detail=f"{path}: {e}") from e
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
        if real != str(real_path):
            raise WorkerLoadFailed(
                f"model {model.id!r}: its {what} is no longer the {what} that was checked "
                "when the model was registered (it, or a directory above it, now leads "
                f"elsewhere); refused", detail=f"{path} now opens {real}")
        if not directory:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise WorkerLoadFailed(
                    f"model {model.id!r}: its file is no longer the file that was checked "
                    "when the model was registered (it is no longer a regular file); refused",
                    detail=f"{path} is not a regular file")
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass(frozen=True, slots=True)
class LaunchOptions:
    """How every worker is started: its deadlines, and (for tests) a worker engine class
    that replaces every model's own."""

    ready_timeout_s: float = defaults.READY_TIMEOUT_S
    stop_grace_s: float = defaults.STOP_GRACE_S
    worker_engine: str | None = None  # module:Class; None: each model's engine


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    """Everything needed to start one worker, besides the model."""

    socket: Path
    options: LaunchOptions = LaunchOptions()
    snapshot_dir: Path | None = None  # where the worker saves and restores slots' KV state


def worker_engine(model: CatalogModel, options: LaunchOptions) -> str:
    """The worker engine (module:Class) a worker for ``model`` runs."""
    return options.worker_engine or engine_for(model).worker_engine


def worker_argv(model: CatalogModel, launch: WorkerLaunch,
                model_path: str | None = None) -> list[str]:
    """The worker's command line; ``model_path`` replaces the catalogued path (the file
    descriptor :func:`open_model_file` opened). An engine whose worker is its own program
    gives the whole of it (unless the launch options name a worker engine for every model:
    the tests' fault engine)."""
    engine = engine_for(model)
    if not launch.options.worker_engine:
        own = engine.command(model, WorkerSpawn(model.id, model_path or str(model.path),
                                                launch.socket, launch.snapshot_dir))
        if own is not None:
            return own
    snapshots = ["--snapshot-dir", str(launch.snapshot_dir)] if launch.snapshot_dir else []
    return [
        sys.executable, "-m", "bunkhouse.worker",
        "--model-id", model.id,
        "--model-path", model_path or str(model.path),
        "--socket", str(launch.socket),
        "--engine", worker_engine(model, launch.options),
        "--parent-pid", str(os.getpid()),
        *snapshots,
        *engine.worker_args(model),
    ]


class WorkerProcess:
    """A worker process serving one model on a Unix socket."""

    def __init__(
        self, model: CatalogModel, launch: WorkerLaunch, spawner: Spawner = spawn_local
    ) -> None:
        self.model = model
        self.launch = launch
        self._spawner = spawner
        self.state = WorkerState.NEW
        self.on_exit: Callable[[], None] | None = None  # called once if it dies while ready
        self.adapter_versions: dict[str, str] = {}  # its adapters' files when it started
        self.exit_cause: str | None = None  # why it exited, for any caller
        self.exit_lost = False  # a local worker never goes with its host: the front is that
        self.exit_detail: str | None = None  # its last output: for the log and admins
        self._proc: asyncio.subprocess.Process | None = None
        self._stderr: deque[str] = deque(maxlen=_STDERR_LINES)
        self._tasks: list[asyncio.Task[None]] = []
        self._model_links: Path | None = None  # a split model's links, until it has loaded
        self._stopping: asyncio.Future[None] | None = None
        self._said_ready = asyncio.Event()  # the worker logged READY_LINE
        # aiohttp under httpx's API, a fresh connection per request (engines/transport.py)
        self._engine = engine_for(model).client(WorkerTransport(str(launch.socket)), model.id)
        self._ready_line = ((None if launch.options.worker_engine else
                             engine_for(model).ready_line) or READY_LINE)
        self.started_at: float | None = None
        self.ready_at: float | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def placement(self) -> Placement:
        return Placement("local", self.pid)

    @property
    def engine(self) -> EngineClient:
        return self._engine

    @property
    def alive(self) -> bool:
        return self.state is WorkerState.READY

    def stderr_tail(self, lines: int = _QUOTED_LINES) -> str:
        return "\n".join(list(self._stderr)[-lines:])

    def memory(self) -> WorkerMemory | None:
        """The worker process's resident memory now and at its peak (None once it stopped)."""
        if self.pid is None or self.state not in (WorkerState.STARTING, WorkerState.READY):
            return None
        return process_memory(self.pid)

    def _set_state(self, new: WorkerState, reason: str) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.model.id}: {self.state.value} -> {new.value}")
        log.info(
            "model %s: worker %s -> %s (%s)", self.model.id, self.state.value, new.value, reason
        )
        self.state = new

    async def start(self) -> None:
        """Spawn the worker and wait until it answers health, its ready deadline, or its exit."""
        self._set_state(WorkerState.STARTING, "spawn")
        self.launch.socket.unlink(missing_ok=True)
        self.adapter_versions = {str(a.path): file_version(a.path) for a in self.model.adapters}
        self.started_at = time.monotonic()
        try:
            _check_draft(self.model)
            opened = open_model_file(self.model, self.launch.socket.with_suffix(".model"))
        except WorkerLoadFailed:
            self._set_state(WorkerState.FAILED, "model file refused")
            await self.stop()
            raise
        try:
            self._proc = await self._spawner(
                worker_argv(self.model, self.launch, opened.worker_path), opened.fds)
        finally:
            # the worker holds its own copies; the links to them only until it has loaded
            opened.close_descriptors()
        self._model_links = opened.link_dir
        self._tasks.append(asyncio.create_task(self._read_output(self._proc)))
        try:
            await self._health_gate(self._proc)
        except WorkerLoadFailed:
            self._set_state(WorkerState.FAILED, "load failed")
            await self.stop()
            raise
        except asyncio.CancelledError:
            await self.stop()  # never leave a half-started worker behind
            raise
        self.ready_at = time.monotonic()
        self._remove_model_links()
        self._set_state(
            WorkerState.READY, f"pid {self._proc.pid} in {self.ready_at - self.started_at:.1f} s"
        )
        self._tasks.append(asyncio.create_task(self._watch_exit(self._proc)))

    async def _health_gate(self, proc: asyncio.subprocess.Process) -> None:
        deadline = time.monotonic() + self.launch.options.ready_timeout_s
        while time.monotonic() < deadline:
            if await self._healthy():
                return
            # the next poll, or sooner: the worker exits, or says it serves (READY_LINE; once)
            waits = [asyncio.ensure_future(proc.wait())]
            if not self._said_ready.is_set():
                waits.append(asyncio.ensure_future(self._said_ready.wait()))
            try:
                await asyncio.wait(waits, timeout=defaults.HEALTH_POLL_S,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            if proc.returncode is not None:
                await self._drain_output()
                raise WorkerLoadFailed(
                    f"model {self.model.id!r} failed to load (worker exited with code "
                    f"{proc.returncode}); the server log has its output",
                    detail=f"{self._reason()}Last lines of its output:\n{self.stderr_tail()}")
        raise WorkerLoadFailed(
            f"model {self.model.id!r} was not ready within "
            f"{self.launch.options.ready_timeout_s:.0f} s; the server log has its output",
            detail=f"Last lines of its output:\n{self.stderr_tail()}")

    def _reason(self) -> str:
        """The worker's own one-line reason (``error: ...``, its last words before exit 3),
        put first: the engine may log more lines after it while it shuts down."""
        for line in reversed(self._stderr):
            if line.startswith("error: "):
                return f"Its reason: {line[len('error: '):]}\n"
        return ""

    async def _healthy(self) -> bool:
        return self.launch.socket.exists() and await self._engine.health(2.0)

    async def _read_output(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip()
            self._stderr.append(line)
            if self._ready_line in line:
                self._said_ready.set()
            log.log(logging.WARNING if _notable(line) else logging.DEBUG,
                    "model %s: worker: %s", self.model.id, line)

    async def _drain_output(self) -> None:
        """Let the output reader take what the exited worker wrote last."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._tasks[0]), 2.0)

    async def _watch_exit(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if self.state is not WorkerState.READY:
            return
        self._set_state(WorkerState.EXITED, f"exit code {code}")  # not alive from now on
        await self._drain_output()  # its last words make the cause
        self.exit_cause = f"worker exited with code {code}"
        self.exit_detail = f"its last output:\n{self.stderr_tail(3)}" if self.stderr_tail(1) \
            else None
        log.error("model %s: worker pid %d exited unexpectedly with code %s; last output:\n%s",
                  self.model.id, proc.pid, code, self.stderr_tail())
        if self.on_exit is not None:
            self.on_exit()

    def kill(self) -> None:
        """SIGKILL now: for a worker that no longer answers. Its exit is handled as a crash."""
        if self._proc is not None and self._proc.returncode is None:
            signal_group(self._proc, signal.SIGKILL)

    def suspend(self) -> None:
        """SIGSTOP: every thread stops where it is (mid-token), its memory and KV cache stay;
        the compute gate's time slice. A stopped worker answers nothing until resumed."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT: a suspended worker goes on where it stopped (harmless on a running one)."""
        self._signal(signal.SIGCONT)

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is not None and self._proc.returncode is None:
            signal_group(self._proc, sig)

    async def stop(self) -> None:
        """SIGTERM, wait up to the grace period, then SIGKILL; returns once the process is
        reaped. Idempotent: every caller waits for the same stop."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        self._set_state(WorkerState.STOPPING, "stop requested")
        # Close our connections first: a stream still running ends now (its relay sends the
        # client an error event), and the engine, seeing the socket closed, frees the slot and
        # can honour SIGTERM at once instead of finishing the generation.
        await self._engine.aclose()
        proc = self._proc
        if proc is not None and proc.returncode is None:
            await _terminate(proc, self.launch.options.stop_grace_s, self.model.id)
        if proc is not None:  # whatever it started and left behind (a wrapper script's child)
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.launch.socket.unlink(missing_ok=True)
        self._remove_model_links()
        self._set_state(WorkerState.STOPPED, "stopped")

    def _remove_model_links(self) -> None:
        if self._model_links is not None:
            shutil.rmtree(self._model_links, ignore_errors=True)
            self._model_links = None


def signal_group(proc: asyncio.subprocess.Process, sig: int) -> None:
    """``sig`` to the worker's process group (it leads one: ``start_new_session``), so that
    a program it started (a wrapper script's llama-server) gets it too; to the process alone
    where it leads none (a test's spawner)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


async def _terminate(proc: asyncio.subprocess.Process, grace_s: float, model_id: str) -> None:
    signal_group(proc, signal.SIGTERM)
    signal_group(proc, signal.SIGCONT)  # a suspended worker handles SIGTERM only once going
    try:
        await asyncio.wait_for(proc.wait(), grace_s)
        return
    except TimeoutError:
        log.warning(
            "model %s: worker pid %d ignored SIGTERM for %.1f s; killing it",
            model_id,
            proc.pid,
            grace_s,
        )
    signal_group(proc, signal.SIGKILL)
    await proc.wait()


def _notable(line: str) -> bool:
    """A worker's line worth the log at its default level: the worker's own errors and
    warnings (what it did about a fault it survived, such as an adapter left out), and
    llama.cpp's errors about a LoRA adapter (why it was left out)."""
    return (" worker ERROR " in line or " worker WARNING " in line
            or (" E " in line and "lora" in line.lower()))
