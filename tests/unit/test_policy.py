"""The eviction decision, table-driven: a pure function, no processes, no clock."""

from __future__ import annotations

import pytest

from bunkhouse.residency.policy import Fits, Holding, MustWait, NeverFits, Resident, Room, plan
from tests.fakes import GIB


def r(id: str, gib: float, last_used: float, *, pinned: bool = False, busy: bool = False,
      holding: Holding = Holding.READY, held: bool = False) -> Resident:
    return Resident(id, int(gib * GIB), last_used, pinned, busy, holding, held)


LOADING, DRAINING = Holding.LOADING, Holding.DRAINING

CASES = [
    # (name, residents, budget GiB, wanted, need GiB, expected)
    ("empty host", [], 8, "a", 4, Fits()),
    ("fits beside others", [r("b", 2, 1), r("c", 2, 2)], 8, "a", 4, Fits()),
    ("exactly fills the budget", [r("b", 4, 1)], 8, "a", 4, Fits()),
    ("evicts the least recently used", [r("b", 3, 5), r("c", 3, 1)], 8, "a", 4, Room(("c",))),
    ("evicts several, oldest first",
     [r("b", 3, 5), r("c", 2, 1), r("d", 2, 3)], 8, "a", 6, Room(("c", "d", "b"))),
    ("skips pinned", [r("b", 4, 1, pinned=True), r("c", 4, 2)], 8, "a", 4, Room(("c",))),
    ("idle before busy", [r("b", 4, 1, busy=True), r("c", 4, 2)], 8, "a", 4, Room(("c",))),
    ("skips loading", [r("b", 4, 1, holding=LOADING), r("c", 4, 2)], 8, "a", 4, Room(("c",))),
    ("a drain under way counts", [r("b", 4, 1, holding=DRAINING), r("c", 4, 2)], 8, "a", 4,
     Room()),
    ("holds busy models when idle ones are not enough",
     [r("b", 6, 1, busy=True)], 8, "a", 4, Room((), ("b",))),
    ("a held model stays chosen among busy ones",
     [r("b", 4, 1, busy=True), r("c", 4, 5, busy=True, held=True)], 8, "a", 4,
     Room((), ("c",))),
    ("evicts idle and holds busy together",
     [r("b", 2, 1, busy=True), r("c", 2, 5)], 5, "a", 4, Room(("c",), ("b",))),
    ("waits for a loading model", [r("b", 6, 1, holding=LOADING)], 8, "a", 4,
     MustWait(4 * GIB, 2 * GIB, ("b",))),
    ("never fits: bigger than the budget", [], 8, "a", 9, NeverFits(9 * GIB, 8 * GIB, 0)),
    ("never fits beside pinned models", [r("b", 5, 1, pinned=True)], 8, "a", 4,
     NeverFits(4 * GIB, 8 * GIB, 5 * GIB)),
    ("the wanted model itself is not counted", [r("a", 4, 1)], 8, "a", 8, Fits()),
    ("ties broken by id", [r("c", 4, 1), r("b", 4, 1)], 8, "a", 4, Room(("b",))),
]


@pytest.mark.parametrize(("residents", "budget", "wanted", "need", "expected"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_plan(residents: list[Resident], budget: float, wanted: str, need: float,
              expected: object) -> None:
    assert plan(residents, int(budget * GIB), wanted, int(need * GIB)) == expected
