"""The residency manager: which models are resident, within each node's memory budget.

Its state is plain data (residency/state.py) changed only by one pure function,
``step(state, event, now) -> (state, effects)`` (residency/step.py), which one task runs
(residency/loop.py): events in from one queue, effects out to an executor whose completions
come back as events. This class is the door to it: its methods send a command or an event
and await the reply; everything else reads the last published state (:meth:`snapshot`).
No caller reads or writes a model's record.

- ``acquire(model)`` returns a :class:`Lease` on a ready worker, loading the model first if
  needed (one load whoever asks; a model loaded for waiting requests serves them before it
  can be chosen to make room). Raises ModelNotFound (being removed), ModelFailed (cooling
  down after a crash loop), ModelTooLarge, InsufficientMemory (503 after
  ``admission_wait_s``), Paused, WorkerLoadFailed, ShuttingDown.
- ``load``, ``unload``, ``delete``, ``register``, ``apply_catalog``, ``set_pinned``, the
  pauses and ``close`` are commands; each returns once the step answered it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from bunkhouse import defaults
from bunkhouse.catalog import Catalog, CatalogModel
from bunkhouse.engines.contract import Adapter, EngineClient
from bunkhouse.residency import messages as msg
from bunkhouse.residency.clock import Clock, RealClock
from bunkhouse.residency.estimate import estimate
from bunkhouse.residency.events import EventLog
from bunkhouse.residency.loop import Executor, FlushSlots, RunLoop, StartWorker
from bunkhouse.residency.slots import SlotGate
from bunkhouse.residency.state import Phase, ResidencyOptions, Spec, State, initial
from bunkhouse.residency.timers import ttl_of
from bunkhouse.supervisor.handle import SparePool, WorkerHandle

__all__ = ["Lease", "ModelStatus", "ResidencyManager", "ResidencyOptions"]


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
    node: str | None = None  # where its worker runs (None: none runs; "local": this host)


class Lease:
    """A hold on a ready model for the whole life of one request. Release it exactly once
    (again is harmless)."""

    def __init__(self, post: Callable[[msg.Event], None], granted: msg.Granted,
                 worker: WorkerHandle, slots: SlotGate,
                 state: Callable[[], State] | None = None) -> None:
        """``state()``: residency's latest state (for :meth:`blamed`)."""
        self._post = post
        self._state = state
        self._granted = granted
        self.worker = worker
        self.slots = slots
        self.model_id = granted.model
        self.adapters: tuple[Adapter, ...] = ()  # the LoRA adapters its worker mounts
        self._released = False
        self._blamed = False  # as it was when released (the release forgets it)

    def release(self) -> None:
        if not self._released:
            self._blamed = self.blamed()
            self._released = True
            self._post(msg.Release(self.model_id, self._granted.lease))

    def constrained(self, on: bool) -> None:
        """This request carries a constraint and was sent to the worker (``on``), or its
        answer ended: a stall of the worker meanwhile is blamed on it, not on the model
        (residency/step.py ``_probed``)."""
        self._post(msg.Constrained(self.model_id, self._granted.lease, on))

    def blamed(self) -> bool:
        """Whether its worker was replaced for a stall while this request ran."""
        if self._released or self._state is None:
            return self._blamed
        model = self._state().models.get(self.model_id)
        return model is not None and self._granted.lease in model.blamed

    def report(self, ok: bool) -> None:
        """Whether the worker answered this request (a 5xx or a broken connection: no)."""
        self._post(msg.Report(self.model_id, self._granted.worker, ok))

    def found_dead(self) -> None:
        """Its worker was dead when the lease was handed over (before its exit watcher said
        so): counted once, whoever tells first."""
        self._post(msg.WorkerExited(self.model_id, self._granted.worker,
                                    self.worker.exit_cause, self.worker.exit_detail,
                                    self.worker.exit_lost))


class ResidencyManager:
    def __init__(self, catalog: Catalog | Iterable[CatalogModel], options: ResidencyOptions,
                 start_worker: StartWorker, clock: Clock | None = None,
                 events: EventLog | None = None, flush: FlushSlots | None = None,
                 spare: SparePool | None = None) -> None:
        """``start_worker(model)``: a ready worker (``use_spare=True``: becoming the spare).
        ``flush``: called once a drained worker's requests ended, before it is stopped (not
        for a crashed one), to save its slots. ``spare``: keeps a spare worker (an engine
        imported, no model) for the next load while the host is idle and the budget has
        room; it counts in the budget and is dropped first when room is needed."""
        self.catalog = catalog if isinstance(catalog, Catalog) else Catalog(catalog, None)
        self.options = options
        self.events = events or EventLog()
        self._spare = spare
        self._clock = clock or RealClock()
        self._wall_offset = time.time() - self._clock.now()
        self._ids = itertools.count(1)
        executor = Executor(self.catalog, self.events, self._clock, start_worker, flush,
                            spare, options.probe_timeout_s, self._lease)
        state = initial(options, [self.spec(m) for m in self.catalog.bases()],
                        spares=spare is not None, flush=flush is not None)
        self._loop = RunLoop(state, executor, self._clock)

    def spec(self, model: CatalogModel) -> Spec:
        """What residency knows of a model: its settings, its estimate, the engine that runs
        it (which spare it may become)."""
        engine = self._spare.engine_of(model) if self._spare is not None else model.engine
        return Spec(model, estimate(model).total, engine,
                    model.transcribes or model.info.split_count <= 1)

    def _lease(self, granted: msg.Granted, worker: WorkerHandle, slots: SlotGate) -> Lease:
        lease = Lease(self._loop.post, granted, worker, slots, lambda: self._loop.state)
        m = self._loop.state.models.get(granted.model)
        if m is not None:  # the spec its worker runs (a re-mount's is taken at its spawn)
            lease.adapters = m.spec.model.adapters
        return lease

    # -- talking to the loop ---------------------------------------------------------------

    def _post(self, event: msg.Event) -> None:
        self._loop.post(event)

    def _future(self) -> tuple[int, asyncio.Future[Any]]:
        """An id and the future its answer (a ``Resolve`` effect) will settle."""
        ident = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._loop.executor.futures[ident] = future
        return ident, future

    async def _ask(self, make: Callable[[int], msg.Event]) -> Any:
        """Send a command and wait for its answer (raised if it is an error)."""
        ident, future = self._future()
        self._post(make(ident))
        return await future

    def snapshot(self) -> State:
        """The state as the last step left it (immutable)."""
        return self._loop.state

    async def changed(self, timeout_s: float | None = None) -> None:
        """Until the state changes next (or ``timeout_s``)."""
        await self._loop.changed(timeout_s)

    @property
    def steps(self) -> int:
        """Events handled so far."""
        return self._loop.steps

    # -- requests ------------------------------------------------------------------------

    async def acquire(self, model: CatalogModel, adapter: str | None = None) -> Lease:
        """A lease on a ready worker for ``model``, loading it if needed (see the module
        docstring for the errors); ``adapter``: the id of the LoRA adapter of ``model`` the
        request runs with, held as long as the lease (ModelNotFound if it is not, or no
        longer, registered on ``model``)."""
        while True:
            lease: Lease = await self._want(model.id, lease=True, adapter=adapter)
            if lease.worker.alive:
                return lease
            lease.found_dead()
            lease.release()

    async def load(self, model_id: str, reset: bool = False) -> None:
        """Once the model is ready (loading it if needed), without holding it. ``reset``: an
        operator's load, which forgets a crash loop's failures first."""
        await self._want(model_id, lease=False, reset=reset)

    async def _want(self, model_id: str, *, lease: bool, reset: bool = False,
                    adapter: str | None = None) -> Any:
        ident, future = self._future()
        self._post(msg.Want(model_id, ident, lease, reset, adapter))
        try:
            return await future
        except asyncio.CancelledError:
            self._post(msg.Cancel(model_id, ident))
            if future.done() and not future.cancelled() and future.exception() is None \
                    and isinstance(future.result(), Lease):
                future.result().release()  # handed over just as its request left
            raise

    def keep_alive(self, model_id: str, seconds: float | None) -> None:
        """A client's ``keep_alive`` (Ollama's API): the model is unloaded after ``seconds``
        idle (0: as soon as no request holds it; ``math.inf``: never for idleness) until it
        is unloaded; None: the configured ttl again."""
        self._post(msg.KeepAlive(model_id, seconds))

    def suspend(self, model_id: str) -> None:
        """Stop the model's worker where it is (the compute gate's time slice); it is not
        probed until resumed."""
        self._post(msg.Suspend(model_id, True))

    def resume(self, model_id: str) -> None:
        self._post(msg.Suspend(model_id, False))

    # -- operators -----------------------------------------------------------------------

    def node_joined(self, node: str, budget: int, engines: frozenset[str] | None = None,
                    spares: bool = False) -> None:
        """A node that runs workers came up, or its budget (bytes) or engines changed."""
        self._post(msg.NodeJoined(node, budget, engines, spares))

    def node_lost(self, node: str, reason: str) -> None:
        """A node is gone with its workers: their models become absent, their requests
        fail, and their waiters are placed again on the nodes left."""
        self._post(msg.NodeLost(node, reason))

    async def unload(self, model_id: str, reason: str, grace_s: float | None = None
                     ) -> bool | None:
        """Drain and stop the model (requests waiting for it when asked are served first).
        True once it is absent; False if requests still ran after ``grace_s``: it accepts
        nothing new and is freed when they end; None if it held nothing (absent or failed,
        nothing waiting for it): nothing changed."""
        grace = self.options.drain_grace_s if grace_s is None else grace_s
        freed = await self._ask(lambda r: msg.Unload(model_id, r, reason, grace))
        return None if freed is None else bool(freed)

    async def delete(self, model_id: str, reason: str, grace_s: float | None = None) -> bool:
        """Remove the model: requests waiting for it get 404, a load under way is
        cancelled, running requests finish (within ``grace_s``: else False, and it goes once
        they end); its id is free once it holds nothing."""
        grace = self.options.drain_grace_s if grace_s is None else grace_s
        return bool(await self._ask(
            lambda r: msg.Unload(model_id, r, reason, grace, forget=True)))

    async def register(self, model: CatalogModel) -> None:
        """Track a model added at runtime (absent until used or loaded). Conflict (409) if
        the id is taken."""
        spec = self.spec(model)
        await self._ask(lambda r: msg.Register(spec, r))

    async def mount(self, base: str, added: CatalogModel | None = None,
                    removed: str | None = None) -> None:
        """The model ``base`` mounts the adapter ``added`` (its catalog entry), or no longer
        the adapter ``removed`` (its id). A resident base is re-mounted once its requests end
        (residency/commands.py ``remount``). Conflict (409) for an id taken or an adapter a
        request holds; ModelNotFound if ``base`` or the adapter is gone."""
        await self._ask(lambda r: msg.Mount(base, r, added, removed))

    async def apply_catalog(self, new: Catalog) -> dict[str, list[str]]:
        """A re-read configuration's catalog, applied without cutting anything (see
        step._reload); adapters registered at runtime stay mounted on their bases. Returns
        the ids by change: added, removed, changed."""
        for adapter in self.catalog:
            if adapter.source == "runtime" and adapter.adapter is not None \
                    and adapter.adapter_of in new and adapter.id not in new:
                base = new.get(adapter.adapter_of)
                new.add(adapter)
                new.add(replace(base, adapters=(*base.adapters, adapter.adapter)))
        before = {m.id: m.adapter for m in self.catalog if m.adapter is not None}
        after = {m.id: m.adapter for m in new if m.adapter is not None}
        specs = tuple(self.spec(m) for m in new.bases())
        change: dict[str, list[str]] = await self._ask(lambda r: msg.Reload(specs, new, r))
        for key, ids in (("added", after.keys() - before.keys()),
                         ("removed", before.keys() - after.keys()),
                         ("changed", {i for i in after.keys() & before.keys()
                                      if after[i] != before[i]})):
            change[key] = sorted({*change[key], *ids})
        return change

    async def set_pinned(self, model_id: str, pinned: bool) -> bool:
        """Pin (never evicted) or unpin the model; whether that changed it."""
        return bool(await self._ask(lambda r: msg.Pin(model_id, pinned, r)))

    async def operator_pause(self, max_s: float, reason: str = "operator") -> float:
        """Hold every model paused until :meth:`operator_resume` or for ``max_s`` seconds,
        whichever comes first (a second call restarts the bound). New leases wait (at most
        ``admission_wait_s``, then Paused, 503 with Retry-After); leases held go on and no
        model is loaded or evicted meanwhile. Returns the wall-clock time it ends by
        itself."""
        ends: float = await self._ask(lambda r: msg.OperatorPause(max_s, reason, r))
        return ends + self._wall_offset

    async def paused_quiet(self) -> bool:
        """Once the operator's pause holds no lease in flight (True), or it ended (False)."""
        return bool(await self._ask(msg.AwaitQuiet))

    async def operator_resume(self, reason: str = "operator") -> bool:
        """End the operator's pause: every waiting request goes on, together. False when
        none was held."""
        return bool(await self._ask(lambda r: msg.OperatorResume(reason, r)))

    @contextlib.asynccontextmanager
    async def pause_all(self) -> AsyncIterator[None]:
        """Hold new leases, wait for every one in flight to end, and let them go together."""
        await self._ask(lambda r: msg.PauseHold(True, r))
        try:
            yield
        finally:
            await self._ask(lambda r: msg.PauseHold(False, r))

    def keep_spare_for(self, model_id: str | None) -> None:
        """At start: keep a spare for ``model_id``'s engine (the default model's), so that
        even the first load finds one. Nothing if a model was loaded already."""
        if self._spare is not None and model_id is not None and model_id in self.catalog:
            self._post(msg.KeepSpare(self._spare.engine_of(self.catalog.get(model_id))))

    def stop_loads(self) -> None:
        """The front begins to stop: running and queued requests on ready models go on for
        the stop's grace, but no model is loaded (or evicted for another) any more; requests
        waiting for a load get ShuttingDown."""
        self._post(msg.StopLoads())

    def open(self) -> None:
        """Accept work (again, after a close: an app whose lifespan runs more than once)."""
        self._post(msg.Open())

    async def close(self) -> None:
        """Stop every worker, in every state, concurrently; refuse everything after. Safe to
        call more than once: every call waits until every worker has stopped."""
        await self._ask(msg.Close)
        await self._loop.executor.aclose()

    # -- reads of the last published state -------------------------------------------------

    @property
    def closing(self) -> bool:
        return self._loop.state.closing

    @property
    def paused(self) -> bool:
        return self._loop.state.paused

    @property
    def peak_bytes(self) -> int:
        return self._loop.state.peak_bytes

    def used_bytes(self) -> int:
        """What the models hold of the budget (each its estimate, or its measured peak if
        larger), and spare workers' share."""
        return self._loop.state.used_bytes()

    def in_flight(self) -> int:
        """Leases held now, all models together (requests in flight)."""
        return self._loop.state.in_flight()

    def status(self, model_id: str) -> ModelStatus:
        """Raises KeyError for a model residency does not track."""
        m = self._loop.state.models[model_id]
        w = m.worker
        return ModelStatus(
            id=model_id, state=m.phase.value, estimated_bytes=m.spec.estimate,
            measured_bytes=m.measured, pinned=m.pinned, leases=len(m.leases),
            last_used=m.last_used + self._wall_offset if m.last_used else None,
            pid=w.pid if w is not None else None, last_error=m.last_error,
            last_error_detail=m.last_error_detail, waiting=len(m.waiters),
            node=w.node if w is not None else None)

    def nodes(self) -> list[dict[str, Any]]:
        """Each node: its id, budget, the bytes its models (and spare) hold, its models, and
        its spare worker (``{"pid", "bytes"}``, or None)."""
        s = self._loop.state
        return [{"id": n.id, "budget_bytes": n.budget, "used_bytes": s.used_bytes(n.id),
                 "models": sorted(m.id for m in s.models.values() if m.node == n.id),
                 "spare": {"pid": n.spare.pid, "bytes": defaults.SPARE_BYTES}
                 if n.spare is not None and n.spare.pid is not None else None}
                for n in s.nodes.values()]

    def statuses(self) -> list[ModelStatus]:
        return [self.status(model_id) for model_id in self._loop.state.models]

    def slots(self, model_id: str) -> SlotGate:
        """The model's slot gate (made with its record, remade when its settings change)."""
        return self._loop.executor.gate(self._loop.state, model_id)

    def ready_workers(self) -> list[tuple[CatalogModel, EngineClient, SlotGate]]:
        """(model, its worker's engine, its slot gate) of every ready model."""
        state, executor = self._loop.state, self._loop.executor
        out = []
        for m in state.models.values():
            w = m.worker
            handle = executor.workers.get(w.id) if w is not None else None
            if m.phase is Phase.READY and handle is not None and handle.alive:
                out.append((m.spec.model, handle.engine, self.slots(m.id)))
        return out

    def spare_status(self) -> dict[str, Any] | None:
        """The spare worker waiting for the next load: its pid and its share of the budget;
        None if there is none. With a cluster, the first node's that has one (each node's
        is in :meth:`nodes`)."""
        for node in self._loop.state.nodes.values():
            if node.spare is not None and node.spare.pid is not None:
                return {"pid": node.spare.pid, "bytes": defaults.SPARE_BYTES}
        return None

    def expires_at(self, model_id: str) -> float | None:
        """When the model will be unloaded for idleness (wall clock), if it stays idle;
        None: never."""
        state = self._loop.state
        m = state.models[model_id]
        ttl = ttl_of(state, m)
        if ttl is None:
            return None
        return (m.last_used or self._clock.now()) + ttl + self._wall_offset

    def pause_left_s(self) -> float | None:
        """Seconds until the operator's pause ends by itself; None when none is held."""
        pause = self._loop.state.pause
        if pause is None or pause.until is None:
            return None
        return max(0.0, pause.until - self._clock.now())

    def pause_status(self) -> dict[str, Any]:
        """The operator's pause, as /stats shows it."""
        left = self.pause_left_s()
        pause = self._loop.state.pause
        ends = pause.until if pause is not None else None
        return {"paused": left is not None,
                "resumes_at": None if ends is None else ends + self._wall_offset,
                "in_flight": self.in_flight()}
