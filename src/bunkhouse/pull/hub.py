"""A pull's plan and download through ``huggingface_hub``: the repo's files and checksums from
the hub's model info, the free disk checked, each file fetched into the hub client's own cache
(which the catalog reads in place), then checked against its sha256. Blocking: run it in a
process of its own (``bunkhouse pull``; the server runs that command as a child).

The hub client does the HTTP: its endpoint (``HF_ENDPOINT``), token (``HF_TOKEN`` or the one
``hf auth login`` stored, never logged), offline switch (``HF_HUB_OFFLINE``), retries and
resumption after a dropped connection (a ranged request from where it stopped), a lock per
file (two pulls of one file make one download), and a temporary file renamed into the
cache only once whole: the cache never holds a half file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bunkhouse.catalog.sources import VERIFYING, hf_cache_root, marker_live
from bunkhouse.config import check_model_id
from bunkhouse.errors import (
    ConfigError,
    Forbidden,
    InsufficientStorage,
    ModelNotFound,
    PullFailed,
)
from bunkhouse.pull.names import Choice, PullName, choose

log = logging.getLogger(__name__)

MIB = 2**20
DISK_MARGIN_BYTES = 256 * MIB
"""Free disk kept beyond a pull's files (the hub client writes each file once, to a
temporary file renamed in place, so the files' sizes are what a pull takes)."""

@dataclass(frozen=True, slots=True)
class HubFile:
    name: str  # its path in the repo
    size: int  # bytes
    sha256: str | None  # the hub's LFS checksum (None: not an LFS file; not checked)

    @property
    def digest(self) -> str:
        """Ollama's name for it: ``sha256:<hex>`` (its name in the repo, without one)."""
        return f"sha256:{self.sha256}" if self.sha256 else self.name


@dataclass(frozen=True, slots=True)
class Plan:
    """What a pull fetches: the repo as the hub spells it, its commit, the chosen files,
    the id the model is served under and the names it also answers to."""

    given: str
    repo: str
    commit: str
    choice: Choice
    files: tuple[HubFile, ...]
    model_id: str
    names: tuple[str, ...]

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)


def make_plan(name: PullName) -> Plan:
    """Ask the hub for the repo's files and choose (names.choose). Raises ModelNotFound (no
    such repo, quantization or file: naming what exists), Forbidden (a gated repo without
    access), PullFailed (the hub unreachable or offline)."""
    from huggingface_hub import HfApi

    with _hub_errors(name.repo):
        info = HfApi().model_info(name.repo, files_metadata=True)
    repo = info.id or name.repo
    siblings = {s.rfilename: s for s in info.siblings or []}
    choice = choose(repo, siblings, name.tag)
    files = []
    for filename in choice.files:
        s = siblings[filename]
        lfs = s.lfs
        files.append(HubFile(filename, int(s.size or (lfs.size if lfs else 0)),
                             lfs.sha256 if lfs else None))
    stem = choice.model.removesuffix(".gguf")
    if len(choice.parts) > 1:
        stem = stem.rsplit("-", 3)[0]  # NAME-00001-of-00002: NAME, as the catalog names it
    try:
        model_id = check_model_id(f"{repo}:{stem}", f"the repo {repo}")
    except ConfigError as e:
        raise ModelNotFound(f"{e.message}: it cannot be served under that id",
                            param="model") from e
    return Plan(name.text, repo, info.sha or "main", choice, tuple(files), model_id,
                name.names(repo, choice.quant))


@contextlib.contextmanager
def _hub_errors(repo: str) -> Iterator[None]:
    """The hub client's errors as ours, with what to do."""
    from huggingface_hub import constants, errors

    try:
        yield
    except errors.GatedRepoError as e:
        raise Forbidden(f"the repo {repo} is gated: accept its terms on the hub, then set "
                        "HF_TOKEN (or run `hf auth login`)", param="model") from e
    except errors.RepositoryNotFoundError as e:
        raise ModelNotFound(f"no repo {repo} on the hub at {constants.ENDPOINT} (a private "
                            "repo needs HF_TOKEN)", param="model") from e
    except (errors.RevisionNotFoundError, errors.EntryNotFoundError) as e:
        raise ModelNotFound(f"the repo {repo}: {_first_line(e)}", param="model") from e
    except errors.OfflineModeIsEnabled as e:
        raise PullFailed("HF_HUB_OFFLINE is set: nothing is downloaded (unset it to pull)") \
            from e
    except (errors.HfHubHTTPError, OSError, ValueError) as e:  # httpx's errors: OSError-like
        raise PullFailed(f"the hub at {constants.ENDPOINT} failed for {repo}: "
                         f"{_first_line(e)}") from e
    except Exception as e:
        if type(e).__module__.startswith(("httpx", "httpcore")):
            raise PullFailed(f"the hub at {constants.ENDPOINT} cannot be reached: "
                             f"{_first_line(e)}") from e
        raise


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def repo_dir(repo: str) -> Path:
    """The repo's folder in the hub client's cache."""
    return hf_cache_root() / f"models--{repo.replace('/', '--')}"


def missing(plan: Plan) -> list[HubFile]:
    """The plan's files not yet in the cache at its commit."""
    from huggingface_hub import try_to_load_from_cache

    out = []
    for f in plan.files:
        cached = try_to_load_from_cache(plan.repo, f.name, revision=plan.commit)
        if not isinstance(cached, str) or not Path(cached).is_file():
            out.append(f)
    return out


def check_disk(plan: Plan, todo: list[HubFile]) -> None:
    """InsufficientStorage, with both figures, when the files to fetch and
    :data:`DISK_MARGIN_BYTES` exceed the free disk where the cache is."""
    need = sum(f.size for f in todo)
    if not need:
        return
    where = hf_cache_root()
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need + DISK_MARGIN_BYTES > free:
        raise InsufficientStorage(
            f"pulling {plan.given} needs {need // MIB:,} MiB (and {DISK_MARGIN_BYTES // MIB} "
            f"MiB to spare) but {where} has {free // MIB:,} MiB free; free some disk (`hf "
            "cache rm`, or set HF_HUB_CACHE to a larger disk)", param="model")


Meter = Callable[[str, int, int], None]
"""Called as bytes come: (file name, bytes done, its size); raises to stop the pull."""


def fetch(plan: Plan, meter: Meter, on_verify: Callable[[HubFile], None]) -> Path:
    """Download every file of the plan that is missing, then check each against its sha256.
    A file that fails is deleted (blob and link) and PullFailed raised naming it. Returns
    the model's first file in the cache. The repo's folder holds this process's marker
    (catalog/sources.py, ``VERIFYING``) from the first byte to the last check, so that no
    catalog lists an unchecked file."""
    from huggingface_hub import hf_hub_download

    paths: dict[str, Path] = {}
    folder = repo_dir(plan.repo)
    folder.mkdir(parents=True, exist_ok=True)
    _clear_leftovers(folder)
    marker = folder / f"{VERIFYING}{os.getpid()}"
    marker.write_text(json.dumps({"pid": os.getpid(), "files": [f.name for f in plan.files]}))
    try:
        for f in plan.files:
            bar = _bar_class(f, meter)
            with _hub_errors(plan.repo):
                path = hf_hub_download(plan.repo, f.name, tqdm_class=bar)  # type: ignore[call-overload]
            paths[f.name] = Path(path)
            meter(f.name, f.size, f.size)
        for f in plan.files:
            on_verify(f)
            _verify(f, paths[f.name])
    finally:
        marker.unlink(missing_ok=True)
    return paths[plan.choice.model]


STALE_PARTIAL_S = 60.0
"""A partial download untouched this long belongs to a pull that was killed outright (a
live one writes every second or so; the hub client's read timeout is 10 s)."""


def _clear_leftovers(folder: Path) -> None:
    """What a pull killed outright (SIGKILL, a power cut) left in the repo's cache folder:
    its marker and its partial file, which the hub client names per process and so never
    resumes."""
    now = time.time()
    for marker in folder.glob(f"{VERIFYING}*"):
        if not marker_live(marker):
            marker.unlink(missing_ok=True)
    for partial in (folder / "blobs").glob("*.incomplete"):
        with contextlib.suppress(OSError):
            if now - partial.stat().st_mtime > STALE_PARTIAL_S:
                partial.unlink()
                log.info("removed %s, left by a pull that was stopped outright", partial)


def _verify(f: HubFile, path: Path) -> None:
    if f.sha256 is None:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(4 * MIB):
            digest.update(chunk)
    if digest.hexdigest() != f.sha256:
        blob = path.resolve()
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise PullFailed(f"{f.name} failed its checksum (sha256 {digest.hexdigest()}, the hub "
                         f"says {f.sha256}): the file was deleted; pull it again",
                         param="model")


def _bar_class(f: HubFile, meter: Meter) -> Callable[..., Any]:
    """What the hub client takes for a tqdm class: each bar it makes reports to ``meter``."""

    class Bar:
        def __init__(self, *_: Any, initial: int = 0, total: int | None = None,
                     **__: Any) -> None:
            self.n = initial
            self.total = total or f.size
            meter(f.name, self.n, self.total)

        def update(self, n: int | float | None = 1) -> None:
            self.n += int(n or 0)
            meter(f.name, self.n, self.total)

        def __enter__(self) -> Bar:
            return self

        def __exit__(self, *_: object) -> None:
            return None

        def close(self) -> None:
            return None

        def set_description(self, *_: Any, **__: Any) -> None:
            return None

    return Bar
