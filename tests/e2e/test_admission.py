"""Admission under concurrent load, with real workers and the packaged models."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from bunkhouse.catalog import Catalog
from tests.e2e.server import Server, serve
from tests.helpers import listening_socket, wait_for
from tests.models import GEMMA, QWEN

A = "qwen-2x4"  # 2 slots, queue 4
B = "gemma-1"  # 1 slot


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory, packaged_catalog: Catalog) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("admission")
    qwen = packaged_catalog.get(QWEN).path
    gemma = packaged_catalog.get(GEMMA).path
    config = workdir / "bunkhouse.toml"
    config.write_text(f"""
include_packaged = false
[[models]]
id = "{A}"
path = "{qwen}"
context = 2048
parallel = 2
queue = 4
[[models]]
id = "{B}"
path = "{gemma}"
context = 1024
parallel = 1
queue = 4
""")
    with serve(workdir, "--config", str(config), "--preload", A, "--preload", B) as server:
        yield server


def _complete(server: Server, model: str, tokens: int, **extra: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": model, "prompt": "Once upon a time", "max_tokens": tokens,
        "ignore_eos": True, **extra})


def _metrics(server: Server, model: str) -> dict[str, float]:
    sock = listening_socket(server.model(model)["pid"])
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock)) as c:
        text = c.get("http://worker/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("llamacpp:")}


def test_a_flood_gets_only_complete_answers_and_429s(host: Server) -> None:
    with ThreadPoolExecutor(40) as pool:
        replies = list(pool.map(lambda _: _complete(host, A, 8), range(40)))
    statuses = sorted(r.status_code for r in replies)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) > 0 and statuses.count(200) >= 6
    for r in replies:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 8
        else:
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("resource_admission", "queue_full")
            assert int(r.headers["retry-after"]) > 0
    wait_for(lambda: host.model(A)["leases"] == 0, 10, "every lease to end")


def test_oversize_request_is_400_before_reaching_the_engine(host: Server) -> None:
    before = _metrics(host, B)
    resp = httpx.post(f"{host.url}/v1/completions", timeout=60, json={
        "model": B, "max_tokens": 100, "prompt": "hello " * 1200})  # a base model: no chat
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert "slot of 1024 tokens" in err["message"]
    after = _metrics(host, B)
    for counter in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total",
                    "llamacpp:n_decode_total"):
        assert after[counter] == before[counter], counter


def test_disconnect_mid_stream_frees_the_only_slot(host: Server) -> None:
    body = {"model": B, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{host.url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        for _ in range(6):
            next(lines)
    # 900 tokens would hold the slot for many seconds; the next request must get it now.
    wait_for(lambda: host.model(B)["running"] == 0, 10, "the slot to be given back")
    reply = _complete(host, B, 8)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8


def test_other_model_answers_while_one_queue_is_full(host: Server) -> None:
    with ThreadPoolExecutor(6) as pool:
        busy = [pool.submit(_complete, host, A, 48) for _ in range(6)]
        wait_for(lambda: host.model(A)["queued"] == 4, 30, f"{A}'s queue to fill")
        assert _complete(host, A, 4).status_code == 429  # A is full...
        reply = _complete(host, B, 8)  # ...and B still answers
        assert reply.status_code == 200 and reply.json()["model"] == B
        assert all(f.result().status_code == 200 for f in busy)


def test_models_show_slots_and_queue(host: Server) -> None:
    info = host.model(A)
    assert (info["parallel"], info["queue"], info["running"], info["queued"]) == (2, 4, 0, 0)




def _busy_slots(server: Server, model: str) -> int:
    sock = listening_socket(server.model(model)["pid"])
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock)) as c:
        return sum(1 for s in c.get("http://worker/slots").json() if s["is_processing"])


def test_plain_request_disconnect_frees_its_slot_while_another_slot_generates(
        host: Server) -> None:
    """llama.cpp alone keeps such a request running to its end; the front must not."""
    started = threading.Event()

    def long_stream() -> int:
        body = {"model": A, "prompt": "Once upon a time", "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        n = 0
        with httpx.stream("POST", f"{host.url}/v1/completions", json=body,
                          timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    n += 1
                    started.set()
        return n

    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(long_stream)
        assert started.wait(60)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{host.url}/v1/completions", timeout=1.5, json={
                "model": A, "prompt": "Write a story", "max_tokens": 900,
                "ignore_eos": True})
        wait_for(lambda: _busy_slots(host, A) == 1, 5,
                 "the disconnected request's slot to be freed while the stream runs")
        assert not stream.done()
        assert stream.result(timeout=120) > 100
