"""Swapping models: two models requested in turn with room for one.

The workload, the same for every target: N streamed completions of 8 tokens, one at a time,
alternating Qwen, Gemma, Qwen, ... on a freshly started server with nothing loaded, so the
first request is a cold load and every later one a swap (the other model must go first).

* ``bunkhouse``: `bunkhouse serve --budget 800MiB` (room for one of the two models);
* ``router``: llama.cpp's own multi-model router, `llama-server --models-dir DIR
  --models-max 1` with the same engine options, when a `llama-server` binary is given
  (xllamacpp's wheel disables the router; `wheel_router_error` shows its reason).

Per request: when it was sent, time to first token, when it ended, and whether it failed.
Meanwhile the summed RSS of each target's model processes is sampled every 100 ms.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    GEMMA,
    QWEN,
    Profile,
    RssSampler,
    bunkhouse,
    children,
    engine_server_argv,
    free_port,
    packaged,
    process,
    wait_http,
)
from bunkhouse.config import EngineOptions
from bunkhouse.engines.llamacpp import parse_options, server_flags

BUDGET = "1150MiB"  # one packaged model at its default context (Qwen 1,058 MiB), not both
TOKENS = 8


def wheel_router_error() -> str:
    """What xllamacpp says when asked for router mode (models_dir, no model path)."""
    code = (
        "import xllamacpp\n"
        "p = xllamacpp.CommonParams()\n"
        "p.models_dir = '.'\n"
        "p.models_max = 1\n"
        "p.hostnames = ['127.0.0.1']\n"
        f"p.port = {free_port()}\n"
        "try:\n"
        "    xllamacpp.Server(p)\n"
        "    print('router started')\n"
        "except Exception as e:\n"
        "    print(f'{type(e).__name__}: {e}')\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp, capture_output=True,
                             text=True, timeout=60)
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[-1] if lines else f"exit code {out.returncode}"


def llama_server_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
    version = lines[0] if lines else "version unknown"
    source = Path(binary + ".source")  # written by benchmarks/build-llama-server.sh
    return f"{version}; {source.read_text().strip()}" if source.exists() else version


@contextmanager
def router(binary: str, name: str, options: EngineOptions | None = None
           ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """llama.cpp's router over the packaged Qwen and Gemma, room for one, on Qwen's engine
    options (or ``options``); yields its URL and process once it answers."""
    qwen, gemma = packaged(QWEN), packaged(GEMMA)
    with tempfile.TemporaryDirectory(prefix="bh-router-") as tmp:
        for model in (qwen, gemma):
            os.symlink(model.path, Path(tmp) / f"{model.id}.gguf")
        port = free_port()
        argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--models-dir", tmp,
                "--models-max", "1", *_engine_args(qwen, options)]
        with process(argv, name) as proc, httpx.Client() as client:
            url = f"http://127.0.0.1:{port}"
            wait_http(client, f"{url}/health", proc)
            yield url, proc


def _ready_after(argv: list[str], url: str, name: str) -> float:
    """Seconds from spawning ARGV to its /health answering 200 (polled every 20 ms)."""
    start = time.perf_counter()
    with process(argv, name) as proc, httpx.Client() as client:
        wait_http(client, f"{url}/health", proc, poll_s=0.02)
        return time.perf_counter() - start


PHASE_MARKS = (
    # (phase that ends at the first line holding this, the text): both engines print them
    ("process start, interpreter and imports", "initializing"),
    ("GGUF metadata, vocabulary and tensors", "threadpool init"),
    ("context, KV cache and warm-up", "model loaded"),
)


def start_phases(argv: list[str], url: str) -> dict[str, float]:
    """Seconds each phase of an engine's start took: spawn to its first log line, the model
    load (with, where the engine says so, the vocabulary apart), the context, then from its
    'model loaded' line to /health answering (polled every 5 ms). Each line is stamped as it
    arrives on the pipe (the engines write their log unbuffered)."""
    stamps: dict[str, float] = {}
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line, now = raw.decode(errors="replace"), time.perf_counter()
            for _, mark in PHASE_MARKS:
                if mark in line and mark not in stamps:
                    stamps[mark] = now

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        with httpx.Client() as client:
            wait_http(client, f"{url}/health", proc, poll_s=0.005)
        ready = time.perf_counter()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    out, last = {}, start
    for phase, mark in PHASE_MARKS:
        at = stamps.get(mark, last)
        out[phase], last = at - last, at
    out["to /health answering"] = ready - last
    out["total"] = ready - start
    return out


def engine_phases(llama_server: str | None) -> dict[str, dict[str, dict[str, float]]]:
    """start_phases of each engine build for each model: xllamacpp in a Python process (as a
    bunkhouse worker is) and llama-server."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for model_id in (QWEN, GEMMA):
        model = packaged(model_id)
        port = free_port()
        out.setdefault("xllamacpp", {})[model_id] = start_phases(
            engine_server_argv(model_id, port), f"http://127.0.0.1:{port}")
        if llama_server:
            port = free_port()
            argv = [llama_server, "-m", str(model.path), "--host", "127.0.0.1",
                    "--port", str(port), *_engine_args(model)]
            out.setdefault("llama-server", {})[model_id] = start_phases(
                argv, f"http://127.0.0.1:{port}")
    return out


def engine_starts(llama_server: str | None) -> dict[str, dict[str, float]]:
    """How long each engine build takes to load a model and answer /health, with nothing
    around it: xllamacpp (a Python process, as a bunkhouse worker is) and llama-server."""
    out: dict[str, dict[str, float]] = {}
    for model_id in (QWEN, GEMMA):
        model = packaged(model_id)
        port = free_port()
        out.setdefault("xllamacpp", {})[model_id] = _ready_after(
            engine_server_argv(model_id, port), f"http://127.0.0.1:{port}", "swap-engine-start")
        if llama_server:
            port = free_port()
            argv = [llama_server, "-m", str(model.path), "--host", "127.0.0.1",
                    "--port", str(port), *_engine_args(model)]
            out.setdefault("llama-server", {})[model_id] = _ready_after(
                argv, f"http://127.0.0.1:{port}", "swap-llama-server-start")
    return out


def _engine_args(model: Any, options: EngineOptions | None = None) -> list[str]:
    o = options or model.options
    own = parse_options(dict(o.engine_keys), "the benchmark's options")
    return ["-c", str(o.context), "-np", str(o.parallel), *server_flags(own), "-b", "512",
            "-ub", "512", "--no-webui"]


def one_request(url: str, model: str, t0: float) -> dict[str, Any]:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": TOKENS,
            "stream": True, "ignore_eos": True}
    sent = time.perf_counter()
    first: float | None = None
    error = ""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as resp:
            if resp.status_code != 200:
                resp.read()
                error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            else:
                for line in resp.iter_lines():
                    if first is None and line.startswith("data: ") and '"text":' in line:
                        first = time.perf_counter()
                    if line.startswith("event: error"):
                        error = "stream error event"
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    if first is None and not error:
        error = "no token"
    end = time.perf_counter()
    return {"model": model, "sent_s": sent - t0, "ttft_s": None if first is None else first - sent,
            "end_s": end - t0, "error": error}


def workload(url: str, pids: Any, requests: int) -> dict[str, Any]:
    models = [QWEN, GEMMA]
    with RssSampler(pids) as sampler:
        started_at = time.time()  # wall clock: the residency events' times
        t0 = time.perf_counter()
        done = [one_request(url, models[i % 2], t0) for i in range(requests)]
        total = time.perf_counter() - t0
    return {"requests": done, "total_s": total, "peak_rss": sampler.peak,
            "started_at": started_at,
            "rss": sampler.samples[::2]}


def measure(profile: Profile, llama_server: str | None) -> dict[str, Any]:
    result: dict[str, Any] = {"budget": BUDGET, "tokens": TOKENS,
                              "requests_per_run": profile.swap_requests,
                              "wheel_router_error": wheel_router_error(), "runs": {}}
    targets = ["bunkhouse"]
    if llama_server:
        targets.append("router")
    for r in range(profile.swap_runs):
        for target in targets if r % 2 == 0 else targets[::-1]:
            if target == "bunkhouse":
                with bunkhouse("swap-bunkhouse", "--budget", BUDGET) as (url, proc):
                    run = workload(url, children(proc.pid), profile.swap_requests)
                    run["peak_used_bytes"] = httpx.get(f"{url}/stats").json()["peak_used_bytes"]
            else:
                assert llama_server
                with router(llama_server, "swap-router") as (url, proc):
                    run = workload(url, children(proc.pid), profile.swap_requests)
            result["runs"].setdefault(target, []).append(run)
        result.setdefault("engine_starts", []).append(engine_starts(llama_server))
        result.setdefault("engine_phases", []).append(engine_phases(llama_server))
        print(f"swap: run {r + 1}/{profile.swap_runs}", file=sys.stderr)
    return result
