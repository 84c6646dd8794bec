"""What the front costs: the same streamed requests, alternating, in one run, against

* ``engine-tcp``: the engine's own HTTP server (xllamacpp, same GGUF, threads, slots and
  prompt cache) on loopback TCP with a per-process API key;
* ``engine-uds``: bunkhouse's own worker, spoken to directly over its private Unix socket;
* ``bunkhouse``: ``bunkhouse serve``, i.e. client -> front (TCP) -> worker (Unix socket).

Each request streams a fixed number of tokens (``ignore_eos``); time to first token (TTFT) is
taken at the first content chunk, decode tokens/s over the chunks after it. Every round sends
one request to each target, in an order that alternates between rounds so that drift in the
machine's speed cancels out. Prompts differ per round and target so that no target is served
from another's prompt cache.

    python -m benchmarks.overhead [--rounds 10] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from dataclasses import dataclass

import httpx
import psutil

from benchmarks.common import bunkhouse_argv, free_port, process, wait_http
from bunkhouse.catalog import build_catalog
from bunkhouse.config import Settings

MODEL = "qwen2.5-coder-0.5b-instruct"
_NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)


@dataclass(frozen=True)
class Target:
    name: str
    base_url: str
    transport: httpx.HTTPTransport | None = None
    api_key: str = ""


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    decode_tps: float
    tokens: int


def stream_once(client: httpx.Client, target: Target, prompt: str, tokens: int) -> Sample:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    stamps: list[float] = []
    start = time.perf_counter()
    with client.stream("POST", f"{target.base_url}/v1/chat/completions", json=body,
                       headers=headers, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"{target.name}: only {len(stamps)} content chunks")
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return Sample(stamps[0] - start, decode, len(stamps))


def _worker_socket(front_url: str) -> str:
    pid = httpx.get(f"{front_url}/v1/models/{MODEL}").json()["pid"]
    cmd = psutil.Process(pid).cmdline()
    return cmd[cmd.index("--socket") + 1]


def run(rounds: int, tokens: int) -> tuple[dict[str, list[Sample]], float]:
    """Samples per target, and the CPU seconds the front process spent meanwhile."""
    model = build_catalog(Settings()).get(MODEL)
    o = model.options
    engine_port, front_port, key = free_port(), free_port(), secrets.token_hex(16)
    engine_argv = [
        sys.executable, "-m", "benchmarks.engine_server", "--model-id", MODEL,
        "--model-path", str(model.path), "--port", str(engine_port), "--api-key", key,
        "--context", str(o.context), "--parallel", str(o.parallel),
        "--cache-ram-mib", str(o.cache_ram_mib), "--threads", str(o.threads),
    ]
    front_argv = [*bunkhouse_argv(), "serve", "--port", str(front_port), "--preload", MODEL]
    front_url = f"http://127.0.0.1:{front_port}"
    with process(engine_argv, "engine-tcp") as engine, \
            process(front_argv, "bunkhouse") as front, \
            httpx.Client(limits=_NO_KEEPALIVE) as client:
        wait_http(client, f"http://127.0.0.1:{engine_port}/health", engine)
        wait_http(client, f"{front_url}/health", front)
        uds = httpx.HTTPTransport(uds=_worker_socket(front_url), limits=_NO_KEEPALIVE)
        targets = [
            Target("engine-tcp", f"http://127.0.0.1:{engine_port}", api_key=key),
            Target("engine-uds", "http://worker", transport=uds),
            Target("bunkhouse", front_url),
        ]
        # No keep-alive anywhere: every target pays one connect per request, as the front
        # does towards its workers.
        clients = {t.name: httpx.Client(transport=t.transport, limits=_NO_KEEPALIVE)
                   for t in targets}
        samples: dict[str, list[Sample]] = {t.name: [] for t in targets}
        for t in targets:  # warm-up, not counted
            stream_once(clients[t.name], t, "Say hello.", 8)
        front_cpu = psutil.Process(front.pid)
        cpu_before = sum(front_cpu.cpu_times()[:2])
        for r in range(rounds):
            order = targets if r % 2 == 0 else targets[::-1]
            for t in order:
                prompt = f"[{t.name} {r}] Write a long list of fruits, one per line."
                samples[t.name].append(stream_once(clients[t.name], t, prompt, tokens))
            print(f"round {r + 1}/{rounds} done", file=sys.stderr)
        front_cpu_s = sum(front_cpu.cpu_times()[:2]) - cpu_before
        return samples, front_cpu_s


def report(samples: dict[str, list[Sample]], front_cpu_s: float, tokens: int) -> str:
    med = {name: (statistics.median(s.ttft_s for s in ss),
                  statistics.median(s.decode_tps for s in ss)) for name, ss in samples.items()}
    rounds = len(next(iter(samples.values())))
    lines = [
        f"front overhead, {MODEL}, {tokens} tokens/request, {rounds} rounds, "
        f"{os.cpu_count()} CPUs (median, min-max)",
        "",
        "| target | TTFT ms | decode tok/s |",
        "| --- | --- | --- |",
    ]
    for name, ss in samples.items():
        ttfts = [s.ttft_s * 1000 for s in ss]
        tps = [s.decode_tps for s in ss]
        lines.append(f"| {name} | {med[name][0] * 1000:.1f} ({min(ttfts):.1f}-{max(ttfts):.1f}) "
                     f"| {med[name][1]:.2f} ({min(tps):.2f}-{max(tps):.2f}) |")
    lines.append("")
    for a, b in (("bunkhouse", "engine-tcp"), ("bunkhouse", "engine-uds"),
                 ("engine-uds", "engine-tcp")):
        d_ttft = (med[a][0] - med[b][0]) * 1000
        ratio = med[a][1] / med[b][1]
        lines.append(f"{a} vs {b}: TTFT {d_ttft:+.1f} ms, decode tok/s ratio {ratio:.3f}")
    front_tokens = sum(s.tokens for s in samples["bunkhouse"])
    lines.append(f"front CPU: {front_cpu_s * 1000:.0f} ms for {front_tokens} streamed tokens "
                 f"({front_cpu_s * 1e6 / front_tokens:.0f} us per token)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args(argv)
    samples, front_cpu_s = run(a.rounds, a.tokens)
    print(report(samples, front_cpu_s, a.tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
