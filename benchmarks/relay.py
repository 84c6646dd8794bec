"""The front at GPU rates: its CPU per relayed token, with an engine that is never the limit.

The benchmark engine (tests/bench_engine.py) streams OpenAI chunks as llama.cpp's server
writes them, a token to every stream per decode step, :data:`RATE` steps a second: at 16
streams that is 4,000 tokens/s, what one GPU's slots stream (1,000-5,000 tokens/s), and each
token is its own event, as it is from a GPU build. The targets, in turns, the order
alternating between rounds:

* ``engine``: the benchmark engine's own server reached directly on its Unix socket (no
  front): the limit;
* ``before``: ``bunkhouse serve`` from :data:`BEFORE` (the front before its relay was cut down,
  checked out of git into a temporary folder), on the same engine;
* ``after``: ``bunkhouse serve`` from this checkout.

For each protocol (chat completions as an OpenAI client asks them, Anthropic Messages, the
Responses API) and 1, 4 and 16 concurrent streams: the tokens a second the client received
(every stream checked for all its tokens), and the front process's CPU time (user + system)
over them, per token: its relay ceiling on one core is the inverse. The client is a bare
asyncio reader, so that its own CPU takes as little of the 2 cores as can be.

Then the same two fronts on the real model (the packaged Qwen on llama.cpp, section 1's
streamed answers: time to first token, decode tokens/s and the front's CPU per token, 1 and
4 requests at once), so that what the rework changed at CPU rates is measured side by side
too, not against an older run.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil
from tests.helpers import CHILD_PYTHONPATH, REPO, wait_for, write_tiny_gguf

from benchmarks.common import LOG_DIR, QWEN, Profile, bunkhouse, process
from benchmarks.overhead import stream_once

RATE = 250
"""Decode steps a second, a token to every stream each: a GPU's per-slot pace."""

CONCURRENCY = (1, 4, 16)

BEFORE = "55e91f4"
"""The commit whose front is the ``before`` target: the last before the relay's rework."""

MODEL = "bench"

PROTOCOLS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": MODEL, "stream": True,
                                      "messages": [{"role": "user", "content": "hi"}]}),
    "messages": ("/v1/messages", {"model": MODEL, "stream": True,
                                  "messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("/v1/responses", {"model": MODEL, "stream": True, "input": "hi"}),
}

_TOKEN = re.compile(rb'"t\d+ "')  # one per token in every protocol's stream ("t12 ")


def _request(path: str, body: dict[str, Any], tokens: int) -> bytes:
    field = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    data = json.dumps({**body, field: tokens}).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


async def _stream(target: str | int, request: bytes) -> tuple[int, bytes]:
    """The answer's token count and its head; ``target``: a Unix socket or a TCP port."""
    if isinstance(target, str):
        reader, writer = await asyncio.open_unix_connection(target)
    else:
        reader, writer = await asyncio.open_connection("127.0.0.1", target)
    writer.write(request)
    pieces = []
    while chunk := await reader.read(1 << 16):
        pieces.append(chunk)
    writer.close()
    data = b"".join(pieces)
    return len(_TOKEN.findall(data)), data[:200]


async def _streams(target: str | int, request: bytes, n: int) -> list[tuple[int, bytes]]:
    return await asyncio.gather(*(_stream(target, request) for _ in range(n)))


def _cpu(pid: int | None) -> tuple[float, float]:
    """The process's user and system CPU seconds."""
    if pid is None:
        return 0.0, 0.0
    times = psutil.Process(pid).cpu_times()
    return times.user, times.system


def run_once(target: str | int, pid: int | None, path: str, body: dict[str, Any],
             concurrency: int, tokens: int) -> dict[str, float]:
    """``concurrency`` streams of ``tokens`` at once; received tokens/s and, for a front
    (``pid``), its CPU per token. Fails if any stream lacks a token."""
    request = _request(path, body, tokens)
    (user0, system0), t0 = _cpu(pid), time.perf_counter()
    got = asyncio.run(_streams(target, request, concurrency))
    wall, (user, system) = time.perf_counter() - t0, _cpu(pid)
    user, system = user - user0, system - system0
    short = [(n, head) for n, head in got if n != tokens]
    if short:
        raise RuntimeError(f"{path} at {concurrency}: {len(short)} streams short of {tokens} "
                           f"tokens, e.g. {short[0][0]}: {short[0][1]!r}")
    total = concurrency * tokens
    return {"tokens_per_s": total / wall, "cpu_ms_per_token": (user + system) * 1000 / total,
            "system_ms_per_token": system * 1000 / total}


def _checkout(ref: str, folder: Path) -> Path | None:
    """``ref``'s src/ under ``folder``, or None where this is no git checkout."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return None
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "src"],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        return None
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder / "src"


def _engine_argv(socket: Path, model: Path) -> list[str]:
    return [sys.executable, "-m", "tests.bench_engine", str(socket), str(model)]


def measure(profile: Profile) -> dict[str, Any]:
    tokens, rounds = profile.relay_tokens, profile.relay_rounds
    work = Path(tempfile.mkdtemp(prefix="bunkhouse-relay-"))
    model = write_tiny_gguf(work / "models" / f"{MODEL}.gguf", context=65536)
    env = {"PYTHONPATH": CHILD_PYTHONPATH, "BUNKHOUSE_BENCH": json.dumps({"rate": RATE})}
    args = ("--no-packaged", "--models-dir", str(work / "models"), "--worker-engine",
            "tests.bench_engine:BenchEngine", "--parallel", "16", "--spare-worker", "off",
            "--compute-gate", "off", "--log-level", "warning")
    before_src = _checkout(BEFORE, work) if profile.relay_before else None
    socket = work / "engine.sock"
    targets: dict[str, tuple[str | int, int | None]] = {}
    with ExitStack() as stack:
        stack.enter_context(process(_engine_argv(socket, model), "relay-engine", env=env))
        after_url, after = stack.enter_context(bunkhouse(
            "relay-after", *args, "--kv-cache-dir", str(work / "kv-after"), env=env,
            module=True))
        before = None if before_src is None else stack.enter_context(bunkhouse(
            "relay-before", *args, "--kv-cache-dir", str(work / "kv-before"),
            env={**env, "PYTHONPATH": f"{before_src}{os.pathsep}{REPO}"}, module=True))
        wait_for(socket.exists, 60, "the benchmark engine's socket")
        targets["engine"] = (str(socket), None)
        if before is not None:
            targets["before"] = (int(before[0].rsplit(":", 1)[1]), before[1].pid)
        targets["after"] = (int(after_url.rsplit(":", 1)[1]), after.pid)
        for port, _ in (t for name, t in targets.items() if name != "engine"):
            run_once(port, None, *PROTOCOLS["chat"], 1, 4)  # warm: the worker loaded
        runs: dict[str, dict[str, dict[str, list[dict[str, float]]]]] = {}
        for r in range(rounds):
            order = list(targets) if r % 2 == 0 else list(reversed(targets))
            for protocol, (path, body) in PROTOCOLS.items():
                for c in CONCURRENCY:
                    for name in order:
                        if name == "engine" and protocol != "chat":
                            continue  # it speaks chat completions only
                        target, pid = targets[name]
                        figures = run_once(target, pid, path, body, c, tokens)
                        runs.setdefault(protocol, {}).setdefault(str(c), {}).setdefault(
                            name, []).append(figures)
                        print(f"relay {protocol} c={c} {name}: "
                              f"{figures['tokens_per_s']:,.0f} tokens/s, "
                              f"{figures['cpu_ms_per_token']:.4f} ms/token "
                              f"({figures['system_ms_per_token']:.4f} in the kernel)",
                              file=sys.stderr, flush=True)
    real = _real_model(profile, before_src, env) if before_src is not None else None
    shutil.rmtree(work, ignore_errors=True)
    return {"rate": RATE, "tokens": tokens, "rounds": rounds, "before": BEFORE
            if before_src else None, "runs": runs, "real_model": real, "logs": str(LOG_DIR)}


def _real_model(profile: Profile, before_src: Path, env: dict[str, str]) -> dict[str, Any]:
    """Per target (``before``, ``after``) and concurrency: each round's [[TTFT s, decode
    tokens/s], ...] of its requests, and the front's CPU seconds and content chunks over
    them all."""
    rounds: dict[str, list[list[list[float]]]] = {}
    cpu: dict[str, float] = {}
    chunks: dict[str, int] = {}
    with ExitStack() as stack:
        fronts = {
            "before": stack.enter_context(bunkhouse(
                "relay-real-before", "--preload", QWEN, module=True,
                env={"PYTHONPATH": f"{before_src}{os.pathsep}{REPO}"})),
            "after": stack.enter_context(bunkhouse(
                "relay-real-after", "--preload", QWEN, module=True,
                env={"PYTHONPATH": env["PYTHONPATH"]})),
        }
        for url, _ in fronts.values():  # warm-up, not counted
            stream_once(url, "", "Say hello.", 4)
        for r in range(profile.overhead_rounds):
            for c in (1, 4):
                for name in (list(fronts) if r % 2 == 0 else list(reversed(fronts))):
                    url, proc = fronts[name]
                    prompts = [f"[{name} {r} {c} {i}] Write a long list of fruits, one per "
                               "line." for i in range(c)]
                    user, system = _cpu(proc.pid)
                    with ThreadPoolExecutor(c) as pool:
                        done = list(pool.map(
                            lambda p, u=url: stream_once(u, "", p, profile.overhead_tokens),
                            prompts))
                    after_user, after_system = _cpu(proc.pid)
                    cpu[name] = cpu.get(name, 0.0) + after_user - user + after_system - system
                    chunks[name] = chunks.get(name, 0) + sum(n for _, _, n in done)
                    rounds.setdefault(f"{name} c={c}", []).append(
                        [[ttft, tps] for ttft, tps, _ in done])
            print(f"relay: real model, round {r + 1}/{profile.overhead_rounds}",
                  file=sys.stderr, flush=True)
    return {"model": QWEN, "tokens": profile.overhead_tokens, "concurrency": [1, 4],
            "rounds": rounds, "cpu_s": cpu, "chunks": chunks}
