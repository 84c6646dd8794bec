"""Helpers the benchmarks share: free ports, child processes with logs, readiness waits."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_http(client: httpx.Client, url: str, proc: subprocess.Popen[bytes],
               timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            if client.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready in {timeout_s} s")


LOG_DIR = Path(__file__).parent / "results"


@contextmanager
def process(argv: list[str], name: str) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` with its output in benchmarks/results/NAME.log; stop it on exit."""
    LOG_DIR.mkdir(exist_ok=True)
    with (LOG_DIR / f"{name}.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bunkhouse_argv() -> list[str]:
    exe = shutil.which("bunkhouse")
    return [exe] if exe else [sys.executable, "-m", "bunkhouse"]
