"""The task that owns residency state, and the executor of its effects.

:class:`RunLoop` takes events from one queue, calls :func:`~bunkhouse.residency.step.step`,
publishes the new state (an immutable snapshot anyone may read) and hands the effects to the
:class:`Executor`. Effects that take time (start, flush or stop a worker, probe it, fill or
drop a spare) run as tasks whose completions come back as events; nothing else writes the
state, and the loop only ever wakes for an event or the one timer the step asked for, so an
effect that has not completed yet never makes it spin.

Who sends what (docs/architecture.md has the picture):

- request tasks: Want, Cancel, Release, Report (through ResidencyManager and Lease);
- operators and the front's lifespan: the commands (Unload, Register, Reload, Pin, ...);
- the executor: WorkerReady, LoadFailed, Flushed, WorkerStopped, Probed, Measured,
  SpareFilled, SpareGone;
- a worker's exit watcher: WorkerExited; the compute gate: Suspend;
- the clock: Tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from bunkhouse.catalog import Catalog, CatalogModel
from bunkhouse.engines.contract import EngineClient
from bunkhouse.errors import BunkhouseError
from bunkhouse.residency import messages as msg
from bunkhouse.residency.clock import Clock, TimerHandle
from bunkhouse.residency.events import EventLog
from bunkhouse.residency.messages import Effect, Event
from bunkhouse.residency.slots import SlotGate
from bunkhouse.residency.state import LOCAL, State
from bunkhouse.residency.step import step, wake_at
from bunkhouse.supervisor.handle import SparePool, WorkerHandle

_UNSTAMPED = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[,.]\d+ ", re.M)
"""A log line's time stamp, which a failure's output is compared without."""

log = logging.getLogger(__name__)

PROGRESS_EVENT_S = 1.0
"""Seconds between a load's ``load_progress`` events."""
PROGRESS_LOG_S = 5.0
"""Seconds between a slow load's log lines."""
TICK_FLOOR_S = 0.1
"""Seconds before the next tick when the last one left a deadline due (a guard)."""

StartWorker = Callable[..., Awaitable[WorkerHandle]]
"""``start(model)``, or ``start(model, use_spare=True)`` to become the spare: a ready worker,
or WorkerLoadFailed; ``start(model, node=NODE)`` on a node other than the local one (a
cluster's: only a front that placed models there is asked that)."""
FlushSlots = Callable[[CatalogModel, EngineClient, SlotGate, str], Awaitable[Any]]
"""Save a draining worker's slots (kvcache/keeper.py ``SnapshotKeeper.flush``)."""
MakeLease = Callable[[msg.Granted, WorkerHandle, SlotGate], Any]


class Executor:
    """Carries out effects; what takes time runs as a task whose end is posted as an event.
    It holds what the state names by id: worker handles, slot gates, and the futures of
    waiters and commands."""

    def __init__(self, catalog: Catalog, events: EventLog, clock: Clock,
                 start_worker: StartWorker, flush: FlushSlots | None,
                 spare: SparePool | None, probe_timeout_s: float,
                 make_lease: MakeLease) -> None:
        """``make_lease(granted, worker, slots)``: what a waiter is handed for a lease."""
        self.catalog = catalog
        self.events = events
        self._clock = clock
        self._start = start_worker
        self._flush = flush
        self._spare = spare
        self._probe_timeout_s = probe_timeout_s
        self.post: Callable[[Event], None] = lambda event: None  # the run loop's
        self._make_lease = make_lease
        self.workers: dict[int, WorkerHandle] = {}
        self.futures: dict[int, asyncio.Future[Any]] = {}
        self._gates: dict[str, tuple[int, SlotGate]] = {}
        self._spawns: dict[int, asyncio.Task[None]] = {}
        self._failed_output: dict[str, str | None] = {}  # each model's last failed load's
        self._fills: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # -- what the state names by id ----------------------------------------------------

    def gate(self, state: State, model_id: str) -> SlotGate:
        """The model's slot gate, made anew when its settings change (its generation)."""
        m = state.models[model_id]
        held = self._gates.get(model_id)
        if held is None or held[0] != m.generation:
            o = m.spec.model.options
            held = (m.generation, SlotGate(model_id, o.parallel, o.queue))
            self._gates[model_id] = held
        return held[1]

    def forget_gates(self, state: State) -> None:
        """Gates go with their models."""
        for model_id in [k for k in self._gates if k not in state.models]:
            del self._gates[model_id]

    # -- effects -----------------------------------------------------------------------

    def run(self, state: State, effects: tuple[Effect, ...]) -> None:
        for effect in effects:
            try:
                self._run(state, effect)
            except Exception:
                log.exception("residency: carrying out %s failed", type(effect).__name__)

    def _run(self, state: State, e: Effect) -> None:
        if isinstance(e, msg.Resolve):
            self._resolve(state, e)
        elif isinstance(e, msg.Publish):
            self.events.emit(e.model, e.kind, e.reason, detail=e.detail, **e.data)
        elif isinstance(e, msg.Spawn):
            self._spawns[e.worker] = self._task(self._spawn_worker(e))
        elif isinstance(e, msg.CancelSpawn):
            task = self._spawns.get(e.worker)
            if task is not None:
                task.cancel()
        elif isinstance(e, msg.Stop):
            self._task(self._stop(e))
        elif isinstance(e, msg.Flush):
            self._task(self._save(state, e))
        elif isinstance(e, msg.Probe):
            self._task(self._probe(e))
        elif isinstance(e, msg.Kill | msg.Signal | msg.Measure):
            self._signal(e)
        elif isinstance(e, msg.FillSpare):
            self._fills[e.node] = self._task(self._fill(e))
        elif isinstance(e, msg.DropSpare):
            self._task(self._drop(e))
        elif isinstance(e, msg.ResetSlots):
            self.gate(state, e.model).reset()
        elif isinstance(e, msg.Log):
            log.log(e.level, "%s", e.message)
        else:
            self._catalog(e)

    def _catalog(self, e: Effect) -> None:
        if isinstance(e, msg.CatalogAdd):
            self.catalog.add(e.model)
        elif isinstance(e, msg.CatalogRemove):
            if e.model in self.catalog:
                self.catalog.remove(e.model)
            self.events.forget(e.model)  # what the front keeps per model goes with it
        elif isinstance(e, msg.CatalogAdopt):
            self.catalog.adopt(e.catalog, e.keep)

    def _resolve(self, state: State, e: msg.Resolve) -> None:
        future = self.futures.pop(e.id, None)
        value = e.value
        if isinstance(value, msg.Granted):
            if future is None or future.done():  # its request left: the lease goes back
                self.post(msg.Release(value.model, value.lease))
                return
            worker = self.workers[value.worker]
            value = self._make_lease(value, worker, self.gate(state, value.model))
        if future is None or future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    def _signal(self, e: msg.Kill | msg.Signal | msg.Measure) -> None:
        worker = self.workers.get(e.worker)
        if worker is None:
            return
        if isinstance(e, msg.Kill):
            worker.kill()
        elif isinstance(e, msg.Signal):
            worker.suspend() if e.suspend else worker.resume()
        else:
            memory = worker.memory()
            self.post(msg.Measured(e.model, e.worker, memory.peak if memory else None))

    def _task(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("residency: an effect failed", exc_info=task.exception())

    # -- effects that take time --------------------------------------------------------

    async def _spawn_worker(self, e: msg.Spawn) -> None:
        try:
            where: dict[str, Any] = {} if e.node == LOCAL else {"node": e.node}
            if e.use_spare:
                where["use_spare"] = True
            start = self._start(e.spec, **where)
            worker = await self._with_progress(e, start)
        except asyncio.CancelledError:
            self.post(msg.LoadFailed(e.model, e.worker, None))
            return
        except BunkhouseError as error:
            # once per failure, with the worker's output when new; each request it refuses (now, or
            # during the cool-down that may follow) logs one short line (errors.log_line)
            self._log_failure(e.model, error)
            error.logged = True
            self.post(msg.LoadFailed(e.model, e.worker, error))
            return
        except Exception as error:
            log.exception("model %s: load failed", e.model)
            self.post(msg.LoadFailed(e.model, e.worker, BunkhouseError(
                f"model {e.model!r} failed to load (an internal error; the server log has "
                "it)", detail=f"{type(error).__name__}: {error}", logged=True)))
            return
        finally:
            self._spawns.pop(e.worker, None)
        self.workers[e.worker] = worker
        worker.on_exit = lambda: self.post(msg.WorkerExited(
            e.model, e.worker, worker.exit_cause, worker.exit_detail, worker.exit_lost))
        memory = worker.memory()
        self.post(msg.WorkerReady(e.model, e.worker, worker.placement.pid,
                                  str(worker.placement), memory.peak if memory else None,
                                  worker.alive))

    def _log_failure(self, model: str, error: BunkhouseError) -> None:
        """A failed load, logged at ERROR with the worker's output indented under it; the
        same output as the model's last failure (a crash loop's retries) is not repeated."""
        output = None if error.detail is None else _UNSTAMPED.sub("", error.detail)
        if output is not None and self._failed_output.get(model) == output:
            log.error("model %s: load failed again: %s (its output is the same as its last "
                      "failure's, logged above)", model, error.message)
            return
        self._failed_output[model] = output
        log.error("model %s: load failed: %s", model, error.message,
                  extra={"output": error.detail})  # its lines indented under this one

    async def _with_progress(self, e: msg.Spawn, start: Awaitable[WorkerHandle]
                             ) -> WorkerHandle:
        """``start``, with a ``load_progress`` event every second while it runs (elapsed
        seconds, and the fraction of the model's last load time if it loaded before) and a
        log line every :data:`PROGRESS_LOG_S`."""
        task = asyncio.ensure_future(start)
        began = logged = self._clock.now()
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=PROGRESS_EVENT_S)
                if done:
                    return task.result()
                now = self._clock.now()
                elapsed, expected = now - began, e.expected_s
                fraction = min(0.99, elapsed / expected) if expected else None
                self.events.emit(e.model, "load_progress", f"{elapsed:.0f} s",
                                 elapsed_s=round(elapsed, 1), expected_s=expected,
                                 fraction=fraction)
                if now - logged >= PROGRESS_LOG_S:
                    logged = now
                    log.info("model %s: still loading after %.0f s%s", e.model, elapsed,
                             f" (its last load took {expected:.0f} s)" if expected else "")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _save(self, state: State, e: msg.Flush) -> None:
        worker = self.workers.get(e.worker)
        try:
            if worker is not None and self._flush is not None and worker.alive:
                model = state.models[e.model].spec.model
                await self._flush(model, worker.engine, self.gate(state, e.model), e.reason)
        except Exception:
            log.exception("model %s: saving its slots failed", e.model)
        finally:
            self.post(msg.Flushed(e.model, e.worker))

    async def _stop(self, e: msg.Stop) -> None:
        worker = self.workers.get(e.worker)
        try:
            if worker is not None:
                await worker.stop()  # returns once the process is reaped: its memory is free
        finally:
            self.workers.pop(e.worker, None)
            self.post(msg.WorkerStopped(e.model, e.worker))

    async def _probe(self, e: msg.Probe) -> None:
        worker = self.workers.get(e.worker)
        ok = False
        try:
            if worker is not None:
                ok = await worker.engine.probe(self._probe_timeout_s)
        finally:
            self.post(msg.Probed(e.model, e.worker, ok, e.suspensions))

    async def _fill(self, e: msg.FillSpare) -> None:
        pid = None
        try:
            if self._spare is not None:
                pid = await self._spare.fill_spare(e.engine, e.node)
        finally:
            self._fills.pop(e.node, None)
            self.post(msg.SpareFilled(e.node, pid))

    async def _drop(self, e: msg.DropSpare) -> None:
        try:
            if self._spare is not None:
                self._spare.drop_spare(e.node)  # a fill under way kills what it makes
            fill = self._fills.get(e.node)
            if fill is not None:
                await asyncio.gather(asyncio.shield(fill), return_exceptions=True)
        finally:
            self.post(msg.SpareGone(e.node))

    async def aclose(self) -> None:
        """Cancel what still runs (probes, fills) once residency closed."""
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class RunLoop:
    """One task that owns residency state: events in from one queue, effects out."""

    def __init__(self, state: State, executor: Executor, clock: Clock) -> None:
        self.state = state
        self.executor = executor
        self._clock = clock
        executor.post = self.post
        self._queue: asyncio.Queue[Event] | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: TimerHandle | None = None
        self._timer_at: float | None = None
        self._changed = asyncio.Event()
        self.steps = 0  # events handled: a test can see that the loop does not spin

    def post(self, event: Event) -> None:
        """Hand the loop an event (from the event loop's thread; never blocks)."""
        self._running().put_nowait(event)

    def _running(self) -> asyncio.Queue[Event]:
        """The queue, with the loop task started on the running event loop (again on a new
        one: an app whose lifespan runs more than once, a test's second loop)."""
        loop = asyncio.get_running_loop()
        if self._queue is None or self._task is None or self._task.done() \
                or self._loop is not loop:
            self._queue = asyncio.Queue()
            self._loop = loop
            self._changed = asyncio.Event()
            self._timer = self._timer_at = None
            self._task = loop.create_task(self._run(self._queue), name="residency")
        return self._queue

    async def _run(self, queue: asyncio.Queue[Event]) -> None:
        while True:
            event = await queue.get()
            self.handle(event)

    def handle(self, event: Event) -> None:
        """One step: the new state is published, then its effects carried out."""
        now = self._clock.now()
        try:
            state, effects = step(self.state, event, now)
        except Exception:
            log.exception("residency: handling %s failed; the state is kept", event)
            self._fail(event)
            return
        self.state = state
        self.steps += 1
        self.executor.forget_gates(state)
        self.executor.run(state, effects)
        when = wake_at(state, now)
        if isinstance(event, msg.Tick) and when is not None and when <= now:
            when = now + TICK_FLOOR_S  # a deadline no tick settles must not spin the loop
        self._arm(when)
        self._changed.set()
        self._changed = asyncio.Event()

    def _fail(self, event: Event) -> None:
        """A step that raised (a bug): whoever waits on the event is told, not left hanging."""
        ident = getattr(event, "waiter", None) or getattr(event, "reply", None)
        if ident is not None:
            self.executor.run(self.state, (msg.Resolve(
                ident, BunkhouseError("internal error in residency; see the server log")),))

    def _arm(self, when: float | None) -> None:
        if when == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, when
        if when is not None:
            self._timer = self._clock.call_at(when, self._tick)

    def _tick(self) -> None:
        self._timer = self._timer_at = None
        if self._queue is not None:
            self._queue.put_nowait(msg.Tick())

    async def changed(self, timeout_s: float | None = None) -> None:
        """Until the next step (or ``timeout_s``)."""
        self._running()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)
