"""Crash isolation with real worker processes and the real model."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx
import psutil

from tests.e2e.server import Server, running, serve
from tests.helpers import still_running
from tests.models import GEMMA, QWEN

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _chat(server: Server) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": QWEN, "messages": FRANCE, "max_tokens": 16, "temperature": 0})


def _long_stream_body() -> dict[str, object]:
    return {"model": QWEN, "max_tokens": 400, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Tell me about ships."}]}


def test_worker_killed_mid_stream(tmp_path: Path) -> None:
    with serve(tmp_path) as server:
        assert _chat(server).status_code == 200
        pid = server.model(QWEN)["pid"]
        events: list[str] = []
        with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                          json=_long_stream_body(), timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith(("data: ", "event: ")):
                    events.append(line)
                if len(events) == 5:
                    os.kill(pid, signal.SIGKILL)
        # The client got a clean end: an SSE error event naming the cause, no hang.
        assert "event: error" in events
        error = json.loads(events[events.index("event: error") + 1][len("data: "):])
        assert error["error"]["code"] == "engine_unavailable"
        # The front is up, and the model answers again after the respawn.
        assert httpx.get(f"{server.url}/health").status_code == 200
        reply = _chat(server)
        assert reply.status_code == 200 and "Paris" in reply.text
        assert server.model(QWEN)["pid"] != pid
        kinds = [e["kind"] for e in server.stats()["events"] if e["model"] == QWEN]
        assert "crashed" in kinds and "respawning" in kinds


def test_worker_killed_during_a_plain_request_gives_502(tmp_path: Path) -> None:
    with serve(tmp_path) as server:
        assert _chat(server).status_code == 200
        pid = server.model(QWEN)["pid"]
        body = {"model": QWEN, "max_tokens": 400, "ignore_eos": True, "messages": FRANCE}
        timer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
        timer.start()
        resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        timer.join()
        assert resp.status_code == 502
        assert resp.json()["error"]["code"] == "engine_unavailable"
        assert _chat(server).status_code == 200


def test_corrupt_gguf_is_a_clear_load_error(tmp_path: Path,
                                            packaged_catalog: object) -> None:
    from bunkhouse.catalog import Catalog

    assert isinstance(packaged_catalog, Catalog)
    real = packaged_catalog.get(GEMMA).path
    models = tmp_path / "models"
    models.mkdir()
    with real.open("rb") as src, (models / "truncated.gguf").open("wb") as dst:
        dst.write(src.read(real.stat().st_size // 2))  # the header is fine, the weights cut
    with serve(tmp_path, "--no-packaged", "--models-dir", str(models)) as server:
        resp = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"model": "truncated", "prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 503
        err = resp.json()["error"]
        assert err["code"] == "model_load_failed"
        assert "failed to load" in err["message"]
        assert str(tmp_path) not in err["message"]  # a client sees no server path
        assert httpx.get(f"{server.url}/health").status_code == 200
    log = server.log.read_text()
    assert "failed to load" in log and "llama" in log  # the engine's own lines, in the log


def test_sigkill_of_the_front_leaves_no_worker(tmp_path: Path) -> None:
    with running(tmp_path, "--preload", QWEN, "--preload", GEMMA) as server:
        assert len(server.model_workers()) == 2
        workers = server.workers()  # and the spare worker, if there is one by now
        server.proc.kill()
        server.proc.wait()
        # Each worker notices at once (parent-death signal); stopping its engine takes a
        # moment, longer on a busy machine: a generous deadline.
        _, alive = psutil.wait_procs(workers, timeout=30)
        alive = [p for p in alive if still_running(p)]
        assert not alive, f"orphaned workers: {alive}"


def test_sigterm_of_the_front_lets_a_running_stream_finish(tmp_path: Path) -> None:
    # a grace long enough for 48 tokens on a machine whose cores other processes share
    with serve(tmp_path, "--stop-grace", "120") as server:
        assert _chat(server).status_code == 200
        body = {**_long_stream_body(), "max_tokens": 48,
                "stream_options": {"include_usage": True}}
        lines: list[str] = []
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                          timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[len("data: "):])
                    if len(lines) == 3:
                        server.proc.send_signal(signal.SIGTERM)
        assert lines[-1] == "[DONE]"
        assert json.loads(lines[-2])["usage"]["completion_tokens"] == 48
        assert server.proc.wait(timeout=30) == 0
