"""The server's pulls: each runs ``bunkhouse pull NAME --json`` as a child process (the same
command as the shell's, bunkhouse/pull/run.py) and reads its steps; the routes that start,
follow and cancel one (``/admin/pull``, Ollama's ``/api/pull``) read them from here.

A download is a persistent producer, as the seeds' host calls it: nothing waits for it, a
request never starts one, and the server's stop cancels every pull before it drains (a
cancelled pull's child gets SIGTERM, its hub client removes its temporary file, and after
:data:`STOP_GRACE_S` it gets SIGKILL). Two pulls of one name share one child; two names for
one file share one download through the hub client's lock on it. Once a pull succeeds the
configuration is re-read (front/reload.py), which puts the model in the catalog: no restart.

Progress also goes to the residency event log (``/admin/events``, the console, ``bunkhouse
events``) as ``pull_started``, ``pull_progress`` (at most every :data:`EVENT_EVERY_S` a
pull), ``pulled`` and ``pull_failed``, under the name pulled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from bunkhouse.errors import (
    BunkhouseError,
    Conflict,
    Forbidden,
    InsufficientStorage,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    PullFailed,
    ShuttingDown,
)
from bunkhouse.pull.names import parse
from bunkhouse.residency.events import EventLog
from bunkhouse.worker.lifeline import die_with_parent

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
"""Seconds a cancelled pull's child has to remove its temporary file before SIGKILL."""
EVENT_EVERY_S = 1.0
"""Seconds between two ``pull_progress`` events of one pull."""
KEPT_ENDED = 50
"""Ended pulls ``GET /admin/pull`` still lists (the oldest go first)."""
MAX_PULLS = 4
"""Pulls at once (each is a process and a download): the next is refused with a 409."""

_ERRORS: dict[str, type[BunkhouseError]] = {
    e.code: e for e in (InvalidRequest, ModelNotFound, Forbidden, InsufficientStorage,
                        PullFailed)}

Step = dict[str, Any]


class Pull:
    """One pull under way or ended: its steps so far, read by any number of followers."""

    def __init__(self, pull_id: str, name: str) -> None:
        self.id = pull_id
        self.name = name
        self.steps: list[Step] = []
        self.ended = asyncio.Event()
        self.proc: asyncio.subprocess.Process | None = None
        self.last: Step | None = None  # the child's last step, held until the pull ends
        self.stopping = False  # cancelled by the server's stop
        self.cancelling = asyncio.Event()  # set once cancelled
        self.total: int | None = None  # bytes, from its plan
        self.done: dict[str, int] = {}  # bytes fetched of each file, from its progress
        self._changed = asyncio.Condition()

    @property
    def result(self) -> Step | None:
        """Its last step once ended: ``success`` or an error."""
        return self.steps[-1] if self.ended.is_set() and self.steps else None

    def error(self) -> BunkhouseError | None:
        """Its failure as our error (None: it succeeded or runs)."""
        last = self.result
        if last is None or "error" not in last:
            return None
        kind = _ERRORS.get(last.get("code", ""), PullFailed)
        if last.get("code") == "pull_cancelled" and self.stopping:
            return ShuttingDown(f"the pull of {self.name} was cancelled: the server is "
                                "stopping")
        if last.get("code") == "pull_cancelled":
            return Conflict(f"the pull of {self.name} was cancelled (DELETE /admin/pull/"
                            f"{self.id})")
        return kind(last["error"], param="model" if kind is not PullFailed else None)

    @property
    def completed(self) -> int:
        """Bytes fetched so far, over its files."""
        return sum(self.done.values())

    async def add(self, step: Step) -> None:
        self.steps.append(step)
        if step.get("status") == "plan":
            self.total = step["total"]
        if "file" in step and "completed" in step:
            self.done[step["file"]] = step["completed"]
        async with self._changed:
            self._changed.notify_all()

    async def finish(self, step: Step) -> None:
        """Its last step (``success`` or an error) and its end, seen together."""
        self.steps.append(step)
        self.ended.set()
        async with self._changed:
            self._changed.notify_all()

    async def follow(self) -> AsyncIterator[Step]:
        """Every step from the first, then each as it comes, until it ends."""
        seen = 0
        while True:
            while seen < len(self.steps):
                seen += 1
                yield self.steps[seen - 1]
            if self.ended.is_set():
                return
            async with self._changed:
                if seen == len(self.steps) and not self.ended.is_set():
                    await self._changed.wait()

    def view(self) -> dict[str, Any]:
        """What ``GET /admin/pull`` shows of it."""
        progress = next((s for s in reversed(self.steps) if "completed" in s), None)
        last = self.steps[-1] if self.steps else {}
        status = last.get("status", "starting")
        if "error" in last:
            status = "cancelled" if last.get("code") == "pull_cancelled" else "failed"
        return {"id": self.id, "model": self.name, "status": status,
                "total": self.total, "completed": self.completed,
                "ended": self.ended.is_set(),
                "error": last.get("error"), "served_as": last.get("id"),
                "file": progress.get("file") if progress else None}


class Pulls:
    def __init__(self, data_dir: Path, events: EventLog,
                 on_pulled: Callable[[str], Awaitable[Any]] | None = None) -> None:
        """``on_pulled(name)``: what makes a pulled model servable (the reload; None: a
        server that cannot re-read its catalog serves it after a restart)."""
        self.data_dir = data_dir
        self.events = events
        self.on_pulled = on_pulled
        self._pulls: dict[str, Pull] = {}  # by id; ended ones are kept until the next start
        self._closed = False

    def start(self, name: str) -> Pull:
        """The pull of ``name``: the one under way for the same name, or a new one. Raises
        InvalidRequest for a name that is no pull name, Conflict past :data:`MAX_PULLS`,
        ShuttingDown once the server stops. No await between the check and the start."""
        if self._closed:
            raise ShuttingDown("the server is stopping: no pull starts")
        key = parse(name).text
        for pull in self._pulls.values():
            if not pull.ended.is_set() and pull.name.lower() == key.lower():
                return pull
        running = [p for p in self._pulls.values() if not p.ended.is_set()]
        if len(running) >= MAX_PULLS:
            raise Conflict(f"{MAX_PULLS} pulls are under way: wait for one to end, or cancel "
                           "one (DELETE /admin/pull/ID)")
        ended = [i for i, p in self._pulls.items() if p.ended.is_set()]
        for pull_id in ended[: max(0, len(ended) - KEPT_ENDED)]:  # the oldest first
            del self._pulls[pull_id]
        pull = Pull(secrets.token_hex(6), key)
        self._pulls[pull.id] = pull
        task = asyncio.create_task(self._run(pull), name=f"pull {key}")
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return pull

    def get(self, pull_id: str) -> Pull:
        pull = self._pulls.get(pull_id)
        if pull is None:
            raise NotFound(f"no pull {pull_id!r} (GET /admin/pull lists them)")
        return pull

    def list(self) -> list[dict[str, Any]]:
        return [p.view() for p in self._pulls.values()]

    def cancel(self, pull_id: str) -> Pull:
        """Stop a pull (SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`); NotFound for an
        unknown id. A pull that ended already is left as it ended."""
        pull = self.get(pull_id)
        if not pull.ended.is_set():
            _cancel(pull)
        return pull

    def stop(self) -> None:
        """Start no pull from now on, and cancel every one under way (the server's stop
        begins)."""
        self._closed = True
        running = [p for p in self._pulls.values() if not p.ended.is_set()]
        for pull in running:
            pull.stopping = True
            _cancel(pull)
        if running:
            log.info("cancelling %d pull(s): the server is stopping", len(running))

    async def close(self) -> None:
        """:meth:`stop`, then return once their children are gone (at most the grace)."""
        self.stop()
        running = [p for p in self._pulls.values() if not p.ended.is_set()]
        if running:
            await asyncio.wait([asyncio.ensure_future(p.ended.wait()) for p in running],
                               timeout=STOP_GRACE_S + 2)

    async def _run(self, pull: Pull) -> None:
        argv = [sys.executable, "-m", "bunkhouse", "pull", "--json", pull.name]
        env = {**os.environ, "BUNKHOUSE_DATA_DIR": str(self.data_dir)}
        self.events.emit(pull.name, "pull_started", f"pull {pull.id} started", pull=pull.id)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True,
                preexec_fn=die_with_parent(os.getpid()))
        except OSError as e:
            await pull.finish({"error": f"the pull could not start: {e}",
                               "code": "pull_failed"})
            return
        pull.proc = proc
        if pull.cancelling.is_set():  # cancelled while it started
            _signal(pull, "SIGTERM")
        killer = asyncio.create_task(self._kill_late(pull))
        stderr = asyncio.create_task(proc.stderr.read())  # type: ignore[union-attr]
        try:
            await self._read(pull, proc)
            await proc.wait()
        finally:
            killer.cancel()
        output = (await stderr).decode(errors="replace").strip()
        last = pull.last
        if last is None or ("error" not in last and last.get("status") != "success"):
            reason = "it was cancelled" if pull.cancelling.is_set() else \
                f"its process exited with code {proc.returncode}"
            last = {"error": f"the pull of {pull.name} stopped: {reason}",
                    "code": "pull_cancelled" if pull.cancelling.is_set() else "pull_failed"}
            if output and not pull.cancelling.is_set():
                log.warning("pull %s (%s): its output:\n%s", pull.id, pull.name, output[-4000:])
        if "error" in last:
            self.events.emit(pull.name, "pull_failed", last["error"], pull=pull.id,
                             code=last.get("code"))
        else:
            try:
                if self.on_pulled is None:
                    log.warning("pulled %s: restart the server to serve it", pull.name)
                else:
                    await self.on_pulled(pull.name)
            except BunkhouseError as e:
                log.error("pulled %s, but the catalog was not re-read: %s", pull.name,
                          e.message)
            self.events.emit(pull.name, "pulled", f"served as {last['id']}",
                             pull=pull.id, served_as=last["id"])
        await pull.finish(last)

    async def _read(self, pull: Pull, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        told = 0.0
        while line := await proc.stdout.readline():
            try:
                step = json.loads(line)
            except ValueError:
                continue
            if not isinstance(step, dict):
                continue
            if step.get("status") == "success" or "error" in step:
                pull.last = step  # told with the pull's end (a success: once catalogued)
                continue
            await pull.add(step)
            if "completed" in step and time.monotonic() - told >= EVENT_EVERY_S:
                told = time.monotonic()
                total = pull.total or step["total"]
                done = pull.completed
                self.events.emit(pull.name, "pull_progress",
                                 f"{done * 100 // max(total, 1)}% of {total // 2**20} MiB",
                                 pull=pull.id, completed=done, total=total)

    @staticmethod
    async def _kill_late(pull: Pull) -> None:
        """SIGKILL a cancelled pull's child that outlives its grace."""
        await pull.cancelling.wait()
        await asyncio.sleep(STOP_GRACE_S)
        _signal(pull, "SIGKILL")


def _cancel(pull: Pull) -> None:
    pull.cancelling.set()
    _signal(pull, "SIGTERM")


def _signal(pull: Pull, name: str) -> None:
    import signal

    proc = pull.proc
    if proc is not None and proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, getattr(signal, name))
