"""``bunkhouse pull NAME``: one pull, start to end, in this process. It tells how it goes as
steps (:class:`Step`), which ``--json`` prints one JSON object a line (what the server reads
from the pull it runs as a child process) and a terminal sees as a progress bar (tqdm: bytes,
speed, time left).

The steps, in Ollama's order: ``pulling manifest``; ``pulling <digest>`` for each file as its
bytes come (``digest``, ``total``, ``completed``; at most every :data:`EVERY_S`); ``verifying
sha256 digest``; ``writing manifest`` (the pull's record, which puts the model in the
catalog); ``success`` (with ``id``, the id it is served under, and ``names``). A failure ends
it with ``{"error", "code", "http_status"}``. SIGTERM or SIGINT stops it: the hub client
removes its temporary file, and nothing is recorded.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from bunkhouse.errors import BunkhouseError
from bunkhouse.pull import hub
from bunkhouse.pull.names import parse
from bunkhouse.pull.records import record

EVERY_S = 0.25
"""Seconds between two progress steps of one file (its first and last always go)."""

Step = dict[str, Any]


class Stopped(BaseException):
    """SIGTERM or SIGINT: the pull stops where it is (a BaseException: nothing catches it
    on the way out but the hub client's own clean-up)."""


def pull(name: str, data_dir: Path, emit: Callable[[Step], None]) -> hub.Plan:
    """Pull ``name`` (see bunkhouse.pull.names), telling ``emit`` each step. Raises
    BunkhouseError (InvalidRequest, ModelNotFound, Forbidden, InsufficientStorage,
    PullFailed)."""
    parsed = parse(name)
    emit({"status": "pulling manifest"})
    plan = hub.make_plan(parsed)
    todo = hub.missing(plan)
    hub.check_disk(plan, todo)
    emit({"status": "plan", "repo": plan.repo, "commit": plan.commit, "id": plan.model_id,
          "total": plan.total, "download": sum(f.size for f in todo),
          "files": [{"name": f.name, "digest": f.digest, "size": f.size} for f in plan.files]})
    digests = {f.name: f.digest for f in plan.files}
    last: dict[str, float] = {}

    told: dict[str, int] = {}

    def meter(file: str, done: int, total: int) -> None:
        now = time.monotonic()
        if told.get(file) == done or (done < total and now - last.get(file, 0.0) < EVERY_S):
            return
        last[file], told[file] = now, done
        emit({"status": f"pulling {digests[file]}", "file": file, "digest": digests[file],
              "total": total, "completed": min(done, total)})

    def verifying(f: hub.HubFile) -> None:
        if f is plan.files[0]:
            emit({"status": "verifying sha256 digest"})

    hub.fetch(plan, meter, verifying)
    emit({"status": "writing manifest"})
    record(data_dir, plan)
    emit({"status": "success", "id": plan.model_id, "names": list(plan.names)})
    return plan


def main(name: str, data_dir: Path, as_json: bool) -> int:
    """The command: 0 once pulled; 1 with the error (stderr, or a JSON step); 130 stopped."""
    def stop(*_: object) -> None:
        raise Stopped

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    out: Callable[[Step], None] = _json_lines(sys.stdout) if as_json else _Terminal(sys.stderr)
    try:
        plan = pull(name, data_dir, out)
    except BunkhouseError as e:
        if as_json:
            out({"error": e.message, "code": e.code, "http_status": e.status})
        else:
            print(f"\nbunkhouse: error: {e.message}", file=sys.stderr)
        return 1
    except Stopped:
        if as_json:
            out({"error": "the pull was cancelled", "code": "pull_cancelled",
                 "http_status": 499})
        else:
            print("\nbunkhouse: pull stopped (nothing was kept but whole files)",
                  file=sys.stderr)
        return 130
    if not as_json:
        others = ", ".join(n for n in plan.names if n != plan.model_id)
        print(f"pulled {plan.given}: served as {plan.model_id}"
              + (f" (also {others})" if others else ""), file=sys.stderr)
        print(plan.model_id)
        print("a running server serves it after `bunkhouse reload`; `bunkhouse serve` "
              "serves it from now on", file=sys.stderr)
    return 0


def _json_lines(stream: TextIO) -> Callable[[Step], None]:
    def emit(step: Step) -> None:
        stream.write(json.dumps(step) + "\n")
        stream.flush()

    return emit


class _Terminal:
    """Steps as a terminal shows them: a line per stage, one byte bar for the download."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._bar: Any = None
        self._done: dict[str, int] = {}

    def __call__(self, step: Step) -> None:
        from tqdm import tqdm

        status = step["status"]
        if status == "plan":
            files = step["files"]
            print(f"{step['repo']} at {step['commit'][:12]}: {len(files)} file(s), "
                  f"{_size(step['total'])}" + ("" if step["download"] else ", all in the cache"),
                  file=self._stream)
            if step["download"]:
                # the terminal's size, 80x24 where it reports none (a new pty's 0x0 would
                # hide tqdm's bar as off screen)
                size = shutil.get_terminal_size()
                self._bar = tqdm(total=step["total"], unit="B", unit_scale=True,
                                 unit_divisor=1024, desc="pulling", file=self._stream,
                                 ncols=min(size.columns, 120), nrows=size.lines, miniters=1)
        elif "file" in step:
            if self._bar is not None:
                self._done[step["file"]] = step["completed"]
                self._bar.update(sum(self._done.values()) - self._bar.n)
        else:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            print(status, file=self._stream)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
