"""The engine's own HTTP server (xllamacpp's embedded llama-server) on loopback TCP.

The peer that benchmarks compare bunkhouse against: the same GGUF with the same engine
parameters bunkhouse's worker uses (context, slots, and llama.cpp's own options: threads,
prompt cache, as ``--engine-options`` JSON, as a worker gets them), listening on
127.0.0.1 with a per-process API key instead of a private Unix socket.
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

import xllamacpp

from bunkhouse.worker.engine import WorkerConfig
from bunkhouse.worker.engines.llamacpp import build_params


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-id", required=True)
    p.add_argument("--model-path", required=True, type=Path)
    p.add_argument("--port", required=True, type=int)
    p.add_argument("--api-key", default="")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--engine-options", default="{}", metavar="JSON")
    a = p.parse_args()
    config = WorkerConfig(a.model_id, a.model_path, Path("unused.sock"), a.context,
                          a.parallel, engine_options=a.engine_options)
    params = build_params(config)
    params.hostnames = ["127.0.0.1"]
    params.port = a.port
    if a.api_key:
        params.api_keys = [a.api_key]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = xllamacpp.Server(params)
    print("ready", flush=True)
    while not stop.wait(0.2):
        pass
    del server


if __name__ == "__main__":
    main()
