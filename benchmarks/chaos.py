"""Chaos: mixed streaming load on both packaged models while workers are SIGKILLed at random.

Every request must end one of two ways: answered, or failed cleanly (an OpenAI error
envelope, or an SSE `event: error` at the end of a stream). A request that outlives its
timeout is hung; anything else (a truncated stream with no error, a reset) is unclean. After
the run the front is stopped and every worker process ever seen must be gone.

Run as part of `python -m benchmarks run` (section `reliability`).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from collections import Counter

import httpx
import psutil

from benchmarks.common import bunkhouse_argv, free_port, process, wait_http

MODELS = ("qwen2.5-coder-0.5b-instruct", "gemma-3-270m")
REQUEST_TIMEOUT_S = 60.0


def one_request(url: str, model: str, rng: random.Random) -> str:
    """'ok', 'clean' (a clean failure), 'hung' or 'unclean'."""
    stream = rng.random() < 0.75
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": rng.randint(8, 48),
            "ignore_eos": True, "stream": stream}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body,
                          timeout=REQUEST_TIMEOUT_S) as resp:
            if resp.status_code != 200:
                resp.read()
                error = resp.json().get("error")
                return f"clean:{error['code']}" if error else "unclean"
            if not stream:
                resp.read()
                return "ok" if resp.json().get("choices") else "unclean"
            lines = [line for line in resp.iter_lines() if line]
    except httpx.TimeoutException:
        return "hung"
    except (httpx.HTTPError, ValueError):
        return "unclean"
    if lines and lines[-1] == "data: [DONE]":
        return "ok"
    if len(lines) >= 2 and lines[-2] == "event: error":
        return "clean:stream_error_event"
    return "unclean"


def run(duration_s: float, clients: int, seed: int) -> dict[str, int]:
    port = free_port()
    argv = [*bunkhouse_argv(), "serve", "--port", str(port), "--preload", MODELS[0],
            "--preload", MODELS[1], "--probe-interval", "2"]
    url = f"http://127.0.0.1:{port}"
    outcomes: Counter[str] = Counter()
    seen_workers: dict[int, psutil.Process] = {}
    kills = 0
    stop = threading.Event()
    lock = threading.Lock()
    with process(argv, "chaos-bunkhouse") as front, httpx.Client() as client:
        wait_http(client, f"{url}/health", front)
        front_ps = psutil.Process(front.pid)

        def load(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while not stop.is_set():
                result = one_request(url, rng.choice(MODELS), rng)
                with lock:
                    outcomes[result] += 1

        threads = [threading.Thread(target=load, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        rng = random.Random(seed)
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            for child in front_ps.children(recursive=True):
                seen_workers.setdefault(child.pid, child)
            if stop.wait(rng.uniform(8.0, 16.0)):  # within the restart budget (3 in 60 s)
                break
            workers = front_ps.children(recursive=True)
            if workers:
                victim = rng.choice(workers)
                seen_workers.setdefault(victim.pid, victim)
                os.kill(victim.pid, signal.SIGKILL)
                kills += 1
                print(f"killed worker pid {victim.pid}", file=sys.stderr)
        stop.set()
        for t in threads:
            t.join(REQUEST_TIMEOUT_S + 10)
        for child in front_ps.children(recursive=True):
            seen_workers.setdefault(child.pid, child)
        front_alive = front.poll() is None
    # _process has SIGTERMed the front and waited for it.
    _, alive = psutil.wait_procs(list(seen_workers.values()), timeout=2)
    for kind, n in sorted(outcomes.items()):
        print(f"{kind}: {n}", file=sys.stderr)
    return {
        "duration_s": int(duration_s),
        "clients": clients,
        "workers_killed": kills,
        "requests_sent": sum(outcomes.values()),
        "succeeded": outcomes["ok"],
        "failed_cleanly": sum(n for k, n in outcomes.items() if k.startswith("clean")),
        "unclean": outcomes["unclean"],
        "hung": outcomes["hung"],
        "front_restarts": 0 if front_alive else 1,
        "front_exit_code": front.returncode,
        "orphans": len(alive),
    }
