"""The catalog: every local model bunkhouse can serve, by id.

Sources, in order of precedence when two name the same id:

1. entries of the config file (``[[models]]``),
2. models shipped in installed Python packages (``pip install -e ".[models]"``),
3. every ``*.gguf`` under the model roots (``--models-dir``), with the path relative to its
   root, less ``.gguf``, as id (``sub/name``). Of a split GGUF only the first shard is listed.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bunkhouse.catalog import packaged
from bunkhouse.catalog.gguf_meta import GGUFInfo, read_gguf_info
from bunkhouse.config import EngineOptions, ModelEntry, Settings, engine_options
from bunkhouse.errors import ConfigError, GGUFError, ModelNotFound, PackagedModelError

log = logging.getLogger(__name__)

_SHARD_RE = re.compile(r"-(\d{5})-of-(\d{5})$")


@dataclass(frozen=True, slots=True)
class CatalogModel:
    id: str
    path: Path
    source: str  # "config", "package" or "models_dir"
    info: GGUFInfo
    options: EngineOptions
    size_bytes: int
    modified: int = 0  # the file's mtime, seconds since the epoch ("created" in the API)
    pinned: bool = False  # never evicted
    ttl_s: float | None = None  # idle unload; None: the global ttl
    chat_template: str | None = None  # configured: a template name or a .jinja file's path
    engine: str = "llama.cpp"  # the engine adapter that serves it (bunkhouse.engines)

    @property
    def embeddings(self) -> bool:
        """Whether it serves embeddings: configured, else only if it is an embedding model."""
        configured = self.options.embeddings
        return self.info.pooling if configured is None else configured

    @property
    def has_chat_template(self) -> bool:
        """Whether chat can be templated: configured, or carried by the GGUF."""
        return self.chat_template is not None or self.info.has_chat_template


class Catalog:
    """The id → model mapping with one default model. Built at startup; runtime-registered
    models are added and removed by the admin endpoints (the only writer after startup)."""

    def __init__(self, models: Iterable[CatalogModel], default_id: str | None) -> None:
        self._models = {m.id: m for m in models}
        if default_id is not None and default_id not in self._models:
            raise ConfigError(
                f"default model {default_id!r} is not in the catalog; known: {self.ids()}"
            )
        self.default_id = default_id

    def __iter__(self) -> Iterator[CatalogModel]:
        return iter(list(self._models.values()))

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._models

    def add(self, model: CatalogModel) -> None:
        self._models[model.id] = model

    def remove(self, model_id: str) -> None:
        del self._models[model_id]

    def __len__(self) -> int:
        return len(self._models)

    def ids(self) -> list[str]:
        return list(self._models)

    def get(self, model_id: str | None) -> CatalogModel:
        """The model named ``model_id``; the default model when it is None."""
        if model_id is None:
            if self.default_id is None:
                raise ModelNotFound(
                    "no model given and no default model is configured", param="model"
                )
            model_id = self.default_id
        found = self._models.get(model_id)
        if found is None:
            known = ", ".join(self._models) or "(none)"
            shown = model_id if len(model_id) <= 200 else f"{model_id[:200]}..."
            raise ModelNotFound(
                f"model {shown!r} not found; known models: {known}", param="model"
            )
        return found


def _effective_options(
    base: EngineOptions, overrides: dict[str, Any], info: GGUFInfo, where: str
) -> EngineOptions:
    options = engine_options(base, overrides, where)
    trained = info.context_length
    if trained and options.context > trained:
        log.info(
            "%s: context %d capped at the model's trained context %d",
            where,
            options.context,
            trained,
        )
        options = engine_options(options, {"context": trained}, where)
    return options


def model_files(path: Path, split_count: int) -> list[Path]:
    """Every file of the model whose first (or only) file is ``path``: llama.cpp finds the
    parts of a split model by name (``NAME-00001-of-00003.gguf``, ``-00002-``, ...), next to
    the first. Raises GGUFError when the name does not say so, or a part is missing."""
    if split_count <= 1:
        return [path]
    if split_count > 999:
        raise GGUFError(f"{path}: a model split into {split_count} files (at most 999)")
    shard = _SHARD_RE.search(path.name.removesuffix(".gguf"))
    if shard is None or int(shard.group(1)) != 1 or int(shard.group(2)) != split_count:
        raise GGUFError(f"{path}: a model split into {split_count} files must be named "
                        f"NAME-00001-of-{split_count:05d}.gguf")
    prefix = path.name[: shard.start()]
    files = [path.with_name(f"{prefix}-{i:05d}-of-{split_count:05d}.gguf")
             for i in range(1, split_count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise GGUFError(f"{path}: parts of the split model are missing: "
                        f"{', '.join(missing[:3])}{more}")
    return files


def files_size(files: list[Path]) -> int:
    """All parts' bytes together (what the memory estimate counts as weights)."""
    return sum(f.stat().st_size for f in files)


def _model(model_id: str, path: Path, source: str, settings: Settings,
           entry: ModelEntry | None = None) -> CatalogModel:
    info = read_gguf_info(path)
    overrides = entry.options if entry else {}
    options = _effective_options(settings.defaults, overrides, info, f"model {model_id!r}")
    st = path.stat()
    size = files_size(model_files(path, info.split_count))
    return CatalogModel(model_id, path, source, info, options, size,
                        modified=int(st.st_mtime), pinned=entry.pinned if entry else False,
                        ttl_s=entry.ttl_s if entry else None,
                        chat_template=entry.chat_template if entry else None,
                        engine=entry.engine if entry else "llama.cpp")


def _from_config(settings: Settings) -> Iterator[CatalogModel]:
    for entry in settings.entries:
        if not entry.path.is_file():
            raise ConfigError(f"model {entry.id!r}: no file at {entry.path}")
        try:
            yield _model(entry.id, entry.path.resolve(), "config", settings, entry)
        except GGUFError as e:
            raise ConfigError(f"model {entry.id!r}: {e.message}") from e


def _from_packages(settings: Settings) -> Iterator[CatalogModel]:
    for pm in packaged.KNOWN:
        try:
            parts = packaged.part_paths(pm)
            if parts is None:
                log.debug("packaged model %s is not installed", pm.id)
                continue
            path = packaged.assemble(pm, parts, settings.cache_dir / "models")
        except PackagedModelError as e:
            log.warning("skipping packaged model: %s", e.message)
            continue
        yield _model(pm.id, path, "package", settings)


def gguf_files(root: Path) -> Iterator[tuple[str, Path]]:
    """(id, path) of each servable GGUF under ``root``, in a stable order."""
    for path in sorted(root.rglob("*.gguf")):
        if not path.is_file() or path.name.startswith("."):
            continue
        rel = path.relative_to(root).with_suffix("").as_posix()
        shard = _SHARD_RE.search(rel)
        if shard:
            if int(shard.group(1)) != 1:
                continue
            rel = rel[: shard.start()]
        yield rel, path


def _from_dirs(settings: Settings) -> Iterator[CatalogModel]:
    for root in settings.models_dirs:
        if not root.is_dir():
            raise ConfigError(f"--models-dir {root} is not a directory")
        for model_id, path in gguf_files(root):
            try:
                yield _model(model_id, path.resolve(), "models_dir", settings)
            except GGUFError as e:
                log.warning("skipping %s: %s", path, e.message)
            except OSError as e:  # unreadable, gone since the listing, a name too long
                log.warning("skipping %s: %s", path, e)


def build_catalog(settings: Settings) -> Catalog:
    """Scan every source named by ``settings`` into a catalog."""
    models: dict[str, CatalogModel] = {}
    sources = [_from_config(settings)]
    if settings.include_packaged:
        sources.append(_from_packages(settings))
    sources.append(_from_dirs(settings))
    for source in sources:
        for model in source:
            if model.id in models:
                log.warning(
                    "model id %r from %s is already taken by %s; skipped",
                    model.id,
                    model.path,
                    models[model.id].path,
                )
                continue
            models[model.id] = model
    return Catalog(models.values(), settings.default_model or _first_default(models))


def _first_default(models: dict[str, CatalogModel]) -> str | None:
    for source in ("config", "package", "models_dir"):
        for model in models.values():
            if model.source == source:
                return model.id
    return None
