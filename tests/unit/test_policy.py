"""The eviction decision, table-driven: a pure function, no processes, no clock."""

from __future__ import annotations

import pytest

from bunkhouse.residency.policy import Fits, MustWait, NeverFits, Resident, plan

GIB = 1024**3


def r(id: str, gib: float, last_used: float, *, pinned: bool = False, leases: int = 0,
      ready: bool = True) -> Resident:
    return Resident(id, int(gib * GIB), last_used, pinned, leases, evictable_state=ready)


CASES = [
    # (name, residents, budget GiB, wanted, need GiB, expected)
    ("empty host", [], 8, "a", 4, Fits()),
    ("fits beside others", [r("b", 2, 1), r("c", 2, 2)], 8, "a", 4, Fits()),
    ("exactly fills the budget", [r("b", 4, 1)], 8, "a", 4, Fits()),
    ("evicts the least recently used", [r("b", 3, 5), r("c", 3, 1)], 8, "a", 4, Fits(("c",))),
    ("evicts several, oldest first",
     [r("b", 3, 5), r("c", 2, 1), r("d", 2, 3)], 8, "a", 6, Fits(("c", "d", "b"))),
    ("skips pinned", [r("b", 4, 1, pinned=True), r("c", 4, 2)], 8, "a", 4, Fits(("c",))),
    ("skips leased", [r("b", 4, 1, leases=2), r("c", 4, 2)], 8, "a", 4, Fits(("c",))),
    ("skips loading and draining",
     [r("b", 4, 1, ready=False), r("c", 4, 2)], 8, "a", 4, Fits(("c",))),
    ("waits when only leased models could go",
     [r("b", 6, 1, leases=1)], 8, "a", 4, MustWait(4 * GIB, 2 * GIB, ("b",))),
    ("waits for a loading model", [r("b", 6, 1, ready=False)], 8, "a", 4,
     MustWait(4 * GIB, 2 * GIB, ("b",))),
    ("never fits: bigger than the budget", [], 8, "a", 9, NeverFits(9 * GIB, 8 * GIB, 0)),
    ("never fits beside pinned models", [r("b", 5, 1, pinned=True)], 8, "a", 4,
     NeverFits(4 * GIB, 8 * GIB, 5 * GIB)),
    ("the wanted model itself is not counted", [r("a", 4, 1)], 8, "a", 8, Fits()),
    ("ties broken by id", [r("c", 4, 1), r("b", 4, 1)], 8, "a", 4, Fits(("b",))),
]


@pytest.mark.parametrize(("residents", "budget", "wanted", "need", "expected"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_plan(residents: list[Resident], budget: float, wanted: str, need: float,
              expected: object) -> None:
    assert plan(residents, int(budget * GIB), wanted, int(need * GIB)) == expected
