"""Interleavings that broke residency, replayed deterministically with fake workers.

Timing is varied by how many event-loop turns pass between two requests (no sleeps as
synchronisation); slow starts and stops are events the test sets.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from bunkhouse.errors import ShuttingDown
from bunkhouse.front.admission import ComputeGate
from bunkhouse.residency.manager import Lease
from bunkhouse.supervisor.restart import RestartPolicy
from tests.fakes import Host, model, run, until


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def _host(*models: tuple[str, float], budget_gib: float, **kwargs: object) -> Host:
    h = Host([model(id, gib) for id, gib in models], budget_gib=budget_gib,
             **kwargs)  # type: ignore[arg-type]
    h.stop_gate = asyncio.Event()
    h.stop_gate.set()
    drains: list[tuple[str, int, str]] = []
    emit = h.manager.events.emit

    def recording(model_id: str, kind: str, reason: str, **data: Any) -> Any:
        if kind == "draining":
            drains.append((model_id, h.manager.status(model_id).leases, reason))
        return emit(model_id, kind, reason, **data)

    h.manager.events.emit = recording  # type: ignore[method-assign]
    h.drains = drains  # type: ignore[attr-defined]
    return h


def _no_stop_under_a_lease(h: Host) -> None:
    """No model began draining to make room while leased, and no worker stopped leased."""
    for model_id, leases, reason in h.drains:  # type: ignore[attr-defined]
        assert leases == 0, f"{model_id} began draining ({reason}) under {leases} lease(s)"
    for w in h.workers:
        assert all(n == 0 for n in w.leases_at_stop), f"{w.model.id} stopped under a lease"


async def _stream(h: Host, lease: Lease, turns: int) -> None:
    """Hold the lease for a while (0.1 s of the clock a turn), as a long stream does,
    checking that its worker stays up."""
    for _ in range(turns):
        assert not lease.worker.stopped, f"{lease.model_id}: its worker stopped mid-stream"  # type: ignore[attr-defined]
        h.advance(0.1)
        await asyncio.sleep(0)
    lease.release()


@pytest.mark.parametrize("delay", range(0, 40, 3))
@pytest.mark.parametrize("stop_turns", [0, 5, 20])
def test_stale_plan_never_drains_a_model_leased_after_the_plan(delay: int,
                                                                stop_turns: int) -> None:
    """g1 and g2 fit together, q fits with neither. q's load plans to evict both; a request
    for g2 arrives while g1 is being stopped: g2 is never stopped under it, both answer."""
    async def go() -> None:
        h = _host(("g1", 1), ("g2", 1), ("q", 2.5), budget_gib=3)
        await h.use("g1")
        h.advance(1)
        await h.use("g2")
        h.stop_gate.clear()  # stops take a while
        q = asyncio.create_task(h.manager.acquire(h.models["q"]))
        await _turns(delay)
        g2 = asyncio.create_task(h.manager.acquire(h.models["g2"]))
        await _turns(stop_turns)
        h.stop_gate.set()

        async def answered(task: asyncio.Task[Lease], turns: int) -> None:
            await _stream(h, await task, turns)

        # g2 streams its 1,500 tokens; q is answered before or after it, never during.
        await asyncio.gather(answered(g2, 200), answered(q, 20))
        _no_stop_under_a_lease(h)
        assert len(h.starts) <= 5, f"swap loop: {h.starts}"

    run(go())


@pytest.mark.parametrize("delay", [0, 1, 2, 5, 10, 30])
def test_two_cold_models_that_cannot_be_resident_together_are_both_answered(
        delay: int) -> None:
    async def go() -> None:
        h = _host(("q", 2), ("g2", 2), budget_gib=3)

        async def ask(id: str) -> None:
            lease = await h.manager.acquire(h.models[id])
            await _stream(h, lease, 20)

        first = asyncio.create_task(ask("q"))
        await _turns(delay)
        await asyncio.gather(first, ask("g2"))
        assert sorted(h.starts) == ["g2", "q"], f"each model loads once: {h.starts}"
        _no_stop_under_a_lease(h)

    run(go())


def test_a_model_loaded_for_waiting_requests_serves_them_before_it_can_be_evicted() -> None:
    async def go() -> None:
        h = _host(("q", 2), ("g2", 2), budget_gib=3)
        h.gate = asyncio.Event()  # q's load is slow: requests for both pile up meanwhile
        waiting_q = [asyncio.create_task(h.manager.acquire(h.models["q"])) for _ in range(3)]
        await _turns(5)
        waiting_g2 = asyncio.create_task(h.manager.acquire(h.models["g2"]))
        await _turns(5)
        h.gate.set()
        leases = await asyncio.gather(*waiting_q)
        assert all(lease.worker is leases[0].worker for lease in leases)
        assert h.manager.status("q").leases == 3 and not waiting_g2.done()
        for lease in leases:
            lease.release()
        (await waiting_g2).release()
        assert h.starts == ["q", "g2"]

    run(go())


def test_a_crash_during_an_admin_drain_ends_absent_without_a_respawn(
        caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        h = _host(("a", 1), budget_gib=3)
        lease = await h.manager.acquire(h.models["a"])
        unload = asyncio.create_task(h.manager.unload("a", "operator"))
        await until(h, lambda: h.state("a") == "draining")
        h.workers[0].die("exit code -9")
        lease.release()
        assert await unload is True
        assert h.state("a") == "absent" and h.starts == ["a"]
        kinds = [e.kind for e in h.manager.events.recent() if e.model == "a"]
        assert "crashed" in kinds and "respawning" not in kinds
        await h.use("a")  # it loads again on demand
        assert h.starts == ["a", "a"]

    with caplog.at_level(logging.WARNING):
        run(go())
    assert "background residency task failed" not in caplog.text


def test_a_crash_during_an_eviction_drain_lets_the_load_go_on() -> None:
    async def go() -> None:
        h = _host(("a", 2), ("b", 2), budget_gib=3)
        await h.use("a")
        h.stop_gate.clear()
        b = asyncio.create_task(h.use("b"))
        await until(h, lambda: h.state("a") == "draining")
        h.workers[0].die("exit code 139")
        h.stop_gate.set()
        await b
        assert (h.state("a"), h.state("b")) == ("absent", "ready") and h.starts == ["a", "b"]

    run(go())


def test_ttl_expiry_racing_an_acquire() -> None:
    async def go() -> None:
        h = _host(("a", 1), budget_gib=3, ttl_s=60)
        await h.use("a")
        h.stop_gate.clear()
        h.advance(61)
        await until(h, lambda: h.state("a") == "draining")
        waiting = asyncio.create_task(h.manager.acquire(h.models["a"]))
        await _turns(5)
        assert not waiting.done()
        h.stop_gate.set()
        lease = await waiting
        assert lease.worker is h.workers[1] and h.workers[0].stopped
        h.advance(61)
        await _turns(30)
        assert h.state("a") == "ready"  # leased: never expired
        lease.release()
        _no_stop_under_a_lease(h)

    run(go())


@pytest.mark.parametrize("unload_first", [False, True])
def test_admin_unload_racing_an_eviction(unload_first: bool) -> None:
    async def go() -> None:
        h = _host(("a", 2), ("b", 2), budget_gib=3)
        await h.use("a")
        h.stop_gate.clear()
        if unload_first:
            unload = asyncio.create_task(h.manager.unload("a", "operator"))
            await _turns(3)
            b = asyncio.create_task(h.use("b"))
        else:
            b = asyncio.create_task(h.use("b"))
            await until(h, lambda: h.state("a") == "draining")
            unload = asyncio.create_task(h.manager.unload("a", "operator"))
        await _turns(5)
        h.stop_gate.set()
        assert await unload is True
        await b
        assert (h.state("a"), h.state("b")) == ("absent", "ready")
        assert h.starts == ["a", "b"]

    run(go())


def test_close_while_one_model_drains_and_another_loads_stops_every_worker() -> None:
    async def go() -> None:
        h = _host(("a", 1), ("b", 1), budget_gib=3)
        lease = await h.manager.acquire(h.models["a"])
        unload = asyncio.create_task(h.manager.unload("a", "operator"))
        await until(h, lambda: h.state("a") == "draining")
        h.gate = asyncio.Event()  # b's start never finishes on its own
        loading = asyncio.create_task(h.manager.acquire(h.models["b"]))
        await until(h, lambda: h.state("b") == "loading")
        await h.manager.close()
        assert all(w.stopped for w in h.workers) and h.running == 0
        assert (h.state("a"), h.state("b")) == ("absent", "absent")
        with pytest.raises(ShuttingDown):
            await loading
        assert await unload is True
        lease.release()  # the stream that held it ends after the close: harmless
        with pytest.raises(ShuttingDown):
            await h.use("a")

    run(go())


def test_an_acquire_that_finds_a_dead_worker_and_the_exit_watcher_count_one_crash() -> None:
    async def go() -> None:
        h = _host(("a", 1), budget_gib=3, restart=RestartPolicy(max_restarts=1,
                                                               backoff_s=0.001))
        await h.use("a")
        h.advance(100)
        dead = h.workers[0]
        dead.stopped = True  # exited; its watcher has not reported yet
        await h.use("a")  # replaced
        dead.die("exit code -9")  # the watcher's late report
        await h.use("a")
        crashes = [e for e in h.manager.events.recent() if e.kind == "crashed"]
        assert len(crashes) == 1 and h.starts == ["a", "a"] and h.state("a") == "ready"

    run(go())


def test_a_worker_that_served_for_minutes_does_not_count_towards_a_crash_loop() -> None:
    async def go() -> None:
        h = _host(("a", 1), budget_gib=3,
                  restart=RestartPolicy(max_restarts=1, window_s=60, backoff_s=0.001))
        await h.use("a")
        for n in range(4):
            h.advance(61)  # each worker served longer than the window
            h.workers[-1].die("exit code -9")
            await until(h, lambda n=n: len(h.workers) == n + 2 and h.state("a") == "ready")
        assert h.state("a") == "ready"

    run(go())


def test_compute_gate_passes_on_when_its_next_owner_was_cancelled() -> None:
    async def go() -> None:
        gate = ComputeGate(batch_window_s=0)
        await gate.enter("a")
        b = asyncio.create_task(gate.enter("b"))
        await _turns(3)
        gate.leave("a")  # the turn passes to b ...
        b.cancel()  # ... whose only request goes away before it runs
        with pytest.raises(asyncio.CancelledError):
            await b
        await asyncio.wait_for(gate.enter("c"), 1)  # never stuck with an absent owner
        assert gate.owner == "c"
        gate.leave("c")
        assert gate.owner is None

    run(go())


def test_compute_gate_forgets_a_turn_whose_waiters_all_left() -> None:
    async def go() -> None:
        gate = ComputeGate(batch_window_s=0)
        await gate.enter("a")
        b = asyncio.create_task(gate.enter("b"))
        await _turns(3)
        b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await b
        gate.leave("a")
        assert gate.owner is None
        await asyncio.wait_for(gate.enter("c"), 1)
        assert gate.owner == "c"

    run(go())
