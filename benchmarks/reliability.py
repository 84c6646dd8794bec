"""Reliability runs: chaos (benchmarks.chaos), a request flood, and schemathesis against a
real server.

* flood: N small completions to one model from C clients at once, far more than its slots
  (4) and queue (8) hold. Every answer must be 200 or 429 `queue_full`; nothing may hang;
  the front's RSS is sampled throughout and must not grow with the number of requests.
* fuzz: `schemathesis run` over the server's own `/openapi.json` (every endpoint, admin ones
  included, with an admin key and runtime loading on), checking that no input gets a 5xx;
  but for the event stream (endless by design) and Ollama's routes documented as 501.
  The server serves the packaged Gemma with context 512 and 2 slots, so that the context
  check bounds every generated request to 256 tokens (a request may take a minute on 2 cores).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks import chaos
from benchmarks.common import GEMMA, QWEN, Profile, bunkhouse, packaged

FLOOD_TIMEOUT_S = 120.0


async def _flood(url: str, requests: int, concurrency: int,
                 progress: list[int]) -> Counter[str]:
    statuses: Counter[str] = Counter()
    body = {"model": QWEN, "prompt": "Hello", "max_tokens": 4}
    remaining = iter(range(requests))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=FLOOD_TIMEOUT_S) as client:

        async def one_client() -> None:
            for _ in remaining:
                try:
                    resp = await client.post(f"{url}/v1/completions", json=body)
                    code = resp.json().get("error", {}).get("code") if resp.status_code != 200 \
                        else None
                    statuses[f"{resp.status_code} {code}" if code else str(resp.status_code)] += 1
                except httpx.TimeoutException:
                    statuses["hung"] += 1
                except (httpx.HTTPError, ValueError) as e:
                    statuses[f"error {type(e).__name__}"] += 1
                progress[0] += 1

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return statuses


def flood(profile: Profile) -> dict[str, Any]:
    with bunkhouse("flood-bunkhouse", "--preload", QWEN) as (url, proc):
        httpx.post(f"{url}/v1/completions", json={"model": QWEN, "prompt": "Hi", "max_tokens": 2},
                   timeout=60).raise_for_status()
        front = psutil.Process(proc.pid)
        before = front.memory_info().rss
        progress = [0]
        marks: list[tuple[int, int]] = []  # (requests answered, front RSS) every 0.1 s
        start = time.perf_counter()

        def mark() -> None:
            marks.append((progress[0], front.memory_info().rss))

        async def run() -> Counter[str]:
            task = asyncio.ensure_future(_flood(url, profile.flood_requests,
                                                profile.flood_concurrency, progress))
            while not task.done():
                mark()
                await asyncio.sleep(0.1)
            return task.result()

        statuses = asyncio.run(run())
        mark()
        wall = time.perf_counter() - start
        after = front.memory_info().rss
    # Flat memory: the RSS once a tenth of the requests were answered (allocator and caches
    # warmed up) against the RSS at the end.
    tenth = next((rss for n, rss in marks if n >= profile.flood_requests // 10), before)
    return {"requests": profile.flood_requests, "concurrency": profile.flood_concurrency,
            "statuses": dict(statuses), "wall_s": wall, "front_rss_before": before,
            "front_rss_after_tenth": tenth, "front_rss_after": after,
            "front_rss_peak": max(rss for _, rss in marks)}


FUZZ_CONFIG = """\
[[models]]
id = "gemma"
path = "{path}"
context = 512
parallel = 2
"""


def fuzz(profile: Profile) -> dict[str, Any]:
    exe = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    with tempfile.TemporaryDirectory(prefix="bh-fuzz-") as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        config = Path(tmp) / "fuzz.toml"
        fixed = ("" if profile.fuzz_max_tokens is None  # the tiny profile: quick answers
                 else f"fixed_params = {{ max_tokens = {profile.fuzz_max_tokens} }}\n")
        config.write_text(FUZZ_CONFIG.format(path=packaged(GEMMA).path) + fixed)
        report = Path(tmp) / "events.ndjson"
        with bunkhouse("fuzz-bunkhouse", "--config", str(config), "--admin-key", "fuzz-admin",
                       "--allow-runtime-load", "--allowed-root", str(root),
                       "--preload", "gemma") as (url, proc):
            argv = [exe, "run", f"{url}/openapi.json", "-H", "Authorization: Bearer fuzz-admin",
                    "--checks", "not_a_server_error", "--max-examples", str(profile.fuzz_examples),
                    "--request-timeout", "120", "--max-time", str(profile.fuzz_seconds),
                    "--seed", "1", "--report", "ndjson", "--report-ndjson-path", str(report),
                    # An event stream that ends only when its client leaves: each case of it
                    # would wait out --request-timeout (tests/e2e covers it).
                    "--exclude-path", "/admin/events",
                    # A pull reaches the Hugging Face hub, which this machine cannot: a 502
                    # by design (tests/e2e/test_pull.py covers pulls against a local hub).
                    "--exclude-path", "/admin/pull", "--exclude-path", "/api/pull"]
            for path in _documented_501(url):  # answered 501 by design (docs/protocols.md)
                argv += ["--exclude-path", path]
            if profile.fuzz_phases:
                argv += ["--phases", profile.fuzz_phases]
            start = time.perf_counter()
            out = subprocess.run(argv, capture_output=True, text=True, cwd=tmp,
                                 timeout=profile.fuzz_seconds + 300)
            wall = time.perf_counter() - start
            alive = proc.poll() is None
        summary = _fuzz_summary(report)
    summary.update({"exit_code": out.returncode, "wall_s": wall, "server_alive": alive,
                    "output_tail": out.stdout[-1500:]})
    return summary


def _documented_501(url: str) -> list[str]:
    """The paths whose description gives a 501: Ollama's routes bunkhouse does not serve."""
    schema = httpx.get(f"{url}/openapi.json", timeout=60).raise_for_status().json()
    return sorted(path for path, ops in schema["paths"].items()
                  if any("501" in (op.get("responses") or {}) for op in ops.values()
                         if isinstance(op, dict)))


def _fuzz_summary(report: Path) -> dict[str, Any]:
    """Cases sent and check failures, from schemathesis' NDJSON event stream."""
    cases = 0
    failures: Counter[str] = Counter()
    errors = 0
    operations: set[str] = set()
    if not report.exists():
        return {"cases": 0, "failures": {}, "errors": 0, "operations": 0}
    for line in report.read_text().splitlines():
        event = json.loads(line)
        for name, payload in event.items():
            if name == "ScenarioFinished":
                recorder = payload.get("recorder") or {}
                n = len(recorder.get("cases") or {})
                if n and recorder.get("label"):
                    operations.add(recorder["label"])
                cases += n
                for checks in (recorder.get("checks") or {}).values():
                    for check in checks:
                        if str(check.get("status")).lower() == "failure":
                            failures[check.get("name", "?")] += 1
            elif name == "NonFatalError":
                errors += 1
    return {"cases": cases, "failures": dict(failures), "errors": errors,
            "operations": len(operations)}


def measure(profile: Profile) -> dict[str, Any]:
    chaos_runs = []
    for r in range(profile.chaos_runs):
        chaos_runs.append(chaos.run(profile.chaos_seconds, clients=4, seed=r + 1))
        print(f"reliability: chaos run {r + 1}/{profile.chaos_runs}", file=sys.stderr)
    floods = []
    for r in range(profile.flood_runs):
        floods.append(flood(profile))
        print(f"reliability: flood run {r + 1}/{profile.flood_runs}", file=sys.stderr)
    return {"chaos": chaos_runs, "flood": floods, "fuzz": fuzz(profile)}
