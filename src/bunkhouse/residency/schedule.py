"""Residency's scheduling, decided inside the step after every event (residency/step.py).

- Models that want a load (requests wait for them, or a crashed worker is to be respawned)
  are taken in the order their first request came. One cold start at a time per node.
- The first of them that does not fit now is the *head*. The least recently used idle models
  on its node are drained for it; if that is not enough, busy models are *held*: they take
  no new leases (their new requests wait for their next load) and drain once their requests
  end, so the head cannot starve behind a model that keeps getting requests
  (:func:`_make_room` has the phases).
- While the head waits for requests to end (or for a load under way), a later model that
  fits now is loaded (*backfill*); once only idle drains stand between the head and its
  room, nothing is loaded on its node ahead of it. A backfilled model may itself be drained
  when the head's room comes; one drained for the head is not loaded again ahead of it.
- A model made ready gives every waiting request its lease in the same step, so it serves
  them before it can be chosen to make room (no swap loop).
- Waiting for memory holds no lock; it is bounded by ``admission_wait_s`` (residency/
  timers.py), then 503 ``insufficient_memory``. A model bigger than every node's budget fails
  at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from bunkhouse import defaults
from bunkhouse.errors import (
    InsufficientMemory,
    ModelTooLarge,
)
from bunkhouse.residency import messages as msg
from bunkhouse.residency import policy
from bunkhouse.residency.edit import (
    MIB,
    SPARE_ID,
    Fx,
    advance_drain,
    begin_drain,
    put,
    put_node,
    refuse,
    set_phase,
    take_pending,
    wants_load,
)
from bunkhouse.residency.state import (
    HOLDING,
    Model,
    Node,
    Phase,
    Spare,
    SpareStatus,
    State,
    Worker,
)


def schedule(s: State, now: float, fx: Fx) -> State:
    """Grant what can be granted, then load and drain what the line of waiting models
    needs, then grant again (models no longer held), then keep a spare."""
    s = _grant_all(s, now, fx)
    for m in s.models.values():
        if m.wait_since is not None and not wants_load(m):
            s = put(s, replace(m, wait_since=None))
    if s.closing or s.stopping or s.paused:
        s = replace(s, head=None, held=frozenset(), freed=frozenset())
    else:
        s = _plan_loads(s, now, fx)
    s = _grant_all(s, now, fx)
    return _keep_spares(s, fx)


def _grant_all(s: State, now: float, fx: Fx) -> State:
    """Ready models give their waiters leases; one an operator unloads drains right
    after (its waiters, there before the unload, served first). A held model answers only
    those who wanted it loaded without a lease (it is)."""
    if s.closing or s.paused:
        return s
    for m in list(s.models.values()):
        if m.phase is not Phase.READY:
            continue
        if m.id in s.held:
            if any(not w.lease for w in m.waiters):
                for w in m.waiters:
                    if not w.lease:
                        fx.append(msg.Resolve(w.id, None))
                s = put(s, replace(m, waiters=tuple(w for w in m.waiters if w.lease)))
            continue
        if m.waiters:
            s = _grant(s, m, now, fx)
            m = s.models[m.id]
        if m.unloads:
            s = put(s, advance_drain(s, begin_drain(m, m.unloads[0].reason, fx,
                                                       force=True), fx))
    return s


def _grant(s: State, m: Model, now: float, fx: Fx) -> State:
    """Every waiter of a ready model gets its lease (or its answer) in this one step; an
    unload waiting on them drains the model right after."""
    assert m.worker is not None
    leases = set(m.leases)
    adapters = set(m.adapter_leases)
    next_id = s.next_id
    for w in m.waiters:
        if w.lease:
            fx.append(msg.Resolve(w.id, msg.Granted(m.id, next_id, m.worker.id)))
            leases.add(next_id)
            if w.adapter is not None:
                adapters.add((next_id, w.adapter))
            next_id += 1
        else:
            fx.append(msg.Resolve(w.id, None))
    m = replace(m, waiters=(), leases=frozenset(leases), adapter_leases=frozenset(adapters),
                last_used=now)
    return replace(put(s, m), next_id=next_id)


def _plan_loads(s: State, now: float, fx: Fx) -> State:
    line = sorted((m for m in s.models.values() if wants_load(m)),
                  key=lambda m: (_first_asked(m, now), min((w.id for w in m.waiters),
                                                            default=0), m.id))
    cold = {m.node for m in s.models.values() if m.phase is Phase.LOADING}
    reserved: set[str] = set()  # the head's node, while only idle drains stand before it
    head: str | None = None
    for m in line:
        if m.wait_since is None:
            m = replace(m, wait_since=_first_asked(m, now))
            s = put(s, m)
        if m.not_before > now:
            continue
        node, decision, use_spare = place(s, m)
        if isinstance(decision, policy.NeverFits):
            s = put(s, _never_fits(m, decision, fx))
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
    return replace(refuse(m, too_large(m, d), fx), respawn=False, wait_since=None)


def too_large(m: Model, d: policy.NeverFits) -> ModelTooLarge:
    """The refusal of a model that can never fit (``d``), naming both sizes."""
    pinned = f", of which pinned models hold {d.pinned_bytes // MIB} MiB" \
        if d.pinned_bytes else ""
    need, budget = _sizes(d.need, d.budget)
    if not d.budget:
        return ModelTooLarge(f"model {m.id!r}: no node that runs its engine "
                             f"({m.spec.engine or 'its own program'}) is up")
    return ModelTooLarge(f"model {m.id!r} needs {need} but the memory budget is {budget}"
                         f"{pinned}; raise --budget (on a Ray cluster: a node's "
                         "bunkhouse_memory_mib) or lower the model's context")


def _sizes(a: int, b: int) -> tuple[str, str]:
    """Two sizes in MiB, or in bytes when they round to the same MiB."""
    if a // MIB == b // MIB:
        return f"{a:,} bytes", f"{b:,} bytes"
    return f"{a // MIB} MiB", f"{b // MIB} MiB"


def memory_error(s: State, m: Model) -> InsufficientMemory:
    node, decision, _ = place(s, m)
    free = s.nodes[node].budget - s.used_bytes(node) if node in s.nodes else 0
    blocking: Iterable[str] = ()
    if isinstance(decision, policy.MustWait):
        blocking = decision.blocking
    elif isinstance(decision, policy.Room):  # the models it needs gone that still run requests
        blocking = [v for v in (*decision.evict, *decision.hold)
                    if v != SPARE_ID and s.models[v].leases]
    return InsufficientMemory(
        f"model {m.id!r} needs {m.spec.estimate // MIB} MiB and {max(free, 0) // MIB} MiB "
        f"are free; models in use ({', '.join(b for b in blocking if b != SPARE_ID) or 'none'})"
        " did not finish in time; retry later", retry_after_s=s.options.retry_after_s)


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


def place(s: State, m: Model) -> tuple[str, policy.Decision, bool]:
    """The node for ``m`` and what it takes there: among the nodes that run its engine, the
    node where it fits now, else where it fits after drains alone, else after requests end,
    else where loads under way stand in the way; NeverFits only if it fits on none. Among
    nodes equal in that, the node its last worker served on (its KV snapshots are on that
    node's disk), then a node whose spare worker it can become, then the least used (the
    smallest share of its budget in use), then the first by id. A model that fits no node
    is refused against the largest one."""
    best: tuple[tuple[int, int, bool, bool, float, str], policy.Decision, bool] | None = None
    for node in s.nodes.values():
        if node.engines is not None and m.spec.engine not in node.engines:
            continue
        residents, use_spare = _residents(s, node, m)
        decision = policy.plan(residents, node.budget, m.id, m.spec.estimate)
        rank = _RANK[type(decision)]
        if isinstance(decision, policy.Room) and decision.hold:
            rank = 2
        used = s.used_bytes(node.id) / node.budget if node.budget > 0 else math.inf
        largest = -node.budget if isinstance(decision, policy.NeverFits) else 0
        key = (rank, largest, node.id != m.last_node, not use_spare, used, node.id)
        if best is None or key < best[0]:
            best = (key, decision, use_spare)
    if best is None:  # no node runs its engine: waiting cannot help
        return "", policy.NeverFits(m.spec.estimate, 0, 0), False
    return best[0][5], best[1], best[2]


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
            m = advance_drain(s, begin_drain(s.models[v], reason, fx, force=True), fx)
            s = replace(put(s, m), freed=s.freed | {v})
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
    return put_node(s, replace(node, spare=replace(node.spare, status=SpareStatus.DROPPING)))


def _spawn(s: State, m: Model, node_id: str, use_spare: bool, now: float, fx: Fx) -> State:
    m = take_pending(m, fx)
    worker = Worker(s.next_id, node_id, now)
    m = set_phase(m, Phase.LOADING, f"estimated {m.spec.estimate // MIB} MiB", fx,
               estimated_bytes=m.spec.estimate, file_bytes=m.spec.model.size_bytes)
    m = replace(m, worker=worker, wait_since=None, respawn=False, not_before=0.0,
                measured=None)
    fx.append(msg.Spawn(m.id, worker.id, node_id, m.spec.model, use_spare, m.last_load_s))
    s = replace(put(s, m), next_id=s.next_id + 1)
    if use_spare:
        s = put_node(s, replace(s.nodes[node_id], spare=None))
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
            s = put_node(s, replace(node, spare=Spare(node.spare_engine)))
    return s


def settle(s: State, fx: Fx) -> State:
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
            s = put(s, replace(m, unloads=tuple(u for u in m.unloads if u not in settled)))
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
