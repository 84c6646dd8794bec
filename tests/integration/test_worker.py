"""A real worker process with a real model, driven over its Unix socket."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from bunkhouse.catalog import Catalog, CatalogModel
from bunkhouse.config import EngineOptions
from bunkhouse.errors import WorkerLoadFailed
from bunkhouse.gguf.meta import read_gguf_info
from bunkhouse.supervisor.process import (
    LaunchOptions,
    WorkerLaunch,
    WorkerProcess,
    WorkerState,
    worker_argv,
)
from tests.fault_engine import ENGINE
from tests.helpers import (
    CHILD_PYTHONPATH,
    healthy_socket,
    wait_for,
    worker_socket,
    write_tiny_gguf,
)
from tests.models import GEMMA, QWEN

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def qwen_socket(packaged_catalog: Catalog) -> Iterator[Path]:
    """`python -m bunkhouse.worker` serving Qwen on a socket in a private directory."""
    qwen = packaged_catalog.get(QWEN)
    options = dataclasses.replace(qwen.options, embeddings=True)
    with worker_socket(dataclasses.replace(qwen, options=options)) as sock:
        yield sock


def _sdk(sock: Path) -> openai.OpenAI:
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)))
    return openai.OpenAI(base_url="http://worker/v1", api_key="unused", http_client=http)


def test_chat_over_the_socket(qwen_socket: Path) -> None:
    with _sdk(qwen_socket) as client:
        reply = client.chat.completions.create(model=QWEN, messages=FRANCE,  # type: ignore[arg-type]
                                               max_tokens=24, temperature=0)
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.model == QWEN  # the engine answers with our id, not its file path


def test_streaming_over_the_socket(qwen_socket: Path) -> None:
    with _sdk(qwen_socket) as client:
        stream = client.chat.completions.create(
            model=QWEN, messages=FRANCE, max_tokens=24, temperature=0,  # type: ignore[arg-type]
            stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_async_completions_and_embeddings(qwen_socket: Path) -> None:
    async def run() -> tuple[str, list[list[float]]]:
        http = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(qwen_socket)))
        async with openai.AsyncOpenAI(base_url="http://worker/v1", api_key="x",
                                      http_client=http) as client:
            comp = await client.completions.create(model=QWEN, prompt="1, 2, 3, 4,",
                                                   max_tokens=6, temperature=0)
            emb = await client.embeddings.create(model=QWEN, input=["hello", "bonjour"])
        return comp.choices[0].text, [d.embedding for d in emb.data]

    text, vectors = asyncio.run(run())
    assert "5" in text
    assert len(vectors) == 2
    for v in vectors:
        assert math.isclose(math.sqrt(sum(x * x for x in v)), 1.0, rel_tol=1e-3)


def _model_at(path: Path) -> CatalogModel:
    return CatalogModel("broken", path, "models_dir", read_gguf_info(path),
                        EngineOptions(context=512, parallel=1, engine_keys=(("threads", 1),)),
                        path.stat().st_size)


def test_supervisor_start_measure_stop(packaged_catalog: Catalog, tmp_path: Path) -> None:
    async def run() -> None:
        model = packaged_catalog.get(GEMMA)
        worker = WorkerProcess(model, WorkerLaunch(tmp_path / "g.sock", LaunchOptions(60, 5)))
        await worker.start()
        try:
            assert worker.state is WorkerState.READY and worker.pid
            measured = worker.memory()
            assert measured is not None and measured.peak > model.size_bytes * 0.5
            assert await worker.engine.health(5)
        finally:
            await worker.stop()
        assert worker.state is WorkerState.STOPPED
        assert not psutil.pid_exists(worker.pid) or \
            psutil.Process(worker.pid).status() == psutil.STATUS_ZOMBIE
        assert not (tmp_path / "g.sock").exists()

    asyncio.run(run())


def test_load_failure_quotes_the_engine_in_its_detail_only(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "broken.gguf")  # metadata only: no real weights

    async def run() -> WorkerProcess:
        launch = WorkerLaunch(tmp_path / "b.sock", LaunchOptions(60, 5))
        worker = WorkerProcess(_model_at(path), launch)
        with pytest.raises(WorkerLoadFailed) as info:
            await worker.start()
        assert "failed to load" in info.value.message
        assert str(tmp_path) not in info.value.message  # no server path for a client
        assert info.value.detail is not None
        assert "llama" in info.value.detail.lower()  # a line quoted from the engine's output
        assert info.value.status == 503
        return worker

    worker = asyncio.run(run())
    assert worker.state is WorkerState.STOPPED


def test_worker_exits_when_its_parent_is_killed(packaged_catalog: Catalog,
                                                tmp_path: Path) -> None:
    model = packaged_catalog.get(GEMMA)
    argv = worker_argv(model, WorkerLaunch(tmp_path / "o.sock", LaunchOptions(60, 5)))
    # An intermediate parent that starts the worker (naming itself as parent), then waits.
    script = (
        "import os, subprocess, sys, time\n"
        "argv = sys.argv[1:]\n"
        "argv[argv.index('--parent-pid') + 1] = str(os.getpid())\n"
        "p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script, *argv], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    worker_pid = int(parent.stdout.readline())
    try:
        wait_for(lambda: healthy_socket(tmp_path / "o.sock"), 60, "worker health")
        parent.kill()
        parent.wait()
        wait_for(lambda: not psutil.pid_exists(worker_pid)
                 or psutil.Process(worker_pid).status() == psutil.STATUS_ZOMBIE,
                 5, "the orphaned worker to exit")
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        if psutil.pid_exists(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


def test_a_burst_of_stop_signals_never_wedges_a_worker(tmp_path: Path) -> None:
    """A signal handler that took a lock the interrupted main loop held left a worker hung for
    good (found as an orphan after its front was SIGKILLed): 300 SIGTERMs at once, 10 times."""
    model = write_tiny_gguf(tmp_path / "m.gguf")
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}
    for n in range(10):
        sock = tmp_path / f"w{n}.sock"
        proc = subprocess.Popen(
            [sys.executable, "-m", "bunkhouse.worker", "--model-id", "m", "--model-path",
             str(model), "--socket", str(sock), "--engine", ENGINE],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda sock=sock: sock.exists(), 60, "the worker's socket")
            for _ in range(300):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
