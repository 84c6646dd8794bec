"""Residency's one step: ``step(state, event, now) -> (state, effects)``, a pure function.

It is the only code that makes residency state (residency/state.py): every event is handled
by one small function (requests and workers here, operator commands in
residency/commands.py, time in residency/timers.py), then residency/schedule.py decides, on
the state that results, what loads, what drains, who gets a lease and who is refused, and
answers those waiting for a condition (an unload for the model's absence, a pause for
quiet, a close for every worker's stop). Nothing here awaits, logs, sleeps or touches a
process: it returns the effects for residency/loop.py to carry out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from bunkhouse.errors import (
    BunkhouseError,
    ModelFailed,
    ModelMisconfigured,
    ModelNotFound,
    ShuttingDown,
    WorkerLoadFailed,
)
from bunkhouse.residency import commands, timers
from bunkhouse.residency import messages as msg
from bunkhouse.residency.edit import (
    MIB,
    Fx,
    absent,
    advance_drain,
    begin_drain,
    current,
    forget,
    put,
    put_health,
    put_node,
    refuse,
    set_phase,
    wants_load,
)
from bunkhouse.residency.messages import Effect, Event
from bunkhouse.residency.policy import NeverFits
from bunkhouse.residency.schedule import place, schedule, settle, too_large
from bunkhouse.residency.state import (
    Drain,
    Model,
    Node,
    Phase,
    SpareStatus,
    Stage,
    State,
    Waiter,
)
from bunkhouse.residency.timers import wake_at
from bunkhouse.supervisor import restart, supervision

__all__ = ["step", "wake_at"]


def step(state: State, event: Event, now: float) -> tuple[State, tuple[Effect, ...]]:
    """The state after ``event`` at ``now`` (the injected clock's seconds), and the effects
    to carry out, in order."""
    fx: Fx = []
    handler: Callable[[State, Any, float, Fx], State] = _HANDLERS[type(event)]
    state = handler(state, event, now, fx)
    state = schedule(state, now, fx)
    state = settle(state, fx)
    return state, tuple(fx)


def _want(s: State, e: msg.Want, now: float, fx: Fx) -> State:
    m = s.models.get(e.model)
    error = _refusal(s, m, e.model, now, reset=e.reset)
    if error is not None:
        fx.append(msg.Resolve(e.waiter, error))
        return s
    assert m is not None
    h = s.health[m.id]
    if e.adapter is not None and not _mounts(m, e.adapter):
        fx.append(msg.Resolve(e.waiter, ModelNotFound(
            f"adapter {e.adapter!r} is not registered on model {m.id!r} (any more)",
            param="model")))
        return s
    if e.reset or (h.failed_until is not None and h.failed_until <= now):
        s = put_health(s, m.id, supervision.forgiven(h))
    waiter = Waiter(e.waiter, now, e.lease, e.adapter)
    return put(s, replace(m, waiters=(*m.waiters, waiter)))


def _mounts(m: Model, adapter: str) -> bool:
    """Whether the model's worker mounts ``adapter``, or will once re-mounted."""
    return any(a.id == adapter for a in (m.pending or m.spec).model.adapters)


def _refusal(s: State, m: Model | None, model_id: str, now: float,
             reset: bool = False) -> Exception | None:
    """Why a request for the model is refused at once, if it is (``reset``: an operator's
    load, which a crash loop's cool-down does not refuse)."""
    if m is None or m.retired:
        return ModelNotFound(f"model {model_id!r} is being removed", param="model")
    if s.closing:
        return ShuttingDown(model_id)
    refused = (m.pending or m.spec).model.refused
    if refused:
        return ModelMisconfigured(
            f"model {m.id!r} cannot be served under its options: {refused}; fix its entry "
            "in the config file and reload (POST /admin/reload)", param="model")
    if s.stopping and (s.paused or m.phase not in (Phase.READY, Phase.LOADING)):
        return ShuttingDown(model_id)  # no model is loaded any more, no pause is resumed
    if m.phase is Phase.FAILED and not reset:
        left = supervision.cooling_s(s.health[m.id], now)
        if left is not None:
            return cooling(m, max(1, math.ceil(left)))
    if m.phase in (Phase.ABSENT, Phase.FAILED):  # not even a pause or a backoff can help
        _, decision, _ = place(s, m)
        if isinstance(decision, NeverFits):
            return too_large(m, decision)
    return None


def cooling(m: Model, left_s: int) -> ModelFailed:
    """A failed model's refusal in its cool-down: why once, when it is tried again (the
    same whole seconds in the message and in Retry-After) and what an admin can do."""
    why = m.last_error or "its load failed"
    if not why.startswith(f"model {m.id!r}"):
        why = f"model {m.id!r} is failed: {why}"
    return ModelFailed(f"{why}; {_tried_again(m.id, left_s)}",
                       retry_after_s=left_s, detail=m.last_error_detail, logged=True)


def _tried_again(model_id: str, left_s: int) -> str:
    """When a failed model is tried again, and what an admin can do meanwhile."""
    return (f"it is tried again in {left_s} s (an admin's POST /v1/models/{model_id}/load, "
            f"or bunkhouse load {model_id}, tries at once)")


def _cancel(s: State, e: msg.Cancel, now: float, fx: Fx) -> State:
    m = s.models.get(e.model)
    if m is None or not any(w.id == e.waiter for w in m.waiters):
        return s
    m = replace(m, waiters=tuple(w for w in m.waiters if w.id != e.waiter))
    if m.wait_since is not None and not wants_load(m):
        fx.append(msg.Log(logging.INFO, f"model {m.id}: load given up: no request waits for "
                                        "it any more"))
    return put(s, m)


def _release(s: State, e: msg.Release, now: float, fx: Fx) -> State:
    m = s.models.get(e.model)
    if m is None or e.lease not in m.leases:
        return s
    m = replace(m, leases=m.leases - {e.lease}, constrained=m.constrained - {e.lease},
                blamed=m.blamed - {e.lease}, last_used=now,
                adapter_leases=frozenset(p for p in m.adapter_leases if p[0] != e.lease))
    if m.keep_alive_s == 0 and not m.leases:
        m = begin_drain(m, "keep_alive 0: unloaded once idle", fx)
    return put(s, advance_drain(s, m, fx))


def _constrained(s: State, e: msg.Constrained, now: float, fx: Fx) -> State:
    m = s.models.get(e.model)
    if m is None or e.lease not in m.leases:
        return s
    constrained = m.constrained | {e.lease} if e.on else m.constrained - {e.lease}
    return put(s, replace(m, constrained=constrained))


def _report(s: State, e: msg.Report, now: float, fx: Fx) -> State:
    m = current(s, e.model, e.worker)
    if m is None or m.worker is None or not m.worker.alive:
        return s
    h, replace_it = supervision.request_answered(s.health[m.id], e.ok,
                                                 s.options.generation_failures)
    if replace_it:
        _kill(m, f"{h.failed_requests} requests in a row failed", fx)
    return put_health(s, m.id, h)


def _kill(m: Model, why: str, fx: Fx) -> None:
    assert m.worker is not None
    fx.append(msg.Log(logging.ERROR, f"model {m.id}: {why}; replacing worker "
                                     f"({m.worker.placement})"))
    fx.append(msg.Kill(m.id, m.worker.id))


def _worker_ready(s: State, e: msg.WorkerReady, now: float, fx: Fx) -> State:
    m = current(s, e.model, e.worker)
    if m is None or m.phase is not Phase.LOADING or m.worker is None:
        return s
    worker = replace(m.worker, pid=e.pid, placement=e.placement, ready_at=now)
    load_s = now - m.worker.spawned_at
    m = replace(m, worker=worker, measured=e.measured, last_error=None,
                last_error_detail=None, last_load_s=load_s, respawn=False, not_before=0.0,
                last_node=worker.node)
    measured = f"{e.measured // MIB} MiB" if e.measured else "unknown"
    m = set_phase(m, Phase.READY,
               f"{e.placement}, {m.spec.model.size_bytes / MIB:.0f} MiB file, loaded in "
               f"{load_s:.1f} s, measured {measured}, estimated {m.spec.estimate // MIB} MiB",
               fx, measured_bytes=e.measured, estimated_bytes=m.spec.estimate,
               load_s=round(load_s, 3))
    fx.append(msg.ResetSlots(m.id))
    s = put_health(s, m.id, supervision.fresh_worker(s.health[m.id]))
    node = s.nodes.get(worker.node)
    if node is not None and m.spec.engine:  # "": an engine's own program (no spare becomes
        s = put_node(s, replace(node, spare_engine=m.spec.engine, spare_failed=False))  # it)
    if m.drain is not None:  # cancelled while it started: it stops at once
        reason = m.drain.reason
        fx.append(msg.Stop(m.id, worker.id))
        m = set_phase(m, Phase.DRAINING, reason, fx)
        return put(s, replace(m, drain=Drain(reason, Stage.STOP)))
    s = put(s, m)
    if not e.alive:  # it died before anyone saw it ready
        s = _exited(s, msg.WorkerExited(m.id, worker.id), now, fx)
    return s


def _load_failed(s: State, e: msg.LoadFailed, now: float, fx: Fx) -> State:
    m = current(s, e.model, e.worker)
    if m is None or m.phase is not Phase.LOADING or m.worker is None:
        return s
    if e.error is None or m.drain is not None:  # cancelled: a delete, the front's close, its
        # node lost (a load that failed once cancelled is not the model's failure)
        m = replace(set_phase(m, Phase.ABSENT, "load cancelled", fx), worker=None, drain=None)
        return absent(s, m, now, fx)
    # what any reader may see; the detail (paths, output) is for the log and admins only
    if isinstance(e.error, BunkhouseError):
        message, detail = e.error.message, e.error.detail
    else:
        message, detail = f"model {m.id!r} failed to load", str(e.error)
    s = _count_failure(s, m, message, detail, now, fx)
    m = replace(s.models[m.id], worker=None, respawn=False)
    m = refuse(set_phase(m, Phase.FAILED, message, fx, detail),
               _with_retry(s, m, e.error, now), fx)
    if m.retired:
        return forget(s, m, fx)
    return put(s, m)


def _with_retry(s: State, m: Model, error: Exception, now: float) -> Exception:
    """A failed load's refusal saying when the model is tried again (its backoff, or the
    cool-down a crash loop began: the same whole seconds in the message and in
    Retry-After), as a refusal during the cool-down says it (:func:`cooling`)."""
    if not isinstance(error, WorkerLoadFailed):
        return error
    left = supervision.cooling_s(s.health[m.id], now)
    if left is None:
        left = m.not_before - now
    left_s = max(1, math.ceil(left))
    return WorkerLoadFailed(f"{error.message}; {_tried_again(m.id, left_s)}",
                            param=error.param, detail=error.detail, logged=error.logged,
                            retry_after_s=left_s)


def _count_failure(s: State, m: Model, cause: str, detail: str | None, now: float, fx: Fx,
                   served_s: float = 0.0) -> State:
    """A failure against the restart budget; sets the model's backoff (``not_before``)
    and ``respawn``: whether it may be tried again by itself (its load failing is not
    retried by itself: the next request tries again, after the backoff)."""
    assert m.worker is not None
    h, verdict = supervision.failed(s.options.restart, s.health[m.id], now,
                                    m.worker.spawned_at, served_s)
    m = replace(m, last_error=cause, last_error_detail=detail)
    if isinstance(verdict, restart.GiveUp):
        fx.append(msg.Publish(m.id, "gave_up",
                              f"{verdict.failures} failures in {verdict.window_s:.0f} s; "
                              f"cooling down {s.options.restart.cooldown_s:.0f} s: {cause}",
                              detail=detail))
        m = replace(m, respawn=False, not_before=0.0)
    else:
        m = replace(m, respawn=True, not_before=now + verdict.delay_s)
    return put_health(put(s, m), m.id, h)


def _exited(s: State, e: msg.WorkerExited, now: float, fx: Fx) -> State:
    m = current(s, e.model, e.worker)
    if m is None or m.worker is None or m.phase is Phase.LOADING:
        return s  # a starting worker's death is its load's failure
    h = s.health[m.id]
    cause = e.cause or m.last_error or f"worker ({m.worker.placement}) exited"
    if h.counted == e.worker:  # counted already: only a better cause may come later
        return put(s, replace(m, last_error=cause, last_error_detail=e.detail)) \
            if e.cause else s
    s = put_health(s, m.id, replace(h, counted=e.worker))
    # "lost": gone with its node or host process (a cluster's), not the model's crash
    fx.append(msg.Publish(m.id, "lost" if e.lost else "crashed", cause, detail=e.detail))
    worker = replace(m.worker, alive=False)
    m = replace(m, worker=worker, last_error=cause, last_error_detail=e.detail)
    if m.phase is Phase.DRAINING:  # it was being stopped anyway: no respawn, no flush
        return put(s, advance_drain(s, m, fx))
    served_s = now - (worker.ready_at or now)
    if e.lost:  # its host went (a cluster node): the next request loads it where it fits
        s = put(s, replace(m, respawn=False, last_node=None))
    elif worker.stalled_by:  # a request's constraint stalled it (_probed): not its own failure
        s = put(s, replace(m, respawn=True))
    else:
        s = _count_failure(s, m, cause, e.detail, now, fx, served_s=served_s)
    m = s.models[m.id]
    if m.retired:
        m = replace(m, respawn=False)
    why = "node_lost" if e.lost else "crashed"
    m = replace(set_phase(m, Phase.DRAINING, cause if e.lost else "crashed", fx, cause=why),
                drain=Drain(cause if e.lost else "crashed", Stage.STOP))
    assert m.worker is not None
    fx.append(msg.Stop(m.id, m.worker.id))  # its requests are failing already
    return put(s, m)


def _probed(s: State, e: msg.Probed, now: float, fx: Fx) -> State:
    m = current(s, e.model, e.worker)
    if m is None:
        return s
    h, replace_it = supervision.probe_answered(s.health[m.id], e.ok, e.suspensions,
                                               s.options.probe_failures)
    if replace_it and m.phase is Phase.READY and m.worker is not None and m.worker.alive:
        why = f"{h.probe_failures} liveness probes in a row missed"
        if m.constrained:  # those requests' constraints stalled it: theirs, not the model's
            why += (f" while it ran {len(m.constrained)} request(s) with a constraint; "
                    "they fail, the model does not count it")
            m = replace(m, worker=replace(m.worker, stalled_by=m.constrained),
                        blamed=m.blamed | m.constrained, constrained=frozenset())
            s = put(s, m)
        _kill(m, why, fx)
    return put_health(s, m.id, h)


def _flushed(s: State, e: msg.Flushed, now: float, fx: Fx) -> State:
    m = current(s, e.model, e.worker)
    if m is None or m.drain is None or m.drain.stage is not Stage.FLUSH:
        return s
    m = replace(m, drain=replace(m.drain, stage=Stage.STOP))
    fx.append(msg.Stop(m.id, e.worker))
    return put(s, m)


def _stopped(s: State, e: msg.WorkerStopped, now: float, fx: Fx) -> State:
    m = current(s, e.model, e.worker)
    if m is None or m.phase is not Phase.DRAINING or m.drain is None:
        return s
    reason = m.drain.reason
    cooling = supervision.cooling_s(s.health[m.id], now) is not None
    if cooling and not s.closing:  # its crash loop gave up: it rests until the cool-down
        m = set_phase(m, Phase.FAILED, f"stopped ({reason}); {m.last_error}", fx,
                      m.last_error_detail)
    else:
        m = set_phase(m, Phase.ABSENT, f"stopped ({reason})", fx)
    # requests that came while it drained wait for its next load from now: their wait for
    # room (and its deadline) begins once the old worker is gone (a crash, a lost node)
    m = replace(m, worker=None, measured=None, drain=None,
                wait_since=now if m.waiters else None)
    if m.respawn and not s.closing and not m.retired:
        delay = max(0.0, m.not_before - now)
        fx.append(msg.Publish(m.id, "respawning", f"after {delay:.0f} s backoff"))
        if delay:
            fx.append(msg.Log(logging.INFO, f"model {m.id}: waiting {delay:.0f} s before "
                                            "the next start (crash-loop backoff)"))
    return absent(s, replace(m, respawn=m.respawn and not s.closing), now, fx)


def _measured(s: State, e: msg.Measured, now: float, fx: Fx) -> State:
    m = current(s, e.model, e.worker)
    if m is None or m.phase is not Phase.READY or e.peak is None:
        return s
    if e.peak > m.bytes:
        fx.append(msg.Log(logging.WARNING,
                          f"model {m.id}: its worker peaked at {e.peak // MIB} MiB, above "
                          f"its estimate of {m.spec.estimate // MIB} MiB; counting the peak"))
    return put(s, replace(m, measured=max(m.measured or 0, e.peak)))


def _spare_filled(s: State, e: msg.SpareFilled, now: float, fx: Fx) -> State:
    node = s.nodes.get(e.node)
    if node is None:  # lost meanwhile, and its spare with it
        return s
    if node.spare is None or node.spare.status is not SpareStatus.FILLING:
        return s  # dropped meanwhile: the executor kills what the fill made
    if e.pid is None:
        return put_node(s, replace(node, spare=None, spare_failed=True))
    return put_node(s, replace(node, spare=replace(node.spare, status=SpareStatus.READY,
                                                    pid=e.pid)))


def _spare_gone(s: State, e: msg.SpareGone, now: float, fx: Fx) -> State:
    node = s.nodes.get(e.node)
    return s if node is None else put_node(s, replace(node, spare=None))


def _node_joined(s: State, e: msg.NodeJoined, now: float, fx: Fx) -> State:
    node = s.nodes.get(e.node)
    if node is None:
        fx.append(msg.Log(logging.INFO, f"node {e.node} joined: budget {e.budget // MIB} MiB"))
        return put_node(s, Node(e.node, e.budget, e.engines, e.spares))
    return put_node(s, replace(node, budget=e.budget, engines=e.engines, spares=e.spares))


def _node_lost(s: State, e: msg.NodeLost, now: float, fx: Fx) -> State:
    """Every worker on the node is gone with it. A model loading there is cancelled (its
    waiters wait on, and are placed again once the cancel comes back); a ready one drains
    at once (its requests are failing already: their leases end as they do); none of it
    counts against a model's restart budget (the node failed, not the model)."""
    if e.node not in s.nodes:
        return s
    lost = sorted(m.id for m in s.models.values()
                  if m.worker is not None and m.worker.node == e.node)
    fx.append(msg.Log(logging.WARNING,
                      f"node {e.node} lost ({e.reason}); its models: "
                      f"{', '.join(lost) or 'none'}"))
    s = replace(s, nodes={k: v for k, v in s.nodes.items() if k != e.node})
    cause = f"its node {e.node} was lost ({e.reason})"
    for model_id in lost:
        m = s.models[model_id]
        assert m.worker is not None
        worker = replace(m.worker, alive=False)
        # its death is known: a later exit of the same worker is not counted (nor is this)
        s = put_health(s, m.id, replace(s.health[m.id], counted=worker.id))
        if m.phase is Phase.LOADING:
            if m.drain is None:
                fx.append(msg.CancelSpawn(m.id, worker.id))
                m = replace(m, drain=Drain(cause, Stage.STOP))
            s = put(s, replace(m, worker=worker))
        elif m.phase is Phase.READY:
            fx.append(msg.Publish(m.id, "lost", cause))
            m = replace(set_phase(m, Phase.DRAINING, cause, fx, cause="node_lost"),
                        worker=worker, drain=Drain(cause, Stage.STOP), last_error=cause,
                        last_node=None)
            fx.append(msg.Stop(m.id, worker.id))
            s = put(s, m)
        else:  # draining: its flush (if one is under way) comes back, then it stops
            s = put(s, advance_drain(s, replace(m, worker=worker, last_node=None), fx))
    return s


def _suspend(s: State, e: msg.Suspend, now: float, fx: Fx) -> State:
    m = s.models.get(e.model)
    if m is None or m.worker is None or not m.worker.alive \
            or m.phase not in (Phase.READY, Phase.DRAINING):
        return s  # nothing running to stop (a starting worker is not yet the gate's)
    fx.append(msg.Signal(m.id, m.worker.id, e.on))
    return put_health(s, m.id, supervision.suspended(s.health[m.id], e.on))


_HANDLERS: Mapping[type, Callable[[State, Any, float, Fx], State]] = {  # one per event
    msg.Want: _want, msg.Cancel: _cancel, msg.Release: _release, msg.Constrained: _constrained,
    msg.Report: _report,
    msg.WorkerReady: _worker_ready, msg.LoadFailed: _load_failed, msg.WorkerExited: _exited,
    msg.Probed: _probed, msg.Flushed: _flushed, msg.WorkerStopped: _stopped,
    msg.Measured: _measured, msg.SpareFilled: _spare_filled, msg.SpareGone: _spare_gone,
    msg.NodeJoined: _node_joined, msg.NodeLost: _node_lost,
    msg.Suspend: _suspend, msg.Tick: timers.tick,
    msg.Unload: commands.unload, msg.Register: commands.register, msg.Mount: commands.mount,
    msg.Reload: commands.reload, msg.Pin: commands.pin, msg.KeepAlive: commands.keep_alive,
    msg.PauseHold: commands.pause_hold, msg.OperatorPause: commands.operator_pause,
    msg.OperatorResume: commands.operator_resume, msg.AwaitQuiet: commands.await_quiet,
    msg.StopLoads: commands.stop_loads, msg.Open: commands.reopen, msg.Close: commands.close,
    msg.KeepSpare: commands.keep_spare,
}
