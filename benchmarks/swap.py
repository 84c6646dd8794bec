"""What a swap costs: time to B's first token when A is resident and the budget is full
(drain A, stop it, start B), against B's cold start alone, in one run.

Each round starts a fresh `bunkhouse serve --budget 800MiB` (room for one of the two packaged
models) twice, alternating the order between rounds: once with A preloaded (swap), once with
nothing loaded (cold). Both directions are measured.

    python -m benchmarks.swap [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from benchmarks.common import bunkhouse_argv, free_port, process, wait_http

QWEN = "qwen2.5-coder-0.5b-instruct"
GEMMA = "gemma-3-270m"
BUDGET = "800MiB"


@contextmanager
def _server(preload: str | None) -> Iterator[str]:
    port = free_port()
    argv = [*bunkhouse_argv(), "serve", "--port", str(port), "--budget", BUDGET]
    if preload:
        argv += ["--preload", preload]
    with process(argv, "swap-bunkhouse") as proc, httpx.Client() as client:
        url = f"http://127.0.0.1:{port}"
        wait_http(client, f"{url}/health", proc)
        yield url


def time_to_first_token(url: str, model: str) -> float:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8,
            "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as resp:
        resp.raise_for_status()
        first: float | None = None
        for line in resp.iter_lines():
            if first is None and line.startswith("data: ") and '"text":' in line:
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"{model}: no token")
    return first


def measure(resident: str, wanted: str, swap: bool) -> float:
    with _server(resident if swap else None) as url:
        return time_to_first_token(url, wanted)


def run(rounds: int) -> dict[tuple[str, str], dict[str, list[float]]]:
    results: dict[tuple[str, str], dict[str, list[float]]] = {}
    for resident, wanted in ((QWEN, GEMMA), (GEMMA, QWEN)):
        times: dict[str, list[float]] = {"swap": [], "cold": []}
        for r in range(rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            for swap in order:
                times["swap" if swap else "cold"].append(measure(resident, wanted, swap))
            print(f"{wanted} after {resident}: round {r + 1}/{rounds}", file=sys.stderr)
        results[(resident, wanted)] = times
    return results


def report(results: dict[tuple[str, str], dict[str, list[float]]]) -> str:
    rounds = len(next(iter(results.values()))["swap"])
    lines = [
        f"swap vs cold start, budget {BUDGET} (one model), {rounds} rounds, "
        f"{os.cpu_count()} CPUs; time to first token, median (min-max)",
        "",
        "| resident A -> wanted B | swap: A resident, B requested | cold: B alone | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for (resident, wanted), t in results.items():
        s, c = statistics.median(t["swap"]), statistics.median(t["cold"])
        lines.append(
            f"| {resident} -> {wanted} | {s * 1000:.0f} ms ({min(t['swap']) * 1000:.0f}-"
            f"{max(t['swap']) * 1000:.0f}) | {c * 1000:.0f} ms ({min(t['cold']) * 1000:.0f}-"
            f"{max(t['cold']) * 1000:.0f}) | {s / c:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args(argv)
    print(report(run(a.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
