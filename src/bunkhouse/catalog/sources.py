"""GGUF models that other local LLM tools already keep on this machine, found where they are.

Pure, blocking readers: nothing is copied, downloaded or written. Each reader yields
:class:`Found` entries sorted by id and never raises for a bad entry: the entry is skipped
with a warning naming its path and the reason. A missing root yields nothing (debug log);
a root that cannot be read yields nothing (warning). The layouts are hostile input: walks
never follow directory symlinks, stop at ``_MAX_DEPTH`` levels and ``_MAX_ENTRIES`` entries
per root, files are ``stat``-ed as regular before they are opened (non-blocking, and
``fstat``-ed again), and names that are hidden or not UTF-8 are left out.

Hugging Face hub cache (huggingface_hub's "Manage the cache" guide and ``constants.py``)::

    $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub (~/.cache/...)
      models--{org}--{repo}/          (datasets--, spaces-- are not models)
        blobs/<sha>                   file contents
        refs/main                     the commit hash of the main branch
        snapshots/<commit>/<path/in/repo.gguf> -> ../../blobs/<sha>

  The snapshot is the one ``refs/main`` names, else the most recently modified one. Id
  ``org/repo:path/in/repo`` (less ``.gguf``), ``repo:...`` for a repo without an org. Links
  must resolve inside the repo's own directory; a missing blob is an unfinished download.

Ollama (server/manifest.go, server/modelpath.go, types/model/name.go)::

    $OLLAMA_MODELS, else ~/.ollama/models
      manifests/<host>/<namespace>/<model>/<tag>   an OCI image manifest (JSON)
      blobs/sha256-<hex>                           the layer with digest ``sha256:<hex>``

  One ``application/vnd.ollama.image.model`` layer is the GGUF; the ``template``,
  ``system``, ``params`` and ``projector`` layers are read as well (as in Ollama, a later
  layer of a kind replaces an earlier one). Named as Ollama's ``DisplayShortest`` names it:
  ``model:tag`` on ``registry.ollama.ai/library``, ``namespace/model:tag`` elsewhere on that
  host, ``host/namespace/model:tag`` on any other host.

LM Studio (lmstudio.ai docs, "Import models" / "Change the models directory")::

    $LMSTUDIO_MODELS, else ~/.lmstudio/models and the older ~/.cache/lm-studio/models
      <publisher>/<repo>/<file>.gguf

  Id ``publisher/repo/file``.

An MLX model (catalog/mlx.py) is a hub cache repo whose snapshot is a model directory (no
GGUF in it): id ``org/repo``, every file's link inside the repo's directory.

Everywhere, a split model (``NAME-00001-of-00003.gguf``) is listed once, by its first shard,
with the shard suffix dropped from the id; a ``*mmproj*.gguf`` file is a vision projector,
not a model, and goes with every model in its directory (the first by name, if several).
Ids must pass :func:`bunkhouse.config.check_model_id`.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from bunkhouse.catalog import mlx
from bunkhouse.config import check_model_id, param_error
from bunkhouse.errors import ConfigError

log = logging.getLogger(__name__)

_MAX_DEPTH = 8
_MAX_ENTRIES = 100_000
_MAX_TEXT = 1024 * 1024  # a manifest, template, system or params layer
_MAGIC = b"GGUF"
_SHARD_RE = re.compile(r"-(\d{5})-of-(\d{5})$")
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_OLLAMA_HOST = "registry.ollama.ai"
_OLLAMA_NAMESPACE = "library"
_OLLAMA_LAYER = "application/vnd.ollama.image."

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Found:
    id: str  # the model id users know it by
    path: Path  # the GGUF file to load (first shard of a split model)
    source: str  # "hf_cache", "ollama" or "lmstudio"
    projector: Path | None = None  # a vision projector (mmproj) next to it / in its manifest
    template: str | None = None  # Ollama: the template layer's text (Go template)
    params: dict[str, Any] = field(default_factory=dict)  # Ollama: the params layer's object
    system: str | None = None  # Ollama: the system layer's text


class _Skip(Exception):
    """An entry to leave out, and why; the loop that meets it logs the warning."""


class _Budget:
    """How many more directory entries one root's walk may visit (warns once when spent)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.left = _MAX_ENTRIES

    def spend(self, n: int) -> int:
        """How many of ``n`` entries may still be visited."""
        allowed = min(n, self.left)
        if n > self.left:
            log.warning("%s: stopped after %d entries; the rest is not listed",
                        self.root, _MAX_ENTRIES)
        self.left -= allowed
        return allowed


def is_projector(path: Path) -> bool:
    """Whether ``path`` names a vision projector (``mmproj`` in the name, any case)."""
    return "mmproj" in path.name.lower()


# -- shared helpers ---------------------------------------------------------------------


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def _entries(path: Path, budget: _Budget, *, quiet_missing: bool = False,
             ) -> list[os.DirEntry[str]]:
    """The visible, UTF-8-named entries of the directory ``path``, sorted by name; [] with
    a warning when it cannot be read (only a debug line, with ``quiet_missing``, when it is
    not there)."""
    if budget.left <= 0:
        return []
    try:
        with os.scandir(path) as it:
            entries = list(itertools.islice(it, budget.left + 1))
    except FileNotFoundError:
        (log.debug if quiet_missing else log.warning)("%s: no such directory", path)
        return []
    except OSError as e:
        log.warning("skipping %s: %s", path, e.strerror or e)
        return []
    entries = sorted(entries[: budget.spend(len(entries))], key=lambda e: e.name)
    return [e for e in entries if not e.name.startswith(".") and _utf8(e)]


def _utf8(entry: os.DirEntry[str]) -> bool:
    try:
        entry.name.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes come back as lone surrogates
        log.warning("skipping %r: the name is not UTF-8", entry.path)
        return False
    return True


def _is_dir(entry: os.DirEntry[str]) -> bool:
    """A real directory (never a symlink to one, so no walk can loop)."""
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _walk(top: Path, budget: _Budget, depth: int = 0) -> Iterator[Path]:
    """Every non-directory entry under ``top`` (symlinks included, not followed), depth
    first in name order, at most ``_MAX_DEPTH`` levels down."""
    for entry in _entries(top, budget, quiet_missing=depth == 0):
        if not _is_dir(entry):
            yield Path(entry.path)
        elif depth + 1 < _MAX_DEPTH:
            yield from _walk(Path(entry.path), budget, depth + 1)
        else:
            log.debug("%s: deeper than %d levels, not searched", entry.path, _MAX_DEPTH)


def _read(path: Path, limit: int, *, whole: bool = True) -> bytes:
    """The first ``limit`` bytes of the regular file at ``path`` (following symlinks); with
    ``whole``, all of it, which must be no larger. Raises _Skip, never opens a FIFO or a
    device: stat before, non-blocking open, fstat after."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise _Skip("not a regular file")
        with open(path, "rb", opener=lambda p, fl: os.open(p, fl | os.O_NONBLOCK)) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise _Skip("not a regular file")
            if whole and st.st_size > limit:
                raise _Skip(f"larger than {limit} bytes")
            data = f.read(limit + 1 if whole else limit)
    except FileNotFoundError as e:
        raise _Skip("missing (an unfinished download?)") from e
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise _Skip(str(e)) from e
    if whole and len(data) > limit:
        raise _Skip(f"larger than {limit} bytes")
    return data


def _check_gguf(path: Path, what: str = "not a GGUF file") -> None:
    if _read(path, len(_MAGIC), whole=False) != _MAGIC:
        raise _Skip(what)


def _model_id(model_id: str, where: Path) -> str:
    try:
        return check_model_id(model_id, str(where))
    except ConfigError as e:
        raise _Skip(e.message) from e


def _unshard(stem: str) -> str | None:
    """``stem`` less a split model's shard suffix; None for a shard after the first."""
    shard = _SHARD_RE.search(stem)
    if shard is None:
        return stem
    return stem[: shard.start()] if int(shard.group(1)) == 1 else None


def _gguf_dir(files: Iterable[tuple[str, Path]], source: str, inside: Path | None = None,
              ) -> list[Found]:
    """The models among ``(id, path)`` pairs in name order (an id still carries a split
    model's shard suffix), each with the first projector of its directory. ``inside``:
    where every file must resolve (the HF repo directory)."""
    models: list[tuple[str, Path]] = []
    projectors: dict[Path, Path] = {}
    for name, path in files:
        stem = _unshard(name)
        if stem is None or (is_projector(path) and path.parent in projectors):
            continue
        try:
            _check_target(path, inside)
            _check_gguf(path)
            if is_projector(path):
                projectors[path.parent] = path
            else:
                models.append((_model_id(stem, path), path))
        except _Skip as e:
            log.warning("%s: skipping %s: %s", source, path, e)
    return [Found(i, p, source, projectors.get(p.parent)) for i, p in models]


def _check_target(path: Path, inside: Path | None) -> None:
    if inside is None:
        return
    try:
        real = path.resolve(strict=True)
    except FileNotFoundError as e:
        raise _Skip("its blob is missing (an unfinished download?)") from e
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise _Skip(str(e)) from e
    if not real.is_relative_to(inside):
        raise _Skip(f"it links outside {inside}")


# -- Hugging Face hub cache -------------------------------------------------------------


def hf_cache_root() -> Path:
    """Where huggingface_hub keeps its cache, by the same environment variables."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):  # the second: its older name
        if (path := _env_path(name)) is not None:
            return path
    if (home := _env_path("HF_HOME")) is not None:
        return home / "hub"
    cache = _env_path("XDG_CACHE_HOME") or Path.home() / ".cache"
    return cache / "huggingface" / "hub"


def hf_cache_models(root: Path) -> Iterator[Found]:
    """Every GGUF model in the main snapshot of each model repo in the cache at ``root``."""
    budget = _Budget(root)
    found: list[Found] = []
    for entry in _entries(root, budget, quiet_missing=True):
        if entry.name.startswith("models--") and _is_dir(entry):
            found += _hf_repo(Path(entry.path), budget)
    yield from sorted(found, key=lambda f: f.id)


def _hf_repo_id(dirname: str) -> str:
    org, _, repo = dirname.removeprefix("models--").partition("--")
    return f"{org}/{repo}" if repo else org


def _hf_repo(repo: Path, budget: _Budget) -> list[Found]:
    snapshot = _hf_snapshot(repo, budget)
    if snapshot is None:
        return []
    unchecked = _being_verified(repo)
    repo_id = _hf_repo_id(repo.name)
    try:
        inside = repo.resolve(strict=True)
    except (OSError, RuntimeError) as e:
        log.warning("hf_cache: skipping %s: %s", repo, e)
        return []
    if mlx.looks_like(snapshot) and not unchecked:  # an MLX model: the snapshot is one
        try:
            for path in _walk(snapshot, budget):
                _check_target(path, inside)
        except _Skip as e:
            log.warning("hf_cache: skipping %s: %s", repo_id, e)
            return []
        return [Found(repo_id, snapshot, "hf_cache")]
    files = (
        (f"{repo_id}:{path.relative_to(snapshot).as_posix().removesuffix('.gguf')}", path)
        for path in _walk(snapshot, budget) if path.name.endswith(".gguf")
        and path.relative_to(snapshot).as_posix() not in unchecked
    )
    return _gguf_dir(files, "hf_cache", inside)


VERIFYING = ".bunkhouse-verifying-"
"""The name (then the pid of its pull) of a marker in a hub cache repo's folder while
`bunkhouse pull` checks its files (bunkhouse/pull/hub.py): ``{"pid", "files"}``; those files
are not listed until they pass. A marker whose process is gone is stale and ignored."""


def _being_verified(repo: Path) -> frozenset[str]:
    """The files of ``repo`` that a pull under way has not checked yet."""
    files: set[str] = set()
    try:
        markers = [e.name for e in os.scandir(repo) if e.name.startswith(VERIFYING)][:64]
    except OSError:
        return frozenset()
    for name in markers:
        if not marker_live(repo / name):
            continue
        try:
            marker = json.loads(_read(repo / name, 64 * 1024))
            files |= {f for f in marker.get("files", ()) if isinstance(f, str)}
        except (_Skip, ValueError, AttributeError, TypeError):
            continue
    return frozenset(files)


def marker_live(marker: Path) -> bool:
    """Whether the process a :data:`VERIFYING` marker is named after still runs."""
    try:
        os.kill(int(marker.name.removeprefix(VERIFYING)), 0)
    except (ValueError, ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's live process
        pass
    return True


def pulled_model(root: Path, repo: str, commit: str, model: str, model_id: str
                 ) -> Found | None:
    """A model `bunkhouse pull` recorded, checked as the hub cache's models are (None when
    its file is gone, with a warning when it fails a check)."""
    folder = root / f"models--{repo.replace('/', '--')}"
    path = folder / "snapshots" / commit / model
    if not path.exists():  # removed since (hf cache rm): its record is stale, not an error
        log.debug("pulled: %s is no longer in the hub cache (%s)", model_id, path)
        return None
    if model in _being_verified(folder):
        return None
    try:
        inside = folder.resolve(strict=True)
    except (OSError, RuntimeError) as e:
        log.warning("pulled: skipping %s (%s): %s", model_id, folder, e)
        return None
    found = _gguf_dir([(model_id, path)], "pulled", inside)
    return found[0] if found else None


def _hf_snapshot(repo: Path, budget: _Budget) -> Path | None:
    """The snapshot ``refs/main`` names when it is there, else the latest modified one.
    The ref only picks among listed directories: no path is built from its text."""
    snapshots = [e for e in _entries(repo / "snapshots", budget, quiet_missing=True) if _is_dir(e)]
    if not snapshots:
        return None
    try:
        ref = _read(repo / "refs" / "main", 256).decode("ascii", "replace").strip()
    except _Skip:
        ref = ""
    named = [e for e in snapshots if e.name == ref]
    if named:
        return Path(named[0].path)
    return Path(max(snapshots, key=_mtime_name).path)


def _mtime_name(entry: os.DirEntry[str]) -> tuple[float, str]:
    try:
        return entry.stat(follow_symlinks=False).st_mtime, entry.name
    except OSError:
        return 0.0, entry.name


# -- Ollama -----------------------------------------------------------------------------


def ollama_root() -> Path:
    """Where Ollama keeps its models: ``$OLLAMA_MODELS``, else ``~/.ollama/models``."""
    return _env_path("OLLAMA_MODELS") or Path.home() / ".ollama" / "models"


def ollama_models(root: Path) -> Iterator[Found]:
    """Every model of the Ollama store at ``root`` whose model layer is a GGUF file."""
    budget = _Budget(root)
    found: list[Found] = []
    for parts, path in _ollama_manifests(root / "manifests", budget):
        try:
            found.append(_ollama_model(root, path, _ollama_name(*parts)))
        except _Skip as e:
            log.warning("ollama: skipping %s: %s", path, e)
    yield from sorted(found, key=lambda f: f.id)


def _ollama_manifests(top: Path, budget: _Budget, parts: tuple[str, ...] = (),
                      ) -> Iterator[tuple[tuple[str, str, str, str], Path]]:
    """``((host, namespace, model, tag), path)`` of each manifest file, exactly four levels
    under ``top``; anything at another depth is not a manifest."""
    for entry in _entries(top, budget, quiet_missing=not parts):
        path = Path(entry.path)
        if len(parts) == 3:
            if not _is_dir(entry):
                yield (parts[0], parts[1], parts[2], entry.name), path
        elif _is_dir(entry):
            yield from _ollama_manifests(path, budget, (*parts, entry.name))


def _ollama_name(host: str, namespace: str, model: str, tag: str) -> str:
    if host.casefold() != _OLLAMA_HOST:
        return f"{host}/{namespace}/{model}:{tag}"
    if namespace.casefold() != _OLLAMA_NAMESPACE:
        return f"{namespace}/{model}:{tag}"
    return f"{model}:{tag}"


def _ollama_layers(manifest: Path) -> list[tuple[str, str]]:
    """``(kind, digest)`` of each Ollama layer (kind: ``model``, ``template``, ...)."""
    try:
        doc = json.loads(_read(manifest, _MAX_TEXT))
    except (ValueError, RecursionError) as e:
        raise _Skip(f"not a JSON manifest: {e}") from e
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, list):
        raise _Skip("not a manifest: no list of layers")
    kinds: list[tuple[str, str]] = []
    for layer in layers:
        media = layer.get("mediaType") if isinstance(layer, dict) else None
        digest = layer.get("digest") if isinstance(layer, dict) else None
        if not isinstance(media, str) or not isinstance(digest, str):
            raise _Skip("a layer is not an object with a mediaType and a digest")
        if not _DIGEST_RE.fullmatch(digest):
            raise _Skip(f"a layer's digest {digest[:80]!r} is not sha256:<64 hex digits>")
        if media.startswith(_OLLAMA_LAYER):
            kinds.append((media.removeprefix(_OLLAMA_LAYER), digest))
    return kinds


def _ollama_model(root: Path, manifest: Path, name: str) -> Found:
    model_id = _model_id(name, manifest)
    layers = _ollama_layers(manifest)
    models = [digest for kind, digest in layers if kind == "model"]
    if len(models) != 1:
        raise _Skip(f"{len(models)} model layers (one GGUF model layer is needed)")
    blobs = {kind: _ollama_blob(root, digest) for kind, digest in layers}
    try:
        _check_gguf(blobs["model"], "not a GGUF model layer")
    except _Skip as e:
        raise _Skip(f"model layer {blobs['model'].name}: {e}") from e
    return Found(model_id, blobs["model"], "ollama",
                 projector=_optional(manifest, blobs, "projector", _projector),
                 template=_optional(manifest, blobs, "template", _text),
                 params=_optional(manifest, blobs, "params", _params) or {},
                 system=_optional(manifest, blobs, "system", _text))


def _ollama_blob(root: Path, digest: str) -> Path:
    return root / "blobs" / digest.replace(":", "-", 1)  # digest checked by _DIGEST_RE


def _optional(manifest: Path, blobs: dict[str, Path], kind: str,
              read: Callable[[Path], _T]) -> _T | None:
    """The ``kind`` layer read by ``read``; None (with a warning when it is there but
    unusable) otherwise."""
    if kind not in blobs:
        return None
    try:
        return read(blobs[kind])
    except _Skip as e:
        log.warning("ollama: %s: ignoring the %s layer %s: %s",
                    manifest, kind, blobs[kind].name, e)
        return None


def _text(blob: Path) -> str:
    try:
        return _read(blob, _MAX_TEXT).decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Skip("not UTF-8 text") from e


def _params(blob: Path) -> dict[str, Any]:
    try:
        params = json.loads(_read(blob, _MAX_TEXT))
    except (ValueError, RecursionError) as e:
        raise _Skip(f"not JSON: {e}") from e
    if not isinstance(params, dict):
        raise _Skip("not a JSON object")
    return params


def _projector(blob: Path) -> Path:
    _check_gguf(blob)
    return blob


# -- LM Studio --------------------------------------------------------------------------


def lmstudio_roots() -> list[Path]:
    """``$LMSTUDIO_MODELS``, else those of LM Studio's current and older default model
    folders that exist."""
    if (path := _env_path("LMSTUDIO_MODELS")) is not None:
        return [path]
    home = Path.home()
    return [p for p in (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models")
            if os.path.isdir(p)]


def lmstudio_models(root: Path) -> Iterator[Found]:
    """Every GGUF model under ``root/<publisher>/<repo>/``."""
    budget = _Budget(root)
    files = (
        (path.relative_to(root).as_posix().removesuffix(".gguf"), path)
        for path in _walk(root, budget)
        if path.name.endswith(".gguf") and len(path.relative_to(root).parts) >= 3
    )
    yield from sorted(_gguf_dir(files, "lmstudio"), key=lambda f: f.id)


# -- Ollama's parameters as request defaults --------------------------------------------

_NUMBER_PARAMS = ("temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty",
                  "presence_penalty", "frequency_penalty")


def ollama_params(params: dict[str, Any], where: str = "an Ollama params layer"
                  ) -> dict[str, Any]:
    """An Ollama params layer (a Modelfile's ``PARAMETER`` lines) as request defaults in
    OpenAI's field names: the sampling numbers under their own names, ``stop`` (at most 4
    strings), ``num_predict`` as ``max_tokens``. ``num_ctx`` and the rest are the server's
    to set, and dropped; a value the request schema would refuse is dropped with a warning
    (``where`` names the model)."""
    given: dict[str, Any] = {name: params[name] for name in _NUMBER_PARAMS if name in params}
    stop = params.get("stop")
    if stop is not None:
        given["stop"] = ([stop] if isinstance(stop, str) else
                         stop[:4] if isinstance(stop, list) else stop)
    predict = params.get("num_predict")
    if predict not in (None, -2, -1, 0):  # these: until the context is full (as Ollama)
        given["max_tokens"] = predict
    out: dict[str, Any] = {}
    for name, value in given.items():
        error = param_error(name, value)
        if error is None:
            out[name] = value
        else:
            log.warning("%s: parameter %s ignored: %s", where, name, error)
    return out
