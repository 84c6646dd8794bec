"""Residency's one step: ``step(state, event, now) -> (state, effects)``, a pure function.

It is the only code that makes residency state (residency/state.py): every event is handled
by one small function below, then :func:`_schedule` decides, on the state that results, what
loads, what drains, who gets a lease and who is refused, and :func:`_settle` answers those
waiting for a condition (an unload for the model's absence, a pause for quiet, a close for
every worker's stop). Nothing here awaits, logs, sleeps or touches a process: it returns the
effects for residency/loop.py to carry out. :func:`wake_at` says when the step wants a
:class:`~bunkhouse.residency.messages.Tick`.

Scheduling (DESIGN.md "Residency"):

- Models that want a load (requests wait for them, or a crashed worker is to be respawned)
  are taken in the order their first request came. One cold start at a time per node.
- The first of them that does not fit now is the *head*. The least recently used idle models
  on its node are drained for it; if that is not enough, busy models are *held*: they take
  no new leases (their new requests wait for their next load) and drain once their requests
  end, so the head cannot starve behind a model that keeps getting requests.
- While the head waits for requests to end (or for a load under way), a later model that
  fits now is loaded (*backfill*); once only idle drains stand between the head and its
  room, nothing is loaded on its node ahead of it. A backfilled model may itself be drained
  when the head's room comes.
- A model made ready gives every waiting request its lease in the same step, so it serves
  them before it can be chosen to make room (no swap loop).
- Waiting for memory holds no lock; it is bounded by ``admission_wait_s``, then 503
  ``insufficient_memory``. A model bigger than every node's budget fails at once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from bunkhouse import defaults
from bunkhouse.catalog import CatalogModel
from bunkhouse.errors import (
    Conflict,
    InsufficientMemory,
    ModelFailed,
    ModelNotFound,
    ModelTooLarge,
    Paused,
    ShuttingDown,
)
from bunkhouse.residency import messages as msg
from bunkhouse.residency import policy
from bunkhouse.residency.messages import Effect, Event
from bunkhouse.residency.state import (
    HOLDING,
    TRANSITIONS,
    Drain,
    Model,
    Node,
    Pause,
    Phase,
    Quiet,
    Spare,
    SpareStatus,
    Stage,
    State,
    UnloadWait,
    Waiter,
    Worker,
)
from bunkhouse.supervisor import supervision
from bunkhouse.supervisor.supervision import Health

MIB = 1024 * 1024
SPARE_ID = "\0spare"  # the spare worker among a node's residents (no model id has a NUL)

Fx = list[Effect]


def step(state: State, event: Event, now: float) -> tuple[State, tuple[Effect, ...]]:
    """The state after ``event`` at ``now`` (the injected clock's seconds), and the effects
    to carry out, in order."""
    fx: Fx = []
    handler: Callable[[State, Any, float, Fx], State] = _HANDLERS[type(event)]
    state = handler(state, event, now, fx)
    state = _schedule(state, now, fx)
    state = _settle(state, fx)
    return state, tuple(fx)


# -- small helpers ----------------------------------------------------------------------


def _put(s: State, m: Model) -> State:
    return replace(s, models={**s.models, m.id: m})


def _put_health(s: State, model_id: str, h: Health) -> State:
    return replace(s, health={**s.health, model_id: h})


def _put_node(s: State, n: Node) -> State:
    return replace(s, nodes={**s.nodes, n.id: n})


def _phase(m: Model, new: Phase, reason: str, fx: Fx, **data: Any) -> Model:
    """``m`` in its new phase, published; an illegal transition is a bug."""
    if new not in TRANSITIONS[m.phase]:
        raise RuntimeError(f"{m.id}: illegal {m.phase.value} -> {new.value}")
    fx.append(msg.Publish(m.id, new.value, reason, data))
    return replace(m, phase=new)


def _current(s: State, model_id: str, worker: int) -> Model | None:
    """The model, if ``worker`` is its worker now (else the event is about a worker that
    is gone or was replaced: stale)."""
    m = s.models.get(model_id)
    return m if m is not None and m.worker is not None and m.worker.id == worker else None


def _refuse(m: Model, error: Exception, fx: Fx, keep: Callable[[Waiter], bool] | None = None
            ) -> Model:
    """Every waiter (but those ``keep`` keeps) answered with ``error``."""
    kept = tuple(w for w in m.waiters if keep is not None and keep(w))
    for w in m.waiters:
        if w not in kept:
            fx.append(msg.Resolve(w.id, error))
    return replace(m, waiters=kept)


def _removed(model_id: str) -> ModelNotFound:
    return ModelNotFound(f"model {model_id!r} was removed", param="model")


# -- requests ---------------------------------------------------------------------------


def _want(s: State, e: msg.Want, now: float, fx: Fx) -> State:
    m = s.models.get(e.model)
    error = _refusal(s, m, e.model, now)
    if error is not None:
        fx.append(msg.Resolve(e.waiter, error))
        return s
    assert m is not None
    h = s.health[m.id]
    if e.reset or (h.failed_until is not None and h.failed_until <= now):
        s = _put_health(s, m.id, supervision.forgiven(h))
    return _put(s, replace(m, waiters=(*m.waiters, Waiter(e.waiter, now, e.lease))))


def _refusal(s: State, m: Model | None, model_id: str, now: float) -> Exception | None:
    """Why a request for the model is refused at once, if it is."""
    if m is None or m.retired:
        return ModelNotFound(f"model {model_id!r} is being removed", param="model")
    if s.closing:
        return ShuttingDown(model_id)
    if s.stopping and (s.paused or m.phase not in (Phase.READY, Phase.LOADING)):
        return ShuttingDown(model_id)  # no model is loaded any more, no pause is resumed
    if m.phase is Phase.FAILED:
        left = supervision.cooling_s(s.health[m.id], now)
        if left is not None:
            return ModelFailed(
                f"model {model_id!r} is failed: {m.last_error}; it will be tried again in "
                f"{left:.0f} s", retry_after_s=max(1, int(left)), detail=m.last_error_detail)
    return None


def _cancel(s: State, e: msg.Cancel, now: float, fx: Fx) -> State:
    m = s.models.get(e.model)
    if m is None or not any(w.id == e.waiter for w in m.waiters):
        return s
    m = replace(m, waiters=tuple(w for w in m.waiters if w.id != e.waiter))
    if m.wait_since is not None and not _wants_load(m):
        fx.append(msg.Log(logging.INFO, f"model {m.id}: load given up: no request waits for "
                                        "it any more"))
    return _put(s, m)


def _release(s: State, e: msg.Release, now: float, fx: Fx) -> State:
    m = s.models.get(e.model)
    if m is None or e.lease not in m.leases:
        return s
    m = replace(m, leases=m.leases - {e.lease}, last_used=now)
    if m.keep_alive_s == 0 and not m.leases:
        m = _begin_drain(m, "keep_alive 0: unloaded once idle", fx)
    return _put(s, _advance_drain(s, m, fx))


def _report(s: State, e: msg.Report, now: float, fx: Fx) -> State:
    m = _current(s, e.model, e.worker)
    if m is None or m.worker is None or not m.worker.alive:
        return s
    h, replace_it = supervision.request_answered(s.health[m.id], e.ok,
                                                 s.options.generation_failures)
    if replace_it:
        _kill(m, f"{h.failed_requests} requests in a row failed", fx)
    return _put_health(s, m.id, h)


def _kill(m: Model, why: str, fx: Fx) -> None:
    assert m.worker is not None
    fx.append(msg.Log(logging.ERROR, f"model {m.id}: {why}; replacing worker "
                                     f"({m.worker.placement})"))
    fx.append(msg.Kill(m.id, m.worker.id))


# -- workers ----------------------------------------------------------------------------


def _worker_ready(s: State, e: msg.WorkerReady, now: float, fx: Fx) -> State:
    m = _current(s, e.model, e.worker)
    if m is None or m.phase is not Phase.LOADING or m.worker is None:
        return s
    worker = replace(m.worker, pid=e.pid, placement=e.placement, ready_at=now)
    load_s = now - m.worker.spawned_at
    m = replace(m, worker=worker, measured=e.measured, last_error=None,
                last_error_detail=None, last_load_s=load_s, respawn=False, not_before=0.0)
    measured = f"{e.measured // MIB} MiB" if e.measured else "unknown"
    m = _phase(m, Phase.READY,
               f"{e.placement}, {m.spec.model.size_bytes / MIB:.0f} MiB file, loaded in "
               f"{load_s:.1f} s, measured {measured}, estimated {m.spec.estimate // MIB} MiB",
               fx, measured_bytes=e.measured, estimated_bytes=m.spec.estimate,
               load_s=round(load_s, 3))
    fx.append(msg.ResetSlots(m.id))
    s = _put_health(s, m.id, supervision.fresh_worker(s.health[m.id]))
    node = s.nodes[worker.node]
    s = _put_node(s, replace(node, spare_engine=m.spec.engine, spare_failed=False))
    if m.drain is not None:  # cancelled while it started: it stops at once
        reason = m.drain.reason
        fx.append(msg.Stop(m.id, worker.id))
        m = _phase(m, Phase.DRAINING, reason, fx)
        return _put(s, replace(m, drain=Drain(reason, Stage.STOP)))
    s = _put(s, m)
    if not e.alive:  # it died before anyone saw it ready
        s = _exited(s, msg.WorkerExited(m.id, worker.id), now, fx)
    return s


def _load_failed(s: State, e: msg.LoadFailed, now: float, fx: Fx) -> State:
    m = _current(s, e.model, e.worker)
    if m is None or m.phase is not Phase.LOADING or m.worker is None:
        return s
    if e.error is None:  # cancelled: a delete, or the front's close
        m = replace(_phase(m, Phase.ABSENT, "load cancelled", fx), worker=None, drain=None)
        return _absent(s, m, now, fx)
    message = getattr(e.error, "message", str(e.error))
    detail = getattr(e.error, "detail", None)
    s = _count_failure(s, m, message, detail, now, fx)
    m = replace(s.models[m.id], worker=None, respawn=False)
    m = _refuse(_phase(m, Phase.FAILED, message, fx), e.error, fx)
    if m.retired:
        return _forget(s, m, fx)
    return _put(s, m)


def _count_failure(s: State, m: Model, cause: str, detail: str | None, now: float, fx: Fx,
                   served_s: float = 0.0) -> State:
    """A failure against the restart budget; sets the model's backoff (``not_before``)
    and ``respawn``: whether it may be tried again by itself (its load failing is not
    retried by itself: the next request tries again, after the backoff)."""
    assert m.worker is not None
    h, verdict = supervision.failed(s.options.restart, s.health[m.id], now,
                                    m.worker.spawned_at, served_s)
    m = replace(m, last_error=cause, last_error_detail=detail)
    if isinstance(verdict, supervision.GiveUp):
        fx.append(msg.Publish(m.id, "gave_up",
                              f"{verdict.failures} failures in {verdict.window_s:.0f} s; "
                              f"cooling down {s.options.restart.cooldown_s:.0f} s: {cause}"))
        m = replace(m, respawn=False, not_before=0.0)
    else:
        m = replace(m, respawn=True, not_before=now + verdict.delay_s)
    return _put_health(_put(s, m), m.id, h)


def _exited(s: State, e: msg.WorkerExited, now: float, fx: Fx) -> State:
    m = _current(s, e.model, e.worker)
    if m is None or m.worker is None or m.phase is Phase.LOADING:
        return s  # a starting worker's death is its load's failure
    h = s.health[m.id]
    cause = e.cause or m.last_error or f"worker ({m.worker.placement}) exited"
    if h.counted == e.worker:  # counted already: only a better cause may come later
        return _put(s, replace(m, last_error=cause, last_error_detail=e.detail)) \
            if e.cause else s
    s = _put_health(s, m.id, replace(h, counted=e.worker))
    fx.append(msg.Publish(m.id, "crashed", cause))
    worker = replace(m.worker, alive=False)
    m = replace(m, worker=worker, last_error=cause, last_error_detail=e.detail)
    if m.phase is Phase.DRAINING:  # it was being stopped anyway: no respawn
        assert m.drain is not None
        m = replace(m, drain=replace(m.drain, crashed=True))
        return _put(s, _advance_drain(s, m, fx))
    served_s = now - (worker.ready_at or now)
    s = _count_failure(s, m, cause, e.detail, now, fx, served_s=served_s)
    m = s.models[m.id]
    if m.retired:
        m = replace(m, respawn=False)
    m = replace(_phase(m, Phase.DRAINING, "crashed", fx, cause="crashed"),
                drain=Drain("crashed", Stage.STOP, crashed=True))
    assert m.worker is not None
    fx.append(msg.Stop(m.id, m.worker.id))  # its requests are failing already
    return _put(s, m)


def _probed(s: State, e: msg.Probed, now: float, fx: Fx) -> State:
    m = _current(s, e.model, e.worker)
    if m is None:
        return s
    h, replace_it = supervision.probe_answered(s.health[m.id], e.ok, e.suspensions,
                                               s.options.probe_failures)
    if replace_it and m.phase is Phase.READY and m.worker is not None and m.worker.alive:
        _kill(m, f"{h.probe_failures} liveness probes in a row missed", fx)
    return _put_health(s, m.id, h)


def _flushed(s: State, e: msg.Flushed, now: float, fx: Fx) -> State:
    m = _current(s, e.model, e.worker)
    if m is None or m.drain is None or m.drain.stage is not Stage.FLUSH:
        return s
    m = replace(m, drain=replace(m.drain, stage=Stage.STOP))
    fx.append(msg.Stop(m.id, e.worker))
    return _put(s, m)


def _stopped(s: State, e: msg.WorkerStopped, now: float, fx: Fx) -> State:
    m = _current(s, e.model, e.worker)
    if m is None or m.phase is not Phase.DRAINING or m.drain is None:
        return s
    reason = m.drain.reason
    cooling = supervision.cooling_s(s.health[m.id], now) is not None
    if cooling and not s.closing:  # its crash loop gave up: it rests until the cool-down
        m = _phase(m, Phase.FAILED, f"stopped ({reason}); {m.last_error}", fx)
    else:
        m = _phase(m, Phase.ABSENT, f"stopped ({reason})", fx)
    m = replace(m, worker=None, measured=None, drain=None)
    if m.respawn and not s.closing and not m.retired:
        delay = max(0.0, m.not_before - now)
        fx.append(msg.Publish(m.id, "respawning", f"after {delay:.0f} s backoff"))
        if delay:
            fx.append(msg.Log(logging.INFO, f"model {m.id}: waiting {delay:.0f} s before "
                                            "the next start (crash-loop backoff)"))
    return _absent(s, replace(m, respawn=m.respawn and not s.closing), now, fx)


def _absent(s: State, m: Model, now: float, fx: Fx) -> State:
    """``m`` holds nothing any more: a removed model is forgotten, changed settings are
    taken, a client's keep_alive ends."""
    if m.retired:
        return _forget(s, m, fx)
    if not m.waiters:
        m = replace(_take_pending(m, fx), keep_alive_s=None)
    return _put(s, m)


def _forget(s: State, m: Model, fx: Fx) -> State:
    """Remove a model that holds nothing: its catalog entry, record and health together."""
    m = _refuse(m, _removed(m.id), fx)
    for u in m.unloads:
        fx.append(msg.Resolve(u.reply, True))
    fx.append(msg.CatalogRemove(m.id))
    models = {k: v for k, v in s.models.items() if k != m.id}
    health = {k: v for k, v in s.health.items() if k != m.id}
    return replace(s, models=models, health=health, held=s.held - {m.id})


def _take_pending(m: Model, fx: Fx) -> Model:
    """A reload's settings, taken while no worker runs the model."""
    if m.pending is None:
        return m
    fx.append(msg.CatalogAdd(m.pending.model))
    return replace(m, spec=m.pending, pending=None, pinned=m.pending.model.pinned,
                   generation=m.generation + 1)


def _measured(s: State, e: msg.Measured, now: float, fx: Fx) -> State:
    m = _current(s, e.model, e.worker)
    if m is None or m.phase is not Phase.READY or e.peak is None:
        return s
    if e.peak > m.bytes:
        fx.append(msg.Log(logging.WARNING,
                          f"model {m.id}: its worker peaked at {e.peak // MIB} MiB, above "
                          f"its estimate of {m.spec.estimate // MIB} MiB; counting the peak"))
    return _put(s, replace(m, measured=max(m.measured or 0, e.peak)))


def _spare_filled(s: State, e: msg.SpareFilled, now: float, fx: Fx) -> State:
    node = s.nodes[e.node]
    if node.spare is None or node.spare.status is not SpareStatus.FILLING:
        return s  # dropped meanwhile: the executor kills what the fill made
    if e.pid is None:
        return _put_node(s, replace(node, spare=None, spare_failed=True))
    return _put_node(s, replace(node, spare=replace(node.spare, status=SpareStatus.READY,
                                                    pid=e.pid)))


def _spare_gone(s: State, e: msg.SpareGone, now: float, fx: Fx) -> State:
    return _put_node(s, replace(s.nodes[e.node], spare=None))


def _suspend(s: State, e: msg.Suspend, now: float, fx: Fx) -> State:
    m = s.models.get(e.model)
    if m is None or m.worker is None or not m.worker.alive \
            or m.phase not in (Phase.READY, Phase.DRAINING):
        return s  # nothing running to stop (a starting worker is not yet the gate's)
    fx.append(msg.Signal(m.id, m.worker.id, e.on))
    return _put_health(s, m.id, supervision.suspended(s.health[m.id], e.on))


# -- drains -------------------------------------------------------------------------------


def _begin_drain(m: Model, reason: str, fx: Fx, *, force: bool = False) -> Model:
    """Mark a ready model draining (it takes no new lease), if nobody holds it and it is
    not pinned (``force``: whatever holds it). Its requests end, then its KV state is saved
    and its worker stopped (:func:`_advance_drain`)."""
    if m.phase is not Phase.READY or (not force and (m.busy or m.pinned)):
        return m
    m = _phase(m, Phase.DRAINING, reason, fx)
    return replace(m, drain=Drain(reason))


def _advance_drain(s: State, m: Model, fx: Fx) -> Model:
    """A draining model whose requests ended (or the front closes): save, then stop."""
    d = m.drain
    if m.phase is not Phase.DRAINING or d is None or d.stage is not Stage.LEASES \
            or m.worker is None or (m.leases and not s.closing):
        return m
    if d.crashed or not m.worker.alive or not s.flush:
        fx.append(msg.Stop(m.id, m.worker.id))
        return replace(m, drain=replace(d, stage=Stage.STOP))
    fx.append(msg.Flush(m.id, m.worker.id, d.reason))
    return replace(m, drain=replace(d, stage=Stage.FLUSH))


def _retire(s: State, m: Model, reason: str, fx: Fx) -> State:
    """Remove a model whatever it holds: its waiters get 404 at once, a load under way is
    cancelled, a ready worker drains (running requests finish), and the record is forgotten
    once it holds nothing."""
    m = _refuse(replace(m, retired=True, respawn=False), _removed(m.id), fx)
    if m.phase in (Phase.ABSENT, Phase.FAILED):
        return _forget(s, m, fx)
    if m.phase is Phase.LOADING and m.worker is not None and m.drain is None:
        fx.append(msg.CancelSpawn(m.id, m.worker.id))
        m = replace(m, drain=Drain(reason, Stage.STOP))
    m = _begin_drain(m, reason, fx, force=True)
    return _put(s, _advance_drain(s, m, fx))


# -- operator commands --------------------------------------------------------------------


def _unload(s: State, e: msg.Unload, now: float, fx: Fx) -> State:
    m = s.models.get(e.model)
    if m is None:
        fx.append(msg.Resolve(e.reply, ModelNotFound(f"model {e.model!r} not found",
                                                     param="model")))
        return s
    wait = UnloadWait(e.reply, e.reason, frozenset(w.id for w in m.waiters),
                      now + e.grace_s)
    m = replace(m, unloads=(*m.unloads, wait), respawn=False)
    if e.forget:
        return _retire(s, m, e.reason, fx)
    if not m.waiters:  # else it drains once they are served (_grant_all)
        m = _advance_drain(s, _begin_drain(m, e.reason, fx, force=True), fx)
    return _put(s, m)


def _register(s: State, e: msg.Register, now: float, fx: Fx) -> State:
    model_id = e.spec.model.id
    if model_id in s.models:
        fx.append(msg.Resolve(e.reply, Conflict(f"model id {model_id!r} is already in use",
                                                param="id")))
        return s
    fx.append(msg.CatalogAdd(e.spec.model))
    fx.append(msg.Resolve(e.reply, None))
    s = _put(s, Model(e.spec, pinned=e.spec.model.pinned))
    return _put_health(s, model_id, Health())


def _front_only(old: CatalogModel, new: CatalogModel) -> bool:
    """Whether two settings differ only in what the front applies (names, request params,
    idle ttl), which a running worker need not be restarted for."""
    return dataclasses.replace(old, aliases=new.aliases, request=new.request,
                               ttl_s=new.ttl_s) == new


def _reload(s: State, e: msg.Reload, now: float, fx: Fx) -> State:
    """Models only in the new configuration are added; models gone from it are removed
    (waiting requests get 404, running ones finish); a model whose settings changed takes
    them at its next load (at once if it holds nothing, or if only names, request params
    or its ttl changed). Runtime-registered models stay."""
    old = {k: m for k, m in s.models.items() if not m.retired}
    fresh = {spec.model.id: spec for spec in e.specs}
    added = sorted(fresh.keys() - old.keys())
    removed = sorted(k for k in old.keys() - fresh.keys()
                     if old[k].spec.model.source != "runtime")
    changed = sorted(k for k in fresh.keys() & old.keys()
                     if fresh[k].model != (old[k].pending or old[k].spec).model)
    fx.append(msg.CatalogAdopt(e.catalog, tuple(k for k in s.models if k not in fresh)))
    for k in added:
        m = s.models.get(k)  # back while its removal drains: it stays
        m = replace(m, retired=False, pending=fresh[k]) if m is not None \
            else Model(fresh[k], pinned=fresh[k].model.pinned)
        s = _put_health(_put(s, m), k, s.health.get(k, Health()))
    for k in changed:
        m = s.models[k]
        if _front_only(m.spec.model, fresh[k].model):
            fx.append(msg.CatalogAdd(fresh[k].model))
            s = _put(s, replace(m, spec=fresh[k], pending=None))
        else:
            s = _put(s, replace(m, pending=fresh[k]))
    for k in (*added, *changed):
        m = s.models[k]
        if m.phase in (Phase.ABSENT, Phase.FAILED) and not m.busy:
            s = _put(s, _take_pending(m, fx))
    for k in removed:
        s = _retire(s, s.models[k], "removed from the configuration", fx)
    fx.append(msg.Resolve(e.reply, {"added": added, "removed": removed, "changed": changed}))
    return s


def _pin(s: State, e: msg.Pin, now: float, fx: Fx) -> State:
    m = s.models.get(e.model)
    if m is not None and m.pinned != e.pinned:
        fx.append(msg.Publish(m.id, "pinned" if e.pinned else "unpinned", "operator"))
        s = _put(s, replace(m, pinned=e.pinned))
    fx.append(msg.Resolve(e.reply, None))
    return s


def _keep_alive(s: State, e: msg.KeepAlive, now: float, fx: Fx) -> State:
    m = s.models.get(e.model)
    if m is None:
        return s
    m = replace(m, keep_alive_s=e.seconds)
    if e.seconds == 0 and not m.leases:
        m = _advance_drain(s, _begin_drain(m, "keep_alive 0: unloaded once idle", fx), fx)
    return _put(s, m)


def _pause_hold(s: State, e: msg.PauseHold, now: float, fx: Fx) -> State:
    p = s.pause or Pause(since=now)
    if e.on:
        return replace(s, pause=replace(p, holds=p.holds + 1),
                       quiet=(*s.quiet, Quiet(e.reply, operator=False)))
    fx.append(msg.Resolve(e.reply, None))
    return _resume_if_free(s, replace(p, holds=max(0, p.holds - 1)), now)


def _resume_if_free(s: State, p: Pause, now: float) -> State:
    """The pause, or none once nobody holds it: every waiting request goes on, and loads
    waiting for memory wait afresh."""
    if p.holds or p.until is not None:
        return replace(s, pause=p)
    models = {k: replace(m, wait_since=now) if m.wait_since is not None else m
              for k, m in s.models.items()}
    return replace(s, pause=None, models=models)


def _operator_pause(s: State, e: msg.OperatorPause, now: float, fx: Fx) -> State:
    p = s.pause or Pause(since=now)
    renewed = p.until is not None
    fx.append(msg.Publish("*", "paused", f"{e.reason}{', renewed' if renewed else ''}",
                          {"max_s": e.max_s, "in_flight": s.in_flight(), "renewed": renewed}))
    fx.append(msg.Resolve(e.reply, now + e.max_s))
    return replace(s, pause=replace(p, until=now + e.max_s, max_s=e.max_s))


def _operator_resume(s: State, e: msg.OperatorResume, now: float, fx: Fx) -> State:
    if s.pause is None or s.pause.until is None:
        fx.append(msg.Resolve(e.reply, False))
        return s
    fx.append(msg.Resolve(e.reply, True))
    return _end_operator_pause(s, e.reason, now, fx)


def _end_operator_pause(s: State, reason: str, now: float, fx: Fx) -> State:
    pause = s.pause
    assert pause is not None
    fx.append(msg.Publish("*", "resumed", reason))
    for q in s.quiet:
        if q.operator:
            fx.append(msg.Resolve(q.reply, False))
    s = replace(s, quiet=tuple(q for q in s.quiet if not q.operator))
    return _resume_if_free(s, replace(pause, until=None), now)


def _await_quiet(s: State, e: msg.AwaitQuiet, now: float, fx: Fx) -> State:
    if s.pause is None or s.pause.until is None:
        fx.append(msg.Resolve(e.reply, False))
        return s
    return replace(s, quiet=(*s.quiet, Quiet(e.reply, operator=True)))


def _stop_loads(s: State, e: msg.StopLoads, now: float, fx: Fx) -> State:
    s = replace(s, stopping=True)
    for m in s.models.values():
        if s.paused or m.phase not in (Phase.READY, Phase.LOADING):
            s = _put(s, replace(_refuse(m, ShuttingDown(m.id), fx), respawn=False))
    return s


def _open(s: State, e: msg.Open, now: float, fx: Fx) -> State:
    return replace(s, closing=False, stopping=False) if not s.closers else s


def _close(s: State, e: msg.Close, now: float, fx: Fx) -> State:
    """Stop every worker in every state, concurrently; refuse everything after."""
    for q in s.quiet:
        fx.append(msg.Resolve(q.reply, False))
    s = replace(s, closing=True, pause=None, quiet=(), head=None, held=frozenset(),
                freed=frozenset(), closers=(*s.closers, e.reply))
    for m in list(s.models.values()):
        m = replace(_refuse(m, ShuttingDown(m.id), fx), respawn=False)
        if m.phase is Phase.LOADING and m.worker is not None and m.drain is None:
            fx.append(msg.CancelSpawn(m.id, m.worker.id))
            m = replace(m, drain=Drain("shutdown", Stage.STOP))
        m = _advance_drain(s, _begin_drain(m, "shutdown", fx, force=True), fx)
        s = _put(s, m)
    for node in s.nodes.values():
        if node.spare is not None and node.spare.status is not SpareStatus.DROPPING:
            fx.append(msg.DropSpare(node.id))
            s = _put_node(s, replace(node, spare=replace(node.spare,
                                                         status=SpareStatus.DROPPING)))
    return s


def _keep_spare(s: State, e: msg.KeepSpare, now: float, fx: Fx) -> State:
    node = next(iter(s.nodes.values()))
    if not node.spares or node.spare_engine is not None:
        return s
    return _put_node(s, replace(node, spare_engine=e.engine))


# -- time -----------------------------------------------------------------------------------


def _tick(s: State, e: msg.Tick, now: float, fx: Fx) -> State:
    if s.pause is not None and s.pause.until is not None and s.pause.until <= now:
        s = _end_operator_pause(s, f"not resumed within {s.pause.max_s:g} s", now, fx)
    for old in list(s.models.values()):
        m = _expire_idle(s, _expire_unloads(_expire_waits(s, old, now, fx), now, fx), now, fx)
        if m is not old:
            s = _put(s, m)
    s = _probes(s, now, fx)
    if s.options.measure_interval_s > 0 \
            and s.measured_at + s.options.measure_interval_s <= now:
        for m in s.models.values():
            if m.phase is Phase.READY and m.worker is not None and m.worker.alive:
                fx.append(msg.Measure(m.id, m.worker.id))
        s = replace(s, measured_at=now)
    return s


def _expire_waits(s: State, m: Model, now: float, fx: Fx) -> Model:
    """Requests that waited their admission wait: for memory (503 insufficient_memory), or
    under a pause (503 with the pause's end as Retry-After)."""
    wait = s.options.admission_wait_s
    if s.pause is not None:
        start = s.pause.since
        if not any(max(w.since, start) + wait <= now for w in m.waiters):
            return m
        return _refuse(m, _paused_error(s, m.id, now), fx,
                       keep=lambda w: max(w.since, start) + wait > now)
    if m.wait_since is None or m.wait_since + wait > now or not _wants_load(m):
        return m
    return replace(_refuse(m, _memory_error(s, m), fx), wait_since=None, respawn=False)


def _expire_unloads(m: Model, now: float, fx: Fx) -> Model:
    """An unload's grace is over: False (202) if requests still run, else it waits on."""
    if not any(u.deadline is not None and u.deadline <= now for u in m.unloads):
        return m
    unloads = []
    for u in m.unloads:
        if u.deadline is not None and u.deadline <= now:
            if m.leases:
                fx.append(msg.Resolve(u.reply, False))
                continue
            u = replace(u, deadline=None)
        unloads.append(u)
    return replace(m, unloads=tuple(unloads))


def ttl_of(s: State, m: Model) -> float | None:
    """Idle seconds before the model is unloaded; None: never."""
    if m.keep_alive_s is not None:
        return None if math.isinf(m.keep_alive_s) else m.keep_alive_s
    ttl = m.spec.model.ttl_s if m.spec.model.ttl_s is not None else s.options.ttl_s
    return ttl if ttl > 0 else None


def _expire_idle(s: State, m: Model, now: float, fx: Fx) -> Model:
    ttl = ttl_of(s, m)
    if ttl is None or not _idle(s, m) or m.last_used + ttl > now:  # as wake_at times it
        return m
    return _advance_drain(s, _begin_drain(
        m, f"idle for {now - m.last_used:.0f} s (ttl {ttl:.0f} s)", fx), fx)


def _idle(s: State, m: Model) -> bool:
    """Ready, and nothing holds it: its ttl runs."""
    return m.phase is Phase.READY and not m.busy and not m.pinned and m.id not in s.held


def _probed_model(m: Model) -> bool:
    return m.phase is Phase.READY and m.worker is not None and m.worker.alive


def _probes(s: State, now: float, fx: Fx) -> State:
    for m in s.models.values():
        h = s.health[m.id]
        if _probed_model(m) and supervision.probe_due(h, now, s.options.probe_interval_s):
            assert m.worker is not None
            fx.append(msg.Probe(m.id, m.worker.id, h.suspensions))
            s = _put_health(s, m.id, supervision.probe_sent(h, m.worker.id, now))
    return s


def wake_at(s: State, now: float) -> float | None:
    """When the step wants a Tick: the earliest deadline, ttl, probe or measurement due
    after ``now``; None: nothing is timed."""
    times: list[float] = []
    wait = s.options.admission_wait_s
    if s.pause is not None:
        if s.pause.until is not None:
            times.append(s.pause.until)
        times += [max(w.since, s.pause.since) + wait
                  for m in s.models.values() for w in m.waiters]
    for m in s.models.values():
        if s.pause is None and m.wait_since is not None and _wants_load(m):
            times.append(m.wait_since + wait)
        if m.not_before > now:
            times.append(m.not_before)
        times += [u.deadline for u in m.unloads if u.deadline is not None]
        ttl = ttl_of(s, m)
        if ttl is not None and _idle(s, m):
            times.append(m.last_used + ttl)
        h = s.health[m.id]
        if _probed_model(m) and s.options.probe_interval_s > 0 and h.probing is None \
                and not h.suspended:
            times.append(h.last_probe + s.options.probe_interval_s)
    if s.options.measure_interval_s > 0 and any(m.phase is Phase.READY
                                                 for m in s.models.values()):
        times.append(s.measured_at + s.options.measure_interval_s)
    return min(times) if times else None


# -- scheduling -----------------------------------------------------------------------------


def _wants_load(m: Model) -> bool:
    return (m.phase in (Phase.ABSENT, Phase.FAILED) and not m.retired
            and (bool(m.waiters) or m.respawn))


def _schedule(s: State, now: float, fx: Fx) -> State:
    """Grant what can be granted, then load and drain what the line of waiting models
    needs, then grant again (models no longer held), then keep a spare."""
    s = _grant_all(s, now, fx)
    for m in s.models.values():
        if m.wait_since is not None and not _wants_load(m):
            s = _put(s, replace(m, wait_since=None))
    if s.closing or s.stopping or s.paused:
        s = replace(s, head=None, held=frozenset(), freed=frozenset())
    else:
        s = _plan_loads(s, now, fx)
    s = _grant_all(s, now, fx)
    return _keep_spares(s, fx)


def _grant_all(s: State, now: float, fx: Fx) -> State:
    """Ready models give their waiters leases; one an operator unloads drains right
    after (its waiters, there before the unload, served first)."""
    if s.closing or s.paused:
        return s
    for m in list(s.models.values()):
        if m.phase is not Phase.READY or m.id in s.held:
            continue
        if m.waiters:
            s = _grant(s, m, now, fx)
            m = s.models[m.id]
        if m.unloads:
            s = _put(s, _advance_drain(s, _begin_drain(m, m.unloads[0].reason, fx,
                                                       force=True), fx))
    return s


def _grant(s: State, m: Model, now: float, fx: Fx) -> State:
    """Every waiter of a ready model gets its lease (or its answer) in this one step; an
    unload waiting on them drains the model right after."""
    assert m.worker is not None
    leases = set(m.leases)
    next_id = s.next_id
    for w in m.waiters:
        if w.lease:
            fx.append(msg.Resolve(w.id, msg.Granted(m.id, next_id, m.worker.id)))
            leases.add(next_id)
            next_id += 1
        else:
            fx.append(msg.Resolve(w.id, None))
    m = replace(m, waiters=(), leases=frozenset(leases), last_used=now)
    return replace(_put(s, m), next_id=next_id)


def _plan_loads(s: State, now: float, fx: Fx) -> State:
    line = sorted((m for m in s.models.values() if _wants_load(m)),
                  key=lambda m: (_first_asked(m, now), m.id))
    cold = {m.node for m in s.models.values() if m.phase is Phase.LOADING}
    reserved: set[str] = set()  # the head's node, while only idle drains stand before it
    head: str | None = None
    for m in line:
        if m.wait_since is None:
            m = replace(m, wait_since=_first_asked(m, now))
            s = _put(s, m)
        if m.not_before > now:
            continue
        node, decision, use_spare = _place(s, m)
        if isinstance(decision, policy.NeverFits):
            s = _put(s, _never_fits(m, decision, fx))
        elif isinstance(decision, policy.Fits):
            backfill = head is not None and m.id in s.freed  # not again ahead of the head
            if node not in cold and node not in reserved and not backfill:
                s = _spawn(s, m, node, use_spare, now, fx)
                cold.add(node)
        elif head is None:
            head = m.id
            s, lease_bound = _make_room(s, m, decision, node, fx)
            if not lease_bound:
                reserved.add(node)
    if head is None:  # nobody waits for room: nothing is held for anyone
        s = replace(s, head=None, held=frozenset(), freed=frozenset())
    return s


def _first_asked(m: Model, now: float) -> float:
    if m.wait_since is not None:
        return m.wait_since
    return min((w.since for w in m.waiters), default=now)


def _never_fits(m: Model, d: policy.NeverFits, fx: Fx) -> Model:
    pinned = f", of which pinned models hold {d.pinned_bytes // MIB} MiB" \
        if d.pinned_bytes else ""
    need, budget = _sizes(d.need, d.budget)
    error = ModelTooLarge(f"model {m.id!r} needs {need} but the memory budget is {budget}"
                          f"{pinned}; raise --budget or lower the model's context")
    return replace(_refuse(m, error, fx), respawn=False, wait_since=None)


def _sizes(a: int, b: int) -> tuple[str, str]:
    """Two sizes in MiB, or in bytes when they round to the same MiB."""
    if a // MIB == b // MIB:
        return f"{a:,} bytes", f"{b:,} bytes"
    return f"{a // MIB} MiB", f"{b // MIB} MiB"


def _memory_error(s: State, m: Model) -> InsufficientMemory:
    node, decision, _ = _place(s, m)
    free = s.nodes[node].budget - s.used_bytes(node)
    blocking: Iterable[str] = ()
    if isinstance(decision, policy.MustWait):
        blocking = decision.blocking
    elif isinstance(decision, policy.Room):
        blocking = decision.hold
    return InsufficientMemory(
        f"model {m.id!r} needs {m.spec.estimate // MIB} MiB and {max(free, 0) // MIB} MiB "
        f"are free; models in use ({', '.join(b for b in blocking if b != SPARE_ID) or 'none'})"
        " did not finish in time; retry later", retry_after_s=s.options.retry_after_s)


def _paused_error(s: State, model_id: str, now: float) -> Paused:
    assert s.pause is not None
    left = None if s.pause.until is None else max(0.0, s.pause.until - now)
    ends = f"; it ends by itself in {left:.0f} s unless resumed sooner" if left else ""
    return Paused(
        f"model {model_id!r}: every model is paused by an operator (POST /admin/pause)"
        f"{ends}; this request waited {s.options.admission_wait_s:g} s "
        "(--admission-wait); retry later",
        retry_after_s=max(1, math.ceil(left)) if left else s.options.retry_after_s)


def _residents(s: State, node: Node, m: Model) -> tuple[list[policy.Resident], bool]:
    """What ``node`` holds, as the policy sees it, and whether ``m``'s worker would be the
    node's spare (its share of the budget then passes to the model)."""
    holding = {Phase.LOADING: policy.Holding.LOADING, Phase.READY: policy.Holding.READY,
               Phase.DRAINING: policy.Holding.DRAINING}
    residents = [policy.Resident(r.id, r.bytes, r.last_used, r.pinned, r.busy,
                                 holding[r.phase], r.id in s.held)
                 for r in s.models.values() if r.phase in HOLDING and r.node == node.id]
    spare = node.spare
    use_spare = (spare is not None and spare.status is SpareStatus.READY
                 and spare.engine == m.spec.engine and m.spec.single_file)
    if spare is not None and not use_spare:
        dropping = spare.status is SpareStatus.DROPPING
        residents.append(policy.Resident(
            SPARE_ID, defaults.SPARE_BYTES, -math.inf,
            holding=policy.Holding.DRAINING if dropping else policy.Holding.READY))
    return residents, use_spare


_RANK = {policy.Fits: 0, policy.Room: 1, policy.MustWait: 3, policy.NeverFits: 4}


def _place(s: State, m: Model) -> tuple[str, policy.Decision, bool]:
    """The node for ``m`` and what it takes there: the node where it fits now, else where
    it fits after drains alone, else after requests end, else where loads under way stand
    in the way; NeverFits only if it fits on no node."""
    best: tuple[int, str, policy.Decision, bool] | None = None
    for node in s.nodes.values():
        residents, use_spare = _residents(s, node, m)
        decision = policy.plan(residents, node.budget, m.id, m.spec.estimate)
        rank = _RANK[type(decision)]
        if isinstance(decision, policy.Room) and decision.hold:
            rank = 2
        if best is None or rank < best[0]:
            best = (rank, node.id, decision, use_spare)
    assert best is not None
    return best[1], best[2], best[3]


def _make_room(s: State, head: Model, decision: policy.Decision, node: str, fx: Fx
               ) -> tuple[State, bool]:
    """Free the head's room, in phases that cannot starve it. The models it needs gone
    (``victims``) that are in use are *held*: they take no new leases and drain once their
    requests end. While a held model still runs requests, the other victims go on serving
    (nothing is gained by stopping them sooner); once no held model runs any, every victim
    in use is held, and once no victim runs any, all drain (the spare is dropped at once).
    Held models stay held while the head is the same one, and a model drained for it is not
    loaded again ahead of it (no churn). Returns the state, and whether the head waits on
    requests or loads (then a later model that fits may be loaded meanwhile)."""
    if s.head != head.id:
        s = replace(s, head=head.id, held=frozenset(), freed=frozenset())
    if not isinstance(decision, policy.Room):
        return replace(s, held=frozenset(h for h in s.held if _ready(s, h))), True
    if SPARE_ID in (*decision.evict, *decision.hold):
        s = _drop_spare(s, node, fx)
    victims = [v for v in (*decision.evict, *decision.hold) if v != SPARE_ID]
    leased = {v for v in victims if s.models[v].leases}
    held = s.held & set(victims)
    if not any(s.models[v].leases for v in held):
        held |= leased
    reason = f"making room for {head.id}"
    for v in victims:
        if not s.models[v].leases and (v in held or not leased):
            m = _advance_drain(s, _begin_drain(s.models[v], reason, fx, force=True), fx)
            s = replace(_put(s, m), freed=s.freed | {v})
    held = frozenset(v for v in held if _ready(s, v))
    return replace(s, held=held), bool(leased)


def _ready(s: State, model_id: str) -> bool:
    m = s.models.get(model_id)
    return m is not None and m.phase is Phase.READY


def _drop_spare(s: State, node_id: str, fx: Fx) -> State:
    node = s.nodes[node_id]
    if node.spare is None or node.spare.status is SpareStatus.DROPPING:
        return s
    fx.append(msg.DropSpare(node_id))
    return _put_node(s, replace(node, spare=replace(node.spare, status=SpareStatus.DROPPING)))


def _spawn(s: State, m: Model, node_id: str, use_spare: bool, now: float, fx: Fx) -> State:
    m = _take_pending(m, fx)
    worker = Worker(s.next_id, node_id, now)
    m = _phase(m, Phase.LOADING, f"estimated {m.spec.estimate // MIB} MiB", fx,
               estimated_bytes=m.spec.estimate, file_bytes=m.spec.model.size_bytes)
    m = replace(m, worker=worker, wait_since=None, respawn=False, not_before=0.0,
                measured=None)
    fx.append(msg.Spawn(m.id, worker.id, node_id, m.spec.model, use_spare, m.last_load_s))
    s = replace(_put(s, m), next_id=s.next_id + 1)
    if use_spare:
        s = _put_node(s, replace(s.nodes[node_id], spare=None))
    return s


def _keep_spares(s: State, fx: Fx) -> State:
    """Keep a spare worker for the engine last loaded on a node while the host is idle (no
    request in flight or waiting, no load or drain under way: its start takes a core for a
    while), nothing is paused or stopping, and the budget has room for it."""
    if s.closing or s.stopping or s.paused or s.in_flight() \
            or any(m.phase in (Phase.LOADING, Phase.DRAINING) or m.waiters or m.respawn
                   for m in s.models.values()):
        return s
    for node in s.nodes.values():
        if not node.spares or node.spare_engine is None or node.spare_failed:
            continue
        if node.spare is not None:
            if node.spare.engine != node.spare_engine \
                    and node.spare.status is SpareStatus.READY:
                s = _drop_spare(s, node.id, fx)  # another engine's: replaced
            continue
        if node.budget - s.used_bytes(node.id) >= defaults.SPARE_BYTES:
            fx.append(msg.FillSpare(node.id, node.spare_engine))
            s = _put_node(s, replace(node, spare=Spare(node.spare_engine)))
    return s


def _settle(s: State, fx: Fx) -> State:
    """Answer who waits for a condition that now holds: an unload for its model's absence
    (after the requests that waited before it), a pause for quiet, a close for every
    worker's stop."""
    for m in list(s.models.values()):
        if not m.unloads:
            continue
        waiting = {w.id for w in m.waiters}
        done = m.phase in (Phase.ABSENT, Phase.FAILED) and not m.respawn
        settled = [u for u in m.unloads if done and not (u.before & waiting)]
        for u in settled:
            fx.append(msg.Resolve(u.reply, True))
        if settled:
            s = _put(s, replace(m, unloads=tuple(u for u in m.unloads if u not in settled)))
    if s.quiet and not s.in_flight():
        for q in s.quiet:
            fx.append(msg.Resolve(q.reply, True))
        s = replace(s, quiet=())
    if s.closers and not any(m.phase in HOLDING for m in s.models.values()) \
            and all(n.spare is None for n in s.nodes.values()):
        for reply in s.closers:
            fx.append(msg.Resolve(reply, None))
        s = replace(s, closers=())
    used = s.used_bytes()
    return replace(s, peak_bytes=used) if used > s.peak_bytes else s


_HANDLERS: Mapping[type, Callable[[State, Any, float, Fx], State]] = {
    msg.Want: _want, msg.Cancel: _cancel, msg.Release: _release, msg.Report: _report,
    msg.WorkerReady: _worker_ready, msg.LoadFailed: _load_failed, msg.WorkerExited: _exited,
    msg.Probed: _probed, msg.Flushed: _flushed, msg.WorkerStopped: _stopped,
    msg.Measured: _measured, msg.SpareFilled: _spare_filled, msg.SpareGone: _spare_gone,
    msg.Suspend: _suspend, msg.Tick: _tick, msg.Unload: _unload, msg.Register: _register,
    msg.Reload: _reload, msg.Pin: _pin, msg.KeepAlive: _keep_alive,
    msg.PauseHold: _pause_hold, msg.OperatorPause: _operator_pause,
    msg.OperatorResume: _operator_resume, msg.AwaitQuiet: _await_quiet,
    msg.StopLoads: _stop_loads, msg.Open: _open, msg.Close: _close,
    msg.KeepSpare: _keep_spare,
}
