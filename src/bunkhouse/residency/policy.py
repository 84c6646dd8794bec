"""The eviction decision on one node: a pure function of what it holds, its budget and the
wanted model.

It must not log, sleep or touch a process; residency's step carries its answer out.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Holding(enum.Enum):
    """Where a resident is in its life, as far as making room goes."""

    READY = "ready"  # may be chosen
    LOADING = "loading"  # never chosen: wait for it
    DRAINING = "draining"  # on its way out: its bytes will be free


@dataclass(frozen=True, slots=True)
class Resident:
    """One model (or the spare worker) that holds memory on the node now."""

    id: str
    bytes: int
    last_used: float
    pinned: bool = False
    busy: bool = False  # leased, or requests wait for it
    holding: Holding = Holding.READY
    held: bool = False  # already held for a waiting model: chosen first among busy ones


@dataclass(frozen=True, slots=True)
class Fits:
    """It fits now."""


@dataclass(frozen=True, slots=True)
class Room:
    """It fits once these models are gone: ``evict`` drain now (nobody holds them),
    ``hold`` take no new leases and drain once their requests end; drains already under
    way count too."""

    evict: tuple[str, ...] = ()
    hold: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class MustWait:
    """Loading models stand in the way: look again once they are ready."""

    need: int
    free: int
    blocking: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NeverFits:
    """Bigger than the budget less what pinned models hold: waiting cannot help."""

    need: int
    budget: int
    pinned_bytes: int


Decision = Fits | Room | MustWait | NeverFits


def plan(residents: Sequence[Resident], budget: int, wanted: str, need: int) -> Decision:
    """What to do so that ``wanted`` (needing ``need`` bytes) fits in ``budget``.

    Idle models go first, least recently used first; busy ones only when idle ones are not
    enough (those already held first, so that a choice once made stands). Pinned and
    loading models are never chosen."""
    others = [r for r in residents if r.id != wanted]
    pinned_bytes = sum(r.bytes for r in others if r.pinned)
    if need > budget - pinned_bytes:
        return NeverFits(need, budget, pinned_bytes)
    free = budget - sum(r.bytes for r in others)
    if need <= free:
        return Fits()
    room = free + sum(r.bytes for r in others if r.holding is Holding.DRAINING)
    evict: list[str] = []
    hold: list[str] = []
    choices = sorted((r for r in others if r.holding is Holding.READY and not r.pinned),
                     key=lambda r: (r.busy, not r.held, r.last_used, r.id))
    for r in choices:
        if need <= room:
            break
        (hold if r.busy else evict).append(r.id)
        room += r.bytes
    if need <= room:
        return Room(tuple(evict), tuple(hold))
    blocking = tuple(r.id for r in others if r.holding is Holding.LOADING)
    return MustWait(need, free, blocking)
