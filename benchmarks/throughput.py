"""Aggregate throughput under concurrency, in one run, alternating between targets.

1. One model (Qwen, 4 slots, same threads): the engine's own HTTP server against
   `bunkhouse serve`, at 1, 4 and 8 concurrent streamed requests.
2. Two models busy at once (4 requests to Qwen and 4 to Gemma at the same time) against each
   model alone, with bunkhouse's compute gate on (the default) and off.

Aggregate tokens/s = all tokens streamed / wall time from the first request to the last
token. Median of the rounds, with min-max.

    python -m benchmarks.throughput [--rounds 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from functools import partial

import httpx

from benchmarks.common import bunkhouse_argv, free_port, process, wait_http
from bunkhouse.catalog import build_catalog
from bunkhouse.config import Settings

QWEN = "qwen2.5-coder-0.5b-instruct"
GEMMA = "gemma-3-270m"
_NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)


def stream_tokens(url: str, model: str, tokens: int, key: str = "") -> int:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    headers = {"authorization": f"Bearer {key}"} if key else {}
    n = 0
    with httpx.Client(limits=_NO_KEEPALIVE) as client, client.stream(
            "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"text":' in line:
                n += 1
    return n


def aggregate(jobs: Sequence[Callable[[], int]]) -> float:
    """Run every job at once; tokens per second over the whole wall time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(job) for job in jobs]
        total: int = sum(f.result() for f in futures)
    return total / (time.perf_counter() - start)


def run(rounds: int, tokens: int) -> dict[str, list[float]]:
    catalog = build_catalog(Settings())
    qwen = catalog.get(QWEN)
    o = qwen.options
    key = secrets.token_hex(16)
    engine_port, gated_port, open_port = free_port(), free_port(), free_port()
    engine_argv = [
        sys.executable, "-m", "benchmarks.engine_server", "--model-id", QWEN,
        "--model-path", str(qwen.path), "--port", str(engine_port), "--api-key", key,
        "--context", str(o.context), "--parallel", str(o.parallel),
        "--cache-ram-mib", str(o.cache_ram_mib), "--threads", str(o.threads),
    ]

    def front(port: int, gate: str) -> list[str]:
        return [*bunkhouse_argv(), "serve", "--port", str(port), "--preload", QWEN,
                "--preload", GEMMA, "--compute-gate", gate]

    results: dict[str, list[float]] = {}

    def record(name: str, jobs: Sequence[Callable[[], int]]) -> None:
        results.setdefault(name, []).append(aggregate(jobs))

    with ExitStack() as stack, httpx.Client() as client:
        servers = {
            "engine": (engine_argv, f"http://127.0.0.1:{engine_port}"),
            "gated": (front(gated_port, "on"), f"http://127.0.0.1:{gated_port}"),
            "open": (front(open_port, "off"), f"http://127.0.0.1:{open_port}"),
        }
        for name, (argv, url) in servers.items():
            proc = stack.enter_context(process(argv, f"throughput-{name}"))
            wait_http(client, f"{url}/health", proc)
        engine, gated, ungated = (servers[n][1] for n in ("engine", "gated", "open"))
        for url, model, k in ((engine, QWEN, key), (gated, QWEN, ""), (gated, GEMMA, ""),
                              (ungated, QWEN, ""), (ungated, GEMMA, "")):
            stream_tokens(url, model, 4, k)  # warm-up
        for r in range(rounds):
            for c in (1, 4, 8):
                pair = [("engine", engine, key), ("bunkhouse", gated, "")]
                for name, url, k in pair if r % 2 == 0 else pair[::-1]:
                    record(f"{name} c={c}", [partial(stream_tokens, url, QWEN, tokens, k)] * c)
            # Without the gate two busy models collapse (minutes a round): measured once.
            gates = (("gate on", gated), ("gate off", ungated)) if r == 0 else (("gate on", gated),)
            for label, url in gates:
                q, g = partial(stream_tokens, url, QWEN, tokens), partial(
                    stream_tokens, url, GEMMA, tokens)
                record(f"{label}: qwen alone x4", [q] * 4)
                record(f"{label}: gemma alone x4", [g] * 4)
                record(f"{label}: both x4+x4", [q] * 4 + [g] * 4)
            print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    return results


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def report(results: dict[str, list[float]], tokens: int) -> str:
    med = {k: statistics.median(v) for k, v in results.items()}
    rounds = len(next(iter(results.values())))
    lines = [f"aggregate tokens/s, {tokens} tokens/request, {rounds} rounds, "
             f"{os.cpu_count()} CPUs, median (min-max)", "",
             "| concurrent | engine's own server | bunkhouse | ratio |",
             "| --- | --- | --- | --- |"]
    for c in (1, 4, 8):
        e, b = f"engine c={c}", f"bunkhouse c={c}"
        lines.append(f"| {c} | {_cell(results[e])} | {_cell(results[b])} | "
                     f"{med[b] / med[e]:.2f} |")
    lines += ["", "| compute gate | Qwen alone x4 | Gemma alone x4 | both x4+x4 | "
              "both / Qwen alone | both / Gemma alone |", "| --- | --- | --- | --- | --- | --- |"]
    for label in ("gate on", "gate off"):
        q, g, both = (f"{label}: {k}" for k in ("qwen alone x4", "gemma alone x4", "both x4+x4"))
        lines.append(f"| {label} | {_cell(results[q])} | {_cell(results[g])} | "
                     f"{_cell(results[both])} | {med[both] / med[q]:.2f} | "
                     f"{med[both] / med[g]:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args(argv)
    print(report(run(a.rounds, a.tokens), a.tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
