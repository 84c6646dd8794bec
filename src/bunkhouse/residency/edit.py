"""Small pure functions that make a new residency state from an old one: the building blocks
residency's step (residency/step.py) and its scheduling, commands and timers share.

Each takes a state or a model record and returns a new one, appending the effects of the
change to ``fx`` (a list the step owns); none awaits, logs or touches a process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from bunkhouse.errors import (
    ModelNotFound,
)
from bunkhouse.residency import messages as msg
from bunkhouse.residency.messages import Effect
from bunkhouse.residency.state import (
    TRANSITIONS,
    Drain,
    Model,
    Node,
    Phase,
    Stage,
    State,
    Waiter,
)
from bunkhouse.supervisor.supervision import Health

MIB = 1024 * 1024


SPARE_ID = "\0spare"  # the spare worker among a node's residents (no model id has a NUL)


Fx = list[Effect]


def put(s: State, m: Model) -> State:
    return replace(s, models={**s.models, m.id: m})


def put_health(s: State, model_id: str, h: Health) -> State:
    return replace(s, health={**s.health, model_id: h})


def put_node(s: State, n: Node) -> State:
    return replace(s, nodes={**s.nodes, n.id: n})


def set_phase(m: Model, new: Phase, reason: str, fx: Fx, detail: str | None = None,
              **data: Any) -> Model:
    """``m`` in its new phase, published (``detail``: for the log and admins only); an
    illegal transition is a bug."""
    if new not in TRANSITIONS[m.phase]:
        raise RuntimeError(f"{m.id}: illegal {m.phase.value} -> {new.value}")
    fx.append(msg.Publish(m.id, new.value, reason, data, detail))
    return replace(m, phase=new)


def current(s: State, model_id: str, worker: int) -> Model | None:
    """The model, if ``worker`` is its worker now (else the event is about a worker that
    is gone or was replaced: stale)."""
    m = s.models.get(model_id)
    return m if m is not None and m.worker is not None and m.worker.id == worker else None


def refuse(m: Model, error: Exception, fx: Fx, keep: Callable[[Waiter], bool] | None = None
            ) -> Model:
    """Every waiter (but those ``keep`` keeps) answered with ``error``."""
    kept = tuple(w for w in m.waiters if keep is not None and keep(w))
    for w in m.waiters:
        if w not in kept:
            fx.append(msg.Resolve(w.id, error))
    return replace(m, waiters=kept)


def removed_error(model_id: str) -> ModelNotFound:
    return ModelNotFound(f"model {model_id!r} was removed", param="model")


def begin_drain(m: Model, reason: str, fx: Fx, *, force: bool = False) -> Model:
    """Mark a ready model draining (it takes no new lease), if nobody holds it and it is
    not pinned (``force``: whatever holds it). Its requests end, then its KV state is saved
    and its worker stopped (:func:`advance_drain`)."""
    if m.phase is not Phase.READY or (not force and (m.busy or m.pinned)):
        return m
    m = set_phase(m, Phase.DRAINING, reason, fx)
    return replace(m, drain=Drain(reason))


def advance_drain(s: State, m: Model, fx: Fx) -> Model:
    """A draining model whose requests ended (or the front closes): save, then stop."""
    d = m.drain
    if m.phase is not Phase.DRAINING or d is None or d.stage is not Stage.LEASES \
            or m.worker is None or (m.leases and not s.closing):
        return m
    if not m.worker.alive or not s.flush:  # a dead worker has nothing to save
        fx.append(msg.Stop(m.id, m.worker.id))
        return replace(m, drain=replace(d, stage=Stage.STOP))
    fx.append(msg.Flush(m.id, m.worker.id, d.reason))
    return replace(m, drain=replace(d, stage=Stage.FLUSH))


def retire(s: State, m: Model, reason: str, fx: Fx) -> State:
    """Remove a model whatever it holds: its waiters get 404 at once, a load under way is
    cancelled, a ready worker drains (running requests finish), and the record is forgotten
    once it holds nothing."""
    m = refuse(replace(m, retired=True, respawn=False), removed_error(m.id), fx)
    if m.phase in (Phase.ABSENT, Phase.FAILED):
        return forget(s, m, fx)
    if m.phase is Phase.LOADING and m.worker is not None and m.drain is None:
        fx.append(msg.CancelSpawn(m.id, m.worker.id))
        m = replace(m, drain=Drain(reason, Stage.STOP))
    m = begin_drain(m, reason, fx, force=True)
    return put(s, advance_drain(s, m, fx))


def forget(s: State, m: Model, fx: Fx) -> State:
    """Remove a model that holds nothing: its catalog entry, record and health together, and
    its adapters' entries (they run on no other model)."""
    m = refuse(m, removed_error(m.id), fx)
    for u in m.unloads:
        fx.append(msg.Resolve(u.reply, True))
    fx.append(msg.CatalogRemove(m.id))
    for adapter_id in sorted({a.id for spec in (m.spec, m.pending) if spec is not None
                              for a in spec.model.adapters}):
        fx.append(msg.CatalogRemove(adapter_id))
    models = {k: v for k, v in s.models.items() if k != m.id}
    health = {k: v for k, v in s.health.items() if k != m.id}
    return replace(s, models=models, health=health, held=s.held - {m.id})


def take_pending(m: Model, fx: Fx) -> Model:
    """A reload's settings, taken while no worker runs the model."""
    if m.pending is None:
        return m
    fx.append(msg.CatalogAdd(m.pending.model))
    return replace(m, spec=m.pending, pending=None, pinned=m.pending.model.pinned,
                   generation=m.generation + 1)


def absent(s: State, m: Model, now: float, fx: Fx) -> State:
    """``m`` holds nothing any more: a removed model is forgotten, changed settings are
    taken, a client's keep_alive ends."""
    if m.retired:
        return forget(s, m, fx)
    if not m.waiters:
        m = replace(take_pending(m, fx), keep_alive_s=None)
    return put(s, m)


def wants_load(m: Model) -> bool:
    return (m.phase in (Phase.ABSENT, Phase.FAILED) and not m.retired
            and (bool(m.waiters) or m.respawn))
