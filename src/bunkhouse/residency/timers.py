"""Time in residency: what a ``Tick`` settles (admission waits, a pause's end, an unload's
grace, ttls, probes, memory readings) and :func:`wake_at`, when the step next needs one. Each
deadline is compared as its timer is set (``start + duration <= now``), so a tick at a
deadline always settles it and the run loop never spins on one."""

from __future__ import annotations

import math
from dataclasses import replace

from bunkhouse.errors import (
    Paused,
)
from bunkhouse.residency import messages as msg
from bunkhouse.residency.commands import end_operator_pause
from bunkhouse.residency.edit import (
    Fx,
    advance_drain,
    begin_drain,
    put,
    put_health,
    refuse,
    wants_load,
)
from bunkhouse.residency.schedule import memory_error
from bunkhouse.residency.state import (
    Model,
    Phase,
    State,
)
from bunkhouse.supervisor import supervision


def tick(s: State, e: msg.Tick, now: float, fx: Fx) -> State:
    if s.pause is not None and s.pause.until is not None and s.pause.until <= now:
        s = end_operator_pause(s, f"not resumed within {s.pause.max_s:g} s", now, fx)
    for old in list(s.models.values()):
        m = _expire_idle(s, _expire_unloads(_expire_waits(s, old, now, fx), now, fx), now, fx)
        if m is not old:
            s = put(s, m)
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
        return refuse(m, paused_error(s, m.id, now), fx,
                       keep=lambda w: max(w.since, start) + wait > now)
    if m.wait_since is None or m.wait_since + wait > now or not wants_load(m):
        return m
    return replace(refuse(m, memory_error(s, m), fx), wait_since=None, respawn=False)


def paused_error(s: State, model_id: str, now: float) -> Paused:
    assert s.pause is not None
    left = None if s.pause.until is None else max(0.0, s.pause.until - now)
    secs = max(1, math.ceil(left)) if left else None  # one figure: message and header
    ends = f"; it ends by itself in {secs} s unless resumed sooner" if secs else ""
    return Paused(
        f"model {model_id!r}: every model is paused by an operator (POST /admin/pause)"
        f"{ends}; this request waited {s.options.admission_wait_s:g} s "
        "(--admission-wait); retry later",
        retry_after_s=secs or s.options.retry_after_s)


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
    return advance_drain(s, begin_drain(
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
            s = put_health(s, m.id, supervision.probe_sent(h, m.worker.id, now))
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
        if s.pause is None and m.wait_since is not None and wants_load(m):
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
