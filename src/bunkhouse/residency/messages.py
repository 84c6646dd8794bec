"""What goes into residency's step (events) and what comes out of it (effects).

Events come from request tasks (want, cancel, release, report), from operators (commands,
each with a ``reply`` id the caller awaits), from the executor as effects complete (a worker
ready, a load failed, a flush or stop done, a probe answered, a spare filled or gone), from
the worker exit watcher, from the cluster (a node joined or lost), from the compute gate
(suspend, resume) and from the one timer (:class:`Tick`). Effects are carried out by
residency/loop.py's executor; those that take time come back as events. Ids name workers,
leases, waiters and replies: residency never holds a process, a socket or a future.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bunkhouse.catalog import CatalogModel
from bunkhouse.residency.state import Spec

# -- events: requests -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Want:
    """A request wants a lease (``lease``), or someone wants the model loaded without one
    (``lease`` false; ``reset``: an operator's load, which forgets a crash loop)."""

    model: str
    waiter: int
    lease: bool = True
    reset: bool = False
    adapter: str | None = None  # the LoRA adapter of the model the request runs with


@dataclass(frozen=True, slots=True)
class Cancel:
    """A waiting request went away before it was answered."""

    model: str
    waiter: int


@dataclass(frozen=True, slots=True)
class Release:
    model: str
    lease: int


@dataclass(frozen=True, slots=True)
class Constrained:
    """A request with a constraint (a grammar, a schema, tools) was sent to the worker
    (``on``), or its answer ended (not ``on``): a stall meanwhile is its. Its whole answer,
    not only its start: a grammar's cost can come at any token (after a fixed prefix)."""

    model: str
    lease: int
    on: bool


@dataclass(frozen=True, slots=True)
class Report:
    """Whether the worker answered a request (a 5xx or a broken connection: no)."""

    model: str
    worker: int
    ok: bool


# -- events: effects completed, workers, the compute gate, time -------------------------


@dataclass(frozen=True, slots=True)
class WorkerReady:
    model: str
    worker: int
    pid: int | None
    placement: str
    measured: int | None  # its peak resident bytes so far
    alive: bool = True  # false: it died before anyone saw it ready


@dataclass(frozen=True, slots=True)
class LoadFailed:
    """The spawn ended without a ready worker; ``error`` None: it was cancelled."""

    model: str
    worker: int
    error: Exception | None


@dataclass(frozen=True, slots=True)
class WorkerExited:
    """A worker died on its own (noticed by its exit watcher, or by a request that found
    it dead first; whoever comes second changes nothing but a better cause)."""

    model: str
    worker: int
    cause: str | None = None
    detail: str | None = None
    lost: bool = False  # it went with its host (a cluster node's): not the model's failure


@dataclass(frozen=True, slots=True)
class Probed:
    model: str
    worker: int
    ok: bool
    suspensions: int  # the count when it was sent


@dataclass(frozen=True, slots=True)
class Flushed:
    model: str
    worker: int


@dataclass(frozen=True, slots=True)
class WorkerStopped:
    """The worker's process is reaped: its memory is free."""

    model: str
    worker: int


@dataclass(frozen=True, slots=True)
class Measured:
    model: str
    worker: int
    peak: int | None


@dataclass(frozen=True, slots=True)
class SpareFilled:
    node: str
    pid: int | None  # None: none was made


@dataclass(frozen=True, slots=True)
class SpareGone:
    node: str


@dataclass(frozen=True, slots=True)
class NodeJoined:
    """A node that runs workers came up (a cluster's machine joined), or its budget or
    engines changed. Bytes; ``engines``: the worker engines it runs (None: every one)."""

    node: str
    budget: int
    engines: frozenset[str] | None = None
    spares: bool = False  # it keeps a spare worker


@dataclass(frozen=True, slots=True)
class NodeLost:
    """A node is gone, and every worker on it (a cluster's machine left or died): its
    models become absent, their requests fail, their waiters are placed again elsewhere."""

    node: str
    reason: str


@dataclass(frozen=True, slots=True)
class Suspend:
    """The compute gate stopped the model's worker (``on``) or let it go on."""

    model: str
    on: bool


@dataclass(frozen=True, slots=True)
class Tick:
    """The time the step asked to be woken at has come."""


# -- events: commands (an operator, the front's lifespan) -------------------------------


@dataclass(frozen=True, slots=True)
class Unload:
    model: str
    reply: int
    reason: str
    grace_s: float
    forget: bool = False  # delete: refuse its waiters, forget it once absent


@dataclass(frozen=True, slots=True)
class Register:
    spec: Spec
    reply: int


@dataclass(frozen=True, slots=True)
class Mount:
    """A base model's adapters change: ``added``, an adapter's catalog entry, is mounted on
    it, or the adapter ``removed`` (its id) leaves it (a 409 while a request holds it). A
    resident base is re-mounted: its worker replaced once its requests end, its slots' KV
    state saved on the way."""

    base: str
    reply: int
    added: CatalogModel | None = None
    removed: str | None = None


@dataclass(frozen=True, slots=True)
class Reload:
    """A re-read configuration: its models' specs, and the catalog to adopt."""

    specs: tuple[Spec, ...]
    catalog: Any  # bunkhouse.catalog.Catalog: handed to the executor to adopt
    reply: int


@dataclass(frozen=True, slots=True)
class Pin:
    model: str
    pinned: bool
    reply: int


@dataclass(frozen=True, slots=True)
class KeepAlive:
    model: str
    seconds: float | None  # 0: unload once idle; inf: never for idleness; None: the ttl


@dataclass(frozen=True, slots=True)
class PauseHold:
    """Hold (``on``) or let go of a pause; ``reply`` is answered once no lease is in flight
    (for a hold)."""

    on: bool
    reply: int


@dataclass(frozen=True, slots=True)
class OperatorPause:
    max_s: float
    reason: str
    reply: int


@dataclass(frozen=True, slots=True)
class OperatorResume:
    reason: str
    reply: int


@dataclass(frozen=True, slots=True)
class AwaitQuiet:
    """Answer True once the operator's pause holds no lease in flight, False if it ends."""

    reply: int


@dataclass(frozen=True, slots=True)
class StopLoads:
    """The front begins to stop: no model is loaded any more."""


@dataclass(frozen=True, slots=True)
class Open:
    """Accept work again (an app whose lifespan runs more than once)."""


@dataclass(frozen=True, slots=True)
class Close:
    reply: int


@dataclass(frozen=True, slots=True)
class KeepSpare:
    """Keep a spare worker for ``engine`` from the start (the default model's)."""

    engine: str


Event = (Want | Cancel | Release | Constrained | Report | WorkerReady | LoadFailed
         | WorkerExited | Probed | Flushed | WorkerStopped | Measured | SpareFilled
         | SpareGone | NodeJoined | NodeLost | Suspend | Tick
         | Unload | Register | Mount | Reload | Pin | KeepAlive | PauseHold | OperatorPause
         | OperatorResume | AwaitQuiet | StopLoads | Open | Close | KeepSpare)

# -- effects ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Spawn:
    """Start a worker for ``spec`` on ``node`` (from its spare if ``use_spare``); comes back
    as WorkerReady or LoadFailed."""

    model: str
    worker: int
    node: str
    spec: CatalogModel
    use_spare: bool = False
    expected_s: float | None = None  # its last load's time, for progress


@dataclass(frozen=True, slots=True)
class CancelSpawn:
    model: str
    worker: int


@dataclass(frozen=True, slots=True)
class Flush:
    """Save the worker's KV state; comes back as Flushed."""

    model: str
    worker: int
    reason: str


@dataclass(frozen=True, slots=True)
class Stop:
    """SIGTERM, grace, SIGKILL; comes back as WorkerStopped once reaped."""

    model: str
    worker: int


@dataclass(frozen=True, slots=True)
class Kill:
    """SIGKILL a worker that no longer answers; its exit comes back as WorkerExited."""

    model: str
    worker: int


@dataclass(frozen=True, slots=True)
class Probe:
    model: str
    worker: int
    suspensions: int


@dataclass(frozen=True, slots=True)
class Signal:
    """Suspend (SIGSTOP) or resume (SIGCONT) the worker: the compute gate's time slice."""

    model: str
    worker: int
    suspend: bool


@dataclass(frozen=True, slots=True)
class Measure:
    model: str
    worker: int


@dataclass(frozen=True, slots=True)
class Granted:
    """A lease, as a waiter is answered with it."""

    model: str
    lease: int
    worker: int


@dataclass(frozen=True, slots=True)
class Resolve:
    """Answer a waiter or a command: with a value, a lease (:class:`Granted`), or an error
    (raised in the caller)."""

    id: int
    value: Any = None


@dataclass(frozen=True, slots=True)
class FillSpare:
    node: str
    engine: str


@dataclass(frozen=True, slots=True)
class DropSpare:
    node: str


@dataclass(frozen=True, slots=True)
class Publish:
    """A residency event: logged, counted, streamed (residency/events.py). ``reason`` is
    for any reader; ``detail`` (paths, a worker's output) for the log and admins only."""

    model: str
    kind: str
    reason: str
    data: Mapping[str, Any] = field(default_factory=dict)
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class Log:
    level: int
    message: str


@dataclass(frozen=True, slots=True)
class ResetSlots:
    """A new worker: the model's slot table holds nothing."""

    model: str


@dataclass(frozen=True, slots=True)
class CatalogAdd:
    model: CatalogModel


@dataclass(frozen=True, slots=True)
class CatalogRemove:
    model: str


@dataclass(frozen=True, slots=True)
class CatalogAdopt:
    catalog: Any  # bunkhouse.catalog.Catalog
    keep: tuple[str, ...]


Effect = (Spawn | CancelSpawn | Flush | Stop | Kill | Probe | Signal | Measure | Resolve
          | FillSpare | DropSpare | Publish | Log | ResetSlots | CatalogAdd | CatalogRemove
          | CatalogAdopt)
