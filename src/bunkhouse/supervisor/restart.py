"""When to respawn a worker that died, and when to give up: a pure decision.

A restart budget (default: at most 3 restarts in 60 s) bounds a crash loop; a worker that dies
within ``quick_death_s`` of its spawn waits an exponential backoff before the next try. Past
the budget the model is failed for ``cooldown_s`` (or until an operator reloads it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    max_restarts: int = 3
    window_s: float = 60.0
    quick_death_s: float = 10.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    cooldown_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Respawn:
    delay_s: float


@dataclass(frozen=True, slots=True)
class GiveUp:
    failures: int
    window_s: float


def decide(policy: RestartPolicy, failures: Sequence[float], quick_deaths: int,
           now: float) -> Respawn | GiveUp:
    """``failures``: when the model's workers died or failed to load, this one included;
    ``quick_deaths``: how many of the latest failures in a row came within quick_death_s of
    their spawn."""
    recent = sum(1 for t in failures if now - t <= policy.window_s)
    if recent > policy.max_restarts:
        return GiveUp(recent, policy.window_s)
    if quick_deaths == 0:
        return Respawn(0.0)
    return Respawn(min(policy.max_backoff_s, policy.backoff_s * 2 ** (quick_deaths - 1)))
