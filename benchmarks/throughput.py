"""Aggregate throughput under concurrency, in one run, alternating between targets.

1. One model (Qwen, 4 slots, same threads): the engine's own HTTP server against
   `bunkhouse serve`, at 1, 4 and 8 concurrent streamed requests.
2. Two models busy at once (4 requests to Qwen and 4 to Gemma at the same time) against each
   model alone, with bunkhouse's compute gate on (the default) and, once, off.
3. Memory, from the same two-model server after each round: each model's estimate against
   its measured RSS, and the peak of the workers' summed RSS against the budget.

Aggregate tokens/s = all tokens streamed / wall time from the first request to the last token.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from functools import partial
from typing import Any

import httpx

from benchmarks.common import (
    GEMMA,
    NO_KEEPALIVE,
    QWEN,
    Profile,
    RssSampler,
    bunkhouse,
    children,
    engine_server,
)

CONCURRENCY = (1, 4, 8)


def stream_tokens(url: str, model: str, tokens: int, key: str = "") -> int:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    headers = {"authorization": f"Bearer {key}"} if key else {}
    n = 0
    with httpx.Client(limits=NO_KEEPALIVE) as client, client.stream(
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


def _memory(url: str) -> dict[str, dict[str, int]]:
    models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return {m["id"]: {"estimated_bytes": m["estimated_bytes"],
                      "measured_bytes": m["measured_bytes"]} for m in models}


def measure(profile: Profile) -> dict[str, Any]:
    tokens = profile.throughput_tokens
    results: dict[str, list[float]] = {}
    memory: list[dict[str, dict[str, int]]] = []

    def record(name: str, jobs: Sequence[Callable[[], int]]) -> None:
        results.setdefault(name, []).append(aggregate(jobs))

    both = ("--preload", QWEN, "--preload", GEMMA)
    with ExitStack() as stack:
        engine, key, _ = stack.enter_context(engine_server(QWEN, "throughput-engine"))
        gated, gated_proc = stack.enter_context(
            bunkhouse("throughput-gated", *both, "--compute-gate", "on"))
        ungated = ""
        if profile.gate_off:
            ungated, _ = stack.enter_context(
                bunkhouse("throughput-ungated", *both, "--compute-gate", "off"))
        budget = httpx.get(f"{gated}/stats", timeout=10).json()["budget_bytes"]
        sampler = stack.enter_context(RssSampler(children(gated_proc.pid)))
        for url, model, k in ((engine, QWEN, key), (gated, QWEN, ""), (gated, GEMMA, "")):
            stream_tokens(url, model, 4, k)  # warm-up
        for r in range(profile.throughput_rounds):
            for c in CONCURRENCY:
                pair = [("engine", engine, key), ("bunkhouse", gated, "")]
                for name, url, k in pair if r % 2 == 0 else pair[::-1]:
                    record(f"{name} c={c}", [partial(stream_tokens, url, QWEN, tokens, k)] * c)
            gates = [("gate on", gated)]
            if ungated and r == 0:  # without the gate two busy models collapse: measured once
                gates.append(("gate off", ungated))
            for label, url in gates:
                q = partial(stream_tokens, url, QWEN, tokens)
                g = partial(stream_tokens, url, GEMMA, tokens)
                record(f"{label}: qwen alone x4", [q] * 4)
                record(f"{label}: gemma alone x4", [g] * 4)
                record(f"{label}: both x4+x4", [q] * 4 + [g] * 4)
            memory.append(_memory(gated))
            print(f"throughput: round {r + 1}/{profile.throughput_rounds}", file=sys.stderr)
    return {"tokens": tokens, "concurrency": list(CONCURRENCY), "results": results,
            "memory": memory, "budget_bytes": budget, "peak_workers_rss": sampler.peak}
