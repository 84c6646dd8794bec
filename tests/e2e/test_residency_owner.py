"""Residency decides on state no other task changes: faults of the kind "a decision made on
state that another task changes, a wait that gives the loop no turn", each reproduced as a
user would, through `bunkhouse serve` with real workers and models.

``BUNKHOUSE_FREEZE_RUNS=20 pytest tests/e2e/test_residency_owner.py -k freezes`` repeats the
first on 20 fresh servers (the suite runs it on 3).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bunkhouse.catalog import Catalog
from tests.e2e.server import Server, serve
from tests.e2e.shared import post_stream, stale_plan_config, stream_usage
from tests.helpers import wait_for
from tests.models import GEMMA, QWEN

ADMIN = {"authorization": "Bearer admin-owner"}
FREEZE_RUNS = int(os.environ.get("BUNKHOUSE_FREEZE_RUNS", "3"))


def _complete(server: Server, model: str, tokens: int = 4,
              timeout: float = 300) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=timeout, json={
        "model": model, "prompt": "Once upon a time", "max_tokens": tokens})


class HealthWatch:
    """Polls /health every 50 ms from a thread; remembers every poll not answered within
    10 s (the front froze) and the longest answer."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.misses: list[str] = []
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                httpx.get(f"{self.server.url}/health", timeout=10).raise_for_status()
            except httpx.HTTPError as e:
                self.misses.append(repr(e))
            self.longest = max(self.longest, time.monotonic() - began)
            self._stop.wait(0.05)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


@pytest.mark.slow
@pytest.mark.parametrize("run", range(FREEZE_RUNS))
def test_a_spare_still_starting_never_freezes_the_front(
        tmp_path: Path, packaged_catalog: Catalog, run: int) -> None:
    """g1's load takes the spare and a new spare starts; g2, asked as soon as g1 answered,
    must count that spare while it starts without the front ever stopping to answer."""
    config = stale_plan_config(tmp_path, packaged_catalog)
    with serve(tmp_path, "--config", str(config), "--budget", "950000000") as server:
        wait_for(lambda: server.stats()["spare_worker"] is not None, 60, "the first spare")
        with HealthWatch(server) as watch, ThreadPoolExecutor(1) as pool:
            answered = threading.Event()
            second = pool.submit(lambda: answered.wait(300) and _complete(server, "g2"))
            # g2 is asked the moment g1's answer ends: while the next spare starts
            status, lines = post_stream(server.url, "/v1/completions", {
                "model": "g1", "prompt": "Once upon a time", "max_tokens": 4}, done=answered)
            answer = second.result(timeout=300)
        assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        assert answer and answer.status_code == 200, answer and answer.text
        assert not watch.misses, f"/health went unanswered: {watch.misses[:3]}"
        stats = server.stats()
        assert stats["used_bytes"] <= stats["budget_bytes"]
        assert stats["peak_used_bytes"] <= stats["budget_bytes"]


def _g1_stream(server: Server, tokens: int, first: threading.Event
               ) -> tuple[int, list[str], float]:
    status, lines = post_stream(server.url, "/v1/completions", {
        "model": "g1", "prompt": "Once upon a time", "max_tokens": tokens,
        "ignore_eos": True, "stream_options": {"include_usage": True}}, first)
    return status, lines, time.monotonic()


def _timed(server: Server, model: str) -> tuple[httpx.Response, float]:
    answer = _complete(server, model)
    return answer, time.monotonic()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_model_that_fits_is_loaded_while_another_waits_for_memory(
        tmp_path: Path, packaged_catalog: Catalog) -> None:
    """g1 streams; q needs g1's memory and waits for its stream to end; g2, which fits beside
    g1, is answered meanwhile (not after q's wait); q is answered once g1's stream ends. Then
    the same while g2 keeps getting requests: q is still served after the stream."""
    config = stale_plan_config(tmp_path, packaged_catalog)
    with serve(tmp_path, "--config", str(config), "--budget", "950000000",
               "--admission-wait", "600") as server, ThreadPoolExecutor(4) as pool:
        for g2_busy in (False, True):
            first = threading.Event()
            g1: Future[tuple[int, list[str], float]] = pool.submit(
                _g1_stream, server, 400, first)
            assert first.wait(300), "g1's stream did not start"
            time.sleep(1)
            q = pool.submit(_timed, server, "q")
            wait_for(lambda: server.model("q")["waiting"] == 1, 60, "q to wait for memory")
            time.sleep(1)
            g2_answer = _complete(server, "g2")
            assert g2_answer.status_code == 200, g2_answer.text
            assert not g1.done(), "g2 was answered only after g1's stream ended"
            stop = threading.Event()
            busy = pool.submit(_keep_asking, server, "g2", stop) if g2_busy else None
            status, lines, g1_end = g1.result(timeout=600)
            assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
            assert stream_usage(lines)["completion_tokens"] == 400
            answer, q_end = q.result(timeout=600)
            stop.set()
            assert answer.status_code == 200, answer.text
            assert q_end >= g1_end - 1.0
            if busy is not None:
                statuses = busy.result(timeout=600)
                assert statuses and set(statuses) == {200}, statuses
            server_used = server.stats()
            assert server_used["peak_used_bytes"] <= server_used["budget_bytes"]


def _keep_asking(server: Server, model: str, stop: threading.Event) -> list[int]:
    """Requests for ``model``, one after the other, until ``stop``."""
    statuses = []
    while not stop.is_set():
        statuses.append(_complete(server, model).status_code)
    return statuses


@pytest.fixture(scope="module")
def admin_host(tmp_path_factory: pytest.TempPathFactory,
               packaged_catalog: Catalog) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("owner")
    root = workdir / "root"
    root.mkdir()
    source = packaged_catalog.get(GEMMA).path.resolve()
    try:
        os.link(source, root / "g.gguf")
    except OSError:
        shutil.copy(source, root / "g.gguf")
    with serve(workdir, "--admin-key", "admin-owner", "--allow-runtime-load",
               "--allowed-root", str(root), "--spare-worker", "off",
               "--stop-grace", "1") as server:
        server.root = root  # type: ignore[attr-defined]
        yield server


def _register(server: Server, model_id: str) -> httpx.Response:
    path = str(server.root / "g.gguf")  # type: ignore[attr-defined]
    return httpx.post(f"{server.url}/v1/models", headers=ADMIN, timeout=300,
                      json={"id": model_id, "path": path, "context": 2048})


def _cold(server: Server, model_id: str) -> None:
    """Make ``model_id`` absent, so that its next request starts a cold load."""
    resp = httpx.post(f"{server.url}/v1/models/{model_id}/unload", headers=ADMIN,
                      timeout=120)
    assert resp.status_code in (200, 204), resp.text  # 200: absent already


def _behind_a_cold_start(server: Server, pool: ThreadPoolExecutor, model_id: str
                         ) -> tuple[Future[httpx.Response], Future[httpx.Response]]:
    """A request for a cold QWEN, and 0.3 s later one for ``model_id``: queued behind
    QWEN's cold start (one at a time)."""
    _cold(server, QWEN)
    _cold(server, model_id)
    cold = pool.submit(_complete, server, QWEN)
    wait_for(lambda: server.model(QWEN)["state"] == "loading", 60, "qwen's cold start")
    time.sleep(0.3)
    queued = pool.submit(_complete, server, model_id)
    wait_for(lambda: server.model(model_id)["waiting"] == 1, 60, f"{model_id} to queue")
    time.sleep(0.3)
    return cold, queued


@pytest.mark.slow
def test_a_delete_during_a_queued_load_frees_the_id(admin_host: Server) -> None:
    """DELETE of a model whose load is queued behind another's cold start: 204, its waiting
    request a clean 404, the id gone from the listing and free to register again."""
    server = admin_host
    assert _register(server, "rx").status_code == 200
    with ThreadPoolExecutor(2) as pool:
        cold, queued = _behind_a_cold_start(server, pool, "rx")
        deleted = httpx.delete(f"{server.url}/v1/models/rx", headers=ADMIN, timeout=120)
        assert deleted.status_code == 204, deleted.text
        answer = queued.result(timeout=300)
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["code"] == "model_not_found"
        assert cold.result(timeout=300).status_code == 200
    listed = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert "rx" not in listed
    again = _register(server, "rx")
    assert again.status_code == 200, again.text
    assert _complete(server, "rx").status_code == 200
    assert httpx.delete(f"{server.url}/v1/models/rx", headers=ADMIN).status_code == 204
    log = server.log.read_text()
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.slow
def test_an_unload_during_a_queued_load_answers_once_the_model_is_absent(
        admin_host: Server) -> None:
    """An unload sent while a load is queued for a waiting request: that request is served,
    then the model stops; the unload answers 204 only then, and the model is never shown
    ready after it."""
    server = admin_host
    assert _register(server, "ru").status_code == 200
    with ThreadPoolExecutor(2) as pool:
        cold, queued = _behind_a_cold_start(server, pool, "ru")
        unloaded = httpx.post(f"{server.url}/v1/models/ru/unload", headers=ADMIN,
                              timeout=300)
        states = [server.model("ru")["state"] for _ in range(20)]
        assert unloaded.status_code == 204, unloaded.text
        assert set(states) == {"absent"}, states
        answer = queued.result(timeout=300)
        assert answer.status_code == 200, answer.text
        assert cold.result(timeout=300).status_code == 200
    events = [(e["model"], e["kind"]) for e in server.stats()["events"]
              if e["model"] == "ru" and e["kind"] != "load_progress"]
    assert events[-4:] == [("ru", "loading"), ("ru", "ready"), ("ru", "draining"),
                           ("ru", "absent")], events
    assert httpx.delete(f"{server.url}/v1/models/ru", headers=ADMIN).status_code == 204
