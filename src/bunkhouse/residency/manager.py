"""The residency manager: which models are resident, within one memory budget.

It is the one writer of residency state. Everything runs on the event loop; state changes
happen in ``_set_state`` only, which checks the transition table and emits an event.

- ``acquire(model)`` returns a :class:`Lease` on a ready worker, loading the model first if
  needed. Concurrent acquires of a cold model share one load; one cold start runs at a time
  across the host. A leased model is never evicted; the lease ends with the response.
- To make room, :func:`policy.plan` picks least recently used, unpinned, unleased models; each
  is drained (no new leases; in-flight work finishes within a grace) and its worker stopped
  and reaped before the next model starts.
- If the model fits only once leased models let go, the load waits up to
  ``admission_wait_s``, then fails with 503 ``insufficient_memory`` and ``Retry-After``. If it
  can never fit, it fails at once with both sizes.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from bunkhouse.catalog import CatalogModel
from bunkhouse.errors import InsufficientMemory, ModelFailed, ModelNotFound, ModelTooLarge
from bunkhouse.residency import policy
from bunkhouse.residency.estimate import MemoryEstimate, estimate
from bunkhouse.residency.events import EventLog
from bunkhouse.supervisor import restart
from bunkhouse.supervisor.restart import RestartPolicy

log = logging.getLogger(__name__)

MIB = 1024 * 1024


class WorkerHandle(Protocol):
    """What the manager needs of a started worker."""

    on_exit: Callable[[], None] | None  # called once if it dies while ready
    exit_cause: str | None

    @property
    def pid(self) -> int | None: ...

    @property
    def alive(self) -> bool: ...

    @property
    def client(self) -> httpx.AsyncClient: ...

    def memory_bytes(self) -> int | None: ...

    async def probe(self, timeout_s: float) -> bool: ...

    def kill(self) -> None: ...

    async def stop(self) -> None: ...


StartWorker = Callable[[CatalogModel], Awaitable[WorkerHandle]]


class State(enum.Enum):
    ABSENT = "absent"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


_TRANSITIONS: dict[State, frozenset[State]] = {
    State.ABSENT: frozenset({State.LOADING, State.FAILED}),  # failed: a crash loop gave up
    State.LOADING: frozenset({State.READY, State.FAILED}),
    State.READY: frozenset({State.DRAINING}),
    State.DRAINING: frozenset({State.ABSENT}),
    State.FAILED: frozenset({State.LOADING}),
}


@dataclass(frozen=True, slots=True)
class ResidencyOptions:
    budget_bytes: int
    ttl_s: float = 0.0  # global idle unload; 0: never
    admission_wait_s: float = 30.0
    drain_grace_s: float = 30.0
    retry_after_s: int = 5
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    probe_interval_s: float = 5.0  # liveness: the engine's main loop must answer this often
    probe_timeout_s: float = 5.0
    probe_failures: int = 2  # consecutive failed probes before the worker is replaced
    generation_failures: int = 3  # consecutive 5xx/broken requests before it is replaced


class _Entry:
    """Residency state of one model. Mutated by the manager only."""

    def __init__(self, model: CatalogModel) -> None:
        self.model = model
        self.state = State.ABSENT
        self.estimate: MemoryEstimate = estimate(model)
        self.measured: int | None = None
        self.worker: WorkerHandle | None = None
        self.leases = 0
        self.last_used = 0.0
        self.pinned = model.pinned
        self.loading: asyncio.Task[None] | None = None
        self.last_error: str | None = None
        self.retired = False  # being deleted: admits nothing new, ever
        # supervision
        self.spawned_at = 0.0
        self.failures: list[float] = []  # when workers died or failed to load
        self.quick_deaths = 0
        self.next_delay_s = 0.0  # backoff before the next spawn
        self.failed_until: float | None = None
        self.probe_failures = 0
        self.probing = False
        self.last_probe = 0.0
        self.failed_requests = 0

    @property
    def bytes(self) -> int:
        """What the model holds: measured once ready, else the estimate."""
        return self.measured if self.measured is not None else self.estimate.total


@dataclass(frozen=True, slots=True)
class ModelStatus:
    id: str
    state: str
    estimated_bytes: int
    measured_bytes: int | None
    pinned: bool
    leases: int
    last_used: float | None  # wall clock, None if never used
    pid: int | None
    last_error: str | None


class Lease:
    """A hold on a ready model for the whole life of one request. Release it exactly once."""

    def __init__(self, manager: ResidencyManager, entry: _Entry, worker: WorkerHandle) -> None:
        self._manager = manager
        self._entry = entry
        self.worker = worker
        self.model_id = entry.model.id
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._manager._release(self._entry)

    def report(self, ok: bool) -> None:
        """Whether the worker answered this request (a 5xx or a broken connection: no)."""
        self._manager._report(self._entry, self.worker, ok)


class ResidencyManager:
    def __init__(self, models: Iterable[CatalogModel], options: ResidencyOptions,
                 start_worker: StartWorker, clock: Callable[[], float] = time.monotonic,
                 events: EventLog | None = None) -> None:
        self.options = options
        self._start_worker = start_worker
        self._clock = clock
        self._wall_offset = time.time() - clock()
        self.events = events or EventLog()
        self._entries = {m.id: _Entry(m) for m in models}
        self._cold_start = asyncio.Lock()
        self._changed = asyncio.Event()
        self._paused = 0
        self.peak_bytes = 0
        self._tasks: set[asyncio.Task[None]] = set()

    # -- queries ---------------------------------------------------------------------------

    def used_bytes(self) -> int:
        return sum(e.bytes for e in self._entries.values() if e.state in _HOLDING)

    def status(self, model_id: str) -> ModelStatus:
        e = self._entries[model_id]
        return ModelStatus(
            id=model_id, state=e.state.value, estimated_bytes=e.estimate.total,
            measured_bytes=e.measured, pinned=e.pinned, leases=e.leases,
            last_used=e.last_used + self._wall_offset if e.last_used else None,
            pid=e.worker.pid if e.worker else None, last_error=e.last_error,
        )

    def statuses(self) -> list[ModelStatus]:
        return [self.status(model_id) for model_id in self._entries]

    # -- acquire / release -----------------------------------------------------------------

    async def acquire(self, model: CatalogModel) -> Lease:
        """A lease on a ready worker for ``model``, loading it (once, whoever asks) if needed."""
        entry = self._entries[model.id]
        while True:
            if entry.retired:
                raise ModelNotFound(f"model {model.id!r} is being removed", param="model")
            while self._paused:
                await self._wait_changed(None)
            if entry.state is State.READY and entry.worker is not None:
                if entry.worker.alive:
                    return self._lease(entry, entry.worker)
                await self._evict(entry, "worker exited")
                continue
            if entry.state is State.DRAINING:
                await self._wait_changed(None)
                continue
            if entry.state is State.FAILED and entry.failed_until is not None:
                remaining = entry.failed_until - self._clock()
                if remaining > 0:
                    raise ModelFailed(
                        f"model {entry.model.id!r} is failed: {entry.last_error}; it will be "
                        f"tried again in {remaining:.0f} s", retry_after_s=max(1, int(remaining)))
                entry.failures.clear()
                entry.quick_deaths = 0
                entry.failed_until = None
            task = entry.loading
            if task is None or task.done():  # a finished load that did not stick: load again
                task = entry.loading = asyncio.create_task(self._load(entry))
            await asyncio.shield(task)  # every waiter gets the load's error, if any

    def _lease(self, entry: _Entry, worker: WorkerHandle) -> Lease:
        entry.leases += 1
        entry.last_used = self._clock()
        return Lease(self, entry, worker)

    def _release(self, entry: _Entry) -> None:
        entry.leases -= 1
        entry.last_used = self._clock()
        self._notify()

    # -- load and evict --------------------------------------------------------------------

    async def _load(self, entry: _Entry) -> None:
        if entry.next_delay_s:
            log.info("model %s: waiting %.0f s before the next start (crash-loop backoff)",
                     entry.model.id, entry.next_delay_s)
            await asyncio.sleep(entry.next_delay_s)
        deadline = self._clock() + self.options.admission_wait_s
        async with self._cold_start:
            if entry.state is State.READY:
                return
            await self._make_room(entry, deadline)
            self._set_state(entry, State.LOADING, f"estimated {entry.estimate.total // MIB} MiB")
            entry.spawned_at = self._clock()
            try:
                worker = await self._start_worker(entry.model)
            except asyncio.CancelledError:
                self._set_state(entry, State.FAILED, "cancelled")
                raise
            except Exception as e:
                self._after_failure(entry, str(e), mark_failed=True)
                raise
            worker.on_exit = lambda: self._worker_exited(entry, worker)
            entry.worker = worker
            entry.measured = worker.memory_bytes()
            entry.last_error = None
            entry.next_delay_s = 0.0
            entry.probe_failures = entry.failed_requests = 0
            measured = f"{entry.measured // MIB} MiB" if entry.measured else "unknown"
            self._set_state(entry, State.READY,
                            f"pid {worker.pid}, measured {measured}, "
                            f"estimated {entry.estimate.total // MIB} MiB")
            self._note_peak()

    async def _make_room(self, entry: _Entry, deadline: float) -> None:
        while True:
            decision = policy.plan(self._residents(), self.options.budget_bytes,
                                   entry.model.id, entry.estimate.total)
            if isinstance(decision, policy.NeverFits):
                raise ModelTooLarge(_never_fits_message(entry.model.id, decision))
            if isinstance(decision, policy.Fits):
                if not decision.evict:
                    return
                for victim in decision.evict:
                    await self._evict(self._entries[victim], f"making room for {entry.model.id}")
                continue
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise InsufficientMemory(_must_wait_message(entry.model.id, decision),
                                         retry_after_s=self.options.retry_after_s)
            await self._wait_changed(remaining)

    def _residents(self) -> list[policy.Resident]:
        return [
            policy.Resident(e.model.id, e.bytes, e.last_used, e.pinned, e.leases,
                            evictable_state=e.state is State.READY)
            for e in self._entries.values() if e.state in _HOLDING
        ]

    async def _evict(self, entry: _Entry, reason: str) -> None:
        """Drain (no new leases, in-flight work finishes within the grace), stop, reap."""
        self._set_state(entry, State.DRAINING, reason)
        if not await self._drained(entry, self.options.drain_grace_s):
            log.warning("model %s: %d request(s) still running after the %.0f s drain grace",
                        entry.model.id, entry.leases, self.options.drain_grace_s)
        await self._stop(entry, reason)

    async def _drained(self, entry: _Entry, grace_s: float | None) -> bool:
        """Wait until no request holds the model, or the grace passes (None: no limit)."""
        deadline = None if grace_s is None else self._clock() + grace_s
        while entry.leases and (deadline is None or self._clock() < deadline):
            await self._wait_changed(None if deadline is None else deadline - self._clock())
        return entry.leases == 0

    async def _stop(self, entry: _Entry, reason: str) -> None:
        worker, entry.worker = entry.worker, None
        if worker is not None:
            await worker.stop()  # returns once the process is reaped: its memory is free
        entry.measured = None
        self._set_state(entry, State.ABSENT, f"stopped ({reason})")

    async def unload(self, model_id: str, reason: str, grace_s: float | None = None,
                     then: Callable[[], None] | None = None, retire: bool = False) -> bool:
        """Drain and stop the model. True once it is freed; False if requests still ran after
        ``grace_s``: it then accepts nothing new and is freed when they end. ``then`` runs
        once the model is freed (or at once if it was not resident). ``retire``: it is being
        deleted, so requests waiting for it, or coming, get 404 instead of a reload."""
        entry = self._entries[model_id]
        entry.retired = entry.retired or retire
        done = then or (lambda: None)
        if entry.loading is not None and not entry.loading.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(entry.loading)
        if entry.state is State.DRAINING:
            return False
        if entry.state is not State.READY:
            done()
            return True
        self._set_state(entry, State.DRAINING, reason)
        grace = self.options.drain_grace_s if grace_s is None else grace_s
        if await self._drained(entry, grace):
            await self._stop(entry, reason)
            done()
            return True

        async def later() -> None:
            await self._drained(entry, None)
            await self._stop(entry, reason)
            done()

        self._spawn_task(later())
        return False

    def register(self, model: CatalogModel) -> None:
        """Track a model added at runtime (absent until first used or loaded)."""
        self._entries[model.id] = _Entry(model)

    def forget(self, model_id: str) -> None:
        """Stop tracking an absent model (a runtime-registered one being removed)."""
        if self._entries[model_id].state is State.ABSENT:
            del self._entries[model_id]

    # -- supervision: crashes, restart budget, liveness ------------------------------------

    def _worker_exited(self, entry: _Entry, worker: WorkerHandle) -> None:
        if entry.worker is worker and entry.state is State.READY:
            self._spawn_task(self._recover(entry, worker.exit_cause or "worker exited"))

    async def _recover(self, entry: _Entry, cause: str) -> None:
        """A ready worker died: clear it out, then respawn it under the restart budget."""
        self.events.emit(entry.model.id, "crashed", cause)
        await self._evict(entry, "crashed")
        if self._after_failure(entry, cause, mark_failed=False):
            self.events.emit(entry.model.id, "respawning",
                             f"after {entry.next_delay_s:.0f} s backoff")
            (await self.acquire(entry.model)).release()

    def _after_failure(self, entry: _Entry, cause: str, *, mark_failed: bool) -> bool:
        """Count a failure; give up past the restart budget. True: it may be tried again."""
        now = self._clock()
        entry.failures.append(now)
        quick = now - entry.spawned_at < self.options.restart.quick_death_s
        entry.quick_deaths = entry.quick_deaths + 1 if quick else 0
        entry.last_error = cause
        decision = restart.decide(self.options.restart, entry.failures, entry.quick_deaths, now)
        if isinstance(decision, restart.GiveUp):
            entry.failed_until = now + self.options.restart.cooldown_s
            entry.next_delay_s = 0.0
            self._set_state(entry, State.FAILED,
                            f"{decision.failures} failures in {decision.window_s:.0f} s; "
                            f"cooling down {self.options.restart.cooldown_s:.0f} s: {cause}")
            return False
        entry.next_delay_s = decision.delay_s
        if mark_failed:
            self._set_state(entry, State.FAILED, cause)
        return True

    def _report(self, entry: _Entry, worker: WorkerHandle, ok: bool) -> None:
        if entry.worker is not worker:
            return
        entry.failed_requests = 0 if ok else entry.failed_requests + 1
        self._replace_if_failing(entry, worker, entry.failed_requests,
                                 self.options.generation_failures, "requests in a row failed")

    def _probe_due(self) -> None:
        now = self._clock()
        for entry in self._entries.values():
            if (entry.state is State.READY and entry.worker is not None and not entry.probing
                    and now - entry.last_probe >= self.options.probe_interval_s):
                entry.probing, entry.last_probe = True, now
                self._spawn_task(self._probe(entry, entry.worker))

    async def _probe(self, entry: _Entry, worker: WorkerHandle) -> None:
        try:
            ok = await worker.probe(self.options.probe_timeout_s)
        finally:
            entry.probing = False
        if entry.worker is not worker:
            return
        entry.probe_failures = 0 if ok else entry.probe_failures + 1
        self._replace_if_failing(entry, worker, entry.probe_failures,
                                 self.options.probe_failures, "liveness probes in a row missed")

    @staticmethod
    def _replace_if_failing(entry: _Entry, worker: WorkerHandle, failures: int, limit: int,
                            what: str) -> None:
        """SIGKILL a worker that failed ``limit`` times in a row; its exit is a crash."""
        if failures >= limit and worker.alive:
            log.error("model %s: %d %s; replacing worker pid %s",
                      entry.model.id, failures, what, worker.pid)
            worker.kill()

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background residency task failed: %s", task.exception())

    def reset_failure(self, model_id: str) -> None:
        """An operator's reload: forget the model's failures and let it load again."""
        entry = self._entries[model_id]
        entry.failures.clear()
        entry.quick_deaths = 0
        entry.failed_until = None
        entry.next_delay_s = 0.0

    # -- background: ttl and measurements --------------------------------------------------

    async def expire_idle(self) -> None:
        """Unload every ready, unpinned, unleased model idle for longer than its ttl."""
        now = self._clock()
        for entry in list(self._entries.values()):
            ttl = entry.model.ttl_s if entry.model.ttl_s is not None else self.options.ttl_s
            idle = now - entry.last_used
            if (entry.state is State.READY and ttl > 0 and not entry.pinned
                    and entry.leases == 0 and idle >= ttl):
                await self._evict(entry, f"idle for {idle:.0f} s (ttl {ttl:.0f} s)")

    def refresh_measurements(self) -> None:
        for entry in self._entries.values():
            if entry.state is State.READY and entry.worker is not None:
                measured = entry.worker.memory_bytes()
                if measured is not None:
                    entry.measured = measured
        self._note_peak()

    async def run_background(self, interval_s: float = 1.0) -> None:
        """Refresh measured memory and apply ttls, every ``interval_s``, until cancelled."""
        while True:
            self.refresh_measurements()
            self._probe_due()
            await self.expire_idle()
            await asyncio.sleep(interval_s)

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.used_bytes())

    # -- pins, pause, shutdown -------------------------------------------------------------

    def set_pinned(self, model_id: str, pinned: bool) -> None:
        entry = self._entries[model_id]
        if entry.pinned != pinned:
            entry.pinned = pinned
            self.events.emit(model_id, "pinned" if pinned else "unpinned", "operator")
            self._notify()

    @contextlib.asynccontextmanager
    async def pause_all(self) -> AsyncIterator[None]:
        """Hold new leases, wait for every in-flight one to end, and release them together."""
        self._paused += 1
        try:
            while any(e.leases for e in self._entries.values()):
                await self._wait_changed(None)
            yield
        finally:
            self._paused -= 1
            self._notify()

    async def close(self) -> None:
        """Stop every worker (concurrently)."""
        loads = [e.loading for e in self._entries.values() if e.loading and not e.loading.done()]
        background = [*loads, *self._tasks]
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        ready = [e for e in self._entries.values() if e.state is State.READY]
        await asyncio.gather(*(self._evict(e, "shutdown") for e in ready),
                             return_exceptions=True)

    # -- the one writer ----------------------------------------------------------------------

    def _set_state(self, entry: _Entry, new: State, reason: str) -> None:
        if new not in _TRANSITIONS[entry.state]:
            raise RuntimeError(f"{entry.model.id}: illegal {entry.state.value} -> {new.value}")
        entry.state = new
        self.events.emit(entry.model.id, new.value, reason)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_changed(self, timeout_s: float | None) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)


_HOLDING = frozenset({State.LOADING, State.READY, State.DRAINING})


def _never_fits_message(model_id: str, d: policy.NeverFits) -> str:
    pinned = f", of which pinned models hold {d.pinned_bytes // MIB} MiB" if d.pinned_bytes else ""
    return (f"model {model_id!r} needs {d.need // MIB} MiB but the memory budget is "
            f"{d.budget // MIB} MiB{pinned}; raise --budget or lower the model's context")


def _must_wait_message(model_id: str, d: policy.MustWait) -> str:
    return (f"model {model_id!r} needs {d.need // MIB} MiB and {max(d.free, 0) // MIB} MiB "
            f"are free; models in use ({', '.join(d.blocking) or 'none'}) did not finish "
            "in time; retry later")
