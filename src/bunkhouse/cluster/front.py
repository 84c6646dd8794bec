"""The front's side of a Ray cluster: the agent process (cluster/agent.py) kept running,
its node lists turned into residency's ``node_joined``/``node_lost``, and workers started on
the node residency chose, each behind a :class:`RemoteWorker` handle.

The agent is a child of the front, restarted with a backoff whenever it exits (Ray ends a
driver that cannot reach its GCS for 60 s; the front must outlive that). While it is down
every node counts as lost: requests for models on them fail cleanly and wait for a node.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import pickle
import secrets
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bunkhouse.catalog import CatalogModel
from bunkhouse.engines import engine_for
from bunkhouse.engines.contract import EngineClient
from bunkhouse.engines.transport import WorkerTransport
from bunkhouse.errors import ConfigError, WorkerLoadFailed
from bunkhouse.supervisor.handle import Placement, WorkerMemory
from bunkhouse.supervisor.process import LaunchOptions, spawn_local, worker_engine

if TYPE_CHECKING:
    from bunkhouse.kvcache.nodes import NodeStores
    from bunkhouse.residency.manager import ResidencyManager

log = logging.getLogger("bunkhouse.cluster")

AGENT_READY_S = 120.0
"""Seconds the agent may take to connect to the cluster (Ray's own connect timeouts are
within this)."""
RESTART_DELAYS_S = (1.0, 2.0, 5.0, 10.0, 30.0)
"""The agent's restart backoff, seconds: the last one repeats."""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """An alive Ray node: its id (hex, as ``ray.nodes()`` gives ``NodeID``), its address,
    its budget in bytes, and whether the operator named that budget (the resource)."""

    id: str
    address: str
    budget: int
    named: bool


def check_cluster(address: str, timeout_s: float = 60.0) -> list[NodeInfo]:
    """The cluster's alive nodes, from a short run of the agent (before the front serves);
    ConfigError saying why if Ray is not installed or the cluster cannot be reached."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        raise ConfigError("--ray needs Ray: pip install 'bunkhouse[ray]' (or "
                          "pip install -e '.[ray]' in a checkout)") from e
    try:
        done = subprocess.run([sys.executable, "-m", "bunkhouse.cluster.agent", "--address",
                               address, "--check"], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise ConfigError(f"--ray {address}: the Ray cluster did not answer within "
                          f"{timeout_s:.0f} s; is `ray start --head` running there?") from e
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"--ray {address}: cannot reach the Ray cluster ({why}); start one "
                          "with `ray start --head`, or pass its address (docs/scaling.md)")
    return [NodeInfo(**n) for n in json.loads(done.stdout)]


class RemoteWorker:
    """A worker on a cluster node, as residency holds any worker (supervisor/handle.py):
    reached through its relay over TCP with its own secret; its memory as the node last
    reported it; its exit as the agent saw it."""

    def __init__(self, cluster: Cluster, worker_id: str, model: CatalogModel, node: str,
                 url: str, secret: str, pid: int | None,
                 adapter_versions: Mapping[str, str]) -> None:
        self._cluster = cluster
        self.id = worker_id
        self.node = node
        self._pid = pid
        self.adapter_versions = dict(adapter_versions)
        self.on_exit: Callable[[], None] | None = None
        self.exit_cause: str | None = None
        self.exit_detail: str | None = None
        self.exit_lost = False  # it went with its node or its host process, not by itself
        self._alive = True
        self._stopping: asyncio.Future[None] | None = None
        self._closing: asyncio.Future[None] | None = None
        self._memory: WorkerMemory | None = None
        self._engine = engine_for(model).client(WorkerTransport(url=url, secret=secret),
                                                model.id)

    @property
    def placement(self) -> Placement:
        return Placement(self.node, self._pid)

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def engine(self) -> EngineClient:
        return self._engine

    def memory(self) -> WorkerMemory | None:
        return self._memory if self._alive else None

    def measured(self, resident: int, peak: int) -> None:
        self._memory = WorkerMemory(resident, max(peak, resident))

    def died(self, cause: str, detail: str | None = None, lost: bool = False) -> None:
        """It is gone (it exited; ``lost``: its node or host process went, the agent ended):
        requests on it fail now (its connections are closed) and residency hears it once."""
        if not self._alive:
            return
        self._alive = False
        self.exit_cause, self.exit_detail, self.exit_lost = cause, detail, lost
        self._closing = asyncio.ensure_future(self._engine.aclose())
        if self._stopping is None and self.on_exit is not None:
            self.on_exit()

    def kill(self) -> None:
        self._cluster.send({"op": "stop", "worker": self.id, "grace_s": 0})
        self.died("killed by the front")

    def suspend(self) -> None:
        self._cluster.send({"op": "signal", "worker": self.id, "suspend": True})

    def resume(self) -> None:
        self._cluster.send({"op": "signal", "worker": self.id, "suspend": False})

    async def stop(self) -> None:
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        await self._engine.aclose()  # its streams end now, as a local worker's
        grace = self._cluster.launch.stop_grace_s
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._cluster.call(
                {"op": "stop", "worker": self.id, "grace_s": grace}), grace + 30)
        self._alive = False
        self._cluster.forget(self.id)


class Cluster:
    """The agent, the nodes it reports and the workers started through it."""

    def __init__(self, address: str, launch: LaunchOptions, spares: bool = False) -> None:
        """``spares``: each node keeps a spare worker (residency says when, for which
        engine; this is its pool: supervisor/handle.py ``SparePool``)."""
        self.address = address
        self.launch = launch
        self.spares = spares
        self.nodes: dict[str, NodeInfo] = {}  # alive, as the agent last said
        self._residency: ResidencyManager | None = None
        self._workers: dict[str, RemoteWorker] = {}
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._writer: asyncio.StreamWriter | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._first_nodes: asyncio.Event | None = None
        self._closed = False
        self._gone: set[str] = set()  # nodes found gone before Ray said so
        self._connected = False  # the running agent reached the cluster
        self.snapshots: NodeStores | None = None  # KV snapshots per node (None: off)

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self, residency: ResidencyManager) -> None:
        """Start the agent and return once it reported the nodes (or its first attempt
        failed: requests then wait for a node while it is tried again)."""
        self._residency = residency
        self.nodes = {}  # residency has none yet: each joins as the agent reports it
        self._first_nodes = asyncio.Event()
        self._task = asyncio.create_task(self._keep_agent(), name="ray-agent")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first_nodes.wait(), AGENT_READY_S)

    async def close(self) -> None:
        """Stop the agent: it stops every worker it started (run after residency closed,
        so that none is left), then Ray ends what its driver owned."""
        self._closed = True
        if self._writer is not None:
            self._writer.close()
        proc = self._proc
        if proc is not None and proc.returncode is None and not self._connected:
            proc.kill()  # still connecting (the cluster is out of reach): it started nothing
        if proc is not None and proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), self.launch.stop_grace_s + 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.snapshots is not None:
            self.snapshots.close()

    async def _keep_agent(self) -> None:
        for attempt in itertools.count():
            if self._closed:
                return
            code = await self._run_agent()
            if self._closed:
                return
            delay = RESTART_DELAYS_S[min(attempt, len(RESTART_DELAYS_S) - 1)]
            log.warning("Ray agent exited with code %s; starting it again in %.0f s",
                        code, delay)
            await asyncio.sleep(delay)

    async def _run_agent(self) -> int | None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = await spawn_local([sys.executable, "-m", "bunkhouse.cluster.agent",
                                      "--address", self.address], stdin=theirs.fileno())
        finally:
            theirs.close()
        self._proc = proc
        output = asyncio.ensure_future(self._log_output(proc))
        reader, self._writer = await asyncio.open_unix_connection(sock=ours)
        try:
            while line := await reader.readline():
                self._on(json.loads(line))
        except (ConnectionError, ValueError) as e:
            log.warning("Ray agent: %s", e)
        finally:
            self._writer.close()
            self._writer = None
            self._connected = False
            if not self._closed:  # before its calls fail: a load cut off is then a cancel
                self._all_lost("the Ray agent exited (it lost the cluster, or was killed)")
            if self._closed:  # the front stops: the agent stops its workers, then exits
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), self.launch.stop_grace_s + 20)
            for reply in self._replies.values():
                if not reply.done():
                    reply.set_exception(ConnectionError("the Ray agent exited"))
            self._replies.clear()
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await proc.wait()
            await output
        return proc.returncode

    async def _log_output(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            text = line.decode(errors="replace").rstrip()
            # Ray's own periodic dumps of its internals: for its developers
            log.log(logging.DEBUG if "[state-dump]" in text else logging.INFO,
                    "ray agent: %s", text)

    # -- messages -------------------------------------------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(json.dumps(message).encode() + b"\n")

    async def call(self, message: dict[str, Any]) -> dict[str, Any]:
        if self._writer is None:
            raise ConnectionError("the Ray agent is not running")
        ident = next(self._ids)
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._replies[ident] = reply
        self.send({**message, "id": ident})
        try:
            return await reply
        finally:
            self._replies.pop(ident, None)

    def _on(self, m: dict[str, Any]) -> None:
        if "id" in m:
            reply = self._replies.get(m["id"])
            if reply is not None and not reply.done():
                reply.set_result(m)
            return
        event = m.get("event")
        if event == "nodes":
            self._nodes_now({n["id"]: NodeInfo(**n) for n in m["nodes"]})
        elif event == "memory":
            worker = self._workers.get(m["worker"])
            if worker is not None:
                worker.measured(m["resident"], m["peak"])
        elif event == "exited":
            worker = self._workers.get(m["worker"])
            if worker is not None:
                worker.died(m.get("cause") or "its worker exited", m.get("detail"),
                            lost=bool(m.get("lost")))
        elif event == "ready":
            self._connected = True
            log.info("connected to the Ray cluster at %s", self.address)

    def _nodes_now(self, nodes: dict[str, NodeInfo]) -> None:
        assert self._residency is not None
        # a node found gone stays gone (Ray may list it alive a while longer; a node that
        # comes back gets a new id)
        nodes = {k: v for k, v in nodes.items() if k not in self._gone}
        for node_id in sorted(set(self.nodes) - set(nodes)):
            self._lost(node_id, "no longer alive in the Ray cluster")
        for node in nodes.values():
            if self.nodes.get(node.id) != node:
                log.info("node %s (%s): budget %d MiB%s", node.id, node.address,
                         node.budget // 2**20, "" if node.named else
                         " (half its memory; set the bunkhouse_memory_mib resource to choose)")
                self._residency.node_joined(node.id, node.budget, spares=self.spares)
        if self.snapshots is not None and set(nodes) != set(self.nodes):
            # the snapshots of nodes gone while the agent was down go too
            asyncio.get_running_loop().run_in_executor(None, self.snapshots.prune, set(nodes))
        self.nodes = nodes
        if self._first_nodes is not None:
            self._first_nodes.set()

    def _lost(self, node_id: str, reason: str, dead: bool = True) -> None:
        """``dead``: Ray says it is gone for good (a node id is never reused: its KV
        snapshots go with it); else only out of reach (the agent is down)."""
        assert self._residency is not None
        self._residency.node_lost(node_id, reason)  # first: then its workers' deaths are known
        self.nodes.pop(node_id, None)
        if dead and self.snapshots is not None:
            asyncio.get_running_loop().run_in_executor(None, self.snapshots.lost, node_id)
        for worker in [w for w in self._workers.values() if w.node == node_id]:
            worker.died(f"its node {node_id} was lost ({reason})", lost=True)

    def _all_lost(self, reason: str) -> None:
        for node_id in sorted(self.nodes):
            self._lost(node_id, reason, dead=False)

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    # -- spare workers: a SparePool --------------------------------------------------------

    def engine_of(self, model: CatalogModel) -> str:
        return worker_engine(model, self.launch)

    async def fill_spare(self, engine: str, node: str) -> int | None:
        """Start ``node``'s spare worker for ``engine`` (in a worker host of its own that
        the node's next load takes over); its pid (None: none was made)."""
        if node not in self.nodes:
            return None
        try:
            reply = await self.call({"op": "fill_spare", "node": node, "engine": engine,
                                     "options": base64.b64encode(
                                         pickle.dumps(self.launch)).decode()})
        except ConnectionError:
            return None
        pid = reply.get("pid")
        return pid if isinstance(pid, int) else None

    def drop_spare(self, node: str) -> None:
        self.send({"op": "drop_spare", "node": node})

    # -- starting workers -----------------------------------------------------------------

    async def start_worker(self, model: CatalogModel, node: str,
                           use_spare: bool = False) -> RemoteWorker:
        """A ready worker for ``model`` on ``node``; WorkerLoadFailed with the reason (its
        load failed there, the node went, the agent is down)."""
        info = self.nodes.get(node)
        if info is None:
            raise WorkerLoadFailed(f"model {model.id!r}: its node {node} is gone")
        worker_id = uuid.uuid4().hex[:12]
        secret = secrets.token_urlsafe(32)
        snapshot_dir = None if self.snapshots is None else \
            await asyncio.to_thread(self.snapshots.worker_dir, model.id, node)
        message = {"op": "start", "worker": worker_id, "node": node, "address": info.address,
                   "use_spare": use_spare,
                   "secret": secret, "snapshot_dir": str(snapshot_dir) if snapshot_dir else None,
                   "model": base64.b64encode(pickle.dumps(model)).decode(),
                   "options": base64.b64encode(pickle.dumps(self.launch)).decode()}
        log.info("model %s: starting its worker on node %s (%s)", model.id, node,
                 info.address)
        try:
            reply = await asyncio.wait_for(self.call(message),
                                           self.launch.ready_timeout_s + 60)
        except asyncio.CancelledError:
            self.send({"op": "stop", "worker": worker_id, "grace_s": 0})
            raise
        except (ConnectionError, TimeoutError) as e:
            self.send({"op": "stop", "worker": worker_id, "grace_s": 0})
            raise WorkerLoadFailed(f"model {model.id!r} could not be started on node {node}",
                                   detail=f"{type(e).__name__}: {e}") from e
        if not reply.get("ok"):
            error = reply.get("error") or {}
            if error.get("node_gone") and node in self.nodes:  # Ray says so: place again
                self._gone.add(node)
                self._lost(node, "Ray cannot place a worker there any more")
            raise WorkerLoadFailed(error.get("message") or f"model {model.id!r} failed to "
                                   f"load on node {node}", param=error.get("param"),
                                   detail=error.get("detail"))
        if snapshot_dir is not None and self.snapshots is not None:
            self.snapshots.placed(model.id, node, bool(reply.get("snapshots")))
        url = f"http://{info.address}:{reply['port']}"
        worker = RemoteWorker(self, worker_id, model, node, url, secret, reply.get("pid"),
                              reply.get("adapter_versions") or {})
        self._workers[worker_id] = worker
        if node not in self.nodes:  # lost while it started
            worker.died(f"its node {node} was lost")
        return worker
