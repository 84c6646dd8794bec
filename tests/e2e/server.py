"""`bunkhouse serve` in a subprocess on a free port, stopped as a user would stop it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.helpers import free_port, wait_for


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def model(self, model_id: str) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(f"{self.url}/v1/models/{model_id}").json()
        return data

    def stats(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(f"{self.url}/stats").json()
        return data

    def workers(self) -> list[psutil.Process]:
        """Every child process: the models' workers and a spare worker, if any."""
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def model_workers(self, key: str = "") -> list[psutil.Process]:
        """The workers serving (or loading) a model: every child but the spare and the
        constraint probe (``key``: a client key, where the server asks for one)."""
        headers = {"authorization": f"Bearer {key}"} if key else {}
        stats = httpx.get(f"{self.url}/stats", headers=headers).json()
        spare = stats.get("spare_worker") or {}
        return [p for p in self.workers() if p.pid != spare.get("pid") and not _probe(p)]


def _probe(proc: psutil.Process) -> bool:
    try:
        return "bunkhouse.worker.engines.llamacpp_probe" in proc.cmdline()
    except psutil.Error:
        return False


def _up(url: str, proc: subprocess.Popen[bytes]) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"bunkhouse serve exited with code {proc.returncode}")
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def running(workdir: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """Start `bunkhouse serve ARGS` and wait for /health; kill it on exit if still alive."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "serve.log"
    if "--kv-cache-dir" not in args:  # never the user's own snapshots
        args = (*args, "--kv-cache-dir", str(workdir / "kv"))
    if "--responses-db" not in args:  # never the user's own stored responses
        args = (*args, "--responses-db", str(workdir / "responses.db"))
    exe = shutil.which("bunkhouse")
    argv = [exe] if exe else [sys.executable, "-m", "bunkhouse"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen([*argv, "serve", "--port", str(port), *args],
                                stdout=log, stderr=log,
                                env={**os.environ, **env} if env else None)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _up(url, proc), 60, "bunkhouse serve to answer /health")
        yield Server(url, proc, log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextmanager
def serve(workdir: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """Start `bunkhouse serve ARGS`; on exit SIGTERM it and check it left no worker behind."""
    with running(workdir, *args, env=env) as server:
        yield server
        workers = server.workers()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
        _, alive = psutil.wait_procs(workers, timeout=5)
        assert not alive, f"workers left running: {alive}"
