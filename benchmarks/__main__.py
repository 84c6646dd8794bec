"""bunkhouse's benchmark harness: every comparison in one go, results in docs/benchmarks.md.

    python -m benchmarks run [--quick] [--llama-server PATH] [--only SECTION ...]
    python -m benchmarks render [RESULTS.json]

Sections, in order: overhead (front vs the engine's own server, 1 and 4 requests at once),
throughput (1/4/8 concurrent; two models at once; memory estimate vs measured), hol (a short
request to one model while another streams a long generation, with the compute gate's time
slice and without), swap
(llama.cpp's router vs bunkhouse, two models alternating with room for one), kv (a
conversation's follow-up after its model was evicted: restored KV state vs the router's
prefill again, at 1K, 4K and 8K tokens), reliability
(chaos, a 1,000-request flood, schemathesis), transcribe (the Whisper worker vs faster-whisper
called directly: time and memory), adapters, speculative, llama_server (bunkhouse on the
engine llama-server against the binary alone, the router and xllamacpp's worker), ray (a
worker on a Ray node against a local one: time to first token, decode, the relay's CPU per
token, the time to place and load), relay (the front's CPU per token at GPU rates, 1, 4
and 16 streams from the benchmark engine, in three protocols, against the front before its
relay was reworked and the engine reached directly), mlx (bunkhouse's MLX worker against
mlx-lm's own server on the same model: time to first token, decode). A full
run takes about 20 minutes on 2 cores, --quick under 10. Every process's log goes to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from benchmarks import (
    adapters,
    hol,
    kv_restore,
    llama_server_engine,
    mlx_engine,
    overhead,
    ray_nodes,
    relay,
    reliability,
    report,
    speculative,
    swap,
    throughput,
    transcribe,
)
from benchmarks.common import PROFILES, Profile

SECTIONS = ("overhead", "throughput", "hol", "swap", "kv", "reliability", "transcribe",
            "adapters", "speculative", "llama_server", "ray", "relay", "mlx")
ROOT = Path(__file__).resolve().parent.parent


def environment(llama_server: str | None) -> dict[str, Any]:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": psutil.virtual_memory().total / 2**30,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "bunkhouse": metadata.version("bunkhouse"),
        "commit": commit or "unknown",
        "xllamacpp": metadata.version("xllamacpp"),
        "schemathesis": metadata.version("schemathesis"),
        "llama_server": swap.llama_server_version(llama_server) if llama_server else "",
    }


def run_sections(profile: Profile, sections: list[str], llama_server: str | None,
                 results_path: Path) -> dict[str, Any]:
    started = time.monotonic()
    results: dict[str, Any] = {
        "profile": profile.name,
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "environment": environment(llama_server),
        "sections": {},
        "errors": {},
        "duration_s": 0.0,
    }
    runners = {
        "overhead": lambda: overhead.measure(profile),
        "throughput": lambda: throughput.measure(profile),
        "hol": lambda: hol.measure(profile),
        "swap": lambda: swap.measure(profile, llama_server),
        "kv": lambda: kv_restore.measure(profile, llama_server),
        "reliability": lambda: reliability.measure(profile),
        "transcribe": lambda: transcribe.measure(profile),
        "adapters": lambda: adapters.measure(profile),
        "speculative": lambda: speculative.measure(profile),
        "llama_server": lambda: llama_server_engine.measure(profile, llama_server),
        "ray": lambda: ray_nodes.measure(profile),
        "relay": lambda: relay.measure(profile),
        "mlx": lambda: mlx_engine.measure(profile),
    }
    for name in sections:
        print(f"== {name} ({profile.name})", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            results["sections"][name] = runners[name]()
        except Exception:
            results["errors"][name] = traceback.format_exc()
            print(results["errors"][name], file=sys.stderr)
        print(f"== {name}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        results["duration_s"] = time.monotonic() - started
        # Saved after every section: a late failure loses nothing measured before it.
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(results, indent=1))
    return results


def write_docs(results: dict[str, Any], out: Path) -> Path:
    page = out / "benchmarks.md"
    out.mkdir(parents=True, exist_ok=True)
    report.plot(results, out / "benchmarks")
    page.write_text(report.render(results))
    return page


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="measure, then write the results and docs")
    r.add_argument("--quick", action="store_true", help="the short profile (under 10 minutes)")
    r.add_argument("--profile", choices=sorted(PROFILES), help="full (default), quick, or "
                   "tiny (the test suite's: checks the harness, measures nothing)")
    r.add_argument("--only", action="append", choices=SECTIONS, metavar="SECTION",
                   help=f"run only this section (repeatable): {', '.join(SECTIONS)}")
    r.add_argument("--llama-server", metavar="PATH",
                   default=os.environ.get("BUNKHOUSE_LLAMA_SERVER") or shutil.which("llama-server"),
                   help="a llama-server binary with router mode, for section 3 "
                   "(default: $BUNKHOUSE_LLAMA_SERVER, else llama-server on PATH)")
    r.add_argument("--out", type=Path,
                   help="where benchmarks.md, benchmarks/*.png and benchmarks/results.json go "
                   "(default: docs/; with --only, benchmarks/results/partial/, so that a "
                   "partial run never replaces the published page)")
    d = sub.add_parser("render", help="rewrite the docs from a saved results.json")
    d.add_argument("results", type=Path, nargs="?",
                   default=ROOT / "docs" / "benchmarks" / "results.json")
    d.add_argument("--out", type=Path, default=ROOT / "docs")
    a = p.parse_args(argv)
    if a.command == "render":
        print(write_docs(json.loads(a.results.read_text()), a.out))
        return 0
    profile = PROFILES[a.profile or ("quick" if a.quick else "full")]
    if a.llama_server and not Path(a.llama_server).is_file():
        p.error(f"--llama-server {a.llama_server}: no such file")
    out = a.out or (ROOT / "benchmarks" / "results" / "partial" if a.only else ROOT / "docs")
    results = run_sections(profile, a.only or list(SECTIONS), a.llama_server,
                           out / "benchmarks" / "results.json")
    page = write_docs(results, out)
    print(f"wrote {page} in {results['duration_s'] / 60:.1f} minutes", file=sys.stderr)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
