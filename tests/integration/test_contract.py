"""The worker contract (engines/contract.py), one suite for every engine: a real worker process
per engine, reached only through its handle and its engine client.

Engines: llama.cpp (xllamacpp's worker) and llama-server (the binary itself as the worker)
serving the packaged Gemma, mlx (mlx-lm on mlx-cpu) serving the SmolLM2 MLX test model
(tests/fixtures/mlx_smollm.py), and the fault engine (tests/fault_engine.py), which keeps the
same contract with no model."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from bunkhouse.catalog import Catalog, CatalogModel, mlx
from bunkhouse.catalog.catalog import files_size
from bunkhouse.engines import LLAMA_SERVER
from bunkhouse.engines.contract import EngineClient, EngineRefused
from bunkhouse.supervisor.process import LaunchOptions, WorkerLaunch, WorkerProcess, WorkerState
from tests import llama_server
from tests.fault_engine import ENGINE
from tests.helpers import write_tiny_gguf
from tests.models import GEMMA

ENGINES = ["llama.cpp", "llama-server", "mlx", "fault"]


@dataclasses.dataclass
class Started:
    worker: WorkerProcess
    engine: EngineClient
    snapshots: Path


Steps = Callable[[Started], Awaitable[None]]


@pytest.fixture(params=ENGINES)
def run(request: pytest.FixtureRequest, packaged_catalog: Catalog,
        tmp_path: Path) -> Callable[[Steps], None]:
    """Run ``steps`` against a started worker of the engine, then stop it (in one loop)."""
    model, worker_engine = _model(request.param, packaged_catalog, tmp_path, request)
    snapshots = tmp_path / "kv"
    snapshots.mkdir()
    launch = WorkerLaunch(tmp_path / "w.sock", LaunchOptions(120, 10, worker_engine), snapshots)

    def go(steps: Steps) -> None:
        async def main() -> None:
            worker = WorkerProcess(model, launch)
            await worker.start()
            try:
                await steps(Started(worker, worker.engine, snapshots))
            finally:
                await worker.stop()
            assert worker.state is WorkerState.STOPPED
            assert not launch.socket.exists()

        asyncio.run(main())

    return go


def _model(engine: str, catalog: Catalog, tmp_path: Path,
           request: pytest.FixtureRequest) -> tuple[CatalogModel, str | None]:
    base = catalog.get(GEMMA)
    if engine == "mlx":
        directory = request.getfixturevalue("mlx_smollm")
        options = dataclasses.replace(base.options, context=1024, parallel=2, engine_keys=())
        return dataclasses.replace(
            base, id="smollm-mlx", path=directory, engine="mlx", info=mlx.info(directory),
            options=options, size_bytes=files_size(mlx.model_files(directory)),
            chat_template=None, resolved=()), None
    if engine == "fault":
        path = write_tiny_gguf(tmp_path / "fault.gguf")
        options = dataclasses.replace(base.options, parallel=2)
        return dataclasses.replace(base, id="fault", path=path, options=options,
                                   size_bytes=path.stat().st_size), \
            ENGINE
    options = dataclasses.replace(base.options, context=1024, parallel=2,
                                  engine_keys=(("threads", 1),))
    if engine == "llama-server":  # the binary itself is the worker
        LLAMA_SERVER.locate(llama_server.require())
    return dataclasses.replace(base, options=options, engine=engine), None


async def _read(resp: Any) -> bytes:
    try:
        return bytes(await resp.aread())
    finally:
        await resp.aclose()


async def _stream_lines(resp: Any) -> AsyncIterator[str]:
    try:
        async for line in resp.aiter_lines():
            if line:
                yield line
    finally:
        await resp.aclose()


def test_health_probe_and_memory(run: Callable[[Steps], None]) -> None:
    async def go(started: Started) -> None:
        assert await started.engine.health(5)
        assert await started.engine.probe(5)
        memory = started.worker.memory()
        assert memory is not None and 0 < memory.resident <= memory.peak
        placement = started.worker.placement
        assert placement.node == "local" and placement.pid and psutil.pid_exists(placement.pid)

    run(go)


def test_counting_tokens(run: Callable[[Steps], None]) -> None:
    async def go(started: Started) -> None:
        short = await started.engine.count_tokens("hello")
        long = await started.engine.count_tokens("hello " * 50)
        assert 0 < short < long
        chat = await started.engine.count_tokens([{"role": "user", "content": "hello " * 50}])
        assert chat >= long - 2  # the template adds its own tokens

    run(go)


def test_streamed_and_plain_generation(run: Callable[[Steps], None]) -> None:
    async def go(started: Started) -> None:
        body = {"prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0, "stream": True}
        resp = await started.engine.generate("/v1/completions", json.dumps(body).encode())
        assert resp.status_code == 200
        lines = [line async for line in _stream_lines(resp)]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 2
        chunk = json.loads(lines[0].removeprefix("data: "))
        assert chunk["choices"]
        plain = {"messages": [{"role": "system", "content": "Be brief."},  # else SmolLM2's
                              {"role": "user", "content": "hi"}],  # template adds 20 tokens
                 "max_tokens": 3}
        resp = await started.engine.generate("/v1/chat/completions", json.dumps(plain).encode())
        answer = json.loads(await _read(resp))
        assert resp.status_code == 200 and answer["choices"][0]["message"]["role"] == "assistant"

    run(go)


def test_a_refused_input_is_a_400_naming_no_internal_detail(run: Callable[[Steps], None]) -> None:
    async def go(started: Started) -> None:
        resp = await started.engine.generate("/v1/completions", b"{not json")
        status, error = started.engine.error(resp.status_code, await _read(resp),
                                             "/v1/completions")
        assert status == 400 and error["error"]["code"] == "invalid_request"

    run(go)


def test_slots_and_kv_save_restore(run: Callable[[Steps], None]) -> None:
    async def go(started: Started) -> None:
        engine = started.engine
        slots = await engine.slots()
        assert [s.id for s in slots] == list(range(started.worker.model.options.parallel))
        assert not any(s.busy for s in slots)
        body = {"prompt": "the quick brown fox jumps over the lazy dog " * 2, "max_tokens": 2,
                "temperature": 0, "cache_prompt": True}
        resp = await engine.generate("/v1/completions", body, slot=0)
        assert resp.status_code == 200, await _read(resp)
        await _read(resp)
        held = (await engine.slots())[0].tokens
        assert held > 0
        saved = await engine.save_slot(0, "s0.bin")
        assert saved.tokens > 0 and saved.bytes > 0
        assert (started.snapshots / "s0.bin").stat().st_size >= saved.bytes > 0
        restored = await engine.restore_slot(1, "s0.bin")
        assert restored.tokens == saved.tokens
        with pytest.raises(EngineRefused):
            await engine.restore_slot(0, "missing.bin")

    run(go)


def test_tokens_pieces_and_template(run: Callable[[Steps], None]) -> None:
    async def go(started: Started) -> None:
        engine = started.engine
        pieces = await engine.token_pieces("hello world", add_special=False,
                                           parse_special=True)
        assert len(pieces) >= 2 and all(isinstance(p.piece, str) for p in pieces)
        text = await engine.detokenize([p.id for p in pieces])
        assert isinstance(text, str) and text
        prompt = await engine.apply_template({"messages": [{"role": "user",
                                                            "content": "hello"}]})
        assert "hello" in prompt
        assert await engine.count_tokens(prompt) > 0

    run(go)


def test_a_generation_runs_in_the_slot_chosen_and_reports_its_timings(
        run: Callable[[Steps], None]) -> None:
    async def go(started: Started) -> None:
        engine = started.engine
        body = {"prompt": "one two three four five six seven eight", "max_tokens": 3,
                "temperature": 0, "stream": True, "cache_prompt": True}
        resp = await engine.generate("/v1/completions", body, slot=1)
        assert resp.status_code == 200
        timings = [t async for t in _timings(engine, resp)]
        assert len(timings) == 1 and timings[0].prompt_tokens > 0
        assert timings[0].generated_tokens > 0
        slots = await engine.slots()
        assert slots[1].tokens > 0 and slots[0].tokens == 0

    run(go)


def test_infill_answers_or_is_refused_as_the_model_cannot(
        run: Callable[[Steps], None]) -> None:
    async def go(started: Started) -> None:
        engine = started.engine
        resp = await engine.infill({"input_prefix": "def add(a, b):\n    return ",
                                    "input_suffix": "\n", "n_predict": 3})
        raw = await _read(resp)
        if resp.status_code == 200:
            assert isinstance(json.loads(raw)["content"], str)
        else:  # a model without fill-in-the-middle tokens (the packaged Gemma)
            status, error = engine.error(resp.status_code, raw, "/infill")
            assert status == 400 and error["error"]["param"] == "model"

    run(go)


async def _timings(engine: EngineClient, resp: Any) -> AsyncIterator[Any]:
    async for line in _stream_lines(resp):
        timings = engine.timings_line(line)
        if timings is not None:
            yield timings


def test_closing_the_client_ends_a_running_stream(run: Callable[[Steps], None]) -> None:
    async def go(started: Started) -> None:
        body = {"prompt": "count: 1, 2,", "max_tokens": 200, "stream": True, "ignore_eos": True}
        resp = await started.engine.generate("/v1/completions", json.dumps(body).encode())
        lines = resp.aiter_lines()
        await lines.__anext__()
        await started.engine.aclose()
        with pytest.raises(Exception):  # noqa: B017 - any transport error: the stream is cut
            async for _ in lines:
                pass

    run(go)
