"""Fault paths with real worker processes running the fault engine (tests/fault_engine.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import psutil

from bunkhouse.catalog import Catalog
from tests.e2e.server import Server, serve
from tests.fault_engine import ENGINE
from tests.helpers import REPO, wait_for, write_tiny_gguf
from tests.models import QWEN


def _serve_faulty(tmp_path: Path, faults: dict[str, dict[str, object]], *args: str):  # type: ignore[no-untyped-def]
    models = tmp_path / "models"
    for model_id in faults:
        write_tiny_gguf(models / f"{model_id}.gguf")
    env = {"BUNKHOUSE_FAULTS": json.dumps(faults), "PYTHONPATH": str(REPO)}
    return serve(tmp_path, "--no-packaged", "--models-dir", str(models), "--worker-engine", ENGINE,
                 *args, env=env)


def _ask(server: Server, model: str, **extra: object) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        **extra})


def _kinds(server: Server, model: str) -> list[str]:
    return [e["kind"] for e in server.stats()["events"] if e["model"] == model]


def test_a_crash_loop_ends_in_failed_after_the_budget(tmp_path: Path) -> None:
    with _serve_faulty(tmp_path, {"crashy": {"fail_load": "weights are garbage"}}) as server:
        codes = [_ask(server, "crashy").json()["error"]["code"] for _ in range(7)]
        assert codes == ["model_load_failed"] * 4 + ["model_failed"] * 3
        assert _kinds(server, "crashy").count("loading") == 4  # 1 + 3 restarts: no storm
        last = _ask(server, "crashy")
        assert last.status_code == 503 and int(last.headers["retry-after"]) > 0
        assert "failed to load" in last.json()["error"]["message"]
        assert server.model("crashy")["state"] == "failed"
    assert "weights are garbage" in server.log.read_text()  # the worker's reason: logged


def test_a_worker_crashing_mid_stream_is_respawned(tmp_path: Path) -> None:
    with _serve_faulty(tmp_path, {"flaky": {"crash_after_tokens": 3}}) as server:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30, json={
                "model": "flaky", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 10, "stream": True}) as resp:
            lines = [line for line in resp.iter_lines() if line]
        assert lines[:3] == [line for line in lines[:3] if line.startswith("data: ")]
        assert lines[3] == "event: error"
        assert json.loads(lines[4][6:])["error"]["code"] == "engine_unavailable"
        wait_for(lambda: "respawning" in _kinds(server, "flaky"), 10, "the respawn")
        # The new worker has the same fault: ask for fewer tokens than it survives.
        assert _ask(server, "flaky", max_tokens=2).status_code == 200


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    with _serve_faulty(tmp_path, {"stubborn": {"ignore_sigterm": True}},
                       "--stop-grace", "1") as server:
        assert _ask(server, "stubborn").status_code == 200
        worker = psutil.Process(server.model("stubborn")["pid"])
        started = time.monotonic()
        server.proc.terminate()
        assert server.proc.wait(timeout=20) == 0
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
        assert time.monotonic() - started < 15
        assert "ignored SIGTERM" in server.log.read_text()


def test_a_hung_worker_is_detected_and_replaced(tmp_path: Path) -> None:
    with _serve_faulty(tmp_path, {"hangs": {"hang_after_requests": 1}},
                       "--probe-interval", "0.5") as server:
        assert _ask(server, "hangs").status_code == 200  # from now on it answers nothing
        first = server.model("hangs")["pid"]
        wait_for(lambda: server.model("hangs")["pid"] not in (first, None)
                 and server.model("hangs")["state"] == "ready", 20, "a replacement worker")
        assert "crashed" in _kinds(server, "hangs")
        assert _ask(server, "hangs").status_code == 200


def test_answers_never_count_against_a_workers_health(tmp_path: Path) -> None:
    """A worker that answers, even with a 500 every time, is alive: only what proves it sick
    (transport failures, timeouts, missed probes, a stream it cut) replaces it."""
    with _serve_faulty(tmp_path, {"broken": {"fail_generation": True}},
                       "--probe-interval", "0.5") as server:
        assert [_ask(server, "broken").status_code for _ in range(6)] == [500] * 6
        pid = server.model("broken")["pid"]
        time.sleep(2)  # several probe rounds: it answers them all
        assert server.model("broken")["pid"] == pid and server.model("broken")["state"] == "ready"
        assert "crashed" not in _kinds(server, "broken")


def test_a_stall_on_a_requests_grammar_is_that_requests_not_the_models(
        tmp_path: Path, packaged_catalog: Catalog) -> None:
    """The constraint probe measures the real model (a cheap grammar passes it); the fault
    engine's worker then stalls on that grammar past its liveness probes, three times: each
    request gets a 400 naming ``grammar``, its grammar is refused from then on, the client
    whose requests stalled it twice gets 429 for its next constrained request, and the model
    never counts a failure (nor gives up)."""
    models = tmp_path / "models"
    models.mkdir()
    os.link(packaged_catalog.get(QWEN).path, models / "stally.gguf")
    env = {"BUNKHOUSE_FAULTS": json.dumps({"stally": {"stall_on_grammar": True}}),
           "PYTHONPATH": str(REPO)}
    with serve(tmp_path, "--no-packaged", "--models-dir", str(models), "--worker-engine",
               ENGINE, "--probe-interval", "1", "--api-key", "one", "--api-key", "two",
               env=env) as server:
        def ask(key: str, **extra: object) -> httpx.Response:
            return httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
                "model": "stally", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, **extra}, headers={"authorization": f"Bearer {key}"})

        assert ask("one").status_code == 200
        for n, key in enumerate(["one", "one", "two"]):
            grammar = f'root ::= "yes{n}" | "no{n}"'
            resp = ask(key, grammar=grammar)
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["param"] == "grammar" and "stalled" in error["message"], error
            again = ask("two", grammar=grammar)  # refused before any worker, for anyone
            assert again.status_code == 400 and again.json()["error"]["param"] == "grammar"
            if n == 1:  # two stalls: this client's constrained requests wait a while
                cooled = ask("one", grammar='root ::= "other"')
                assert cooled.status_code == 429 and int(cooled.headers["retry-after"]) > 0
                assert cooled.json()["error"]["code"] == "stalled_too_often"
        assert ask("one").status_code == 200  # unconstrained: served
        kinds = _kinds_keyed(server, "stally", "one")
        assert kinds.count("crashed") == 3 and "gave_up" not in kinds, kinds
        model = httpx.get(f"{server.url}/v1/models/stally",
                          headers={"authorization": "Bearer two"}).json()
        assert model["state"] == "ready"


def _kinds_keyed(server: Server, model: str, key: str) -> list[str]:
    stats = httpx.get(f"{server.url}/stats", headers={"authorization": f"Bearer {key}"}).json()
    return [e["kind"] for e in stats["events"] if e["model"] == model]
