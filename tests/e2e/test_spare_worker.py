"""The spare worker, with real processes: kept while the host is idle, taken by the next load
(the new worker is the spare's process), counted in the budget, and gone with its front."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import psutil

from bunkhouse import defaults
from tests.e2e.server import Server, running, serve
from tests.helpers import wait_for
from tests.models import GEMMA, QWEN

MIB = 1024 * 1024


def _spares(server: Server) -> list[psutil.Process]:
    """The spare worker /stats shows, checked to be a child of the front waiting as one."""
    spare = server.stats()["spare_worker"]
    if spare is None:
        return []
    proc = psutil.Process(spare["pid"])
    assert proc in server.workers() and "--spare" in proc.cmdline()
    return [proc]


def _complete(server: Server, model: str) -> None:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": model, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_each_load_becomes_the_spare_and_its_memory_is_in_the_budget(tmp_path: Path) -> None:
    with serve(tmp_path, "--budget", "1150MiB") as server:  # one model (and a spare)
        first = wait_for(lambda: _spares(server), 60, "a spare worker at start")[0]
        _complete(server, QWEN)  # the first load, too, takes the spare
        assert server.model(QWEN)["pid"] == first.pid
        spare = wait_for(lambda: _spares(server), 60, "a spare worker once idle")[0]
        stats = server.stats()
        qwen = server.model(QWEN)
        assert stats["used_bytes"] == qwen["estimated_bytes"] + defaults.SPARE_BYTES
        assert spare.memory_info().rss < defaults.SPARE_BYTES
        _complete(server, GEMMA)  # Qwen is evicted; Gemma's worker is the spare
        assert server.model(GEMMA)["pid"] == spare.pid
        assert server.model(QWEN)["state"] == "absent"
        next_spare = wait_for(lambda: _spares(server), 60, "a new spare")[0]
        assert next_spare.pid != spare.pid
        _complete(server, QWEN)
        assert server.model(QWEN)["pid"] == next_spare.pid
        assert server.stats()["peak_used_bytes"] <= 1150 * MIB


def test_no_spare_with_the_option_off_or_without_room(tmp_path: Path) -> None:
    with serve(tmp_path / "off", "--spare-worker", "off") as server:
        _complete(server, GEMMA)
        time.sleep(2)  # a spare would be started as soon as the request ended
        assert not _spares(server)
    with serve(tmp_path / "tight", "--budget", "680MiB") as server:  # Gemma, not a spare too
        _complete(server, GEMMA)
        time.sleep(2)
        gemma = server.model(GEMMA)["estimated_bytes"]
        assert 680 * MIB - gemma < defaults.SPARE_BYTES
        assert not _spares(server)


def test_the_spare_dies_with_its_front(tmp_path: Path) -> None:
    with running(tmp_path) as server:
        _complete(server, GEMMA)
        spare = wait_for(lambda: _spares(server), 60, "a spare worker")[0]
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        _, alive = psutil.wait_procs([spare], timeout=30)
        assert not alive
