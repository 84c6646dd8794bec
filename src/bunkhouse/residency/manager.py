"""The residency manager: which models are resident, within one memory budget.

It is the single writer of residency state. Everything runs on one event loop, and every
change to a model's entry (state, leases, waiters, worker, failures, measured bytes) happens in
one of the synchronous *commit* methods at the bottom of the class: each checks what it needs
and changes what it must in one step, with no await in between, so no decision is ever made
on state that an await let go stale. The async methods only orchestrate: commit, await an
effect (start or stop a process), commit again; a plan is made again after every await.

- ``acquire(model)`` returns a :class:`Lease` on a ready worker, loading the model first if
  needed. A request that must wait registers as a *waiter*; when the load commits ``ready`` it
  hands a lease to every waiter in the same step, so a model loaded for waiting requests
  serves them before it can be chosen for eviction (no swap loop). A model with a lease or a
  waiter is never drained to make room.
- Concurrent acquires of a cold model share one load; one cold start runs at a time across
  the host.
- To make room, :func:`policy.plan` picks least recently used, unpinned, unleased models; the
  drains of all of them begin in the step that made the plan (each re-checked), the manager
  waits for their workers to be reaped, then plans again.
- If the model fits only once leased models let go, the load waits up to
  ``admission_wait_s``, then fails with 503 ``insufficient_memory`` and ``Retry-After``. If it
  can never fit, it fails at once with both sizes.
- A worker that dies is handled by one path (:meth:`ResidencyManager._worker_died`), whoever
  notices first (its exit watcher, an acquire, a drain), and counted once against the restart
  budget.
- ``close()`` stops every worker in every state (loading, ready, draining), concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

from bunkhouse import defaults
from bunkhouse.catalog import Catalog, CatalogModel
from bunkhouse.engines.contract import EngineClient
from bunkhouse.errors import (
    BunkhouseError,
    InsufficientMemory,
    ModelFailed,
    ModelNotFound,
    ModelTooLarge,
    Paused,
    ShuttingDown,
)
from bunkhouse.residency import policy
from bunkhouse.residency.estimate import MemoryEstimate, estimate
from bunkhouse.residency.events import EventLog
from bunkhouse.residency.slots import SlotGate
from bunkhouse.supervisor import restart
from bunkhouse.supervisor.handle import SparePool, WorkerHandle
from bunkhouse.supervisor.restart import RestartPolicy

log = logging.getLogger(__name__)

MIB = 1024 * 1024
PROGRESS_EVENT_S = 1.0
"""Seconds between a load's ``load_progress`` events."""
PROGRESS_LOG_S = 5.0
"""Seconds between a slow load's log lines."""


StartWorker = Callable[[CatalogModel], Awaitable[WorkerHandle]]
Flush = Callable[[CatalogModel, EngineClient, SlotGate, str], Awaitable[Any]]
"""Save a draining worker's slots (kvcache/keeper.py ``SnapshotKeeper.flush``)."""


class State(enum.Enum):
    ABSENT = "absent"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


_TRANSITIONS: dict[State, frozenset[State]] = {
    State.ABSENT: frozenset({State.LOADING, State.FAILED}),  # failed: a crash loop gave up
    State.LOADING: frozenset({State.READY, State.FAILED, State.ABSENT}),  # absent: cancelled
    State.READY: frozenset({State.DRAINING}),
    State.DRAINING: frozenset({State.ABSENT, State.FAILED}),  # failed: it crashed, gave up
    State.FAILED: frozenset({State.LOADING}),
}


@dataclass(frozen=True, slots=True)
class ResidencyOptions:
    budget_bytes: int
    ttl_s: float = 0.0  # global idle unload; 0: never
    admission_wait_s: float = defaults.ADMISSION_WAIT_S
    drain_grace_s: float = defaults.DRAIN_GRACE_S
    retry_after_s: int = defaults.RETRY_AFTER_S
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    probe_interval_s: float = defaults.PROBE_INTERVAL_S  # the engine's loop must answer
    probe_timeout_s: float = defaults.PROBE_INTERVAL_S
    probe_failures: int = defaults.PROBE_FAILURES  # in a row, before it is replaced
    generation_failures: int = defaults.GENERATION_FAILURES  # 5xx/broken in a row


# What a waiter's future resolves to: a lease, or None for "the state changed: look again".
_Waiter = asyncio.Future["Lease | None"]


class _Entry:
    """Residency state of one model. Written by the manager's commit methods only."""

    def __init__(self, model: CatalogModel) -> None:
        self.model = model
        self.state = State.ABSENT
        self.estimate: MemoryEstimate = estimate(model)
        self.measured: int | None = None  # the worker's peak resident memory so far
        self.worker: WorkerHandle | None = None
        self.slots = SlotGate(model.id, model.options.parallel, model.options.queue)
        self.leases = 0
        self.wanting = 0  # acquire() calls under way: requests waiting for a lease
        self.waiters: list[_Waiter] = []
        self.last_used = 0.0
        self.pinned = model.pinned
        self.loading: asyncio.Task[None] | None = None
        self.stopping: asyncio.Task[None] | None = None  # the drain under way
        self.on_absent: list[Callable[[], None]] = []
        self.last_error: str | None = None  # for any caller: no paths, no worker output
        self.last_error_detail: str | None = None  # the worker's output: log and admins only
        self.retired = False  # being deleted: admits nothing new, ever
        # supervision
        self.spawned_at = 0.0
        self.last_load_s: float | None = None  # its last load's time, start to ready
        self.ready_at = 0.0
        self.failures: list[float] = []  # when workers died or failed to load
        self.quick_deaths = 0
        self.next_delay_s = 0.0  # backoff before the next spawn
        self.failed_until: float | None = None
        self.died: WorkerHandle | None = None  # the worker whose death was last counted
        self.respawn = False  # load again once the dead worker is reaped
        self.probe_failures = 0
        self.probing = False
        self.last_probe = 0.0
        self.suspended = False  # its worker stopped by the compute gate's time slice
        self.suspensions = 0  # how many times: a probe that overlapped one proves nothing
        self.failed_requests = 0
        self.keep_alive_s: float | None = None  # a client's keep_alive until it is unloaded
        self.pending: CatalogModel | None = None  # settings a reload changed: the next load's

    @property
    def bytes(self) -> int:
        """What the model may hold: its estimate (the worker's worst case), or its measured
        peak if that ever went beyond (the estimate was wrong: the truth counts)."""
        return max(self.estimate.total, self.measured or 0)

    @property
    def busy(self) -> bool:
        """Someone holds it or waits for it: it may not be drained to make room."""
        return self.leases > 0 or bool(self.waiters)


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
    last_error_detail: str | None = None  # for admin-key callers only
    waiting: int = 0  # requests waiting for a lease: the model's load, memory, a pause


def _front_only(old: CatalogModel, new: CatalogModel) -> bool:
    """Whether two settings of a model differ only in what the front applies (its names,
    request params, idle ttl), which a running worker need not be restarted for."""
    return dataclasses.replace(old, aliases=new.aliases, request=new.request,
                               ttl_s=new.ttl_s) == new


class Lease:
    """A hold on a ready model for the whole life of one request. Release it exactly once."""

    def __init__(self, manager: ResidencyManager, entry: _Entry, worker: WorkerHandle) -> None:
        self._manager = manager
        self._entry = entry
        self.worker = worker
        self.slots = entry.slots
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
    def __init__(self, catalog: Catalog | Iterable[CatalogModel], options: ResidencyOptions,
                 start_worker: StartWorker, clock: Callable[[], float] = time.monotonic,
                 events: EventLog | None = None, flush: Flush | None = None,
                 spare: SparePool | None = None) -> None:
        """``flush``: called once a drained worker's requests ended, before it is stopped
        (not for a crashed one), to save its slots. ``spare``: keeps a spare worker (an engine
        imported, no model) for the next load while the host is idle and the budget has room
        for it; it counts in the budget and is dropped first when room is needed."""
        self.catalog = catalog if isinstance(catalog, Catalog) else Catalog(catalog, None)
        self.options = options
        self._start_worker = start_worker
        self._flush = flush
        self._clock = clock
        self._wall_offset = time.time() - clock()
        self.events = events or EventLog()
        self._entries = {m.id: _Entry(m) for m in self.catalog}
        self._cold_start = asyncio.Lock()
        self._changed = asyncio.Event()
        self._paused = 0
        self._pause_timer: asyncio.TimerHandle | None = None  # the operator's pause
        self._pause_ends = 0.0
        self.closing = False
        self.no_new_loads = False  # the front is stopping: see stop_loads
        self._closed: asyncio.Task[None] | None = None
        self.peak_bytes = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._spare = spare
        self._spare_engine: str | None = None  # the engine of the last model loaded

    # -- queries ---------------------------------------------------------------------------

    def used_bytes(self) -> int:
        """What the models hold of the budget (each its estimate, or its measured peak if
        larger), and a spare worker's share while there is one."""
        return (sum(e.bytes for e in self._entries.values() if e.state in _HOLDING)
                + self._spare_bytes())

    def spare_status(self) -> dict[str, Any] | None:
        """The spare worker waiting for the next load: its pid and its share of the budget;
        None if there is none."""
        pid = self._spare.spare_pid if self._spare is not None else None
        return None if pid is None else {"pid": pid, "bytes": self._spare_bytes()}

    def _spare_bytes(self) -> int:
        return self._spare.spare_bytes if self._spare is not None else 0

    def status(self, model_id: str) -> ModelStatus:
        e = self._entries[model_id]
        return ModelStatus(
            id=model_id, state=e.state.value, estimated_bytes=e.estimate.total,
            measured_bytes=e.measured, pinned=e.pinned, leases=e.leases,
            last_used=e.last_used + self._wall_offset if e.last_used else None,
            pid=e.worker.placement.pid if e.worker else None, last_error=e.last_error,
            last_error_detail=e.last_error_detail, waiting=e.wanting,
        )

    def statuses(self) -> list[ModelStatus]:
        return [self.status(model_id) for model_id in self._entries]

    def ready_workers(self) -> list[tuple[CatalogModel, EngineClient, SlotGate]]:
        """(model, its worker's engine, its slot gate) of every ready model."""
        return [(e.model, e.worker.engine, e.slots) for e in self._entries.values()
                if e.state is State.READY and e.worker is not None and e.worker.alive]

    def slots(self, model_id: str) -> SlotGate:
        """The model's slot gate (created and removed with its entry)."""
        return self._entries[model_id].slots

    # -- the registry: catalog entry, residency entry and slot gate together ----------------

    def add(self, model: CatalogModel) -> None:
        """Track a model added at runtime (absent until first used or loaded)."""
        self.catalog.add(model)
        self._entries[model.id] = _Entry(model)

    def remove(self, model_id: str) -> None:
        """Forget a model that holds nothing (absent or failed, no lease, nobody waiting)."""
        entry = self._entries[model_id]
        if entry.state not in (State.ABSENT, State.FAILED) or entry.busy or entry.loading:
            raise RuntimeError(f"model {model_id!r} is {entry.state.value}; unload it first")
        del self._entries[model_id]
        if model_id in self.catalog:
            self.catalog.remove(model_id)

    def apply_catalog(self, new: Catalog) -> dict[str, list[str]]:
        """A re-read configuration's catalog, applied without cutting anything: models only
        in ``new`` are added; models gone from it are discarded (requests waiting for them
        get 404, running ones finish, then the worker stops); a model whose settings changed
        takes them at its next load (at once if it holds nothing). Runtime-registered models
        stay. Aliases and the default model are ``new``'s. Returns the ids by change."""
        old = {m.id: m for m in self.catalog if not self._entries[m.id].retired}
        fresh = {m.id: m for m in new}
        for model_id in fresh.keys() - old.keys():  # back while its removal drains
            entry = self._entries.get(model_id)
            if entry is not None:
                entry.retired = False  # its removal forgets it only if still retired
                entry.pending = fresh[model_id]
        added = sorted(fresh.keys() - old.keys())
        removed = sorted(i for i in old.keys() - fresh.keys() if old[i].source != "runtime")
        changed = sorted(i for i in fresh.keys() & old.keys()
                         if fresh[i] != (self._entries[i].pending or old[i]))
        self.catalog.adopt(new, keep=[m.id for m in self.catalog if m.id not in fresh])
        for model_id in added:
            if model_id not in self._entries:
                self._entries[model_id] = _Entry(fresh[model_id])
        for model_id in changed:
            entry = self._entries[model_id]
            if _front_only(old[model_id], fresh[model_id]):  # names, params, ttl: at once
                entry.model = fresh[model_id]
                self.catalog.add(fresh[model_id])
            else:
                entry.pending = fresh[model_id]
        for model_id in (*added, *changed):
            entry = self._entries[model_id]
            if entry.pending is not None and entry.state in (State.ABSENT, State.FAILED) \
                    and not entry.busy and entry.loading is None:
                self._take_pending(entry)
        for model_id in removed:
            self.discard(model_id)
        return {"added": added, "removed": removed, "changed": changed}

    def _take_pending(self, entry: _Entry) -> None:
        """The model's changed settings, taken while no worker runs it."""
        model, entry.pending = entry.pending, None
        if model is None:
            return
        entry.model = model
        entry.estimate = estimate(model)
        entry.pinned = model.pinned
        entry.slots = SlotGate(model.id, model.options.parallel, model.options.queue)
        self.catalog.add(model)

    def discard(self, model_id: str) -> None:
        """Remove a model whatever it holds: requests waiting for it get 404 at once, its
        worker (loading or ready) is stopped, and it is forgotten once it holds nothing."""
        entry = self._entries.get(model_id)
        if entry is None:
            return
        self._retire(entry)
        if entry.state in (State.ABSENT, State.FAILED) and entry.loading is None:
            self.remove(model_id)
            return
        self._spawn_task(self._discard(model_id))

    async def _discard(self, model_id: str) -> None:
        await self.unload(model_id, "removed", 0.0, then=lambda: self._forget(model_id),
                          retire=True)

    def _forget(self, model_id: str) -> None:
        """A discarded model, once it holds nothing, unless a reload brought it back."""
        entry = self._entries.get(model_id)
        if entry is not None and entry.retired:
            self.remove(model_id)

    # -- acquire / release -----------------------------------------------------------------

    async def acquire(self, model: CatalogModel) -> Lease:
        """A lease on a ready worker for ``model``, loading it (once, whoever asks) if needed.

        Raises ModelNotFound (being removed), ModelFailed (cooling down after a crash loop),
        ModelTooLarge, InsufficientMemory, WorkerLoadFailed, ShuttingDown."""
        entry = self._entries[model.id]
        entry.wanting += 1
        paused_until: float | None = None  # while held by a pause: how long it may wait
        try:
            while True:
                ticket = self._ask(entry)
                if isinstance(ticket, Lease):
                    return ticket
                timeout = None
                if self._paused:
                    if paused_until is None:
                        paused_until = self._clock() + self.options.admission_wait_s
                    timeout = max(0.0, paused_until - self._clock())
                try:
                    await asyncio.wait({ticket}, timeout=timeout)
                except asyncio.CancelledError:
                    self._abandon(entry, ticket)
                    raise
                if not ticket.done():  # still paused past its wait
                    self._abandon(entry, ticket)
                    raise self._paused_error(model.id)
                lease = ticket.result()
                if lease is not None:
                    return lease
        finally:
            entry.wanting -= 1

    # -- load and evict (orchestration: commit, await an effect, commit) --------------------

    async def _load(self, entry: _Entry) -> None:
        """Make room, start the worker, commit ready (leasing every waiter). Never raises but
        CancelledError: an error goes to the waiters."""
        try:
            if entry.next_delay_s:
                log.info("model %s: waiting %.0f s before the next start (crash-loop backoff)",
                         entry.model.id, entry.next_delay_s)
                await asyncio.sleep(entry.next_delay_s)
            deadline = self._clock() + self.options.admission_wait_s
            async with self._cold_start:
                await self._make_room(entry, deadline)
                self._begin_load(entry)
                worker = await self._with_progress(entry, self._start_worker(entry.model))
        except asyncio.CancelledError:
            self._load_failed(entry, ShuttingDown(entry.model.id), cancelled=True)
            raise
        except BunkhouseError as e:
            self._load_failed(entry, e)
            return
        except Exception as e:
            log.exception("model %s: load failed", entry.model.id)
            self._load_failed(entry, BunkhouseError(f"model {entry.model.id!r}: {e}"))
            return
        self._loaded(entry, worker)

    async def _with_progress(self, entry: _Entry,
                             start: Awaitable[WorkerHandle]) -> WorkerHandle:
        """``start``, with a ``load_progress`` event every second while it runs (elapsed
        seconds, and the fraction of the model's last load time if it loaded before) and a
        log line every :data:`PROGRESS_LOG_S`."""
        task = asyncio.ensure_future(start)
        began = self._clock()
        logged = began
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=PROGRESS_EVENT_S)
                if done:
                    return task.result()
                now = self._clock()
                elapsed = now - began
                expected = entry.last_load_s
                fraction = min(0.99, elapsed / expected) if expected else None
                self.events.emit(entry.model.id, "load_progress", f"{elapsed:.0f} s",
                                 elapsed_s=round(elapsed, 1), expected_s=expected,
                                 fraction=fraction)
                if now - logged >= PROGRESS_LOG_S:
                    logged = now
                    log.info("model %s: still loading after %.0f s%s", entry.model.id, elapsed,
                             f" (its last load took {expected:.0f} s)" if expected else "")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _make_room(self, entry: _Entry, deadline: float) -> None:
        """Evict what the plan says until the model fits. Before each step: a load nobody
        waits for any more (its requests all left) is given up, and so is every load once
        the front has begun to stop: neither evicts a model for nothing; under a pause, it
        waits for the resume (a load whose worker is starting already goes on)."""
        while True:
            if self.closing or self.no_new_loads:
                raise ShuttingDown(entry.model.id)
            if not entry.wanting:
                log.info("model %s: load given up: no request waits for it any more",
                         entry.model.id)
                raise BunkhouseError(f"model {entry.model.id!r}: nobody waits for its load")
            if self._paused:  # nothing is evicted or loaded while paused: on, once resumed
                await self._wait_changed(None)
                deadline = max(deadline, self._clock() + self.options.admission_wait_s)
                continue
            # the spare counts, unless it is the one this load's worker will be
            spare = 0 if self._spare and self._spare.spare_for(entry.model) \
                else self._spare_bytes()
            decision = policy.plan(self._residents(), self.options.budget_bytes - spare,
                                   entry.model.id, entry.estimate.total)
            if spare and not (isinstance(decision, policy.Fits) and not decision.evict):
                assert self._spare is not None
                self._spare.drop_spare()  # the spare goes first: it holds no model
                continue
            if isinstance(decision, policy.NeverFits):
                raise ModelTooLarge(_never_fits_message(entry.model.id, decision))
            if isinstance(decision, policy.Fits):
                if not decision.evict:
                    return
                drains = self._begin_drains(decision.evict, f"making room for {entry.model.id}")
                await asyncio.gather(*(asyncio.shield(t) for t in drains))
                continue
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise InsufficientMemory(_must_wait_message(entry.model.id, decision),
                                         retry_after_s=self.options.retry_after_s)
            await self._wait_changed(remaining)

    def _residents(self) -> list[policy.Resident]:
        return [
            policy.Resident(e.model.id, e.bytes, e.last_used, e.pinned,
                            e.leases + len(e.waiters), evictable_state=e.state is State.READY)
            for e in self._entries.values() if e.state in _HOLDING
        ]

    async def _finish_drain(self, entry: _Entry, reason: str, *, crashed: bool = False) -> None:
        """Wait for the model's leases to end (or the front to close), then stop its worker.
        A crashed worker is reaped at once: its requests are failing already."""
        while entry.leases and not self.closing and not crashed:
            await self._wait_changed(None)
        worker = entry.worker
        if worker is not None and self._flush is not None and not crashed and worker.alive:
            try:
                await self._flush(entry.model, worker.engine, entry.slots, reason)
            except Exception:
                log.exception("model %s: saving its slots failed", entry.model.id)
        if worker is not None:
            await worker.stop()  # returns once the process is reaped: its memory is free
        self._stopped(entry, worker, reason)

    async def unload(self, model_id: str, reason: str, grace_s: float | None = None,
                     then: Callable[[], None] | None = None, retire: bool = False) -> bool:
        """Drain and stop the model. True once it is freed; False if requests still ran after
        ``grace_s``: it then accepts nothing new and is freed when they end. ``then`` runs
        once the model is freed (or at once if it holds nothing). ``retire``: it is being
        deleted, so requests waiting for it, or coming, get 404 instead of a reload."""
        entry = self._entries[model_id]
        if retire:
            self._retire(entry)
        while entry.state is State.LOADING:  # the load settles first: ready or failed
            await self._wait_changed(None)
        drain = self._begin_unload(entry, reason, then)
        if drain is None:
            return True
        grace = self.options.drain_grace_s if grace_s is None else grace_s
        deadline = self._clock() + grace
        while entry.leases and not drain.done() and self._clock() < deadline:
            await self._wait_changed(deadline - self._clock())
        if entry.leases and not drain.done():
            return False  # it is freed when they end
        await asyncio.shield(drain)
        return True

    # -- supervision: crashes, restart budget, liveness ------------------------------------

    async def _respawn(self, entry: _Entry) -> None:
        self.events.emit(entry.model.id, "respawning", f"after {entry.next_delay_s:.0f} s backoff")
        with contextlib.suppress(BunkhouseError):
            (await self.acquire(entry.model)).release()

    def _probe_due(self) -> None:
        now = self._clock()
        for entry in self._entries.values():
            if (entry.state is State.READY and entry.worker is not None and not entry.probing
                    and not entry.suspended
                    and now - entry.last_probe >= self.options.probe_interval_s):
                entry.probing, entry.last_probe = True, now
                self._spawn_task(self._probe(entry, entry.worker))

    async def _probe(self, entry: _Entry, worker: WorkerHandle) -> None:
        suspensions = entry.suspensions
        try:
            ok = await worker.engine.probe(self.options.probe_timeout_s)
        finally:
            entry.probing = False
        if entry.suspensions == suspensions and not entry.suspended:
            self._probed(entry, worker, ok)

    def suspend(self, model_id: str) -> None:
        """Stop the model's worker where it is (the compute gate's time slice); it is not
        probed until resumed. Nothing if it has no worker."""
        entry = self._entries.get(model_id)
        if entry is None or entry.worker is None:
            return
        entry.suspended = True
        entry.suspensions += 1
        entry.worker.suspend()

    def resume(self, model_id: str) -> None:
        """Let a suspended model's worker go on."""
        entry = self._entries.get(model_id)
        if entry is None:
            return
        entry.suspended = False
        if entry.worker is not None:
            entry.worker.resume()

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background residency task failed", exc_info=task.exception())

    # -- background: ttl and measurements --------------------------------------------------

    def expire_idle(self) -> list[asyncio.Task[None]]:
        """Begin draining every ready, unpinned, unleased model idle for longer than its ttl.
        Returns the drains (they run in the background: one slow stop delays nobody)."""
        now = self._clock()
        drains = []
        for entry in list(self._entries.values()):
            ttl = self._ttl(entry)
            idle = now - entry.last_used
            if ttl is not None and idle >= ttl:
                drain = self._begin_drain(entry, f"idle for {idle:.0f} s (ttl {ttl:.0f} s)")
                if drain is not None:
                    drains.append(drain)
        return drains

    def _ttl(self, entry: _Entry) -> float | None:
        """Idle seconds before the model is unloaded; None: never."""
        if entry.keep_alive_s is not None:
            return None if math.isinf(entry.keep_alive_s) else entry.keep_alive_s
        ttl = entry.model.ttl_s if entry.model.ttl_s is not None else self.options.ttl_s
        return ttl if ttl > 0 else None

    def keep_alive(self, model_id: str, seconds: float | None) -> None:
        """A client's ``keep_alive`` (Ollama's API): the model is unloaded after ``seconds``
        idle (0: as soon as no request holds it; ``math.inf``: never for idleness) until it
        is unloaded; None: the configured ttl again."""
        entry = self._entries[model_id]
        entry.keep_alive_s = seconds
        if seconds == 0 and not entry.leases:
            self._begin_drain(entry, "keep_alive 0: unloaded once idle")

    def expires_at(self, model_id: str) -> float | None:
        """When the model will be unloaded for idleness (wall clock), if it stays idle;
        None: never."""
        entry = self._entries[model_id]
        ttl = self._ttl(entry)
        if ttl is None:
            return None
        return (entry.last_used or self._clock()) + ttl + self._wall_offset

    async def run_background(self, interval_s: float = 1.0) -> None:
        """Refresh measured memory, probe workers and apply ttls, every ``interval_s``,
        until cancelled. Nothing here awaits a worker: a slow one delays no other."""
        while True:
            self.refresh_measurements()
            self._probe_due()
            self.expire_idle()
            await asyncio.sleep(interval_s)

    # -- pause, shutdown -------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def pause_all(self) -> AsyncIterator[None]:
        """Hold new leases, wait for every in-flight one to end, and release them together."""
        self._set_paused(+1)
        try:
            await self._quiet()
            yield
        finally:
            self._set_paused(-1)

    async def _quiet(self) -> None:
        while self.in_flight():
            await self._wait_changed(None)

    def in_flight(self) -> int:
        """Leases held now, all models together (requests in flight)."""
        return sum(e.leases for e in self._entries.values())

    @property
    def paused(self) -> bool:
        return bool(self._paused)

    def _paused_error(self, model_id: str) -> Paused:
        """What a request that waited out its admission wait under a pause is told: when
        the pause ends by itself at the latest (its Retry-After)."""
        left = self.pause_left_s()
        ends = f"; it ends by itself in {left:.0f} s unless resumed sooner" if left else ""
        return Paused(
            f"model {model_id!r}: every model is paused by an operator (POST /admin/pause)"
            f"{ends}; this request waited {self.options.admission_wait_s:g} s "
            "(--admission-wait); retry later",
            retry_after_s=max(1, math.ceil(left)) if left else self.options.retry_after_s)

    def pause_left_s(self) -> float | None:
        """Seconds until the operator's pause ends by itself; None when none is held."""
        if self._pause_timer is None:
            return None
        return max(0.0, self._pause_ends - self._clock())

    def pause_status(self) -> dict[str, Any]:
        """The operator's pause, as /stats shows it."""
        left = self.pause_left_s()
        return {"paused": left is not None,
                "resumes_at": None if left is None else self._pause_ends + self._wall_offset,
                "in_flight": self.in_flight()}

    def operator_pause(self, max_s: float, reason: str = "operator") -> float:
        """Hold every model paused (:meth:`pause_all`'s hold, kept across calls) until
        :meth:`operator_resume` or for ``max_s`` seconds at most, whichever comes first;
        a second call while paused restarts the bound. New leases wait (at most
        ``admission_wait_s``, then Paused, a 503 with Retry-After); leases held go on and
        no model is loaded meanwhile (a request still waiting for its model's load is held
        like a new one: it holds no lease). Returns the wall-clock time it ends by itself."""
        renewed = self._pause_timer is not None
        if self._pause_timer is not None:
            self._pause_timer.cancel()
        else:
            self._set_paused(+1)
        self.events.emit("*", "paused", f"{reason}{', renewed' if renewed else ''}",
                         max_s=max_s, in_flight=self.in_flight(), renewed=renewed)
        self._pause_timer = asyncio.get_running_loop().call_later(
            max_s, self.operator_resume, f"not resumed within {max_s:g} s")
        self._pause_ends = self._clock() + max_s
        return self._pause_ends + self._wall_offset

    async def paused_quiet(self) -> bool:
        """Once the operator's pause holds no lease in flight (True), or it ended (False)."""
        while self._pause_timer is not None and self.in_flight():
            await self._wait_changed(None)
        return self._pause_timer is not None

    def operator_resume(self, reason: str = "operator") -> bool:
        """End the operator's pause: every waiting request goes on, together. False when
        none was held."""
        if self._pause_timer is None:
            return False
        self._pause_timer.cancel()
        self._pause_timer = None
        self.events.emit("*", "resumed", reason)
        self._set_paused(-1)
        return True

    def stop_loads(self) -> None:
        """The front begins to stop: running and queued requests on ready models go on for
        the stop's grace, but no model is loaded (or evicted for another) any more; requests
        waiting for a load get ShuttingDown."""
        self.no_new_loads = True
        for entry in self._entries.values():
            if self._paused or (entry.state is not State.READY
                                and entry.state is not State.LOADING):
                self._wake(entry)  # they look again, and are told
        self._notify()

    def open(self) -> None:
        """Accept work (again, after a close: an app whose lifespan runs more than once)."""
        if self._closed is not None and self._closed.done():
            self._closed = None
            self.closing = False
            self.no_new_loads = False

    async def close(self) -> None:
        """Stop every worker, in every state, concurrently; refuse everything after. Safe to
        call more than once (and from several places): every call waits for the one close."""
        if self._closed is None:
            self._closed = asyncio.create_task(self._close())
        await asyncio.shield(self._closed)

    async def _close(self) -> None:
        self._begin_close()
        loads = [e.loading for e in self._entries.values() if e.loading is not None]
        drains = self._drains()
        background = [t for t in (*loads, *self._tasks)
                      if t is not asyncio.current_task() and t not in drains]
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        for entry in self._entries.values():
            self._begin_drain(entry, "shutdown", force=True)  # the draining ones go on
        await asyncio.gather(*self._drains(), return_exceptions=True)

    def _drains(self) -> list[asyncio.Task[None]]:
        return [e.stopping for e in self._entries.values() if e.stopping is not None]

    # -- commits: every write to an entry happens below, each in one step -------------------

    def _ask(self, entry: _Entry) -> Lease | _Waiter:
        """A lease now if the model is ready, else a waiter (starting its load if needed)."""
        if entry.retired:
            raise ModelNotFound(f"model {entry.model.id!r} is being removed", param="model")
        if self.closing:
            raise ShuttingDown(entry.model.id)
        if entry.state is State.READY and entry.worker is not None and not entry.worker.alive:
            self._worker_died(entry, entry.worker)
        if self.no_new_loads and (self._paused or (entry.state is not State.READY
                                                   and entry.state is not State.LOADING)):
            # stopping: no model is loaded any more, and a pause is never resumed
            raise ShuttingDown(entry.model.id)
        if entry.state is State.READY and entry.worker is not None and not self._paused:
            return self._lease(entry, entry.worker)
        if entry.state is State.FAILED and entry.failed_until is not None:
            remaining = entry.failed_until - self._clock()
            if remaining > 0:
                raise ModelFailed(
                    f"model {entry.model.id!r} is failed: {entry.last_error}; it will be "
                    f"tried again in {remaining:.0f} s", retry_after_s=max(1, int(remaining)),
                    detail=entry.last_error_detail)
            entry.failures.clear()
            entry.quick_deaths = 0
            entry.failed_until = None
        waiter: _Waiter = asyncio.get_running_loop().create_future()
        entry.waiters.append(waiter)
        if entry.state in (State.ABSENT, State.FAILED) and entry.loading is None \
                and not self._paused:  # paused: it loads once resumed (_wake: look again)
            entry.loading = asyncio.create_task(self._load(entry))
        return waiter

    def _abandon(self, entry: _Entry, waiter: _Waiter) -> None:
        """A waiting request went away: drop its place, or give back the lease it was handed."""
        if waiter in entry.waiters:
            entry.waiters.remove(waiter)
            self._notify()
        elif waiter.done() and not waiter.cancelled() and waiter.exception() is None:
            lease = waiter.result()
            if lease is not None:
                lease.release()

    def _lease(self, entry: _Entry, worker: WorkerHandle) -> Lease:
        entry.leases += 1
        entry.last_used = self._clock()
        return Lease(self, entry, worker)

    def _release(self, entry: _Entry) -> None:
        entry.leases -= 1
        entry.last_used = self._clock()
        if entry.keep_alive_s == 0 and not entry.leases:
            self._begin_drain(entry, "keep_alive 0: unloaded once idle")
        self._notify()
        self._keep_spare()

    def keep_spare_for(self, model_id: str | None) -> None:
        """At start: keep a spare for ``model_id``'s engine (the default model's), so that
        even the first load finds one. Nothing if a model was loaded already."""
        if self._spare is None or self._spare_engine is not None or model_id is None \
                or model_id not in self._entries:
            return
        self._spare_engine = self._spare.engine_of(self._entries[model_id].model)
        self._keep_spare()

    def _keep_spare(self) -> None:
        """Start a spare worker for the engine last loaded if the host is idle (no request
        in flight, no load under way: it takes a core for about 0.3 s), nothing is paused or
        stopping, and the budget has room for it besides the models."""
        if (self._spare is None or self._spare_engine is None or self.closing
                or self.no_new_loads or self._paused or self.in_flight()
                or self._cold_start.locked()
                or self.options.budget_bytes - self.used_bytes() + self._spare_bytes()
                < defaults.SPARE_BYTES):
            return
        self._spawn_task(self._spare.fill_spare(self._spare_engine))

    def _wake(self, entry: _Entry, error: BaseException | None = None) -> None:
        """Hand each waiter a lease (ready, not paused), the error, or None: look again."""
        waiters, entry.waiters = entry.waiters, []
        for waiter in waiters:
            if waiter.done():
                continue
            if error is not None:
                waiter.set_exception(error)
            elif entry.state is State.READY and entry.worker is not None and not self._paused:
                waiter.set_result(self._lease(entry, entry.worker))
            else:
                waiter.set_result(None)
        self._notify()

    def _begin_load(self, entry: _Entry) -> None:
        if self.closing:
            raise ShuttingDown(entry.model.id)
        if entry.retired:
            raise ModelNotFound(f"model {entry.model.id!r} was removed", param="model")
        self._take_pending(entry)
        self._set_state(entry, State.LOADING, f"estimated {entry.estimate.total // MIB} MiB",
                        estimated_bytes=entry.estimate.total,
                        file_bytes=entry.model.size_bytes)
        entry.spawned_at = self._clock()

    def _loaded(self, entry: _Entry, worker: WorkerHandle) -> None:
        entry.loading = None
        worker.on_exit = lambda: self._worker_died(entry, worker)
        entry.worker, entry.suspended = worker, False
        entry.slots.reset()  # a new worker's slots hold nothing
        memory = worker.memory()
        entry.measured = memory.peak if memory else None
        entry.last_error = entry.last_error_detail = None
        entry.next_delay_s = 0.0
        entry.probe_failures = entry.failed_requests = 0
        entry.ready_at = self._clock()
        entry.last_load_s = entry.ready_at - entry.spawned_at
        measured = f"{entry.measured // MIB} MiB" if entry.measured else "unknown"
        self._set_state(entry, State.READY,
                        f"{worker.placement}, {entry.model.size_bytes / MIB:.0f} MiB file, "
                        f"loaded in {entry.last_load_s:.1f} s, measured {measured}, "
                        f"estimated {entry.estimate.total // MIB} MiB",
                        measured_bytes=entry.measured, estimated_bytes=entry.estimate.total,
                        load_s=round(entry.last_load_s, 3))
        self._note_peak()
        self._wake(entry)  # every waiting request gets its lease in this same step
        if not worker.alive:  # it died before anyone could see it ready
            self._worker_died(entry, worker)
        if self._spare is not None:
            self._spare_engine = self._spare.engine_of(entry.model)
            self._keep_spare()

    def _load_failed(self, entry: _Entry, error: BunkhouseError, *,
                     cancelled: bool = False) -> None:
        """The load did not end ready: refused before its worker started (no room, too
        large: nothing to count), its worker failed to start (a failure against the restart
        budget), or it was cancelled. Every waiter gets ``error``."""
        entry.loading = None
        if entry.state is State.LOADING and cancelled:
            self._set_state(entry, State.ABSENT, error.message)
        elif entry.state is State.LOADING:
            self._count_failure(entry, error.message, detail=error.detail)
            self._set_state(entry, State.FAILED, error.message)
        self._wake(entry, error)

    def _begin_drains(self, victims: Iterable[str], reason: str) -> list[asyncio.Task[None]]:
        drains = [self._begin_drain(self._entries[v], reason) for v in victims]
        return [d for d in drains if d is not None]

    def _begin_drain(self, entry: _Entry, reason: str, *,
                     force: bool = False) -> asyncio.Task[None] | None:
        """Mark the model draining and start stopping it, if it is ready, unleased, nobody
        waits for it and it is not pinned (``force``: whatever holds it). The one way a drain
        begins. Returns the drain, or None if the model may not be drained now."""
        if entry.state is not State.READY:
            return entry.stopping if force and entry.state is State.DRAINING else None
        if not force and (entry.busy or entry.pinned):
            return None
        self._set_state(entry, State.DRAINING, reason)
        entry.stopping = self._spawn_task(self._finish_drain(entry, reason))
        return entry.stopping

    def _begin_unload(self, entry: _Entry, reason: str,
                      then: Callable[[], None] | None) -> asyncio.Task[None] | None:
        """An operator's unload: drain whatever holds it. None if it holds nothing."""
        drain = self._begin_drain(entry, reason, force=True)
        if drain is None:
            if then is not None:
                then()
            return None
        if then is not None:
            entry.on_absent.append(then)
        return drain

    def _stopped(self, entry: _Entry, worker: WorkerHandle | None, reason: str) -> None:
        """The drained worker is reaped: its memory is free."""
        if entry.worker is worker:
            entry.worker = None
            entry.measured = None
        entry.stopping = None
        if entry.state is State.DRAINING and entry.failed_until is not None and not self.closing:
            # its crash loop gave up: it rests until the cool-down passes
            self._set_state(entry, State.FAILED, f"stopped ({reason}); {entry.last_error}")
        elif entry.state is State.DRAINING:
            self._set_state(entry, State.ABSENT, f"stopped ({reason})")
        if entry.state is State.ABSENT and not entry.busy and entry.loading is None:
            self._take_pending(entry)  # a reload's settings, shown from now on
            entry.keep_alive_s = None  # a client's keep_alive lasts while it is loaded
        callbacks, entry.on_absent = entry.on_absent, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("model %s: a callback after its unload failed", entry.model.id)
        respawn, entry.respawn = entry.respawn, False
        if entry.retired:
            self._wake(entry, ModelNotFound(f"model {entry.model.id!r} was removed",
                                            param="model"))
        elif respawn and not self.closing and entry.loading is None:
            self._spawn_task(self._respawn(entry))
            self._wake(entry)
        else:
            self._wake(entry)  # waiters look again: one of them starts the next load

    def _worker_died(self, entry: _Entry, worker: WorkerHandle) -> None:
        """A worker's process exited on its own. Called by whoever notices first (its exit
        watcher, an acquire, a drain); counted once."""
        if entry.worker is not worker:
            return
        cause = worker.exit_cause or f"worker ({worker.placement}) exited"
        if entry.died is worker:  # already counted: only a better cause may come later
            entry.last_error, entry.last_error_detail = cause, worker.exit_detail
            return
        entry.died = worker
        self.events.emit(entry.model.id, "crashed", cause)
        if entry.state is State.DRAINING:  # it was being stopped anyway: no respawn
            entry.last_error, entry.last_error_detail = cause, worker.exit_detail
            return
        served_s = self._clock() - entry.ready_at
        may_retry = self._count_failure(entry, cause, served_s=served_s,
                                        detail=worker.exit_detail)
        self._set_state(entry, State.DRAINING, "crashed")
        entry.respawn = may_retry
        entry.stopping = self._spawn_task(self._finish_drain(entry, "crashed", crashed=True))

    def _count_failure(self, entry: _Entry, cause: str, served_s: float = 0.0,
                       detail: str | None = None) -> bool:
        """Count a failure against the restart budget; True: it may be tried again. A worker
        that served for at least the budget's window ends a crash loop: earlier failures are
        forgotten. Past the budget the model is failed for the cool-down (it goes to
        ``failed`` once its worker is reaped)."""
        now = self._clock()
        if served_s >= self.options.restart.window_s:
            entry.failures.clear()
        entry.failures.append(now)
        quick = now - entry.spawned_at < self.options.restart.quick_death_s
        entry.quick_deaths = entry.quick_deaths + 1 if quick else 0
        entry.last_error, entry.last_error_detail = cause, detail
        decision = restart.decide(self.options.restart, entry.failures, entry.quick_deaths, now)
        if isinstance(decision, restart.GiveUp):
            entry.failed_until = now + self.options.restart.cooldown_s
            entry.next_delay_s = 0.0
            self.events.emit(entry.model.id, "gave_up",
                             f"{decision.failures} failures in {decision.window_s:.0f} s; "
                             f"cooling down {self.options.restart.cooldown_s:.0f} s: {cause}")
            return False
        entry.next_delay_s = decision.delay_s
        return True

    def _retire(self, entry: _Entry) -> None:
        entry.retired = True
        self._wake(entry, ModelNotFound(f"model {entry.model.id!r} was removed", param="model"))

    def _report(self, entry: _Entry, worker: WorkerHandle, ok: bool) -> None:
        if entry.worker is not worker:
            return
        entry.failed_requests = 0 if ok else entry.failed_requests + 1
        self._replace_if_failing(entry, worker, entry.failed_requests,
                                 self.options.generation_failures, "requests in a row failed")

    def _probed(self, entry: _Entry, worker: WorkerHandle, ok: bool) -> None:
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
            log.error("model %s: %d %s; replacing worker (%s)",
                      entry.model.id, failures, what, worker.placement)
            worker.kill()

    def reset_failure(self, model_id: str) -> None:
        """An operator's reload: forget the model's failures and let it load again."""
        entry = self._entries[model_id]
        entry.failures.clear()
        entry.quick_deaths = 0
        entry.failed_until = None
        entry.next_delay_s = 0.0

    def refresh_measurements(self) -> None:
        for entry in self._entries.values():
            if entry.state is State.READY and entry.worker is not None:
                memory = entry.worker.memory()
                if memory is not None:
                    above = memory.peak > max(entry.estimate.total, entry.measured or 0)
                    entry.measured = max(entry.measured or 0, memory.peak)
                    if above:
                        log.warning("model %s: its worker peaked at %d MiB, above its estimate "
                                    "of %d MiB; counting the peak", entry.model.id,
                                    memory.peak // MIB, entry.estimate.total // MIB)
        self._note_peak()

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.used_bytes())

    def set_pinned(self, model_id: str, pinned: bool) -> None:
        entry = self._entries[model_id]
        if entry.pinned != pinned:
            entry.pinned = pinned
            self.events.emit(model_id, "pinned" if pinned else "unpinned", "operator")
            self._notify()

    def _set_paused(self, delta: int) -> None:
        self._paused += delta
        if not self._paused:
            for entry in self._entries.values():
                self._wake(entry)
        self._notify()

    def _begin_close(self) -> None:
        self.closing = True
        if self._pause_timer is not None:  # nothing resumes any more: waiters are told
            self._pause_timer.cancel()
            self._pause_timer = None
        for entry in self._entries.values():
            self._wake(entry, ShuttingDown(entry.model.id))

    def _set_state(self, entry: _Entry, new: State, reason: str, **data: Any) -> None:
        if new not in _TRANSITIONS[entry.state]:
            raise RuntimeError(f"{entry.model.id}: illegal {entry.state.value} -> {new.value}")
        entry.state = new
        self.events.emit(entry.model.id, new.value, reason, **data)
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
    need, budget = _sizes(d.need, d.budget)
    return (f"model {model_id!r} needs {need} but the memory budget is {budget}{pinned}; "
            "raise --budget or lower the model's context")


def _sizes(a: int, b: int) -> tuple[str, str]:
    """Two sizes in MiB, or in bytes when they round to the same MiB."""
    if a // MIB == b // MIB:
        return f"{a:,} bytes", f"{b:,} bytes"
    return f"{a // MIB} MiB", f"{b // MIB} MiB"


def _must_wait_message(model_id: str, d: policy.MustWait) -> str:
    return (f"model {model_id!r} needs {d.need // MIB} MiB and {max(d.free, 0) // MIB} MiB "
            f"are free; models in use ({', '.join(d.blocking) or 'none'}) did not finish "
            "in time; retry later")
