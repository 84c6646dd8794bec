"""The compute gate's time slice, with real workers: a short request to one model is answered
while another model streams a long generation (which is suspended, then goes on), and a
suspended worker never outlives its front."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.e2e.server import Server, running, serve
from tests.helpers import wait_for
from tests.models import GEMMA, QWEN


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("turns")
    with serve(workdir, "--preload", QWEN, "--preload", GEMMA) as server:
        yield server


class Stream(threading.Thread):
    """A streamed completion of ``tokens`` tokens read in a thread; records its tokens and when
    it ended (monotonic)."""

    def __init__(self, server: Server, model: str, tokens: int) -> None:
        super().__init__(daemon=True)
        self.server, self.model, self.tokens = server, model, tokens
        self.texts: list[str] = []
        self.done = False
        self.ended: float | None = None
        self.first = threading.Event()
        self.stop = threading.Event()  # set: the client goes away
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            self._read()
        except httpx.TransportError as e:  # the front died under it (the last test)
            self.error = e

    def _read(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": self.tokens,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{self.server.url}/v1/completions", json=body,
                          timeout=300) as r:
            for line in r.iter_lines():
                if self.stop.is_set():
                    return
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: {"):
                    chunk: dict[str, Any] = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0].get("text"):
                        self.texts.append(chunk["choices"][0]["text"])
                        self.first.set()
        self.ended = time.monotonic()


def _metric(server: Server, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def _worker(server: Server, model: str) -> psutil.Process:
    return psutil.Process(server.model(model)["pid"])


def test_a_short_request_to_another_model_is_answered_during_a_long_stream(
        host: Server) -> None:
    preempted = _metric(host, "bunkhouse_compute_gate_preemptions_total")
    long = Stream(host, QWEN, 400)
    long.start()
    assert long.first.wait(120), "the long stream never began"
    time.sleep(1.0)  # past the first turn's time slice
    short = httpx.post(f"{host.url}/v1/completions", timeout=120, json={
        "model": GEMMA, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True})
    answered = time.monotonic()
    assert short.status_code == 200, short.text
    assert short.json()["usage"]["completion_tokens"] == 8
    long.join(300)
    # The short request did not wait for the long one: it was answered first ...
    assert long.ended is not None and answered < long.ended
    # ... and the long one, suspended meanwhile, went on to its end, every token of it.
    assert long.done and len(long.texts) == 400
    assert _metric(host, "bunkhouse_compute_gate_preemptions_total") > preempted
    assert _metric(host, "bunkhouse_compute_gate_suspended") == 0
    assert _worker(host, QWEN).status() != psutil.STATUS_STOPPED


def test_a_suspended_model_whose_client_left_is_resumed(host: Server) -> None:
    qwen = Stream(host, QWEN, 400)
    qwen.start()
    assert qwen.first.wait(120)
    time.sleep(1.0)
    gemma = Stream(host, GEMMA, 300)  # long enough to suspend Qwen for a while
    gemma.start()
    worker = _worker(host, QWEN)
    wait_for(lambda: worker.status() == psutil.STATUS_STOPPED, 60,
             "Qwen's worker suspended while Gemma computes", interval_s=0.01)
    qwen.stop.set()  # Qwen's client leaves while its worker is stopped
    gemma.join(300)
    assert gemma.done and len(gemma.texts) == 300
    wait_for(lambda: worker.status() != psutil.STATUS_STOPPED, 30, "Qwen's worker resumed")
    r = httpx.post(f"{host.url}/v1/completions", timeout=120, json={
        "model": QWEN, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert _worker(host, QWEN).pid == worker.pid  # never replaced (no missed probe counted)


def test_a_suspended_worker_dies_with_its_front(tmp_path: Path) -> None:
    with running(tmp_path, "--preload", QWEN, "--preload", GEMMA) as server:
        qwen_worker = _worker(server, QWEN)
        workers = server.workers()
        streams = [Stream(server, QWEN, 2000), Stream(server, GEMMA, 2000)]
        for s in streams:
            s.start()
        wait_for(lambda: any(w.status() == psutil.STATUS_STOPPED for w in workers), 60,
                 "a worker suspended by the time slice", interval_s=0.01)
        server.proc.send_signal(signal.SIGKILL)  # the front dies: nobody will resume it
        server.proc.wait()
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, f"workers outlived their front: {alive}"
        assert not qwen_worker.is_running()
