"""A worker on a Ray node against a local worker: what the network hop and the relay cost.

* ``local``: ``bunkhouse serve``: client -> front (TCP) -> worker (Unix socket);
* ``ray``: ``bunkhouse serve --ray ADDRESS`` over a one-node Ray cluster started here
  (``ray.cluster_utils.Cluster``): client -> front -> the worker host's relay (TCP on the
  node's address, the per-worker secret checked) -> worker (Unix socket on its node).

Both serve Qwen with the same engine options, side by side in one run. A round streams the
same kind of chat answer (``ignore_eos``, a fixed token count) from each target in turn, the
order alternating between rounds, at 1 and then 4 requests at once: time to first token and
decode tokens/s, as section 1 measures them. Per target the front's CPU time over its
tokens, and on ``ray`` the worker host's (the relay's, less its idle memory polls measured
in a quiet window), give the CPU each relayed token costs.

Then the time to place and load: per round, the model unloaded, then loaded by the admin
API (``POST /v1/models/{id}/load`` returns once it is ready) on each target in turn: a
local process spawned against an actor made on the node, which then spawns the worker.
Neither front keeps a spare worker here, so that both loads start a worker from nothing.
"""

from __future__ import annotations

import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.common import QWEN, Profile, bunkhouse
from benchmarks.overhead import stream_once

CONCURRENCY = (1, 4)
NODE_MIB = 4096  # the Ray node's budget: Qwen fits
ADMIN = "bench-admin-key"


def _config(folder: Path) -> Path:
    """No discovered models: the packaged ones only, on both targets."""
    path = folder / "bunkhouse.toml"
    path.write_text("hf_cache = false\nollama = false\nlmstudio = false\n")
    return path


def _cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _worker_host() -> int:
    """The pid of the Ray actor process that hosts the worker (its relay runs there)."""
    hosts = [p.pid for p in psutil.process_iter(["name"])
             if "WorkerHost" in (p.info["name"] or "")]
    if len(hosts) != 1:
        raise RuntimeError(f"expected one worker host process, found {len(hosts)}")
    return hosts[0]


def _load(url: str) -> float:
    """Seconds for the admin API to load Qwen, placed and ready."""
    headers = {"authorization": f"Bearer {ADMIN}"}
    unloaded = httpx.post(f"{url}/v1/models/{QWEN}/unload", headers=headers, timeout=300)
    if unloaded.status_code not in (200, 202, 204):
        raise RuntimeError(f"{url}: unload answered {unloaded.status_code}: {unloaded.text}")
    deadline = time.monotonic() + 300
    while httpx.get(f"{url}/v1/models/{QWEN}", timeout=30).json()["state"] != "absent":
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: {QWEN} not unloaded within 300 s")
        time.sleep(0.2)
    started = time.perf_counter()
    loaded = httpx.post(f"{url}/v1/models/{QWEN}/load", headers=headers, timeout=600)
    if loaded.status_code != 200:
        raise RuntimeError(f"{url}: load answered {loaded.status_code}: {loaded.text}")
    return time.perf_counter() - started


def measure(profile: Profile) -> dict[str, Any]:
    """Per target and concurrency, per round: [[ttft_s, decode_tps], ...]; per target the
    CPU seconds and tokens relayed; per target the load times (s)."""
    try:
        from ray import cluster_utils
    except ImportError as e:
        raise RuntimeError("the ray section needs the 'ray' extra: pip install -e "
                           "'.[ray]'") from e
    folder = Path(tempfile.mkdtemp(prefix="bunkhouse-bench-ray-"))
    config = str(_config(folder))
    tokens = profile.ray_tokens
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"bunkhouse_memory_mib": NODE_MIB}})
    try:
        with bunkhouse("ray-local", "--config", config, "--preload", QWEN, "--admin-key",
                       ADMIN, "--kv-cache-dir", str(folder / "kv-local"),
                       "--spare-worker", "off") as (local, front), \
                bunkhouse("ray-ray", "--config", config, "--preload", QWEN, "--admin-key",
                          ADMIN, "--ray", cluster.address, "--spare-worker", "off",
                          "--kv-cache-dir", str(folder / "kv-ray")) as (remote, ray_front):
            targets = [("local", local, front.pid), ("ray", remote, ray_front.pid)]
            for _, url, _ in targets:  # warm-up, not counted
                stream_once(url, "", "Say hello.", 4)
            host = _worker_host()
            before = _cpu(host)
            time.sleep(profile.ray_idle_s)  # quiet: its own CPU (the memory polls)
            idle_cpu_per_s = (_cpu(host) - before) / profile.ray_idle_s
            rounds: dict[str, list[list[list[float]]]] = {}
            cpu = {name: 0.0 for name, _, _ in targets} | {"relay": 0.0}
            relayed = {name: 0 for name, _, _ in targets}
            for r in range(profile.ray_rounds):
                for c in CONCURRENCY:
                    for name, url, pid in targets if r % 2 == 0 else targets[::-1]:
                        prompts = [f"[{name} {r} {c} {i}] Write a long list of fruits, one "
                                   "per line." for i in range(c)]
                        front_before, host_before = _cpu(pid), _cpu(host)
                        started = time.monotonic()
                        with ThreadPoolExecutor(c) as pool:
                            done = list(pool.map(
                                lambda p, u=url: stream_once(u, "", p, tokens), prompts))
                        cpu[name] += _cpu(pid) - front_before
                        if name == "ray":
                            cpu["relay"] += max(0.0, _cpu(host) - host_before
                                                - idle_cpu_per_s * (time.monotonic() - started))
                        relayed[name] += sum(n for _, _, n in done)
                        rounds.setdefault(f"{name} c={c}", []).append(
                            [[ttft, tps] for ttft, tps, _ in done])
                print(f"ray: round {r + 1}/{profile.ray_rounds}", file=sys.stderr)
            loads: dict[str, list[float]] = {name: [] for name, _, _ in targets}
            for r in range(profile.ray_load_rounds):
                for name, url, _ in targets if r % 2 == 0 else targets[::-1]:
                    loads[name].append(_load(url))
                print(f"ray: load round {r + 1}/{profile.ray_load_rounds}", file=sys.stderr)
    finally:
        cluster.shutdown()  # type: ignore[no-untyped-call]
    return {"model": QWEN, "tokens": tokens, "concurrency": list(CONCURRENCY),
            "rounds": rounds, "cpu_s": cpu, "relayed_tokens": relayed,
            "host_idle_cpu_per_s": idle_cpu_per_s, "loads": loads}
