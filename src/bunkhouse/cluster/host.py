"""What runs on a cluster node for one worker: a Ray actor (the agent makes it, pinned to
the node) that starts the worker exactly as the front starts a local one
(supervisor/process.py: the model file opened and checked, the ready deadline, the output
kept, SIGTERM then SIGKILL, the parent-death signal) and puts the relay (cluster/relay.py)
in front of its Unix socket.

The worker is the actor process's child and the actor the raylet's: when the raylet goes
(its node lost), the actor's parent-death signal ends it, and the worker's ends the worker.
Once it serves (or holds the node's spare), the host also ends itself, and with it its
worker, when the agent has not called it for :data:`HEARTBEAT_S` (its memory readings
come every second): an agent gone while the cluster's GCS was down (a front stopped then,
or killed) leaves no worker behind, which Ray cannot end without its GCS.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bunkhouse.catalog import CatalogModel
from bunkhouse.cluster.relay import Relay
from bunkhouse.supervisor.launcher import LocalLauncher, owned_socket_dir
from bunkhouse.supervisor.process import LaunchOptions, WorkerLaunch, WorkerProcess
from bunkhouse.worker.lifeline import hold

HEARTBEAT_S = float(os.environ.get("BUNKHOUSE_RAY_HEARTBEAT_S") or 30.0)
"""Seconds without a call from the agent after which a serving host ends itself (the
node's environment may set another: the tests' cluster does)."""


class WorkerHost:
    """One worker on this node (first, maybe, the node's spare worker, which the worker
    then becomes). Each method is an actor call from the agent."""

    def __init__(self) -> None:
        # The actor process is the raylet's child: it dies with the raylet (a lost node's
        # actors would otherwise run on, orphaned, for as long as Ray takes to notice), and
        # its worker with it.
        hold(os.getppid(), lambda: os._exit(1))
        # mode 0700, named by this process: the next host on the node removes it if this
        # one was killed (its node's raylet gone) before it could
        self._dir = owned_socket_dir(Path(tempfile.gettempdir()), "bunkhouse-node-")
        self._worker: WorkerProcess | None = None
        self._relay: Relay | None = None
        self._spares: LocalLauncher | None = None  # the node's spare, while this host has it
        self._armed = False
        self._heard = time.monotonic()  # the agent's last call
        self._exited = asyncio.Event()

    async def fill_spare(self, options: LaunchOptions, engine: str) -> int | None:
        """Start the node's spare worker for ``engine`` (module:Class), as the front does
        locally (supervisor/launcher.py); its pid (None: none was made)."""
        if self._spares is None:
            self._spares = LocalLauncher(options, tmp_dir=self._dir)
        pid = await self._spares.fill_spare(engine)
        self._arm()
        return pid

    async def start(self, model: CatalogModel, options: LaunchOptions, secret: str,
                    host: str, snapshot_dir: str | None) -> dict[str, Any]:
        """Start the worker and its relay on ``host`` (this node's address); returns
        ``{"port", "pid", "adapter_versions", "snapshots"}``; raises WorkerLoadFailed as
        locally. ``snapshot_dir``: the model's directory in this node's KV snapshot store,
        which the front made just before: where this node does not see it (the front's
        filesystem is not this node's), the worker saves none (``"snapshots": false``)."""
        self._heard = float("inf")  # no heartbeat while it starts (the agent is awaiting it)
        snapshots = Path(snapshot_dir) if snapshot_dir else None
        if snapshots is not None and not snapshots.is_dir():
            snapshots = None
        launch = WorkerLaunch(self._dir / "w.sock", options, snapshots)
        # this host's spare becomes the worker if it can (else a process is spawned)
        worker = WorkerProcess(model, launch, self._spares.spawner(True)) \
            if self._spares is not None else WorkerProcess(model, launch)
        worker.on_exit = self._exited.set
        self._worker = worker
        await worker.start()
        self._relay = Relay(str(self._dir / "w.sock"), secret)
        port = await self._relay.start(host)
        self._arm()
        return {"port": port, "pid": worker.pid,
                "adapter_versions": dict(worker.adapter_versions),
                "snapshots": snapshots is not None}

    async def exited(self) -> dict[str, Any]:
        """Returns once the worker died by itself: why, and its last output."""
        await self._exited.wait()
        worker = self._worker
        assert worker is not None
        return {"cause": worker.exit_cause, "detail": worker.exit_detail}

    def _arm(self) -> None:
        """From now on, end this host when the agent stops calling (started once)."""
        self._heard = time.monotonic()
        if not self._armed:
            self._armed = True
            threading.Thread(target=self._watch_agent, name="agent-heartbeat",
                             daemon=True).start()

    def _watch_agent(self) -> None:
        while time.monotonic() - self._heard < HEARTBEAT_S:
            time.sleep(1.0)
        # its worker and spare first: their parent-death signal would end them with this
        # process, but a signal sent here does not depend on which thread forked them
        if self._worker is not None:
            self._worker.kill()  # SIGKILL to its process group
        if self._spares is not None:
            self._spares.drop_spare()
        os._exit(1)

    def memory(self) -> tuple[int, int] | None:
        """The worker's resident bytes now and at its peak (None: not running); each call
        is the agent's heartbeat."""
        self._heard = time.monotonic()
        memory = self._worker.memory() if self._worker is not None else None
        return (memory.resident, memory.peak) if memory is not None else None

    def signal(self, suspend: bool) -> None:
        """The compute gate's time slice: SIGSTOP (``suspend``) or SIGCONT."""
        if self._worker is not None:
            self._worker.suspend() if suspend else self._worker.resume()

    async def stop(self) -> None:
        """Stop the relay (its streams end), then the worker (SIGTERM, the grace, SIGKILL);
        returns once it is reaped."""
        if self._relay is not None:
            with contextlib.suppress(Exception):
                await self._relay.close()
        if self._worker is not None:
            await self._worker.stop()
        if self._spares is not None:
            self._spares.close()
        shutil.rmtree(self._dir, ignore_errors=True)
