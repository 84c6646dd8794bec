"""Operator commands (and the front's lifespan's) as steps of residency: unload and delete,
register, reload, pin, keep_alive, the pauses, stop, open, close, the first spare. Each
answers its caller with a ``Resolve`` effect once the step decided (an unload once its model
is absent: residency/schedule.py ``settle``)."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

from bunkhouse.catalog import CatalogModel
from bunkhouse.engines.contract import Adapter
from bunkhouse.errors import (
    Conflict,
    ModelNotFound,
    ShuttingDown,
)
from bunkhouse.residency import messages as msg
from bunkhouse.residency.edit import (
    Fx,
    advance_drain,
    begin_drain,
    put,
    put_health,
    put_node,
    refuse,
    retire,
    take_pending,
)
from bunkhouse.residency.state import (
    Drain,
    Model,
    Pause,
    Phase,
    Quiet,
    SpareStatus,
    Spec,
    Stage,
    State,
    UnloadWait,
)
from bunkhouse.supervisor.supervision import Health


def unload(s: State, e: msg.Unload, now: float, fx: Fx) -> State:
    m = s.models.get(e.model)
    if m is None:
        fx.append(msg.Resolve(e.reply, ModelNotFound(f"model {e.model!r} not found",
                                                     param="model")))
        return s
    if not e.forget and m.phase in (Phase.ABSENT, Phase.FAILED) and not m.respawn \
            and not m.waiters and not m.unloads:
        fx.append(msg.Resolve(e.reply, None))  # it holds nothing: nothing changes
        return s
    wait = UnloadWait(e.reply, e.reason, frozenset(w.id for w in m.waiters),
                      now + e.grace_s)
    m = replace(m, unloads=(*m.unloads, wait), respawn=False)
    if e.forget:
        return retire(s, m, e.reason, fx)
    if not m.waiters:  # else it drains once they are served (_grant_all)
        m = advance_drain(s, begin_drain(m, e.reason, fx, force=True), fx)
    return put(s, m)


def register(s: State, e: msg.Register, now: float, fx: Fx) -> State:
    model_id = e.spec.model.id
    if model_id in s.models:
        fx.append(msg.Resolve(e.reply, Conflict(f"model id {model_id!r} is already in use",
                                                param="id")))
        return s
    fx.append(msg.CatalogAdd(e.spec.model))
    fx.append(msg.Resolve(e.reply, None))
    s = put(s, Model(e.spec, pinned=e.spec.model.pinned))
    return put_health(s, model_id, Health())


def mount(s: State, e: msg.Mount, now: float, fx: Fx) -> State:
    """A base's adapters change (one added or removed): the base takes the new set, at once
    if no worker runs it, else by a re-mount (:func:`remount`). Removing an adapter a
    request holds is a 409; its waiting requests get 404. Decided here, on the set the
    base's next worker mounts, so that two changes at once both count."""
    m = s.models.get(e.base)
    if m is None or m.retired:
        fx.append(msg.Resolve(e.reply, ModelNotFound(f"model {e.base!r} not found",
                                                     param="adapter_of")))
        return s
    current = m.pending or m.spec
    ids = {a.id for a in current.model.adapters}
    error: Exception | None = None
    if e.removed is not None and e.removed not in ids:
        error = ModelNotFound(f"adapter {e.removed!r} not found", param="model")
    elif e.added is not None and (e.added.id in ids or e.added.id in s.models):
        error = Conflict(f"model id {e.added.id!r} is already in use", param="id")
    elif e.removed is not None:
        held = sum(1 for _, a in m.adapter_leases if a == e.removed)
        if held:
            error = Conflict(f"adapter {e.removed!r} is in use by {held} request(s); delete "
                             "it once they end", param="model")
    if error is not None:
        fx.append(msg.Resolve(e.reply, error))
        return s
    if e.removed is not None:
        m = refuse(m, ModelNotFound(f"adapter {e.removed!r} was removed", param="model"), fx,
                   keep=lambda w: w.adapter != e.removed)
        fx.append(msg.CatalogRemove(e.removed))
        spec = with_adapters(current, tuple(a for a in current.model.adapters
                                            if a.id != e.removed))
        why = f"adapter {e.removed} removed"
    else:
        assert e.added is not None and e.added.adapter is not None
        fx.append(msg.CatalogAdd(e.added))
        spec = with_adapters(current, (*current.model.adapters, e.added.adapter))
        why = f"adapter {e.added.id} added"
    fx.append(msg.Resolve(e.reply, None))
    return put(s, advance_drain(s, remount(m, spec, why, fx), fx))


def with_adapters(spec: Spec, adapters: tuple[Adapter, ...]) -> Spec:
    """``spec`` with ``adapters`` mounted (a default adapter kept while it is one of them).
    The engine's estimate counts an adapter by its file's bytes (engines/llamacpp.py
    ``estimate``: its tensors are read into memory), so the estimate moves by as much."""
    model = spec.model
    default = model.default_adapter if any(a.id == model.default_adapter for a in adapters) \
        else None
    moved = sum(a.bytes for a in adapters) - sum(a.bytes for a in model.adapters)
    return replace(spec, model=replace(model, adapters=adapters, default_adapter=default),
                   estimate=spec.estimate + moved)


def remount(m: Model, spec: Spec, why: str, fx: Fx) -> Model:
    """``m`` with ``spec`` (its adapters changed): taken at once by a model no worker runs;
    else its next worker's. A ready worker drains (its requests end, its slots' KV state is
    saved) and a new one is started at once, whoever waits; a load under way is cancelled and
    started again."""
    if m.worker is None and m.phase in (Phase.ABSENT, Phase.FAILED):
        fx.append(msg.CatalogAdd(spec.model))
        return replace(m, spec=spec, pending=None)
    m = replace(m, pending=spec)
    reason = f"re-mounted: {why}"
    if m.phase is Phase.LOADING and m.worker is not None and m.drain is None:
        fx.append(msg.CancelSpawn(m.id, m.worker.id))
        return replace(m, drain=Drain(reason, Stage.STOP), respawn=True)
    if m.phase is Phase.READY:
        fx.append(msg.Publish(m.id, "remounting", why))
        return replace(begin_drain(m, reason, fx, force=True), respawn=True)
    return m  # draining: its next load takes the new adapters


def _adapters_only(old: CatalogModel, new: CatalogModel) -> bool:
    """Whether two settings differ in their adapters (and what the front applies) only."""
    return old.adapters != new.adapters and _front_only(
        old, dataclasses.replace(new, adapters=old.adapters,
                                 default_adapter=old.default_adapter))


def _front_only(old: CatalogModel, new: CatalogModel) -> bool:
    """Whether two settings differ only in what the front applies (names, request params,
    idle ttl), which a running worker need not be restarted for."""
    return dataclasses.replace(old, aliases=new.aliases, request=new.request,
                               ttl_s=new.ttl_s, default_adapter=new.default_adapter) == new


def reload(s: State, e: msg.Reload, now: float, fx: Fx) -> State:
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
        s = put_health(put(s, m), k, s.health.get(k, Health()))
    for k in changed:
        m = s.models[k]
        if _adapters_only(m.spec.model, fresh[k].model):  # a worker runs with the others
            m = remount(m, fresh[k], "the configuration's adapters changed", fx)
            s = put(s, advance_drain(s, m, fx))
        elif _front_only(m.spec.model, fresh[k].model):
            fx.append(msg.CatalogAdd(fresh[k].model))
            s = put(s, replace(m, spec=fresh[k], pending=None))
        else:
            s = put(s, replace(m, pending=fresh[k]))
    for k in (*added, *changed):
        m = s.models[k]
        if m.phase in (Phase.ABSENT, Phase.FAILED) and not m.busy:
            s = put(s, take_pending(m, fx))
    for k in removed:
        s = retire(s, s.models[k], "removed from the configuration", fx)
    fx.append(msg.Resolve(e.reply, {"added": added, "removed": removed, "changed": changed}))
    return s


def pin(s: State, e: msg.Pin, now: float, fx: Fx) -> State:
    m = s.models.get(e.model)
    changed = m is not None and m.pinned != e.pinned
    if m is not None and changed:
        fx.append(msg.Publish(m.id, "pinned" if e.pinned else "unpinned", "operator"))
        s = put(s, replace(m, pinned=e.pinned))
    fx.append(msg.Resolve(e.reply, changed))  # whether it changed
    return s


def keep_alive(s: State, e: msg.KeepAlive, now: float, fx: Fx) -> State:
    m = s.models.get(e.model)
    if m is None:
        return s
    m = replace(m, keep_alive_s=e.seconds)
    if e.seconds == 0 and not m.leases:
        m = advance_drain(s, begin_drain(m, "keep_alive 0: unloaded once idle", fx), fx)
    return put(s, m)


def pause_hold(s: State, e: msg.PauseHold, now: float, fx: Fx) -> State:
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


def operator_pause(s: State, e: msg.OperatorPause, now: float, fx: Fx) -> State:
    p = s.pause or Pause(since=now)
    renewed = p.until is not None
    fx.append(msg.Publish("*", "paused", f"{e.reason}{', renewed' if renewed else ''}",
                          {"max_s": e.max_s, "in_flight": s.in_flight(), "renewed": renewed}))
    fx.append(msg.Resolve(e.reply, now + e.max_s))
    return replace(s, pause=replace(p, until=now + e.max_s, max_s=e.max_s))


def operator_resume(s: State, e: msg.OperatorResume, now: float, fx: Fx) -> State:
    if s.pause is None or s.pause.until is None:
        fx.append(msg.Resolve(e.reply, False))
        return s
    fx.append(msg.Resolve(e.reply, True))
    return end_operator_pause(s, e.reason, now, fx)


def end_operator_pause(s: State, reason: str, now: float, fx: Fx) -> State:
    pause = s.pause
    assert pause is not None
    fx.append(msg.Publish("*", "resumed", reason))
    for q in s.quiet:
        if q.operator:
            fx.append(msg.Resolve(q.reply, False))
    s = replace(s, quiet=tuple(q for q in s.quiet if not q.operator))
    return _resume_if_free(s, replace(pause, until=None), now)


def await_quiet(s: State, e: msg.AwaitQuiet, now: float, fx: Fx) -> State:
    if s.pause is None or s.pause.until is None:
        fx.append(msg.Resolve(e.reply, False))
        return s
    return replace(s, quiet=(*s.quiet, Quiet(e.reply, operator=True)))


def stop_loads(s: State, e: msg.StopLoads, now: float, fx: Fx) -> State:
    s = replace(s, stopping=True)
    for m in s.models.values():
        if s.paused or m.phase not in (Phase.READY, Phase.LOADING):
            s = put(s, replace(refuse(m, ShuttingDown(m.id), fx), respawn=False))
    return s


def reopen(s: State, e: msg.Open, now: float, fx: Fx) -> State:
    return replace(s, closing=False, stopping=False) if not s.closers else s


def close(s: State, e: msg.Close, now: float, fx: Fx) -> State:
    """Stop every worker in every state, concurrently; refuse everything after."""
    for q in s.quiet:
        fx.append(msg.Resolve(q.reply, False))
    s = replace(s, closing=True, pause=None, quiet=(), head=None, held=frozenset(),
                freed=frozenset(), closers=(*s.closers, e.reply))
    for m in list(s.models.values()):
        m = replace(refuse(m, ShuttingDown(m.id), fx), respawn=False)
        if m.phase is Phase.LOADING and m.worker is not None and m.drain is None:
            fx.append(msg.CancelSpawn(m.id, m.worker.id))
            m = replace(m, drain=Drain("shutdown", Stage.STOP))
        m = advance_drain(s, begin_drain(m, "shutdown", fx, force=True), fx)
        s = put(s, m)
    for node in s.nodes.values():
        if node.spare is not None and node.spare.status is not SpareStatus.DROPPING:
            fx.append(msg.DropSpare(node.id))
            s = put_node(s, replace(node, spare=replace(node.spare,
                                                         status=SpareStatus.DROPPING)))
    return s


def keep_spare(s: State, e: msg.KeepSpare, now: float, fx: Fx) -> State:
    node = next(iter(s.nodes.values()), None)
    if node is None or not node.spares or node.spare_engine is not None or not e.engine:
        return s
    return put_node(s, replace(node, spare_engine=e.engine))
