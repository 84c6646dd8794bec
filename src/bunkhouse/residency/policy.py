"""The eviction decision: a pure function of the residents, the budget and the wanted model.

It must not log, sleep or touch a process; the manager carries its answer out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Resident:
    """One model that holds memory now (loading, ready or draining)."""

    id: str
    bytes: int
    last_used: float
    pinned: bool = False
    leases: int = 0
    evictable_state: bool = True  # ready; loading and draining models are never chosen

    @property
    def evictable(self) -> bool:
        return self.evictable_state and not self.pinned and self.leases == 0


@dataclass(frozen=True, slots=True)
class Fits:
    """Load after evicting these models, in this order (none: it fits now)."""

    evict: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class MustWait:
    """It would fit once models that are leased, loading or draining let go."""

    need: int
    free: int
    blocking: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NeverFits:
    """Bigger than the budget (less what pinned models hold): waiting cannot help."""

    need: int
    budget: int
    pinned_bytes: int


Decision = Fits | MustWait | NeverFits


def plan(residents: Sequence[Resident], budget: int, wanted: str, need: int) -> Decision:
    """What to do so that ``wanted`` (needing ``need`` bytes) fits in ``budget``.

    Least recently used evictable models go first; pinned and leased models are skipped.
    """
    others = [r for r in residents if r.id != wanted]
    pinned_bytes = sum(r.bytes for r in others if r.pinned)
    if need > budget - pinned_bytes:
        return NeverFits(need, budget, pinned_bytes)
    free = budget - sum(r.bytes for r in others)
    if need <= free:
        return Fits()
    chosen: list[str] = []
    for r in sorted((r for r in others if r.evictable), key=lambda r: (r.last_used, r.id)):
        chosen.append(r.id)
        free += r.bytes
        if need <= free:
            return Fits(tuple(chosen))
    blocking = tuple(r.id for r in others if not r.evictable and not r.pinned)
    return MustWait(need, budget - sum(r.bytes for r in others), blocking)
