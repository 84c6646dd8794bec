"""The engine llama-server: bunkhouse on llama.cpp's own binary, beside the binary alone,
bunkhouse on xllamacpp's worker and llama.cpp's router, all on the same binary.

1. Overhead: streamed chat completions to Qwen, 1 and 4 at once, alternating between the
   binary alone (loopback TCP, an API key, exactly the flags bunkhouse's worker gets) and
   ``bunkhouse serve`` with ``engine = "llama-server"``: time to first token, decode tokens/s.
2. Throughput: aggregate tokens/s of 4 and 8 concurrent streamed completions, same pair.
3. Swaps: section 3's workload (Qwen and Gemma alternating with room for one) on bunkhouse
   with ``engine = "llama-server"``, bunkhouse on xllamacpp and the router, alternating; each
   swap on bunkhouse taken apart, phase by phase, from its residency events.
4. A conversation's follow-up after eviction (section 6's scenario) at one length, bunkhouse
   on llama-server against the router.

Needs ``--llama-server PATH``; without it the section records why it was not measured.
"""

from __future__ import annotations

import dataclasses
import secrets
import statistics
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from benchmarks import kv_restore, overhead, swap, throughput
from benchmarks.common import (
    QWEN,
    Profile,
    bunkhouse,
    children,
    free_port,
    packaged,
    process,
    wait_http,
)
from bunkhouse.engines import LLAMA_SERVER

CONCURRENCY = (1, 4)
THROUGHPUT = (4, 8)
KV_TOKENS = 4000


@contextmanager
def binary_alone(binary: str, name: str) -> Iterator[tuple[str, str]]:
    """The binary serving Qwen on loopback TCP with the flags a bunkhouse worker of it gets
    (engines/llamaserver.py); yields its URL and API key."""
    LLAMA_SERVER.locate(Path(binary))
    model = dataclasses.replace(packaged(QWEN), engine=LLAMA_SERVER.name)
    port, key = free_port(), secrets.token_hex(16)
    argv = [binary, "-m", str(model.path), "--host", "127.0.0.1", "--port", str(port),
            "--api-key", key, "--alias", QWEN, "--threads-http",
            str(max(2, model.options.parallel + 1)), *LLAMA_SERVER.worker_args(model)]
    with process(argv, name) as proc, httpx.Client() as client:
        url = f"http://127.0.0.1:{port}"
        wait_http(client, f"{url}/health", proc)
        yield url, key


@contextmanager
def bunkhouse_on(binary: str, name: str, *args: str, config: str = ""
                 ) -> Iterator[tuple[str, Any]]:
    """``bunkhouse serve`` with every GGUF model on the binary (``config``: more TOML)."""
    with tempfile.TemporaryDirectory(prefix="bh-ls-") as tmp:
        path = Path(tmp) / "bunkhouse.toml"
        path.write_text(f'[defaults]\nengine = "llama-server"\n{config}')
        with bunkhouse(name, "--config", str(path), "--llama-server", binary, *args) as (
                url, proc):
            yield url, proc


def _overhead(binary: str, profile: Profile) -> dict[str, Any]:
    rounds: dict[str, list[list[list[float]]]] = {}
    with binary_alone(binary, "ls-overhead-binary") as (alone, key), \
            bunkhouse_on(binary, "ls-overhead-bunkhouse", "--preload", QWEN) as (front, _):
        targets = [("engine", alone, key), ("bunkhouse", front, "")]
        for _, url, k in targets:
            overhead.stream_once(url, k, "Say hello.", 4)  # warm-up
        for r in range(profile.overhead_rounds):
            for c in CONCURRENCY:
                for name, url, k in targets if r % 2 == 0 else targets[::-1]:
                    prompts = [f"[ls {name} {r} {c} {i}] Write a long list of fruits, one per "
                               "line." for i in range(c)]
                    done = [overhead.stream_once(url, k, p, profile.overhead_tokens)
                            for p in prompts] if c == 1 else _at_once(url, k, prompts, profile)
                    rounds.setdefault(f"{name} c={c}", []).append([[t, s] for t, s, _ in done])
            print(f"llama-server overhead: round {r + 1}/{profile.overhead_rounds}",
                  file=sys.stderr)
        tput: dict[str, list[float]] = {}
        for r in range(profile.throughput_rounds):
            for c in THROUGHPUT:
                for name, url, k in targets if r % 2 == 0 else targets[::-1]:
                    job = partial(throughput.stream_tokens, url, QWEN,
                                  profile.throughput_tokens, k)
                    tput.setdefault(f"{name} c={c}", []).append(throughput.aggregate([job] * c))
    return {"model": QWEN, "tokens": profile.overhead_tokens,
            "concurrency": list(CONCURRENCY), "rounds": rounds,
            "throughput_tokens": profile.throughput_tokens, "throughput": tput}


def _at_once(url: str, key: str, prompts: list[str], profile: Profile
             ) -> list[tuple[float, float, int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(
            lambda p: overhead.stream_once(url, key, p, profile.overhead_tokens), prompts))


def _events(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(f"{url}/stats", timeout=30).json()["events"])


def swap_phases(run: dict[str, Any], events: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Each swap's time to first token taken apart (seconds), from the residency events:
    ``admit`` (the request's arrival to the old model's drain), ``drain`` (draining to
    absent: its slots saved, SIGTERM, reaped), ``start`` (absent to the new model's ready:
    spawn and the engine's own start, readiness), ``first token`` (ready to the first token:
    routing, a restore, prefill, decode)."""
    out = []
    for i, req in enumerate(run["requests"][1:], start=1):
        if req["ttft_s"] is None:
            continue
        sent = run["started_at"] + req["sent_s"]
        first = sent + req["ttft_s"]
        old = run["requests"][i - 1]["model"]

        def at(model: str, kind: str, sent: float = sent, first: float = first) -> float | None:
            times = [e["time"] for e in events if e["model"] == model and e["kind"] == kind
                     and sent - 0.05 <= e["time"] <= first]
            return min(times) if times else None

        drain, absent = at(old, "draining"), at(old, "absent")
        ready = at(req["model"], "ready")
        if drain is None or absent is None or ready is None:
            continue
        out.append({"admit": drain - sent, "drain": absent - drain, "start": ready - absent,
                    "first token": first - ready, "total": req["ttft_s"]})
    return out


def _swaps(binary: str, profile: Profile) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {}
    phases: list[dict[str, float]] = []
    targets = ["bunkhouse llama-server", "router", "bunkhouse xllamacpp"]
    for r in range(profile.swap_runs):
        for target in targets if r % 2 == 0 else targets[::-1]:
            if target == "router":
                with swap.router(binary, "ls-swap-router") as (url, proc):
                    run = swap.workload(url, children(proc.pid), profile.swap_requests)
            elif target == "bunkhouse xllamacpp":
                with bunkhouse("ls-swap-xllamacpp", "--budget", swap.BUDGET) as (url, proc):
                    run = swap.workload(url, children(proc.pid), profile.swap_requests)
            else:
                with bunkhouse_on(binary, "ls-swap-bunkhouse", "--budget", swap.BUDGET) as (
                        url, proc):
                    run = swap.workload(url, children(proc.pid), profile.swap_requests)
                    phases += swap_phases(run, _events(url))
            runs.setdefault(target, []).append(run)
        print(f"llama-server swap: run {r + 1}/{profile.swap_runs}", file=sys.stderr)
    return {"budget": swap.BUDGET, "runs": runs, "phases": phases}


def _kv(binary: str) -> dict[str, Any]:
    with kv_restore._config() as config, tempfile.TemporaryDirectory(prefix="bh-ls-kv-") as kv:
        text = config.read_text()
        with bunkhouse_on(binary, "ls-kv-bunkhouse", "--budget", kv_restore.BUDGET,
                          "--kv-cache-dir", kv,
                          config=text.replace("[defaults]\n", "")) as (url, _):
            ours = kv_restore.scenario(url, KV_TOKENS)
            ours["restored"] = httpx.get(f"{url}/v1/models/{QWEN}").json()["kv_cache"][
                "restored"]
    theirs = kv_restore.run_router(binary, KV_TOKENS)
    return {"tokens": KV_TOKENS, "bunkhouse": ours, "router": theirs,
            "ttft_ratio": ours["follow_up_ttft_s"] / theirs["follow_up_ttft_s"],
            "same_answer": ours["follow_up_text"] == theirs["follow_up_text"]}


def measure(profile: Profile, llama_server: str | None) -> dict[str, Any]:
    if not llama_server:
        return {"skipped": "no llama-server binary (pass --llama-server PATH)"}
    result = {"overhead": _overhead(llama_server, profile),
              "swap": _swaps(llama_server, profile)}
    if profile.kv_lengths:
        result["kv"] = _kv(llama_server)
    result["median_swap_phases"] = {
        k: statistics.median(p[k] for p in result["swap"]["phases"])
        for k in ("admit", "drain", "start", "first token", "total")
    } if result["swap"]["phases"] else {}
    return result

