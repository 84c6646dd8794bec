from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from bunkhouse.catalog.packaged import PackagedModel, Part, assemble, part_paths
from bunkhouse.errors import PackagedModelError


def _parts(tmp_path: Path) -> tuple[list[Path], bytes]:
    chunks = [os.urandom(1000), os.urandom(777), os.urandom(3)]
    paths = []
    for i, chunk in enumerate(chunks):
        p = tmp_path / f"part{i}"
        p.write_bytes(chunk)
        paths.append(p)
    return paths, b"".join(chunks)


def _model(whole: bytes, sha: str | None = None) -> PackagedModel:
    return PackagedModel("m", "m.gguf", len(whole), sha or hashlib.sha256(whole).hexdigest(), ())


def test_assembles_verifies_and_reuses(tmp_path: Path) -> None:
    paths, whole = _parts(tmp_path)
    model = _model(whole)
    out = assemble(model, paths, tmp_path / "cache")
    assert out.read_bytes() == whole
    mtime = out.stat().st_mtime_ns
    paths[0].write_bytes(b"x" * 1000)  # a second call must not even read the parts
    assert assemble(model, paths, tmp_path / "cache").stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")] == []


def test_checksum_mismatch_leaves_no_file(tmp_path: Path) -> None:
    paths, whole = _parts(tmp_path)
    with pytest.raises(PackagedModelError, match="sha256"):
        assemble(_model(whole, "0" * 64), paths, tmp_path / "cache")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".m.gguf.lock"]


def test_size_mismatch_is_reported(tmp_path: Path) -> None:
    paths, whole = _parts(tmp_path)
    with pytest.raises(PackagedModelError, match="add up to"):
        assemble(_model(whole + b"!"), paths, tmp_path / "cache")


def test_damaged_target_is_rebuilt(tmp_path: Path) -> None:
    paths, whole = _parts(tmp_path)
    model = _model(whole)
    out = assemble(model, paths, tmp_path / "cache")
    out.write_bytes(b"corrupted")
    assert assemble(model, paths, tmp_path / "cache").read_bytes() == whole


def test_absent_distributions_mean_not_installed() -> None:
    model = PackagedModel("x", "x.gguf", 1, "0" * 64,
                          (Part("no-such-distribution-bunkhouse", "x/y.bin"),))
    assert part_paths(model) is None
