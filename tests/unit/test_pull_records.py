"""What a pull leaves for the catalog (bunkhouse/pull/records.py, catalog/sources.py): the
record serves the model by its names whatever hf_cache says and without a warning where
hf_cache lists it too; a model removed from the cache is skipped quietly; an unreadable
record warns and is kept aside, not overwritten; a killed pull's leftovers are cleared by
the next pull of the repo."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from bunkhouse.catalog import build_catalog
from bunkhouse.catalog.sources import VERIFYING
from bunkhouse.config import Settings
from bunkhouse.engines import ENGINES
from bunkhouse.pull.hub import HubFile, Plan, _clear_leftovers
from bunkhouse.pull.names import Choice, parse
from bunkhouse.pull.records import read_records, record
from tests.helpers import write_tiny_gguf

REPO, COMMIT, FILE = "org/Tiny-GGUF", "c" * 40, "tiny-Q4_K_M.gguf"
MODEL_ID = "org/Tiny-GGUF:tiny-Q4_K_M"


def _pulled(root: Path, data: Path) -> None:
    """The tiny model in a hub cache at ``root`` as a pull leaves it, and its record."""
    folder = root / "models--org--Tiny-GGUF"
    blob = write_tiny_gguf(folder / "blobs" / ("a" * 64))
    link = folder / "snapshots" / COMMIT / FILE
    link.parent.mkdir(parents=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)
    name = parse(f"hf.co/{REPO}:q4_k_m")
    record(data, Plan(name.text, REPO, COMMIT, Choice(FILE, (FILE,), None, "Q4_K_M"),
                      (HubFile(FILE, 1, None),), MODEL_ID, name.names(REPO, "Q4_K_M")))


def _catalog(root: Path, data: Path, hf_cache: bool) -> object:
    settings = Settings(include_packaged=False, data_dir=data,
                        sources=(("hf_cache", root if hf_cache else False),
                                 ("ollama", False), ("lmstudio", False)))
    return build_catalog(settings, engines=ENGINES)


@pytest.mark.parametrize("hf_cache", [True, False])
def test_a_pulled_model_answers_to_its_names_with_no_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        hf_cache: bool) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    _pulled(tmp_path / "hf", tmp_path / "data")
    with caplog.at_level(logging.WARNING):
        catalog = _catalog(tmp_path / "hf", tmp_path / "data", hf_cache)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    for name in (MODEL_ID, f"{REPO}:Q4_K_M", f"hf.co/{REPO}:Q4_K_M", f"{REPO}:q4_k_m",
                 f"hf.co/{REPO}:q4_k_m", f"huggingface.co/{REPO}:Q4_k_m", REPO,
                 f"huggingface.co/{REPO}", f"{REPO}:{FILE}", f"{REPO}:latest"):
        assert catalog.resolve(name) == MODEL_ID, name  # type: ignore[attr-defined]
    assert catalog.resolve(f"{REPO}:Q8_0") is None  # type: ignore[attr-defined]


def test_a_pulled_model_removed_from_the_cache_is_skipped_quietly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    _pulled(tmp_path / "hf", tmp_path / "data")
    for path in sorted((tmp_path / "hf").rglob("*"), reverse=True):  # hf cache rm
        path.unlink() if not path.is_dir() or path.is_symlink() else path.rmdir()
    with caplog.at_level(logging.WARNING):
        catalog = _catalog(tmp_path / "hf", tmp_path / "data", False)
    assert not caplog.records and catalog.resolve(MODEL_ID) is None  # type: ignore[attr-defined]


def test_an_unreadable_record_warns_and_is_kept_aside(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    data = tmp_path / "data"
    data.mkdir()
    (data / "pulled.json").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert read_records(data) == []
    assert "pulled.json cannot be read" in caplog.text
    _pulled(tmp_path / "hf", data)
    [aside] = data.glob("pulled.json.unreadable-*")
    assert aside.read_text() == "{not json"
    assert [r.model_id for r in read_records(data)] == [MODEL_ID]


def test_the_next_pull_clears_what_a_killed_one_left(tmp_path: Path) -> None:
    folder = tmp_path / "models--org--Tiny-GGUF"
    (folder / "blobs").mkdir(parents=True)
    old, live = folder / "blobs" / "a.1.incomplete", folder / "blobs" / "b.2.incomplete"
    old.write_bytes(b"half")
    live.write_bytes(b"being written")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    dead = folder / f"{VERIFYING}{2**22 + 7}"  # no such process
    mine = folder / f"{VERIFYING}{os.getpid()}"
    for marker in (dead, mine):
        marker.write_text(json.dumps({"pid": 0, "files": [FILE]}))
    _clear_leftovers(folder)
    assert not old.exists() and live.exists() and not dead.exists() and mine.exists()
