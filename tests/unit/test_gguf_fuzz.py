"""Malformed-GGUF fuzz: hostile headers fed to the scanner, the catalog scan, the memory
estimate and runtime registration. Nothing but a skip with a warning or a 400."""

from __future__ import annotations

import dataclasses
import logging
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
from hypothesis import strategies as st
from starlette.testclient import TestClient

from bunkhouse.catalog import CatalogModel, build_catalog
from bunkhouse.config import EngineOptions, Settings
from bunkhouse.engines import ENGINES, engine_for
from bunkhouse.errors import GGUFError
from bunkhouse.front.admin import AdminOptions
from bunkhouse.front.auth import Keys
from bunkhouse.gguf.meta import (
    MAX_KEPT_BYTES,
    MAX_STRING_BYTES,
    GGUFInfo,
    read_fields,
    read_gguf_info,
)
from bunkhouse.residency.manager import ResidencyManager, ResidencyOptions
from tests import hostile_gguf
from tests.fakes import FakeWorker
from tests.helpers import front_app, write_tiny_gguf

CASES = list(hostile_gguf.hostile_headers())


def _scan(path: Path) -> GGUFInfo | None:
    """The scan's only outcomes: an info, or GGUFError (anything else fails the test)."""
    try:
        info = read_gguf_info(path)
    except GGUFError:
        return None
    model = CatalogModel("m", path, "models_dir", info, EngineOptions(), 1 << 20)
    total = engine_for(model).estimate(model).total  # a hostile info still estimates
    assert isinstance(total, int) and total > 0
    return info


@pytest.mark.parametrize(("name", "data"), CASES, ids=[name for name, _ in CASES])
def test_each_hostile_header_is_a_gguf_error_or_a_bounded_info(
        tmp_path: Path, name: str, data: bytes) -> None:
    path = tmp_path / "h.gguf"
    path.write_bytes(data)
    info = _scan(path)
    if info is not None:
        for value in dataclasses.astuple(info):
            assert not isinstance(value, float)
            assert not isinstance(value, int) or 0 <= value <= 1 << 64


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
@hypothesis.given(st.data())
def test_random_damage_to_a_valid_header(data: st.DataObject) -> None:
    raw = bytearray(hostile_gguf.valid())
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    raw = raw[: data.draw(st.integers(0, len(raw)))]
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r.gguf"
        path.write_bytes(bytes(raw))
        _scan(path)


SPARSE = dict(hostile_gguf.sparse_headers())
VOCAB = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.model"})


def _outcome(scan: Callable[[], object]) -> str:
    try:
        scan()
    except GGUFError as e:
        return str(e)
    return "read"


@pytest.mark.parametrize(("name", "info", "vocab"), [
    ("chat template of 1 GiB", "tokenizer.chat_template is a string of 1073741824", "read"),
    ("description of 1 GiB", "read", "read"),  # not needed: seeked over, never read
    ("100 tokens of 1 MiB", "read", f"limit of {MAX_KEPT_BYTES} bytes"),
])
def test_a_string_declared_huge_costs_no_more_than_the_budgets(
        tmp_path: Path, name: str, info: str, vocab: str) -> None:
    """A sparse file of a few KiB declaring a 1 GiB chat template took the front from 76 to
    2,169 MiB; now a kept string has a cap, others are never read, and all kept is bounded."""
    path = hostile_gguf.write_sparse(tmp_path / "s.gguf", SPARSE[name])
    tracemalloc.start()
    try:
        outcomes = (_outcome(lambda: read_gguf_info(path)),
                    _outcome(lambda: read_fields(path, VOCAB)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info in outcomes[0] and vocab in outcomes[1]
    assert peak < MAX_KEPT_BYTES + 2 * MAX_STRING_BYTES


def test_the_whole_header_has_one_budget_of_items(tmp_path: Path) -> None:
    """32 arrays of 2^20 empty arrays, each under any per-array bound, took 141 s to scan."""
    path = hostile_gguf.write_sparse(tmp_path / "s.gguf", SPARSE["32 arrays of 2^20 empty arrays"])
    with pytest.raises(GGUFError, match="items a scan visits in a whole header"):
        read_gguf_info(path)


def test_the_catalog_scan_skips_every_hostile_file_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    paths = hostile_gguf.write_all(tmp_path / "models")
    write_tiny_gguf(tmp_path / "models" / "good.gguf")
    with caplog.at_level(logging.WARNING):
        catalog = build_catalog(Settings(models_dirs=(tmp_path / "models",),
                                         include_packaged=False), engines=ENGINES)
    assert "good" in catalog
    skipped = [p for p in paths if p.stem not in catalog]
    assert skipped and all(f"skipping {p}" in caplog.text for p in skipped)


@pytest.fixture
def app(tmp_path: Path) -> Iterator[tuple[TestClient, Path]]:
    root = tmp_path / "root"
    write_tiny_gguf(root / "good.gguf")
    catalog = build_catalog(Settings(models_dirs=(root,), include_packaged=False), engines=ENGINES)

    async def start(model: CatalogModel) -> Any:
        return FakeWorker(model)

    residency = ResidencyManager(catalog, ResidencyOptions(budget_bytes=2**34), start)
    app = front_app(catalog, residency, keys=Keys(admin=["a"]),
                    admin_options=AdminOptions(allow_runtime_load=True, roots=(root,)))
    with TestClient(app, base_url="http://localhost") as client:
        yield client, root


def test_registering_a_hostile_file_is_a_400_never_a_500(
        app: tuple[TestClient, Path]) -> None:
    client, root = app
    paths = hostile_gguf.write_all(root / "hostile")
    for i, path in enumerate(paths):
        resp = client.post("/v1/models", headers={"x-api-key": "a"},
                           json={"id": f"h{i}", "path": str(path)})
        assert resp.status_code in (200, 400, 503), (path, resp.text)
        if resp.status_code == 400:
            assert resp.json()["error"]["param"] == "path"
    assert client.get("/health").status_code == 200


def test_a_path_with_a_component_over_255_bytes_is_a_400(app: tuple[TestClient, Path]) -> None:
    client, root = app
    resp = client.post("/v1/models", headers={"x-api-key": "a"},
                       json={"id": "long", "path": str(root / ("a" * 300) / "m.gguf")})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "path"
    resp = client.post("/v1/models", headers={"x-api-key": "a"},
                       json={"id": "long", "path": str(root / ("a" * 300))})
    assert resp.status_code == 400


def test_a_fifo_is_never_opened_blocking(app: tuple[TestClient, Path], tmp_path: Path) -> None:
    """A FIFO in place of a model file would block whoever opens it until a writer comes."""
    import os

    from bunkhouse.errors import WorkerLoadFailed
    from bunkhouse.supervisor.process import open_model_file
    client, root = app
    os.mkfifo(root / "fifo.gguf")
    with pytest.raises(GGUFError, match="not a regular file"):
        read_gguf_info(root / "fifo.gguf")
    resp = client.post("/v1/models", headers={"x-api-key": "a"},
                       json={"id": "f", "path": str(root / "fifo.gguf")})
    assert resp.status_code == 400
    good = build_catalog(Settings(models_dirs=(root,), include_packaged=False),
                         engines=ENGINES).get("good")
    os.replace(root / "fifo.gguf", root / "good.gguf")  # the registered file, now a FIFO
    with pytest.raises(WorkerLoadFailed, match="no longer the file"):
        open_model_file(good)
