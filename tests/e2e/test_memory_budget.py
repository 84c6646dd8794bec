"""The budget's promise, end to end: under a budget that just fits both packaged models with
embeddings on, the workers' summed peak resident memory stays under it through generation
and embeddings requests (the largest buffers each worker can grow to)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from bunkhouse.catalog import Catalog
from bunkhouse.residency.estimate import estimate
from bunkhouse.supervisor.handle import process_memory
from tests.e2e.server import Server, serve
from tests.models import GEMMA, QWEN

MIB = 2**20
CONTEXT = 1024


def _peak(pid: int) -> int:
    """A worker's resident high-water mark (VmHWM), bytes."""
    memory = process_memory(pid)
    assert memory is not None, f"pid {pid} is gone"
    return memory.peak


def _post(server: Server, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=600)


@pytest.mark.slow
def test_workers_stay_under_a_budget_that_just_fits_them(
        tmp_path: Path, packaged_catalog: Catalog) -> None:
    estimates = {}
    for model_id in (QWEN, GEMMA):
        model = packaged_catalog.get(model_id)
        options = dataclasses.replace(model.options, context=CONTEXT, parallel=1,
                                      embeddings=True)
        estimates[model_id] = estimate(dataclasses.replace(model, options=options)).total
    budget = sum(estimates.values()) + MIB  # both fit, with a MiB to spare
    config = tmp_path / "bunkhouse.toml"
    config.write_text(f"[defaults]\ncontext = {CONTEXT}\nparallel = 1\nembeddings = true\n")
    with serve(tmp_path, "--config", str(config), "--budget", f"{budget // MIB}MiB") as server:
        prompt = "the quick brown fox jumps over the lazy dog " * 60  # > one 512-token batch
        text = "word " * 500  # one micro-batch of embeddings (at most 512 tokens)

        def drive(model_id: str) -> list[int]:
            gen = _post(server, "/v1/completions", {"model": model_id, "prompt": prompt[:2400],
                                                    "max_tokens": 8, "temperature": 0})
            emb = _post(server, "/v1/embeddings", {"model": model_id, "input": text})
            return [gen.status_code, emb.status_code]

        with ThreadPoolExecutor(2) as pool:
            statuses = list(pool.map(drive, [QWEN, GEMMA]))
        assert statuses == [[200, 200], [200, 200]], statuses
        models = {m: server.model(m) for m in (QWEN, GEMMA)}
        assert all(info["state"] == "ready" for info in models.values())  # nothing evicted
        peaks = {m: _peak(info["pid"]) for m, info in models.items()}
        for m in peaks:
            print(f"{m}: peak {peaks[m] / MIB:.0f} MiB, estimate {estimates[m] / MIB:.0f} MiB")
            assert models[m]["estimated_bytes"] == estimates[m]
            assert peaks[m] <= estimates[m], f"{m} grew past its estimate"
        assert sum(peaks.values()) <= budget
        assert psutil.pid_exists(models[QWEN]["pid"])
