"""Supervision's bookkeeping for one model: a pure decision, beside residency's.

Residency's step (residency/step.py) keeps one :class:`Health` per model and asks the
functions here what a worker's death, a failed load, a liveness probe or a failed request
means: respawn (after a backoff), give up for a cool-down, or replace a worker that no
longer answers. Nothing here logs, sleeps or touches a process; the figures come from
:class:`~bunkhouse.supervisor.restart.RestartPolicy` and the residency options.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bunkhouse.supervisor import restart
from bunkhouse.supervisor.restart import RestartPolicy


@dataclass(frozen=True, slots=True)
class Health:
    """What supervision remembers of a model's workers. Times are the injected clock's
    seconds."""

    failures: tuple[float, ...] = ()  # when its workers died or failed to load
    quick_deaths: int = 0  # failures in a row that came within quick_death_s of a spawn
    delay_s: float = 0.0  # backoff before its next spawn
    failed_until: float | None = None  # given up: no load before this (the cool-down)
    counted: int | None = None  # the worker whose death was last counted (once each)
    probe_failures: int = 0  # liveness probes missed in a row
    probing: int | None = None  # the worker a probe is under way for
    last_probe: float = 0.0
    failed_requests: int = 0  # requests in a row that got a 5xx or a broken answer
    suspended: bool = False  # stopped by the compute gate's time slice: not probed
    suspensions: int = 0  # a probe that overlapped one proves nothing


def failed(policy: RestartPolicy, health: Health, now: float, spawned_at: float,
           served_s: float = 0.0) -> tuple[Health, restart.Respawn | restart.GiveUp]:
    """Count one failure (a death, or a load that never became ready): respawn after a
    backoff, or give up (the model is failed until ``health.failed_until``). A worker that
    served for at least the budget's window ends a crash loop: earlier failures are
    forgotten."""
    failures = () if served_s >= policy.window_s else health.failures
    failures = (*failures, now)
    quick = now - spawned_at < policy.quick_death_s
    quick_deaths = health.quick_deaths + 1 if quick else 0
    decision = restart.decide(policy, failures, quick_deaths, now)
    health = replace(health, failures=failures[-(policy.max_restarts + 2):],
                     quick_deaths=quick_deaths)
    if isinstance(decision, restart.GiveUp):
        return replace(health, failed_until=now + policy.cooldown_s, delay_s=0.0), decision
    return replace(health, delay_s=decision.delay_s), decision


def cooling_s(health: Health, now: float) -> float | None:
    """Seconds of cool-down left after a crash loop; None when none is left."""
    if health.failed_until is None or health.failed_until <= now:
        return None
    return health.failed_until - now


def forgiven(health: Health) -> Health:
    """The cool-down passed, or an operator asked for a load: its failures are forgotten."""
    return replace(health, failures=(), quick_deaths=0, failed_until=None, delay_s=0.0)


def fresh_worker(health: Health) -> Health:
    """A new worker is ready: no backoff, no misses, no failed requests."""
    return replace(health, delay_s=0.0, probe_failures=0, failed_requests=0, probing=None,
                   suspended=False)


def probe_due(health: Health, now: float, interval_s: float) -> bool:
    return (interval_s > 0 and health.probing is None and not health.suspended
            and health.last_probe + interval_s <= now)  # as the timer for it is set


def probe_sent(health: Health, worker: int, now: float) -> Health:
    return replace(health, probing=worker, last_probe=now)


def probe_answered(health: Health, ok: bool, suspensions: int, limit: int
                   ) -> tuple[Health, bool]:
    """A probe's answer (``suspensions``: the count when it was sent). True: the worker
    missed ``limit`` in a row and is to be replaced. A probe that overlapped a suspension
    counts for nothing."""
    health = replace(health, probing=None)
    if health.suspended or health.suspensions != suspensions:
        return health, False
    misses = 0 if ok else health.probe_failures + 1
    return replace(health, probe_failures=misses), misses >= limit


def request_answered(health: Health, ok: bool, limit: int) -> tuple[Health, bool]:
    """A request's outcome on the current worker. True: ``limit`` failed in a row, the
    worker is to be replaced."""
    failures = 0 if ok else health.failed_requests + 1
    return replace(health, failed_requests=failures), failures >= limit


def suspended(health: Health, on: bool) -> Health:
    """The compute gate stopped (``on``) or let go the model's worker."""
    if on:
        return replace(health, suspended=True, suspensions=health.suspensions + 1)
    return replace(health, suspended=False)
