"""Residency under contention and shutdown, through `bunkhouse serve` with real workers."""

from __future__ import annotations

import json
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from bunkhouse.catalog import Catalog
from tests.e2e.server import Server, running, serve
from tests.e2e.shared import post_stream, stale_plan_config, stream_usage
from tests.fault_engine import ENGINE
from tests.helpers import CHILD_PYTHONPATH, REPO, wait_for, write_tiny_gguf
from tests.models import GEMMA, QWEN


@pytest.mark.slow
@pytest.mark.timeout(1500)  # about 25 s here; far longer on a machine shared with a busy process
def test_stale_plan_steps_end_to_end(tmp_path: Path, packaged_catalog: Catalog) -> None:
    """g1 and g2 fit together, q fits with neither. A stream to q makes room; while g1 is
    stopped, an 800-token stream starts on g2: it arrives whole; q is answered before or
    after it, or gets a clean 503; the models never swap in a loop."""
    config = stale_plan_config(tmp_path, packaged_catalog)
    with serve(tmp_path, "--config", str(config), "--budget", "950000000") as server:
        for model in ("g1", "g2"):
            warm = httpx.post(f"{server.url}/v1/completions", timeout=120,
                              json={"model": model, "prompt": "Hi", "max_tokens": 1})
            assert warm.status_code == 200, warm.text
        chat = {"model": "q", "max_tokens": 16,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        long = {"model": "g2", "prompt": "Once upon a time", "max_tokens": 800,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        with ThreadPoolExecutor(2) as pool:
            q: Future[tuple[int, list[str]]] = pool.submit(
                post_stream, server.url, "/v1/chat/completions", chat)
            wait_for(lambda: server.model("g1")["state"] != "ready", 60, "g1 to be stopped")
            g2 = pool.submit(post_stream, server.url, "/v1/completions", long)
            g2_status, g2_lines = g2.result(timeout=1400)
            q_status, q_lines = q.result(timeout=1400)
        assert g2_status == 200 and g2_lines[-1] == "data: [DONE]", g2_lines[-3:]
        assert "event: error" not in g2_lines
        assert stream_usage(g2_lines)["completion_tokens"] == 800
        if q_status == 200:
            assert q_lines[-1] == "data: [DONE]" and "event: error" not in q_lines
        else:
            assert q_status == 503 and "insufficient_memory" in q_lines[0], q_lines
        loads = [e for e in server.stats()["events"] if e["kind"] == "loading"]
        assert len(loads) <= 5, f"swap loop: {[e['model'] for e in loads]}"


@pytest.mark.slow
def test_shutdown_ends_running_requests_with_shutting_down(tmp_path: Path) -> None:
    """A stream ends with an SSE error event, a plain request gets a 503, both saying the
    server is shutting down; the busy worker stops at its SIGTERM (no SIGKILL needed)."""
    with running(tmp_path, "--stop-grace", "2") as server:
        first = threading.Event()
        body = {"model": QWEN, "max_tokens": 2000, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Tell me about ships."}]}
        with ThreadPoolExecutor(2) as pool:
            stream = pool.submit(post_stream, server.url, "/v1/chat/completions", body, first)
            assert first.wait(120)
            plain = pool.submit(httpx.post, f"{server.url}/v1/chat/completions", json=body,
                                timeout=120)
            wait_for(lambda: server.model(QWEN)["running"] == 2, 60, "both requests running")
            workers = server.workers()
            assert workers
            server.proc.send_signal(signal.SIGTERM)
            status, lines = stream.result(timeout=120)  # no truncated body: it would raise
            cut = plain.result(timeout=120)
        assert status == 200
        assert lines[-2] == "event: error", lines[-3:]
        assert json.loads(lines[-1][6:])["error"]["code"] == "shutting_down"
        assert cut.status_code == 503 and cut.json()["error"]["code"] == "shutting_down"
        assert server.proc.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers left running: {alive}"
    log = server.log.read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert "ignored SIGTERM" not in log


def test_requests_queued_at_shutdown_get_shutting_down(tmp_path: Path) -> None:
    """Requests waiting for a slot when the front stops are never sent to a stopped worker."""
    models = tmp_path / "models"
    write_tiny_gguf(models / "one.gguf")
    config = tmp_path / "bunkhouse.toml"
    config.write_text(f'include_packaged = false\nmodels_dirs = ["{models}"]\n'
                      "[defaults]\nparallel = 1\nqueue = 2\n")
    env = {"BUNKHOUSE_FAULTS": json.dumps({"one": {"token_interval_s": 0.05}}),
           "PYTHONPATH": CHILD_PYTHONPATH}
    body = {"model": "one", "max_tokens": 400, "messages": [{"role": "user", "content": "hi"}]}
    with running(tmp_path, "--config", str(config), "--worker-engine", ENGINE, "--stop-grace", "1",
                 env=env) as server:
        first = threading.Event()
        with ThreadPoolExecutor(3) as pool:
            stream = pool.submit(post_stream, server.url, "/v1/chat/completions", body, first)
            assert first.wait(60)
            queued = [pool.submit(post_stream, server.url, "/v1/chat/completions", body),
                      pool.submit(httpx.post, f"{server.url}/v1/chat/completions", json=body,
                                  timeout=60)]
            wait_for(lambda: server.model("one")["queued"] == 2, 30, "two queued requests")
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(timeout=60) == 0
            assert stream.result(timeout=30)[1][-2] == "event: error"
            status, lines = queued[0].result(timeout=30)
            plain = queued[1].result(timeout=30)
        # the queued stream had its headers while it waited: its end is the error event
        assert status == 200 and lines[-2] == "event: error" and "shutting_down" in lines[-1]
        assert not [line for line in lines if line.startswith("data: {\"id")]  # no answer
        assert plain.status_code == 503 and plain.json()["error"]["code"] == "shutting_down"
    assert "Traceback" not in server.log.read_text()


def test_a_second_interrupt_still_stops_cleanly(tmp_path: Path) -> None:
    models = tmp_path / "models"
    write_tiny_gguf(models / "one.gguf")
    env = {"BUNKHOUSE_FAULTS": json.dumps({"one": {"token_interval_s": 0.05}}),
           "PYTHONPATH": CHILD_PYTHONPATH}
    body = {"model": "one", "max_tokens": 400, "messages": [{"role": "user", "content": "hi"}]}
    with running(tmp_path, "--no-packaged", "--models-dir", str(models), "--worker-engine", ENGINE,
                 "--stop-grace", "2", env=env) as server:
        first = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(post_stream, server.url, "/v1/chat/completions", body, first)
            assert first.wait(60)
            workers = server.workers()
            server.proc.send_signal(signal.SIGINT)
            wait_for(lambda: "Shutting down" in server.log.read_text(), 30, "the shutdown")
            server.proc.send_signal(signal.SIGINT)
            assert server.proc.wait(timeout=60) == 0
            stream.result(timeout=30)
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive
    assert "Traceback" not in server.log.read_text(), server.log.read_text()[-3000:]


def test_sigterm_while_one_model_drains_and_another_loads(tmp_path: Path) -> None:
    models = tmp_path / "models"
    for model_id in ("busy", "slow"):
        write_tiny_gguf(models / f"{model_id}.gguf")
    faults = {"busy": {"token_interval_s": 0.05}, "slow": {"load_delay_s": 60}}
    env = {"BUNKHOUSE_FAULTS": json.dumps(faults), "PYTHONPATH": CHILD_PYTHONPATH}
    admin = {"authorization": "Bearer adm"}
    with serve(tmp_path, "--no-packaged", "--models-dir", str(models), "--worker-engine", ENGINE,
               "--admin-key", "adm", "--stop-grace", "2", env=env) as server:
        first = threading.Event()
        body = {"model": "busy", "max_tokens": 400,
                "messages": [{"role": "user", "content": "hi"}]}
        with ThreadPoolExecutor(3) as pool:
            stream = pool.submit(post_stream, server.url, "/v1/chat/completions", body, first,
                                 admin)
            assert first.wait(60)
            unload = pool.submit(httpx.post, f"{server.url}/v1/models/busy/unload",
                                 headers=admin, timeout=120)
            wait_for(lambda: _state(server, "busy") == "draining", 30, "busy to drain")
            loading = pool.submit(httpx.post, f"{server.url}/v1/chat/completions", timeout=120,
                                  headers=admin, json={**body, "model": "slow"})
            wait_for(lambda: _state(server, "slow") == "loading", 30, "slow to load")
            wait_for(lambda: len(server.workers()) >= 2, 30, "both workers to be running")
            workers = server.workers()
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(timeout=60) == 0
            _, alive = psutil.wait_procs(workers, timeout=10)
            assert not alive, f"workers left running: {alive}"
            status, lines = stream.result(timeout=30)
            assert status == 200 and lines[-2] == "event: error", lines[-3:]
            assert unload.result(timeout=30).status_code in (202, 204)
            assert loading.result(timeout=30).status_code == 503


def _state(server: Server, model_id: str) -> str:
    state: str = httpx.get(f"{server.url}/v1/models/{model_id}",
                           headers={"authorization": "Bearer adm"}).json()["state"]
    return state


@pytest.mark.slow
def test_a_prompt_that_can_never_fit_is_refused_before_its_model_loads(tmp_path: Path) -> None:
    """Loading the model would evict the resident one: the 400 comes first, nothing moves."""
    prose = (REPO / "README.md").read_text() * 6  # tens of thousands of tokens
    with serve(tmp_path, "--budget", "800MiB", "--context", "8192") as server:
        warm = httpx.post(f"{server.url}/v1/completions", timeout=120,
                          json={"model": GEMMA, "prompt": "Hi", "max_tokens": 1})
        assert warm.status_code == 200
        for path, body in (
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": prose}]}),
                ("/v1/completions", {"prompt": prose})):
            resp = httpx.post(f"{server.url}{path}", timeout=120,
                              json={"model": QWEN, "max_tokens": 16, **body})
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["code"] == "context_length_exceeded" and "at least" in err["message"]
            assert err["param"] == ("messages" if "messages" in body else "prompt")
        assert server.model(GEMMA)["state"] == "ready"
        assert server.model(QWEN)["state"] == "absent"
        assert not [e for e in server.stats()["events"] if e["model"] == QWEN]
