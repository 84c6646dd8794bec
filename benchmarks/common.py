"""Helpers the benchmarks share: workload sizes, child processes with logs, readiness waits,
memory sampling, and the engine's own server as a peer."""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from bunkhouse.catalog import Catalog, CatalogModel, build_catalog
from bunkhouse.config import Settings
from bunkhouse.engines import ENGINES
from bunkhouse.engines import options as engine_opts
from bunkhouse.engines.llamacpp import model_options

QWEN = "qwen2.5-coder-0.5b-instruct"
GEMMA = "gemma-3-270m"
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)


@dataclass(frozen=True)
class Profile:
    """How much of each workload a run does."""

    name: str
    overhead_rounds: int
    overhead_tokens: int
    throughput_rounds: int
    throughput_tokens: int
    gate_off: bool            # also measure two models without the compute gate (slow)
    swap_runs: int
    swap_requests: int
    chaos_runs: int
    chaos_seconds: float
    flood_runs: int
    flood_requests: int
    flood_concurrency: int
    fuzz_examples: int
    fuzz_seconds: int
    kv_lengths: tuple[int, ...] = ()  # conversation tokens before a follow-up after eviction
    transcribe_rounds: int = 5  # the fixture on each target, alternating
    transcribe_long_s: int = 600  # a long file once on each, for memory; 0: none
    marginal_rounds: int = 6  # front CPU: short and long generations, alternating
    marginal_tokens: tuple[int, int] = (8, 128)
    hol_runs: int = 2  # head-of-line: runs of each configuration
    hol_tokens: int = 1000  # the long stream's tokens
    fuzz_max_tokens: int | None = None  # fuzzed generations' tokens, fixed (None: theirs)
    # schemathesis' phases (None: all). Its coverage phase sends every schema's boundary
    # cases (about 1,100 here) and does not stop at --max-time.
    fuzz_phases: str | None = None
    adapter_rounds: int = 5  # LoRA adapters: completions on each target, alternating
    adapter_tokens: int = 64
    adapter_functions: int = 40  # the re-mounted conversation's size (about 14 tokens each)
    spec_rounds: int = 5  # speculative decoding: answers of each target and task, alternating
    spec_tokens: int = 256
    spec_memory: bool = True  # also load Qwen at 32K context with f16 and q8_0 KV caches
    spec_draft: bool = True  # also the draft-model target (a second model in its worker)
    ray_rounds: int = 6  # a Ray node's worker against a local one: streamed rounds of each
    ray_tokens: int = 64
    ray_load_rounds: int = 3  # unload, then load on each target, alternating
    ray_idle_s: float = 5.0  # the quiet window for the worker host's own CPU
    relay_tokens: int = 1500  # the relay at GPU rates: tokens of each stream
    relay_rounds: int = 3  # every target, protocol and concurrency, alternating
    relay_before: bool = True  # also the front before the relay's rework (from git)
    mlx_concurrency: tuple[int, ...] = (1, 2)  # the MLX engine against mlx_lm.server
    mlx_warmup: bool = True  # a first answer of each server, not counted
    mlx_peer: bool = True  # also mlx_lm.server (the tiny profile: bunkhouse alone)


PROFILES = {
    "full": Profile("full", overhead_rounds=8, overhead_tokens=64, throughput_rounds=5,
                    throughput_tokens=32, gate_off=True, swap_runs=3, swap_requests=10,
                    chaos_runs=3, chaos_seconds=60, flood_runs=3, flood_requests=1000,
                    flood_concurrency=64, fuzz_examples=30, fuzz_seconds=300,
                    kv_lengths=(1000, 4000, 8000)),
    "quick": Profile("quick", overhead_rounds=3, overhead_tokens=32, throughput_rounds=3,
                     throughput_tokens=16, gate_off=True, swap_runs=3, swap_requests=5,
                     chaos_runs=1, chaos_seconds=30, flood_runs=1, flood_requests=1000,
                     flood_concurrency=64, fuzz_examples=10, fuzz_seconds=45,
                     kv_lengths=(1000, 4000), transcribe_rounds=3, marginal_rounds=3,
                     hol_runs=1, hol_tokens=400, adapter_rounds=3, adapter_tokens=32,
                     spec_rounds=3, spec_tokens=160, ray_rounds=3, ray_load_rounds=2,
                    relay_tokens=1000, relay_rounds=1),
    # Only for the test suite: checks that every section runs end to end, measures nothing.
    "tiny": Profile("tiny", overhead_rounds=1, overhead_tokens=4, throughput_rounds=1,
                    throughput_tokens=4, gate_off=False, swap_runs=1, swap_requests=3,
                    chaos_runs=1, chaos_seconds=3, flood_runs=1, flood_requests=100,
                    flood_concurrency=16, fuzz_examples=2, fuzz_seconds=4,
                    kv_lengths=(300,), transcribe_rounds=1, transcribe_long_s=0,
                    marginal_rounds=1, marginal_tokens=(4, 8), hol_runs=1, hol_tokens=40,
                    fuzz_max_tokens=4, fuzz_phases="examples,fuzzing", adapter_rounds=1,
                    adapter_tokens=4,
                    adapter_functions=21, spec_rounds=1, spec_tokens=8, spec_memory=False,
                    spec_draft=False, ray_rounds=1, ray_tokens=4, ray_load_rounds=1,
                    ray_idle_s=1.0, relay_tokens=20, relay_rounds=1, relay_before=False,
                    mlx_concurrency=(1,), mlx_warmup=False, mlx_peer=False),
}


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("no values")
        return cls(statistics.median(values), min(values), max(values))


@dataclass
class StreamedChat:
    """A streamed chat answer as a client saw it: its text pieces, when the request was sent
    and its first and last pieces came (``time.perf_counter``; None: no piece), and the
    engine's ``timings`` from its last event that had them."""

    pieces: list[str]
    sent: float
    first: float | None
    last: float | None
    timings: dict[str, Any]

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def stream_chat(url: str, body: dict[str, Any]) -> StreamedChat:
    """POST ``body`` (a chat completion) streamed to ``url`` and read its answer;
    RuntimeError for an error status."""
    pieces: list[str] = []
    first: float | None = None
    last: float | None = None
    timings: dict[str, Any] = {}
    sent = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=900,
                      json={**body, "stream": True}) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {resp.text[:300]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            timings = event.get("timings") or timings
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    last = time.perf_counter()
                    first = first or last
                    pieces.append(content)
    return StreamedChat(pieces, sent, first, last, timings)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_http(client: httpx.Client, url: str, proc: subprocess.Popen[bytes],
              timeout_s: float = 120, poll_s: float = 0.1) -> None:
    """Poll URL every POLL_S until it answers 200; fail at once if PROC exits, or at the
    deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}; see its log in "
                               f"{LOG_DIR}")
        try:
            if client.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{url} not ready in {timeout_s} s")


LOG_DIR = Path(os.environ.get("BUNKHOUSE_BENCH_LOGS", Path(__file__).parent / "results"))


@contextmanager
def process(argv: list[str], name: str,
            env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` with its output in LOG_DIR/NAME.log; SIGTERM it on exit (SIGKILL after 30 s)."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with (LOG_DIR / f"{name}.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **env} if env else None)
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


def packaged(model_id: str) -> CatalogModel:
    return _packaged_catalog().get(model_id)


@functools.cache
def _packaged_catalog() -> Catalog:
    """Built once per run: a build reads every model file's header (and, the first time,
    assembles and checks the packaged files)."""
    return build_catalog(Settings(), engines=ENGINES)


@contextmanager
def bunkhouse(name: str, *args: str, env: dict[str, str] | None = None,
              module: bool = False) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`bunkhouse serve ARGS` on a free port, ready; yields its URL and process. ``env``:
    added to the environment; ``module``: run as ``python -m bunkhouse`` (the code
    ``PYTHONPATH`` names, not the installed script's)."""
    port = free_port()
    if "--responses-db" not in args:  # never the user's own stored responses
        args = (*args, "--responses-db",
                str(Path(tempfile.mkdtemp(prefix="bunkhouse-bench-")) / "responses.db"))
    argv = [sys.executable, "-m", "bunkhouse"] if module else bunkhouse_argv()
    with process([*argv, "serve", "--port", str(port), *args], name, env) as proc, \
            httpx.Client() as client:
        url = f"http://127.0.0.1:{port}"
        wait_http(client, f"{url}/health", proc)
        yield url, proc


def engine_server_argv(model_id: str, port: int, key: str = "") -> list[str]:
    """`python -m benchmarks.engine_server` for a packaged model, on its engine options."""
    model = packaged(model_id)
    o = model.options
    return [
        sys.executable, "-m", "benchmarks.engine_server", "--model-id", model_id,
        "--model-path", str(model.path), "--port", str(port), "--api-key", key,
        "--context", str(o.context), "--parallel", str(o.parallel),
        *engine_opts.worker_args(model_options(model)),
    ]


@contextmanager
def engine_server(model_id: str, name: str) -> Iterator[tuple[str, str, subprocess.Popen[bytes]]]:
    """The engine's own HTTP server on the model's engine options, loopback TCP with an API
    key; yields its URL, key and process."""
    port, key = free_port(), secrets.token_hex(16)
    with process(engine_server_argv(model_id, port, key), name) as proc, \
            httpx.Client() as client:
        url = f"http://127.0.0.1:{port}"
        wait_http(client, f"{url}/health", proc)
        yield url, key, proc


class RssSampler:
    """Samples, every INTERVAL seconds on a thread, the summed RSS of the processes that
    PIDS returns; keeps (seconds since start, bytes) pairs."""

    def __init__(self, pids: Callable[[], list[int]], interval_s: float = 0.1) -> None:
        self._pids = pids
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.samples: list[tuple[float, int]] = []
        self._t0 = time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for pid in self._pids():
                with suppress(psutil.Error):
                    total += psutil.Process(pid).memory_info().rss
            self.samples.append((time.monotonic() - self._t0, total))
            self._stop.wait(self._interval)

    @property
    def peak(self) -> int:
        return max((b for _, b in self.samples), default=0)

    def __enter__(self) -> RssSampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def children(pid: int) -> Callable[[], list[int]]:
    def pids() -> list[int]:
        try:
            return [p.pid for p in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return []
    return pids
