"""The front's relay sends what it always sent: every protocol's streamed answer on the
benchmark engine (tests/bench_engine.py, a real worker process) compared byte for byte with
the answers recorded from the front before its relay was reworked (tests/relay_cases.py:
text, tool calls held and released, usage chunks, errors and breaks mid-stream); a client
that leaves mid-stream frees its slot; and on the real llama.cpp worker an OpenAI stream is
the worker's own events, relayed as they are."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from bunkhouse.catalog import Catalog
from tests.e2e.server import Server, serve
from tests.helpers import CHILD_PYTHONPATH, wait_for, write_tiny_gguf
from tests.models import QWEN
from tests.relay_cases import CASES, GOLDEN, MODEL, ask, masked

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory, packaged_catalog: Catalog) -> Iterator[Server]:
    """The benchmark engine, unpaced, two slots. Its model file is the packaged Qwen's: a
    request with tools has its grammar measured first, by llama.cpp on the real model."""
    tmp = tmp_path_factory.mktemp("relay")
    (tmp / "models").mkdir()
    os.link(packaged_catalog.get(QWEN).path, tmp / "models" / f"{MODEL}.gguf")
    env = {"PYTHONPATH": CHILD_PYTHONPATH}
    with serve(tmp, "--no-packaged", "--models-dir", str(tmp / "models"), "--worker-engine",
               "tests.bench_engine:BenchEngine", "--parallel", "2", "--spare-worker", "off",
               env=env) as server:
        yield server


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_streamed_answer_is_the_same_bytes_as_before(bench: Server, case: str) -> None:
    golden = json.loads(GOLDEN.read_text())[case]
    with httpx.Client(timeout=120) as client:
        got = ask(bench.url, case, client)
    assert got == golden


def test_a_client_that_leaves_mid_stream_frees_its_slot(tmp_path: Path) -> None:
    """One slot, a paced stream of 2,000 tokens: the client reads a few events and closes
    its socket; the next request is served (its slot was freed, not held to the end)."""
    write_tiny_gguf(tmp_path / "models" / "paced.gguf", context=8192)
    env = {"PYTHONPATH": CHILD_PYTHONPATH, "BUNKHOUSE_BENCH": json.dumps({"rate": 50})}
    with serve(tmp_path, "--no-packaged", "--models-dir", str(tmp_path / "models"),
               "--worker-engine", "tests.bench_engine:BenchEngine", "--parallel", "1",
               "--spare-worker", "off", env=env) as server:
        port = int(server.url.rsplit(":", 1)[1])
        body = json.dumps({"model": "paced", "stream": True, "max_tokens": 2000,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(body), body))
            got = b""
            while got.count(b'"content":"t') < 3:
                got += s.recv(4096)
        done = threading.Event()
        answer: list[httpx.Response] = []

        def follow() -> None:
            answer.append(httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
                "model": "paced", "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}]}))
            done.set()

        threading.Thread(target=follow, daemon=True).start()
        # 2,000 tokens at 50 a second is 40 s: served well before, the slot was freed
        wait_for(done.is_set, 30, "the next request, served on the freed slot")
        assert answer[0].status_code == 200
        assert answer[0].json()["choices"][0]["message"]["content"] == "t0 t1 t2 "


def test_an_openai_stream_is_the_workers_own_events(qwen_server: Server) -> None:
    """The packaged Qwen (llama.cpp), greedy: the front's stream of chat completions, and the
    worker's own stream of the same request read from its socket, masked alike."""
    body = {"model": QWEN, "stream": True, "max_tokens": 12,
            "temperature": 0, "seed": 1,
            "messages": [{"role": "user", "content": "Count from one to five in words."}]}
    with httpx.Client(timeout=120) as client:
        front = client.post(f"{qwen_server.url}/v1/chat/completions", json=body).content
        sock = _worker_socket(qwen_server, QWEN)
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=120) as worker:
            own = worker.post("http://worker/v1/chat/completions", json=body).content
    assert b"data: [DONE]" in front
    assert _without_timings(masked(front)) == _without_timings(masked(own))


def _worker_socket(server: Server, model_id: str) -> str:
    """The Unix socket the model's worker listens on."""
    worker = psutil.Process(server.model(model_id)["pid"])
    paths = [c.laddr for c in worker.net_connections(kind="unix")
             if isinstance(c.laddr, str) and c.laddr.endswith(".sock")]
    assert paths, f"no socket of {model_id}'s worker"
    return str(paths[0])


def _without_timings(body: str) -> str:
    """The stream with the engine's timings (its clocks) masked."""
    return re.sub(r'"timings":\{[^}]*\}', '"timings":{}', body)
