"""``python -m bunkhouse.worker``: one model, one engine, one Unix socket.

``python -m bunkhouse.worker --spare ENGINE --parent-pid PID``: a spare worker. It imports
the engine (the Python interpreter's start and the engine's import are a fifth of a small
model's cold start), then waits on its stdin, a Unix socket from the front, for the command
line of the worker it is to become and the model's file descriptor; then it goes on as that
worker. So a load that finds a spare pays only for the model (supervisor/launcher.py).

Exit codes: 0 after SIGTERM/SIGINT or the parent's death, 2 for bad arguments,
3 when the engine cannot load the model (the reason is the last line on stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from bunkhouse.worker.engine import (
    EngineLoadError,
    WorkerConfig,
    load_engine_class,
)
from bunkhouse.worker.lifeline import hold

log = logging.getLogger("bunkhouse.worker")

EXIT_LOAD_FAILED = 3


def parse_args(argv: list[str] | None) -> tuple[WorkerConfig, str, int | None]:
    p = argparse.ArgumentParser(
        prog="python -m bunkhouse.worker", description="Serve one model on a Unix socket."
    )
    p.add_argument("--model-id", required=True)
    p.add_argument("--model-path", required=True, type=Path)
    p.add_argument("--socket", required=True, type=Path)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--chat-template", default=None,
                   help="a chat template name the engine knows, or a .jinja file")
    p.add_argument("--embeddings", action="store_true",
                   help="serve embeddings too (llama.cpp: larger output buffers)")
    p.add_argument("--snapshot-dir", type=Path, default=None,
                   help="where slots' KV state is saved to and restored from")
    p.add_argument("--pooling", choices=["model", "mean"], default="mean",
                   help="embeddings pool as the model file says, or by the mean")
    p.add_argument("--engine", required=True,
                   help="module:Class of the engine (its front-side adapter names it)")
    p.add_argument("--engine-options", default="{}", metavar="JSON",
                   help="the engine's own options, a JSON object its adapter wrote")
    p.add_argument("--adapter", action="append", type=Path, default=[], metavar="PATH",
                   help="a LoRA adapter to mount (repeatable); requests choose its scale")
    p.add_argument("--draft", type=Path, default=None, metavar="PATH",
                   help="a draft model (GGUF) for speculative decoding")
    p.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process stops being our parent"
    )
    a = p.parse_args(argv)
    config = WorkerConfig(
        a.model_id, a.model_path, a.socket, a.context, a.parallel, a.chat_template,
        a.embeddings, a.snapshot_dir, a.pooling, a.engine_options, tuple(a.adapter),
        a.draft,
    )
    return config, a.engine, a.parent_pid


class _StopFlag:
    """Set by the signal handlers and the lifeline, read by the main loop. No lock: a handler
    runs on the main thread between two bytecodes, possibly inside a ``threading.Event``'s own
    locked section, and an Event's ``set()`` there deadlocked the worker for good (an orphan
    once its front was SIGKILLed)."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


READY_LINE = "serving on"
"""Said (in a log line) once the engine has loaded and listens: the front's health gate
watches the worker's output for it (supervisor/process.py)."""


SPARE_FLAG = "--spare"
SPARE_POLL_S = 0.2  # how often a waiting spare looks at its stop flag


def _await_assignment(engine_path: str, stop: _StopFlag) -> list[str] | None:
    """A spare's wait: the worker command line the front sends on stdin (a Unix socket), with
    the model's descriptor, whose number replaces the front's in ``--model-path``. None: the
    front closed the socket or asked us to stop first."""
    control = socket.socket(fileno=os.dup(0))
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)  # fd 0 again, as a worker's
    control.settimeout(SPARE_POLL_S)
    with control:
        while not stop.is_set():
            try:
                data, fds, _, _ = socket.recv_fds(control, 1 << 16, 1)
            except TimeoutError:
                continue
            if not data:
                return None
            message = json.loads(data)
            argv: list[str] = message["argv"]
            theirs, ours = f"/proc/self/fd/{message['fd']}", f"/proc/self/fd/{fds[0]}"
            at = argv.index("--model-path") + 1
            argv[at] = ours + argv[at][len(theirs):] if argv[at].startswith(theirs) else argv[at]
            if argv[argv.index("--engine") + 1] != engine_path:
                raise SystemExit(f"spare for {engine_path} sent {argv!r}")
            return argv
    return None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s worker %(levelname)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = sys.argv[1:] if argv is None else argv
    stop = _StopFlag()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    engine_class = None
    if args[:1] == [SPARE_FLAG]:  # --spare ENGINE --parent-pid PID
        engine_path, parent = args[1], int(args[3])
        hold(parent, stop.set)
        engine_class = load_engine_class(engine_path)  # the import a spare is for
        assigned = _await_assignment(engine_path, stop)
        if assigned is None:
            return 0
        args = assigned
    config, engine_path, parent_pid = parse_args(args)
    if parent_pid is not None and engine_class is None:
        hold(parent_pid, stop.set)
    config.socket.unlink(missing_ok=True)  # a leftover socket file makes the engine fail
    engine = (engine_class or load_engine_class(engine_path))(config)
    log.info("model %s: loading %s", config.model_id, config.model_path)
    try:
        engine.start()
    except EngineLoadError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_LOAD_FAILED
    # READY_LINE: the front's health gate checks at once instead of at its next poll
    log.info("model %s: %s %s (pid %d)", config.model_id, READY_LINE, config.socket,
             os.getpid())
    while not stop.is_set():
        time.sleep(0.2)
    log.info("model %s: stopping", config.model_id)
    engine.stop()
    config.socket.unlink(missing_ok=True)
    return 0
