from __future__ import annotations

import pytest

from bunkhouse.supervisor.restart import GiveUp, Respawn, RestartPolicy, decide

P = RestartPolicy(max_restarts=3, window_s=60, backoff_s=1, max_backoff_s=8)


@pytest.mark.parametrize(
    ("failures", "quick", "now", "expected"),
    [
        ([100], 0, 100, Respawn(0)),  # a long-lived worker died: respawn at once
        ([100], 1, 100, Respawn(1)),  # died soon after spawn: back off
        ([90, 100], 2, 100, Respawn(2)),
        ([80, 90, 100], 3, 100, Respawn(4)),
        ([70, 80, 90, 100], 4, 100, GiveUp(4, 60)),  # the 4th failure in 60 s: budget spent
        ([10, 20, 30, 100], 0, 100, Respawn(0)),  # old failures fall out of the window
        ([1, 2, 3, 4, 5, 6, 7], 7, 7.5, GiveUp(7, 60)),
    ],
)
def test_decide(failures: list[float], quick: int, now: float, expected: object) -> None:
    assert decide(P, failures, quick, now) == expected


def test_backoff_is_capped() -> None:
    assert decide(RestartPolicy(max_restarts=100, backoff_s=1, max_backoff_s=8),
                  [0.0] * 10, 10, 1) == Respawn(8)
