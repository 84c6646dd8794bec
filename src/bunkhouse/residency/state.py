"""Residency state as plain, immutable data.

Nothing here changes: residency/step.py makes a new :class:`State` from the old one and an
event (frozen dataclasses, mappings replaced whole, never written in place), and everything
else reads the state the run loop last published (residency/loop.py).

Per model (:class:`Model`): its phase (``absent → loading → ready → draining → absent``,
plus ``failed``), leases and waiters by id, pin, keep-alive, last use, bytes (estimate and
measured peak), pending settings. Per node (:class:`Node`): its budget and its spare worker.
Host-wide: pause, stopping and closing. Supervision's bookkeeping is its own
(:class:`~bunkhouse.supervisor.supervision.Health`, one per model).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from bunkhouse import defaults
from bunkhouse.catalog import CatalogModel
from bunkhouse.supervisor.restart import RestartPolicy
from bunkhouse.supervisor.supervision import Health

LOCAL = "local"
"""The id of the one node of a host without a cluster."""


class Phase(enum.Enum):
    ABSENT = "absent"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


TRANSITIONS: Mapping[Phase, frozenset[Phase]] = {
    Phase.ABSENT: frozenset({Phase.LOADING, Phase.FAILED}),  # failed: a crash loop gave up
    Phase.LOADING: frozenset({Phase.READY, Phase.FAILED, Phase.ABSENT}),  # absent: cancelled
    Phase.READY: frozenset({Phase.DRAINING}),
    Phase.DRAINING: frozenset({Phase.ABSENT, Phase.FAILED}),  # failed: it crashed, gave up
    Phase.FAILED: frozenset({Phase.LOADING}),
}

HOLDING = frozenset({Phase.LOADING, Phase.READY, Phase.DRAINING})
"""The phases in which a model's worker holds (or is about to hold) memory."""


@dataclass(frozen=True, slots=True)
class ResidencyOptions:
    """How residency decides. Seconds, bytes; defaults from bunkhouse.defaults."""

    budget_bytes: int  # the local node's
    local_node: bool = True  # false: workers run only on the nodes that join (a cluster's)
    ttl_s: float = 0.0  # global idle unload; 0: never
    admission_wait_s: float = defaults.ADMISSION_WAIT_S
    drain_grace_s: float = defaults.DRAIN_GRACE_S
    retry_after_s: int = defaults.RETRY_AFTER_S
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    probe_interval_s: float = defaults.PROBE_INTERVAL_S  # 0: no liveness probes
    probe_timeout_s: float = defaults.PROBE_INTERVAL_S
    probe_failures: int = defaults.PROBE_FAILURES  # in a row, before it is replaced
    generation_failures: int = defaults.GENERATION_FAILURES  # 5xx/broken in a row
    measure_interval_s: float = 1.0  # how often ready workers' memory is read


@dataclass(frozen=True, slots=True)
class Spec:
    """A model's settings and what residency derives from them once, outside the step."""

    model: CatalogModel
    estimate: int  # bytes its worker may take at worst (its engine's estimator)
    engine: str  # the worker engine that runs it: which spare worker it can become
    single_file: bool  # a spare can become its worker only if it is one file


@dataclass(frozen=True, slots=True)
class Waiter:
    """A request waiting for a lease (``lease``), or a load someone waits for without one
    (an operator's, a preload's)."""

    id: int
    since: float
    lease: bool = True
    adapter: str | None = None  # the LoRA adapter its request runs with


class Stage(enum.Enum):
    LEASES = "leases"  # its requests run to their end; it takes no new ones
    FLUSH = "flush"  # its KV state is being saved
    STOP = "stop"  # its worker is being stopped


@dataclass(frozen=True, slots=True)
class Drain:
    reason: str
    stage: Stage = Stage.LEASES


@dataclass(frozen=True, slots=True)
class Worker:
    """A worker process residency started, by the id it gave it."""

    id: int
    node: str
    spawned_at: float
    pid: int | None = None
    placement: str = ""  # for messages: "pid N" (on node X)
    ready_at: float | None = None
    alive: bool = True  # false once its death is known
    stalled_by: frozenset[int] = frozenset()  # killed for a stall those leases' requests made


@dataclass(frozen=True, slots=True)
class UnloadWait:
    """An operator's unload or delete, answered once the model is absent (True), or with
    False at ``deadline`` if requests still run then (it is freed when they end)."""

    reply: int
    reason: str
    before: frozenset[int]  # the waiters there when it was asked: they are served first
    deadline: float | None


@dataclass(frozen=True, slots=True)
class Model:
    spec: Spec
    pinned: bool
    phase: Phase = Phase.ABSENT
    worker: Worker | None = None
    measured: int | None = None  # its worker's peak resident memory so far
    leases: frozenset[int] = frozenset()
    adapter_leases: frozenset[tuple[int, str]] = frozenset()  # (lease, adapter id) held
    constrained: frozenset[int] = frozenset()  # leases whose request's constraint is running
    blamed: frozenset[int] = frozenset()  # leases whose request stalled its worker
    waiters: tuple[Waiter, ...] = ()
    last_used: float = 0.0
    keep_alive_s: float | None = None  # a client's keep_alive, until it is unloaded
    pending: Spec | None = None  # settings a reload changed: its next load's
    retired: bool = False  # being removed: admits nothing, forgotten once absent
    drain: Drain | None = None
    respawn: bool = False  # load it again though nobody waits (its worker crashed)
    not_before: float = 0.0  # crash-loop backoff: no spawn before this
    wait_since: float | None = None  # waiting to load since: its place in line, its deadline
    unloads: tuple[UnloadWait, ...] = ()  # it drains as soon as its waiters are served
    last_error: str | None = None  # for any caller: no paths, no worker output
    last_error_detail: str | None = None  # the worker's output: log and admins only
    last_load_s: float | None = None
    last_node: str | None = None  # where its last worker served: its KV snapshots are there
    generation: int = 0  # of its settings: its slot gate is remade when this changes

    @property
    def id(self) -> str:
        return self.spec.model.id

    @property
    def bytes(self) -> int:
        """What it may hold: its estimate, or its measured peak if that went beyond."""
        return max(self.spec.estimate, self.measured or 0)

    @property
    def busy(self) -> bool:
        return bool(self.leases) or bool(self.waiters)

    @property
    def node(self) -> str | None:
        return self.worker.node if self.worker is not None else None


class SpareStatus(enum.Enum):
    FILLING = "filling"
    READY = "ready"
    DROPPING = "dropping"


@dataclass(frozen=True, slots=True)
class Spare:
    """A worker process with an engine imported and no model, for the next load."""

    engine: str
    status: SpareStatus = SpareStatus.FILLING
    pid: int | None = None


@dataclass(frozen=True, slots=True)
class Node:
    """Where workers run: its memory budget, its spare worker, the engines it runs. Today
    one local node; with a cluster, each of its machines. (Its compute gate is the front's
    ``ComputeGate``, one per node: front/admission.py.)"""

    id: str
    budget: int
    engines: frozenset[str] | None = None  # the worker engines it runs; None: every one
    spares: bool = False  # it keeps a spare worker
    spare: Spare | None = None
    spare_engine: str | None = None  # the engine last loaded: the next spare's
    spare_failed: bool = False  # the last fill made none: not again before the next load


@dataclass(frozen=True, slots=True)
class Pause:
    holds: int = 0  # pause_all callers
    until: float | None = None  # an operator's pause ends by itself then
    max_s: float = 0.0
    since: float = 0.0


@dataclass(frozen=True, slots=True)
class Quiet:
    """Someone waiting for no lease to be in flight (a pause's holder)."""

    reply: int
    operator: bool  # answered False if the operator's pause ends first


@dataclass(frozen=True, slots=True)
class State:
    options: ResidencyOptions
    nodes: Mapping[str, Node]
    models: Mapping[str, Model] = field(default_factory=dict)
    health: Mapping[str, Health] = field(default_factory=dict)
    head: str | None = None  # the first model in line that waits for room
    held: frozenset[str] = frozenset()  # ready models taking no new leases: its room
    freed: frozenset[str] = frozenset()  # models drained for it: not loaded again before it
    pause: Pause | None = None
    stopping: bool = False  # no more loads: the front is stopping
    closing: bool = False
    flush: bool = False  # a drained worker's KV state is saved before it stops
    closers: tuple[int, ...] = ()
    quiet: tuple[Quiet, ...] = ()
    next_id: int = 1  # worker and lease ids
    peak_bytes: int = 0
    measured_at: float = 0.0

    @property
    def paused(self) -> bool:
        return self.pause is not None

    def used_bytes(self, node: str | None = None) -> int:
        """What models (and spares) hold of the budget, on ``node`` or on every node."""
        models = sum(m.bytes for m in self.models.values()
                     if m.phase in HOLDING and (node is None or m.node == node))
        spares = sum(defaults.SPARE_BYTES for n in self.nodes.values()
                     if n.spare is not None and (node is None or n.id == node))
        return models + spares

    def in_flight(self) -> int:
        """Leases held now, every model together."""
        return sum(len(m.leases) for m in self.models.values())


def initial(options: ResidencyOptions, specs: list[Spec], *, spares: bool = False,
            flush: bool = False) -> State:
    """The state of a host that has loaded nothing yet: one local node (none with a cluster:
    its nodes join as events)."""
    nodes = {LOCAL: Node(LOCAL, options.budget_bytes, spares=spares)} \
        if options.local_node else {}
    return State(options, nodes,
                 {s.model.id: Model(s, pinned=s.model.pinned) for s in specs},
                 {s.model.id: Health() for s in specs}, flush=flush)
