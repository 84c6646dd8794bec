"""``python -m bunkhouse.cluster.agent --address ADDRESS``: the front's Ray driver, a child
process of the front.

Ray's driver ends its own process when it cannot reach the cluster's GCS for 60 s, so the
driver is not the front: it is this process, which the front restarts (cluster/front.py).
It talks to the front over the Unix socket it was given as its standard input, in JSON
lines: commands from the front (``start``, ``stop``, ``signal``), with ``id`` for a reply;
events to the front (``ready``, ``nodes`` whenever the alive nodes or their budgets change,
``memory`` of each worker every second, ``exited`` when a worker died by itself). A worker
is a :class:`~bunkhouse.cluster.host.WorkerHost` actor pinned to its node; the actors are
this driver's, so they end with it.

It is started with the parent-death signal armed (supervisor/process.py ``spawn_local``):
a front that dies takes it along, and Ray ends the actors its driver owned, and their
workers with them. Exit codes: 0 when the front closed the socket, 2 for bad arguments, 3
when the cluster cannot be reached (the reason is the last line on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import math
import os
import pickle
import socket
import sys
import threading
import time
from typing import Any, NoReturn

log = logging.getLogger("bunkhouse.cluster.agent")

BUDGET_RESOURCE = "bunkhouse_memory_mib"
"""The custom resource an operator sets on a node for its budget, MiB
(``ray start --resources '{"bunkhouse_memory_mib": 8192}'``)."""
MEMORY_SHARE = 0.5
"""A node's budget without that resource: this share of its memory as Ray reports it."""
EXIT_UNREACHABLE = 3
EXIT_LOST = 4
"""The agent's exit once it lost the cluster (its GCS silent, or its own node gone): the
front starts it again."""
GCS_S = 10.0
"""Seconds the cluster's node list may take before the agent counts the cluster lost (Ray
itself ends a driver only after 60 s)."""
NODE_DEATH_S = 30.0
"""Seconds a start whose actor died waits for Ray to say whether its node is dead (its
health checks take about 15 s): a node's death is not the model's failure."""


def _connect_s() -> float:
    """Seconds to reach the cluster: Ray's own ``ray.init`` retries an address where nothing
    answers for minutes. ``BUNKHOUSE_RAY_CONNECT_S`` sets another (a slow network; the
    tests' unreachable address)."""
    raw = os.environ.get("BUNKHOUSE_RAY_CONNECT_S") or "30"
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise SystemExit(f"BUNKHOUSE_RAY_CONNECT_S={raw!r}: give a number of seconds above 0")
    return value


def node_budget(resources: dict[str, float]) -> int:
    """A node's budget, bytes, from its Ray resources."""
    if BUDGET_RESOURCE in resources:
        return int(resources[BUDGET_RESOURCE]) * 2**20
    return int(resources.get("memory", 0) * MEMORY_SHARE)


def alive_nodes(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``ray.nodes()`` as the front needs it: the alive ones, by id."""
    return sorted(({"id": n["NodeID"], "address": n["NodeManagerAddress"],
                    "budget": node_budget(n.get("Resources") or {}),
                    "named": BUDGET_RESOURCE in (n.get("Resources") or {})}
                   for n in nodes if n.get("Alive")), key=lambda n: n["id"])


class Agent:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._actors: dict[str, Any] = {}  # worker id -> its WorkerHost actor
        self._starting: dict[str, asyncio.Task[None]] = {}
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._stops: set[asyncio.Future[None]] = set()
        self._nodes_of: dict[str, str] = {}  # worker id -> its node
        self._spares: dict[str, Any] = {}  # node -> the host holding its spare worker

    def send(self, message: dict[str, Any]) -> None:
        self._writer.write(json.dumps(message).encode() + b"\n")

    async def watch_nodes(self) -> None:
        import ray

        last: list[dict[str, Any]] | None = None
        while True:
            nodes = alive_nodes(await asyncio.to_thread(ray.nodes))
            if nodes != last:
                self.send({"event": "nodes", "nodes": nodes})
                last = nodes
            for worker, actor in list(self._actors.items()):
                if worker in self._starting:
                    continue
                with contextlib.suppress(Exception):
                    memory = await asyncio.wait_for(actor.memory.remote(), 5)
                    if memory is not None:
                        self.send({"event": "memory", "worker": worker,
                                   "resident": memory[0], "peak": memory[1]})
            for actor in list(self._spares.values()):  # a heartbeat (host.py HEARTBEAT_S)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(actor.memory.remote(), 5)
            await asyncio.sleep(1.0)

    def command(self, c: dict[str, Any]) -> None:
        op = c.get("op")
        if op == "start":
            task = asyncio.ensure_future(self._start(c))
            self._starting[c["worker"]] = task
        elif op == "stop":
            stop = asyncio.ensure_future(self._stop(c))
            self._stops.add(stop)
            stop.add_done_callback(self._stops.discard)
        elif op == "signal":
            actor = self._actors.get(c["worker"])
            if actor is not None:
                actor.signal.remote(bool(c["suspend"]))
        elif op == "fill_spare":
            fill = asyncio.ensure_future(self._fill(c))
            self._stops.add(fill)
            fill.add_done_callback(self._stops.discard)
        elif op == "drop_spare":
            self._drop(c["node"])

    @staticmethod
    def _host(node: str) -> Any:
        """A new WorkerHost actor pinned to ``node`` (no CPU reserved: the worker's threads
        are the model's own setting)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from bunkhouse.cluster.host import WorkerHost

        return ray.remote(WorkerHost).options(
            num_cpus=0, max_concurrency=64, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote()

    async def _fill(self, c: dict[str, Any]) -> None:
        """The node's spare worker, in a host of its own that the next load on that node
        may take over (``use_spare``); replies its pid (None: none)."""
        node = c["node"]
        actor = self._spares.get(node)
        if actor is None:
            actor = self._spares[node] = self._host(node)
        pid = None
        try:
            options = pickle.loads(base64.b64decode(c["options"]))
            pid = await actor.fill_spare.remote(options, c["engine"])
        except Exception as e:
            log.info("node %s: no spare worker (%s: %s)", node, type(e).__name__, e)
            self._drop(node)
        if self._spares.get(node) is not actor:  # dropped, or taken by a start, meanwhile
            pid = None
        self.send({"id": c["id"], "ok": pid is not None, "pid": pid})

    def _drop(self, node: str) -> None:
        """Kill the node's spare (its host, and with it the spare process)."""
        import ray

        actor = self._spares.pop(node, None)
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(actor)

    async def _start(self, c: dict[str, Any]) -> None:
        import ray

        worker = c["worker"]
        actor: Any = None
        try:
            # the node's spare's host, when residency counted the spare for this load
            actor = (self._spares.pop(c["node"], None) if c.get("use_spare") else None) \
                or self._host(c["node"])
            self._actors[worker] = actor
            self._nodes_of[worker] = c["node"]
            model = pickle.loads(base64.b64decode(c["model"]))
            options = pickle.loads(base64.b64decode(c["options"]))
            started = await actor.start.remote(model, options, c["secret"], c["address"],
                                               c.get("snapshot_dir"))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # its load failed, or its node went
            self._actors.pop(worker, None)
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            error = _error(e)
            # its host process died under it: its node's doing, if Ray soon says so
            patience = NODE_DEATH_S if error["kind"] in ("ActorDiedError",
                                                         "ActorUnavailableError") else 0.0
            if error["kind"] == "ActorUnschedulableError" \
                    or await self._node_gone(c["node"], patience):
                error["node_gone"] = True  # not the model's failure: another node may do
            self.send({"id": c["id"], "ok": False, "error": error})
            return
        finally:
            self._starting.pop(worker, None)
        self.send({"id": c["id"], "ok": True, **started})
        self._watches[worker] = asyncio.ensure_future(self._watch(worker, actor))

    async def _watch(self, worker: str, actor: Any) -> None:
        try:
            exited = await actor.exited.remote()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the actor died: stopped, killed, or its node lost
            exited = {"cause": "its host process on its node is gone", "lost": True,
                      "detail": f"{type(e).__name__}: {str(e)[:500]}"}
            if await self._node_gone(self._nodes_of.get(worker, "")):
                return  # the node's loss says it all (the front fails what ran there)
        if worker in self._actors:
            self.send({"event": "exited", "worker": worker, **exited})

    async def _node_gone(self, node: str, patience_s: float = 0.0) -> bool:
        """Whether Ray counts ``node`` dead (its list is then sent at once), asking again
        every second for up to ``patience_s``. Its health checks take about 15 s to notice
        a raylet gone; a worker's death is not held back for that (the front places the
        model again, and a start on a node that is gone fails as such)."""
        import ray

        deadline = time.monotonic() + patience_s
        while True:
            nodes = alive_nodes(await asyncio.to_thread(ray.nodes))
            if all(n["id"] != node for n in nodes):
                self.send({"event": "nodes", "nodes": nodes})
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(1.0)

    async def _stop(self, c: dict[str, Any]) -> None:
        import ray

        worker = c["worker"]
        starting = self._starting.pop(worker, None)
        if starting is not None:
            starting.cancel()
        watch = self._watches.pop(worker, None)
        if watch is not None:
            watch.cancel()
        actor = self._actors.pop(worker, None)
        self._nodes_of.pop(worker, None)
        try:
            if actor is not None and starting is None:
                await asyncio.wait_for(actor.stop.remote(), c.get("grace_s", 10) + 10)
        except Exception as e:
            log.info("worker %s: its stop found it gone (%s)", worker, type(e).__name__)
        finally:
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            if "id" in c:
                self.send({"id": c["id"], "ok": True})


    async def stop_all(self) -> None:
        """Stop every worker (the front closed the socket: it is stopping)."""
        for node in list(self._spares):
            self._drop(node)
        await asyncio.gather(*(self._stop({"worker": w, "grace_s": 5})
                               for w in list(self._actors)), return_exceptions=True)


def watchdog() -> None:
    """Every second, on a thread of its own (Ray's calls can block the event loop's thread
    once the cluster is gone): end the agent if the cluster's node list does not come
    within :data:`GCS_S`, or lists the node this driver is attached to as gone (every call
    through it would hang)."""
    import ray

    own = ray.get_runtime_context().get_node_id()
    while True:
        got: list[list[dict[str, Any]]] = []
        asking = threading.Thread(target=lambda into=got: into.append(
            alive_nodes(ray.nodes())), daemon=True)  # type: ignore[no-untyped-call]
        asking.start()
        asking.join(GCS_S)
        if not got:  # silent, or it raised: its GCS is gone (Ray would end this driver)
            _lost(f"the cluster's node list did not come within {GCS_S:.0f} s")
        if all(n["id"] != own for n in got[0]):
            _lost(f"the node this agent is attached to ({own}) is gone")
        time.sleep(1.0)


def _lost(why: str) -> NoReturn:
    """End the agent: the front counts every node out of reach and starts it again."""
    print(f"lost the Ray cluster: {why}", file=sys.stderr, flush=True)
    os._exit(EXIT_LOST)  # Ray's threads would hold a normal exit


def _error(e: BaseException) -> dict[str, Any]:
    """A failed start for the front: the worker's own error if it came through Ray."""
    cause = getattr(e, "cause", None) or e
    message = getattr(cause, "message", None)
    if message is None:
        message = "the worker could not be started on its node"
    return {"message": message, "param": getattr(cause, "param", None),
            "detail": getattr(cause, "detail", None) or f"{type(cause).__name__}: {cause}",
            "kind": type(cause).__name__}


async def connect(address: str) -> bool:
    """``ray.init`` within :func:`_connect_s`; False (said on stderr) if it failed."""
    import ray

    connect_s = _connect_s()
    try:
        await asyncio.wait_for(asyncio.to_thread(
            ray.init, address=address, namespace="bunkhouse", log_to_driver=False,
            logging_level=logging.WARNING), connect_s)
    except TimeoutError:
        print(f"cannot reach the Ray cluster at {address}: no answer within "
              f"{connect_s:.0f} s", file=sys.stderr, flush=True)
        os._exit(EXIT_UNREACHABLE)  # ray.init's thread would hold the exit
    except Exception as e:
        print(f"cannot reach the Ray cluster at {address}: {e}", file=sys.stderr)
        return False
    return True


async def run(address: str) -> int:
    import ray

    if not await connect(address):
        return EXIT_UNREACHABLE
    channel = socket.socket(fileno=os.dup(0))
    reader, writer = await asyncio.open_unix_connection(sock=channel)
    agent = Agent(writer)
    agent.send({"event": "ready", "address": address})
    threading.Thread(target=watchdog, name="cluster-watchdog", daemon=True).start()
    nodes = asyncio.ensure_future(agent.watch_nodes())
    try:
        while line := await reader.readline():
            agent.command(json.loads(line))
    finally:
        nodes.cancel()
        await agent.stop_all()
        with contextlib.suppress(Exception):
            ray.shutdown()
    return 0


async def check(address: str) -> int:
    """Connect, print the alive nodes as a JSON list on stdout, disconnect."""
    import ray

    if not await connect(address):
        return EXIT_UNREACHABLE
    try:
        nodes = alive_nodes(await asyncio.to_thread(ray.nodes))
    except Exception as e:
        print(f"cannot reach the Ray cluster at {address}: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    print(json.dumps(nodes))
    with contextlib.suppress(Exception):
        ray.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bunkhouse.cluster.agent",
                                description="The front's Ray driver (started by the front).")
    p.add_argument("--address", required=True, help="the Ray cluster's address")
    p.add_argument("--check", action="store_true",
                   help="print the alive nodes as JSON and exit (the front's start check)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    return asyncio.run(check(a.address) if a.check else run(a.address))


if __name__ == "__main__":
    raise SystemExit(main())
