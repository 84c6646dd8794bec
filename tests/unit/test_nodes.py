"""Nodes as residency sees them (a cluster's machines): placement among them, a node joining,
and a node lost with its workers. Pure steps; the random sequences of
tests/unit/test_step_properties.py lose and rejoin nodes too."""

from __future__ import annotations

import dataclasses
from typing import Any

from bunkhouse.errors import ModelTooLarge
from bunkhouse.residency import messages as msg
from bunkhouse.residency.state import Phase, ResidencyOptions, Spec, State, initial
from bunkhouse.residency.step import step
from tests.fakes import model

MIB = 1024 * 1024
SIZES = {"a": 300, "b": 500, "c": 700, "big": 1500}  # MiB


class Host:
    """Steps with the effects kept: what was spawned where, stopped, cancelled, answered."""

    def __init__(self, nodes: dict[str, int]) -> None:
        options = ResidencyOptions(budget_bytes=0, admission_wait_s=60, probe_interval_s=0,
                                   measure_interval_s=0)
        specs = [Spec(model(k, v / 1024), v * MIB, "llama", True) for k, v in SIZES.items()]
        self.state: State = dataclasses.replace(initial(options, specs, flush=True), nodes={})
        self.now = 0.0
        self.ids = 100
        self.effects: list[msg.Effect] = []
        for node, mib in nodes.items():
            self.send(msg.NodeJoined(node, mib * MIB))

    def send(self, event: msg.Event) -> tuple[msg.Effect, ...]:
        self.state, effects = step(self.state, event, self.now)
        self.effects += effects
        return effects

    def of(self, kind: type, **match: Any) -> list[Any]:
        return [e for e in self.effects if isinstance(e, kind)
                and all(getattr(e, k) == v for k, v in match.items())]

    def want(self, model_id: str) -> int:
        self.ids += 1
        self.send(msg.Want(model_id, self.ids))
        return self.ids

    def load(self, model_id: str) -> tuple[str, int]:
        """A request for ``model_id`` and its worker's start: (its node, its lease)."""
        waiter = self.want(model_id)
        spawn = self.of(msg.Spawn, model=model_id)[-1]
        self.send(msg.WorkerReady(model_id, spawn.worker, 1, f"pid 1 on {spawn.node}", None))
        granted = next(e.value for e in self.of(msg.Resolve, id=waiter))
        assert isinstance(granted, msg.Granted)
        return spawn.node, granted.lease

    def unload(self, model_id: str) -> None:
        """An idle model drained to absent: saved (its KV snapshots), then stopped."""
        self.ids += 1
        self.send(msg.Unload(model_id, self.ids, "operator", 0.0))
        worker = self.state.models[model_id].worker
        assert worker is not None
        self.send(msg.Flushed(model_id, worker.id))
        self.send(msg.WorkerStopped(model_id, worker.id))
        assert self.state.models[model_id].phase is Phase.ABSENT


def test_models_go_where_they_fit_then_to_their_snapshots_node_then_the_least_used() -> None:
    host = Host({"n1": 1000, "n2": 1000, "n3": 1000})
    placed = {m: host.load(m) for m in ("a", "b", "c")}
    assert [node for node, _ in placed.values()] == ["n1", "n2", "n3"]  # one each
    for m, (_, lease) in placed.items():
        host.send(msg.Release(m, lease))
    host.unload("a")  # its KV snapshots are on n1's disk
    host.send(msg.NodeJoined("n4", 4000 * MIB))  # emptier than n1, in share and in bytes
    assert host.load("a")[0] == "n1"  # back where its snapshots are
    host.unload("b")
    host.send(msg.NodeLost("n2", "its raylet died"))
    assert host.load("b")[0] == "n4"  # its snapshots' node is gone: the least used node
    assert host.state.models["b"].last_node == "n4"


def test_a_node_lost_fails_its_models_and_their_waiters_are_placed_elsewhere() -> None:
    host = Host({"n1": 1000, "n2": 1000})
    node, _ = host.load("a")
    assert node == "n1"
    loading = host.want("c")  # c starts on n2 (the least used)
    spawn_c = host.of(msg.Spawn, model="c")[-1]
    assert spawn_c.node == "n2"
    worker_a = host.state.models["a"].worker
    assert worker_a is not None

    effects = host.send(msg.NodeLost("n1", "its raylet died"))
    assert msg.Stop("a", worker_a.id) in effects  # its requests are failing already
    a = host.state.models["a"]
    assert a.phase is Phase.DRAINING and a.worker is not None and not a.worker.alive
    assert host.state.health["a"].failures == ()  # the node failed, not the model
    assert "n1" not in host.state.nodes

    waiter = host.want("a")  # a request that comes meanwhile waits for the next load
    host.send(msg.WorkerStopped("a", worker_a.id))
    assert len(host.of(msg.Spawn, model="a")) == 1  # n2 has a cold start under way: c's
    host.send(msg.WorkerReady("c", spawn_c.worker, 3, "pid 3 on n2", None))
    assert isinstance(host.of(msg.Resolve, id=loading)[0].value, msg.Granted)  # untouched
    again = host.of(msg.Spawn, model="a")[-1]
    assert again.node == "n2" and again.worker != worker_a.id
    host.send(msg.WorkerReady("a", again.worker, 2, "pid 2 on n2", None))
    assert isinstance(host.of(msg.Resolve, id=waiter)[0].value, msg.Granted)


def test_a_load_under_way_on_a_lost_node_is_placed_again_not_counted() -> None:
    host = Host({"n1": 1000, "n2": 1000})
    waiter = host.want("a")
    first = host.of(msg.Spawn, model="a")[-1]
    assert first.node == "n1"
    effects = host.send(msg.NodeLost("n1", "removed"))
    assert msg.CancelSpawn("a", first.worker) in effects
    # the start fails as the node goes (or is cancelled): either way, not the model's failure
    host.send(msg.LoadFailed("a", first.worker, RuntimeError("connection reset")))
    assert host.state.health["a"].failures == ()
    second = host.of(msg.Spawn, model="a")[-1]
    assert second.node == "n2" and second.worker != first.worker
    host.send(msg.WorkerReady("a", second.worker, 2, "pid 2 on n2", None))
    assert isinstance(host.of(msg.Resolve, id=waiter)[0].value, msg.Granted)
    # a worker the lost node still reported ready is stopped, never leased
    host.send(msg.WorkerReady("a", first.worker, 1, "pid 1 on n1", None))
    assert host.state.models["a"].worker is not None
    assert host.state.models["a"].worker.id == second.worker


def test_a_model_that_fits_no_node_left_is_refused_with_the_sizes() -> None:
    host = Host({"n1": 2000, "n2": 1000})
    host.load("big")
    host.send(msg.NodeLost("n1", "removed"))
    worker = host.state.models["big"].worker
    assert worker is not None
    waiter = host.want("big")
    host.send(msg.WorkerStopped("big", worker.id))
    refusal = host.of(msg.Resolve, id=waiter)[0].value
    assert isinstance(refusal, ModelTooLarge)
    assert "needs 1500 MiB but the memory budget is 1000 MiB" in refusal.message
    host.send(msg.NodeLost("n2", "removed"))
    waiter = host.want("a")
    refusal = host.of(msg.Resolve, id=waiter)[0].value
    assert isinstance(refusal, ModelTooLarge) and "is up" in refusal.message


def test_the_manager_starts_a_worker_on_the_node_residency_chose() -> None:
    """The executor asks its start function for the node (``node=``) when it is not the
    local one; a node lost fails the model's requests and its next load goes elsewhere."""
    import asyncio

    from tests.fakes import Host as FakeHost
    from tests.fakes import settle

    async def run() -> None:
        host = FakeHost([model("a", 0.5)], budget_bytes=MIB)  # the local node is too small
        host.manager.node_joined("n1", 2**31)
        host.manager.node_joined("n2", 2**30)
        await host.use("a")
        assert host.nodes == ["n1"] and host.state("a") == "ready"
        host.manager.node_lost("n1", "its raylet died")
        await settle()
        assert host.state("a") == "absent"
        await host.use("a")
        assert host.nodes == ["n1", "n2"]
        assert host.manager.snapshot().models["a"].node == "n2"

    asyncio.run(run())


def test_a_worker_lost_with_its_host_is_not_the_models_failure_nor_reloaded_unasked() -> None:
    host = Host({"n1": 1000, "n2": 1000})
    host.load("a")
    worker = host.state.models["a"].worker
    assert worker is not None
    host.send(msg.WorkerExited("a", worker.id, "its host process is gone", lost=True))
    a = host.state.models["a"]
    assert a.phase is Phase.DRAINING and not a.respawn
    assert host.state.health["a"].failures == ()
    host.send(msg.WorkerStopped("a", worker.id))
    assert host.state.models["a"].phase is Phase.ABSENT
    assert len(host.of(msg.Spawn, model="a")) == 1  # nobody asked: nothing loads
    # the node's loss reported after the worker's: counted once, as nothing
    host.send(msg.NodeLost("n1", "removed"))
    assert host.state.health["a"].failures == ()


def test_an_operators_load_is_not_refused_by_a_crash_loops_cool_down() -> None:
    from bunkhouse.errors import ModelFailed

    host = Host({"n1": 1000})
    s = host.state  # a crash loop gave up on "a" a moment ago: it cools down for 60 s
    host.state = dataclasses.replace(
        s, models={**s.models, "a": dataclasses.replace(s.models["a"], phase=Phase.FAILED,
                                                        last_error="crashed")},
        health={**s.health, "a": dataclasses.replace(s.health["a"], failed_until=60.0)})
    waiter = host.want("a")  # a client's request is refused, saying when
    assert isinstance(host.of(msg.Resolve, id=waiter)[0].value, ModelFailed)
    assert not host.of(msg.Spawn, model="a")
    host.ids += 1
    host.send(msg.Want("a", host.ids, lease=False, reset=True))  # POST .../load
    assert not host.of(msg.Resolve, id=host.ids)
    assert host.of(msg.Spawn, model="a")  # tried at once
