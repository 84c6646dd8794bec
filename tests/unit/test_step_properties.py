"""Residency's step against random event sequences (hypothesis): 2 nodes, 4 models of
different sizes, random requests, cancels, releases, crashes, probes, operator commands,
spares, nodes lost and joining again, and time; the effects are completed in random order
as the executor would.

Checked after every step: the step changed nothing in the state it was given; the bytes of
models planned resident on a node (and its spare) never exceed its budget; a model is never
drained to make room or for idleness while it holds a lease, and no worker is stopped under
a lease (but a crashed one, or at close); no effect names a worker that no longer exists;
a worker's death is counted once. Once the random events stop and requests end as soon as
they are served, every waiter is answered (no livelock) and none is refused for memory (no
starvation: two models that cannot be resident together are served in turn).

``--hypothesis-profile long`` runs 100,000 sequences (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import hypothesis
from hypothesis import strategies as st

from bunkhouse import defaults
from bunkhouse.errors import InsufficientMemory, Paused, WorkerLoadFailed
from bunkhouse.residency import messages as msg
from bunkhouse.residency.state import (
    HOLDING,
    Node,
    Phase,
    ResidencyOptions,
    Spec,
    State,
    initial,
)
from bunkhouse.residency.step import step, wake_at
from bunkhouse.supervisor.restart import RestartPolicy
from tests.fakes import model

MIB = 1024 * 1024
SIZES = {"a": 300, "b": 500, "c": 700, "w": 400}  # MiB; w runs another engine
BUDGETS = {"n1": 1000, "n2": 800}  # MiB


def _spec(model_id: str, mib: int) -> Spec:
    return Spec(model(model_id, mib / 1024), mib * MIB, "whisper" if model_id == "w" else "llama",
                True)


_ENGINES = {"n1": None, "n2": frozenset({"llama"})}  # the worker engines each node runs


def _initial() -> State:
    options = ResidencyOptions(budget_bytes=0, ttl_s=30, admission_wait_s=6,
                               restart=RestartPolicy(max_restarts=3, backoff_s=0.5,
                                                     cooldown_s=20),
                               probe_interval_s=5, measure_interval_s=0)
    s = initial(options, [_spec(k, v) for k, v in SIZES.items()], spares=True, flush=True)
    nodes = {k: Node(k, v * MIB, spares=True, spare_engine="llama", engines=_ENGINES[k])
             for k, v in BUDGETS.items()}
    return dataclasses.replace(s, nodes=nodes)


MODELS = sorted(SIZES)


def _contents(s: State) -> tuple[Any, ...]:
    """What a state holds that could change in place: its fields are frozen dataclasses
    (test_residency_state_is_frozen_data), tuples and frozensets, but three are mappings;
    a change in one shows as another key or object here."""
    return tuple((tuple(m), tuple(map(id, m.values())))
                 for m in (s.models, s.health, s.nodes))


def test_residency_state_is_frozen_data() -> None:
    """Only step makes states: every class a state is made of is a frozen dataclass."""
    from bunkhouse.residency import state as module
    from bunkhouse.supervisor.supervision import Health

    classes = [v for v in vars(module).values()
               if isinstance(v, type) and dataclasses.is_dataclass(v)] + [Health]
    assert len(classes) >= 10
    for cls in classes:
        assert cls.__dataclass_params__.frozen, f"{cls.__name__} is not frozen"  # type: ignore[attr-defined]

action = st.one_of(
    st.tuples(st.just("want"), st.sampled_from(MODELS), st.booleans()),
    st.tuples(st.just("want"), st.sampled_from(MODELS), st.just(True)),
    st.tuples(st.just("cancel"), st.integers(0, 7)),
    st.tuples(st.just("release"), st.integers(0, 7)),
    st.tuples(st.just("complete"), st.integers(0, 15), st.booleans()),
    st.tuples(st.just("complete"), st.integers(0, 15), st.just(True)),
    st.tuples(st.just("crash"), st.integers(0, 7)),
    st.tuples(st.just("report"), st.integers(0, 7), st.booleans()),
    st.tuples(st.just("constrained"), st.integers(0, 7), st.booleans()),
    st.tuples(st.just("tick"), st.sampled_from([0.1, 1.0, 7.0, 31.0])),
    st.tuples(st.just("unload"), st.sampled_from(MODELS), st.sampled_from([0.0, 5.0])),
    st.tuples(st.just("delete"), st.sampled_from(MODELS)),
    st.tuples(st.just("pin"), st.sampled_from(MODELS), st.booleans()),
    st.tuples(st.just("keep_alive"), st.sampled_from(MODELS), st.sampled_from([0.0, None])),
    st.tuples(st.just("pause"), st.sampled_from([5.0, 60.0])),
    st.tuples(st.just("resume")),
    st.tuples(st.just("suspend"), st.sampled_from(MODELS), st.booleans()),
    st.tuples(st.just("stop_loads")),
    st.tuples(st.just("node_lost"), st.sampled_from(sorted(BUDGETS))),
    st.tuples(st.just("node_joined"), st.sampled_from(sorted(BUDGETS))),
)


class World:
    """The executor and the clients, simulated: what is outstanding, what is alive, who
    waits and who holds a lease; and the checks after each step."""

    def __init__(self) -> None:
        self.state = _initial()
        self.now = 0.0
        self.ids = 1000
        self.spawning: dict[int, str] = {}  # worker -> model
        self.live: dict[int, str] = {}  # started workers not yet reaped
        self.pending: list[tuple[str, Any]] = []  # effects that come back as events
        self.waiters: dict[int, str] = {}
        self.answers: dict[int, Any] = {}
        self.leases: dict[int, str] = {}
        self.replies: set[int] = set()
        self.crashed: set[int] = set()  # workers whose death was published
        self.stopped: set[int] = set()

    def send(self, event: msg.Event) -> None:
        given = self.state
        before = _contents(given)
        state, effects = step(given, event, self.now)
        assert _contents(given) == before, f"step changed the state it was given ({event})"
        self.state = state
        for e in effects:
            self._effect(e)
        self._check(effects)

    def _effect(self, e: msg.Effect) -> None:
        named = getattr(e, "worker", None)
        if isinstance(e, msg.Spawn):
            assert e.worker not in self.live and e.worker not in self.spawning
            self.spawning[e.worker] = e.model
            self.pending.append(("spawn", e))
        elif isinstance(e, msg.CancelSpawn):
            assert e.worker in self.spawning, "cancel of a worker not starting"
        elif isinstance(e, msg.Resolve):
            self._resolve(e)
        elif isinstance(e, msg.Stop | msg.Flush | msg.Probe | msg.Kill | msg.Signal):
            assert named in self.live, f"{type(e).__name__} names worker {named}, gone"
            if isinstance(e, msg.Stop):
                assert named not in self.stopped, "stopped twice"
                self.stopped.add(named)
            if not isinstance(e, msg.Kill | msg.Signal):
                self.pending.append((type(e).__name__.lower(), e))
            if isinstance(e, msg.Kill):
                self.pending.append(("exit", msg.WorkerExited(e.model, e.worker, "killed")))
        elif isinstance(e, msg.FillSpare | msg.DropSpare):
            self.pending.append((type(e).__name__.lower(), e))
        elif isinstance(e, msg.Publish) and e.kind in ("crashed", "lost"):
            worker = self.state.models[e.model].worker
            assert worker is not None and worker.id not in self.crashed, "death counted twice"
            self.crashed.add(worker.id)

    def _resolve(self, e: msg.Resolve) -> None:
        if isinstance(e.value, msg.Granted):
            assert e.value.worker in self.live, "a lease on a worker that is gone"
            self.leases[e.value.lease] = e.value.model
        if e.id in self.waiters:
            del self.waiters[e.id]
            self.answers[e.id] = e.value
        else:
            assert e.id in self.replies, f"an answer to nobody: {e}"
            self.replies.discard(e.id)

    def _check(self, effects: tuple[msg.Effect, ...]) -> None:
        s = self.state
        for node in s.nodes.values():
            assert s.used_bytes(node.id) <= node.budget, f"{node.id} over its budget"
        for m in s.models.values():
            if m.phase in HOLDING and m.worker is not None and m.worker.node not in s.nodes:
                assert not m.worker.alive and m.drain is not None, f"{m.id} on a lost node"
                assert m.phase is not Phase.READY, f"{m.id} ready on a lost node"
        for e in effects:
            if isinstance(e, msg.Publish) and e.kind == "draining" \
                    and e.data.get("cause") in ("room", "idle", "keep_alive"):
                assert not s.models[e.model].leases, f"{e.model} drained under a lease"
            if isinstance(e, msg.Stop):
                m = s.models[e.model]
                crashed = m.worker is not None and not m.worker.alive
                assert not m.leases or s.closing or crashed, f"{e.model} stopped under a lease"
        for m in s.models.values():
            assert m.constrained <= m.leases and m.blamed <= m.leases, f"{m.id}: a lease gone"
            if m.phase is Phase.READY and m.id not in s.held and not s.paused \
                    and not s.closing:
                assert not m.waiters, f"{m.id} is ready and not held, yet requests wait"
            if m.phase is Phase.READY and not s.paused and not s.closing:
                assert all(w.lease for w in m.waiters), f"{m.id} is loaded, a load waits"
            if m.phase in HOLDING and (m.worker is None or m.worker.node in s.nodes):
                assert m.worker is not None
                engines = s.nodes[m.worker.node].engines
                assert engines is None or m.spec.engine in engines, "on a node without its engine"

    # -- the executor's and the clients' side --------------------------------------------

    def new_id(self) -> int:
        self.ids += 1
        return self.ids

    def ask(self, make: Any) -> None:
        reply = self.new_id()
        self.replies.add(reply)
        self.send(make(reply))

    def complete(self, index: int, ok: bool) -> None:
        if not self.pending:
            return
        kind, e = self.pending.pop(index % len(self.pending))
        if kind == "spawn":
            del self.spawning[e.worker]
            if ok:
                self.live[e.worker] = e.model
                self.send(msg.WorkerReady(e.model, e.worker, e.worker, f"pid {e.worker}",
                                          None))
            else:
                self.send(msg.LoadFailed(e.model, e.worker,
                                         WorkerLoadFailed(f"model {e.model!r} failed")))
        elif kind == "stop":
            self.live.pop(e.worker, None)
            self.send(msg.WorkerStopped(e.model, e.worker))
        elif kind == "flush":
            self.send(msg.Flushed(e.model, e.worker))
        elif kind == "probe":
            self.send(msg.Probed(e.model, e.worker, ok, self.state.health[e.model].suspensions))
        elif kind == "exit":
            if e.worker in self.live:
                self.send(e)
        elif kind == "fillspare":
            self.send(msg.SpareFilled(e.node, 4242 if ok else None))
        elif kind == "dropspare":
            self.send(msg.SpareGone(e.node))

    def crash(self, index: int) -> None:
        running = sorted(w for w in self.live if w not in self.stopped)
        if running:
            w = running[index % len(running)]
            self.send(msg.WorkerExited(self.live[w], w, "exit code -9"))
            self.send(msg.WorkerExited(self.live[w], w, "exit code -9"))  # noticed twice

    def act(self, a: tuple[Any, ...]) -> None:
        kind = a[0]
        if kind == "want":
            w = self.new_id()
            self.waiters[w] = a[1]
            self.send(msg.Want(a[1], w, a[2]))
        elif kind == "cancel" and self.waiters:
            w = sorted(self.waiters)[a[1] % len(self.waiters)]
            self.send(msg.Cancel(self.waiters.pop(w), w))
        elif kind == "release" and self.leases:
            lease = sorted(self.leases)[a[1] % len(self.leases)]
            self.send(msg.Release(self.leases.pop(lease), lease))
        elif kind == "complete":
            self.complete(a[1], a[2])
        elif kind == "crash":
            self.crash(a[1])
        elif kind == "report" and self.live:
            w = sorted(self.live)[a[1] % len(self.live)]
            self.send(msg.Report(self.live[w], w, a[2]))
        elif kind == "constrained" and self.leases:
            lease = sorted(self.leases)[a[1] % len(self.leases)]
            self.send(msg.Constrained(self.leases[lease], lease, a[2]))
        elif kind == "tick":
            self.tick(a[1])
        elif kind == "unload":
            self.ask(lambda r: msg.Unload(a[1], r, "operator", a[2]))
        elif kind == "delete" and a[1] in self.state.models:
            self.ask(lambda r: msg.Unload(a[1], r, "deleted", 0.0, forget=True))
        elif kind == "pin":
            self.ask(lambda r: msg.Pin(a[1], a[2], r))
        elif kind == "keep_alive":
            self.send(msg.KeepAlive(a[1], a[2]))
        elif kind == "pause":
            self.ask(lambda r: msg.OperatorPause(a[1], "operator", r))
        elif kind == "resume":
            self.ask(lambda r: msg.OperatorResume("operator", r))
        elif kind == "suspend":
            self.send(msg.Suspend(a[1], a[2]))
        elif kind == "stop_loads":
            self.send(msg.StopLoads())
        elif kind == "node_lost":
            self.send(msg.NodeLost(a[1], "its raylet died"))
        elif kind == "node_joined":
            self.send(msg.NodeJoined(a[1], BUDGETS[a[1]] * MIB, _ENGINES[a[1]], spares=True))

    def tick(self, seconds: float) -> None:
        """Time passes; a tick comes at each time the step asked for on the way."""
        end = self.now + seconds
        ticked_at = None
        while True:
            when = wake_at(self.state, self.now)
            if when is None or when > end:
                break
            assert ticked_at is None or when > ticked_at, \
                f"a tick at {ticked_at} left {when} due: the run loop would spin"
            self.now = ticked_at = max(self.now, when)
            self.send(msg.Tick())
        self.now = end
        self.send(msg.Tick())

    def finish(self, traffic_rounds: int = 8) -> None:
        """No more random events. For ``traffic_rounds`` seconds every model that is in use
        gets a new request before its running ones end (overlapping streams, as a busy
        client sends), then requests end as soon as they are served; effects complete, time
        passes. Every waiter must be answered, none refused for memory."""
        first = self.ids
        if self.state.paused:
            self.ask(lambda r: msg.OperatorResume("operator", r))
        for round_ in range(traffic_rounds + 400):
            running = dict(self.leases)
            if round_ < traffic_rounds:
                for model_id in sorted(set(running.values())):
                    self.act(("want", model_id, True))
            while self.pending:
                self.complete(0, True)
            for lease, model_id in sorted(running.items()):
                if self.leases.pop(lease, None) is not None:
                    self.send(msg.Release(model_id, lease))
            if round_ >= traffic_rounds and not self.waiters and not self.pending \
                    and not self.leases:
                break
            self.tick(1.0)
        assert not self.waiters, f"waiters never answered: {self.waiters}"
        for w, answer in self.answers.items():
            refused = isinstance(answer, InsufficientMemory) and not isinstance(answer, Paused)
            assert not (w > first and refused), f"starved: refused for memory: {answer}"


@hypothesis.settings(max_examples=max(2000, hypothesis.settings.default.max_examples),
                     deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(st.lists(action, max_size=40))
def test_random_event_sequences_keep_every_invariant(actions: list[tuple[Any, ...]]) -> None:
    world = World()
    for a in actions:
        world.act(a)
    world.finish()


def test_two_models_that_cannot_be_resident_together_are_served_in_turn() -> None:
    """A hand-written case of the property: b and c cannot share n2 and a holds n1; both
    keep getting requests (finish: overlapping ones for 8 s, longer than the admission
    wait); each is served, in turn, and neither is refused."""
    world = World()
    world.state = dataclasses.replace(world.state, nodes={
        "n2": Node("n2", 1000 * MIB, spares=False)})
    for round_ in range(5):
        for model_id in ("b", "c"):
            world.act(("want", model_id, True))
        for _ in range(6):
            world.act(("complete", 0, True))
        assert world.leases or round_ == 0 or world.waiters
    world.finish()
    served = [v.model for v in world.answers.values() if isinstance(v, msg.Granted)]
    assert served.count("b") >= 5 and served.count("c") >= 5
    assert len(served) == len(world.answers)  # none refused


def test_the_spare_is_counted_until_it_is_gone() -> None:
    world = World()
    world.act(("want", "a", True))
    world.act(("complete", 0, True))  # a's worker is ready on n1
    world.act(("release", 0))  # idle: a spare is filled on each node
    fills = [e for kind, e in world.pending if kind == "fillspare"]
    assert {e.node for e in fills} == {"n1", "n2"}
    assert world.state.used_bytes("n1") == SIZES["a"] * MIB + defaults.SPARE_BYTES
    assert all(n.spare is not None and n.spare.status.value == "filling"
               for n in world.state.nodes.values())
