"""The catalog: every local model bunkhouse can serve, by id.

Sources, in order of precedence when two name the same id:

1. entries of the config file (``[[models]]``),
2. models shipped in installed Python packages (``pip install -e ".[models]"``): GGUFs, and
   a Whisper model directory for transcription (catalog/whisper.py),
3. every ``*.gguf`` under the model roots (``--models-dir``), with the path relative to its
   root, less ``.gguf``, as id (``sub/name``). Of a split GGUF only the first shard is listed.
   Every MLX model directory there too (catalog/mlx.py), its relative path as id.
4. the folders other tools keep models in (catalog/sources.py): the Hugging Face hub cache
   (``org/repo:file``; an MLX repo as ``org/repo``), Ollama's store (``name:tag``), LM
   Studio's models folder (``publisher/repo/file``); each can be switched off.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bunkhouse.catalog import mlx, packaged, sources, whisper
from bunkhouse.config import (
    DEFAULT_ENGINE,
    EngineOptions,
    ModelEntry,
    RequestParams,
    Settings,
    engine_options,
)
from bunkhouse.defaults import DEFAULT_SLOT_TOKENS
from bunkhouse.engines import ENGINES
from bunkhouse.engines.contract import Adapter, Draft
from bunkhouse.errors import (
    ConfigError,
    GGUFError,
    InvalidRequest,
    ModelNotFound,
    PackagedModelError,
)
from bunkhouse.gguf.meta import GGUFInfo, lora_misfit, read_gguf_info, read_tensor_shapes
from bunkhouse.pull.names import hub_spellings
from bunkhouse.pull.records import Pulled, read_records

log = logging.getLogger(__name__)

_SHARD_RE = re.compile(r"-(\d{5})-of-(\d{5})$")

DIRECTORY_ENGINES = whisper.ENGINES | {mlx.ENGINE}
"""The engines whose models are directories, not GGUF files."""


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
    aliases: tuple[str, ...] = ()  # other names it answers to
    projector: Path | None = None  # a vision projector found with it (noted, not served)
    # request defaults and filters: configured, or an Ollama params layer's defaults
    request: RequestParams = field(default_factory=RequestParams)
    # the real path of each file when catalogued, where ``path`` is a link by design (the
    # hub cache's snapshot links to blobs); empty: ``path`` and its parts are real paths
    resolved: tuple[Path, ...] = ()
    adapter_of: str | None = None  # a LoRA adapter: the id of the base model it runs on
    scale: float = 1.0  # an adapter's scale
    adapters: tuple[Adapter, ...] = ()  # a base's adapters, mounted with it
    default_adapter: str | None = None  # a base's: the adapter requests for its id run
    draft: Draft | None = None  # a draft model for speculative decoding (its options name it)
    refused: str | None = None  # why it cannot be served under its options: listed, failed

    @property
    def adapter(self) -> Adapter | None:
        """This adapter as its base's worker mounts it; None for a model."""
        if self.adapter_of is None:
            return None
        return Adapter(self.id, self.path, self.size_bytes, self.scale)

    @property
    def kind(self) -> str:
        """What it serves: ``transcription`` (a Whisper model: POST /v1/audio/transcriptions
        only), ``embedding`` (an embedding model), ``chat`` (it has a chat template) or
        ``completion`` (a base model: raw prompts)."""
        if self.engine in whisper.ENGINES:
            return "transcription"
        if self.info.pooling:
            return "embedding"
        return "chat" if self.has_chat_template else "completion"

    @property
    def transcribes(self) -> bool:
        return self.kind == "transcription"

    @property
    def directory(self) -> bool:
        """Whether its ``path`` is a model directory (Whisper's, MLX's), not a GGUF file."""
        return self.engine in DIRECTORY_ENGINES

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
    """The id → model mapping with one default model, and the aliases naming models. Built at
    startup; runtime-registered models are added and removed by the admin endpoints (the only
    writer after startup)."""

    def __init__(self, models: Iterable[CatalogModel], default_id: str | None) -> None:
        self._models = {m.id: m for m in models}
        self._aliases: dict[str, str] = {}
        for model in self._models.values():
            for alias in model.aliases:
                for spelling in _spellings(alias):  # gemma and gemma:latest are one name
                    if spelling in self._models or spelling in self._aliases:
                        taken = "a model's id" if spelling in self._models else \
                            f"an alias of {self._aliases[spelling]!r}"
                        raise ConfigError(f"alias {alias!r} of model {model.id!r} is already "
                                          f"{taken} ({spelling!r}); each name may mean one "
                                          "model")
                self._aliases[alias] = model.id
        if default_id is not None and self.resolve(default_id) is None:
            raise ConfigError(
                f"default model {default_id!r} is not in the catalog; known: {self.ids()}"
            )
        self.default_id = None if default_id is None else self.resolve(default_id)
        if self.default_id is not None and self._models[self.default_id].transcribes:
            raise ConfigError(_TRANSCRIBES_NO_DEFAULT.format(model=self.default_id))
        self._switched: str | None = None  # an operator's choice of default model

    def __iter__(self) -> Iterator[CatalogModel]:
        return iter(list(self._models.values()))

    def bases(self) -> list[CatalogModel]:
        """The models that run workers: every model but the adapters."""
        return [m for m in self._models.values() if m.adapter_of is None]

    def adapters_of(self, base_id: str) -> list[CatalogModel]:
        """The adapters registered on ``base_id`` (the catalog's view: the base's worker
        mounts them once it is re-mounted)."""
        return [m for m in self._models.values() if m.adapter_of == base_id]

    def served(self, model: CatalogModel) -> tuple[CatalogModel, CatalogModel | None]:
        """What a request naming ``model`` runs on: its base (``model`` itself if it is no
        adapter) and the adapter, if any: the adapter named, or the base's default adapter.
        ModelNotFound if an adapter's base is gone."""
        if model.adapter_of is None:
            default = self._models.get(model.default_adapter or "")
            return model, default if default is not None and default.adapter_of == model.id \
                else None
        base = self._models.get(model.adapter_of)
        if base is None:
            raise ModelNotFound(f"adapter {model.id!r}: its base model {model.adapter_of!r} "
                                "is gone", param="model")
        return base, model

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._models

    def taken(self, name: str) -> bool:
        """Whether ``name`` already means a model (an id or an alias)."""
        return name in self._models or name in self._aliases

    def add(self, model: CatalogModel) -> None:
        self._models[model.id] = model

    def remove(self, model_id: str) -> None:
        del self._models[model_id]
        self._aliases = {a: m for a, m in self._aliases.items() if m != model_id}

    def __len__(self) -> int:
        return len(self._models)

    def ids(self) -> list[str]:
        return list(self._models)

    def resolve(self, name: str) -> str | None:
        """The id of the model ``name`` means: an id or an alias, exactly as typed; Ollama's
        ``name:latest`` is ``name``, and a name without a tag is also ``name:latest``; a hub
        name as one types it to pull it (pull/names.py ``hub_spellings``: ``hf.co/``, the
        quantization in any case, a file's path) is the model pulled."""
        found = self._lookup(name)
        if found is None:
            for spelled in hub_spellings(name):  # a hub name as one types it to pull it
                if (found := self._lookup(spelled)) is not None:
                    break
        return found

    def _lookup(self, name: str) -> str | None:
        for candidate in _spellings(name):
            if candidate in self._models:
                return candidate
            if candidate in self._aliases:
                return self._aliases[candidate]
        return None

    def get(self, model_id: str | None) -> CatalogModel:
        """The model named ``model_id`` (see :meth:`resolve`); the default model when it is
        None. Raises ModelNotFound naming the closest known names."""
        if model_id is None:
            if self.default_id is None:
                raise ModelNotFound(
                    "no model given and no default model is configured", param="model"
                )
            model_id = self.default_id
        found = self.resolve(model_id)
        if found is None:
            raise ModelNotFound(self._not_found(model_id), param="model")
        return self._models[found]

    def _not_found(self, name: str) -> str:
        shown = name if len(name) <= 200 else f"{name[:200]}..."
        names = [*self._models, *self._aliases]
        close = difflib.get_close_matches(name[:200].lower(), [n.lower() for n in names],
                                          n=3, cutoff=0.6)
        spelled = {n.lower(): n for n in names}
        hint = f"; did you mean {' or '.join(repr(spelled[c]) for c in close)}?" if close else ""
        known = ", ".join(self._models) if len(self._models) <= 20 else \
            f"{len(self._models)} models (GET /v1/models lists them)"
        return f"model {shown!r} not found{hint}{' K' if hint else '; k'}nown models: " \
               f"{known or '(none)'}"

    def set_default(self, name: str) -> CatalogModel:
        """Make the model ``name`` means the default one, until a restart (ModelNotFound if
        none, InvalidRequest for a transcription model); a configuration reload keeps it
        while the model is served."""
        model = self.get(name)
        if model.transcribes:
            raise InvalidRequest(_TRANSCRIBES_NO_DEFAULT.format(model=model.id),
                                 param="model")
        self.default_id = self._switched = model.id
        return model

    def adopt(self, new: Catalog, keep: Iterable[str]) -> None:
        """Take ``new``'s models, aliases and default model (residency's reload); the models
        of ``keep`` stay (runtime-registered ones, removed ones still draining) and a model
        whose settings changed keeps its running ones until residency takes the new
        (:meth:`add`). An adapter takes its new entry at once: its base's worker is
        re-mounted if its file changed, and a request runs it at its scale."""
        kept = {i: self._models[i] for i in keep if i in self._models}
        self._models = {**{i: m if m.adapter_of is not None else self._models.get(i, m)
                           for i, m in new._models.items()}, **kept}
        self._aliases = dict(new._aliases)
        switched = self._switched
        self.default_id = switched if switched in new._models else new.default_id


_TRANSCRIBES_NO_DEFAULT = (
    "model {model!r} is a transcription model and cannot be the default model (a request "
    "that names no model is a text request); choose a model that generates text")


def _spellings(name: str) -> tuple[str, ...]:
    if name.endswith(":latest"):
        return name, name.removesuffix(":latest")
    return name, f"{name}:latest"


def effective_options(base: EngineOptions, overrides: dict[str, Any], info: GGUFInfo,
                      where: str, engine: str = DEFAULT_ENGINE,
                      own: tuple[tuple[str, Any], ...] = ()) -> EngineOptions:
    """``base`` with a model's ``overrides`` and its ``own`` keys for ``engine``
    (:func:`engine_keys`), its context settled: set by no one, each slot holds
    DEFAULT_SLOT_TOKENS (within the trained context); set, a slot past the trained context is
    lowered to it; then a slot is what ``engine`` allocates (its adapter's ``slot_tokens``).
    Raises ConfigError for invalid options."""
    options = replace(engine_options(base, overrides, where),
                      engine_keys=engine_keys(engine, base, own, where))
    trained = info.context_length
    given = slot = options.context // options.parallel
    if options.context_auto:
        slot = max(64, min(DEFAULT_SLOT_TOKENS, trained or DEFAULT_SLOT_TOKENS))
    elif trained and slot > trained:
        log.info("%s: slots of %d tokens capped at the model's trained context %d",
                 where, slot, trained)
        slot = trained
    slot = ENGINES[engine].slot_tokens(slot)
    if slot == given and options.context == slot * options.parallel:
        return options
    return engine_options(options, {"context": slot * options.parallel}, where)


def engine_keys(engine: str, base: EngineOptions, own: tuple[tuple[str, Any], ...],
                where: str) -> tuple[tuple[str, Any], ...]:
    """A model's options of its ``engine``: the keys of ``base`` (the defaults) that engine
    knows, then the model's ``own``, checked by its adapter (ConfigError naming an unknown
    key or a wrong value)."""
    adapter = ENGINES[engine]
    keys = {k: v for k, v in base.engine_keys if k in adapter.known_options} | dict(own)
    adapter.options(keys, where)
    return tuple(keys.items())


def check_defaults(defaults: EngineOptions) -> None:
    """ConfigError for a key of [defaults] that no engine knows, or a value an engine that
    knows it refuses."""
    known = frozenset().union(*(a.known_options for a in ENGINES.values()))
    unknown = sorted(k for k, _ in defaults.engine_keys if k not in known)
    if unknown:
        raise ConfigError(f"[defaults]: unknown key(s) {unknown}")
    for name in ENGINES:
        engine_keys(name, defaults, (), "[defaults]")


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
           entry: ModelEntry | None = None, found: sources.Found | None = None
           ) -> CatalogModel:
    if entry is not None and entry.engine in whisper.ENGINES:
        return _whisper_model(model_id, path, source, settings, entry)
    if (entry is not None and entry.engine == mlx.ENGINE) or path.is_dir():
        return _mlx_model(model_id, path, source, settings, entry)
    info = read_gguf_info(path)
    if info.general_type == "adapter":
        raise GGUFError(f"{path}: a LoRA adapter, not a model: serve it as an adapter of its "
                        "base model (adapter_of = the base's id)")
    overrides = entry.options if entry else {}
    engine = entry.engine if entry else settings.default_engine
    options, refused = _options_or_refusal(settings.defaults, overrides, info,
                                           f"model {model_id!r}", engine,
                                           entry.engine_keys if entry else ())
    st = path.stat()
    parts = model_files(path, info.split_count)
    size = files_size(parts)
    return CatalogModel(model_id, path, source, info, options, size,
                        modified=int(st.st_mtime), pinned=entry.pinned if entry else False,
                        ttl_s=entry.ttl_s if entry else None,
                        chat_template=entry.chat_template if entry else None,
                        engine=engine,
                        aliases=entry.aliases if entry else (),
                        projector=found.projector if found else None,
                        request=entry.params if entry else RequestParams(
                            tuple(sources.ollama_params(found.params, f"model {model_id!r}")
                                  .items()) if found else ()),
                        resolved=tuple(p.resolve() for p in parts) if found else (),
                        refused=refused)


def _options_or_refusal(base: EngineOptions, overrides: dict[str, Any], info: GGUFInfo,
                        where: str, engine: str, own: tuple[tuple[str, Any], ...]
                        ) -> tuple[EngineOptions, str | None]:
    """A configured model's options (:func:`effective_options`), and the refusal of its own
    engine keys when its engine refuses them: the model is then catalogued without them,
    listed as failed with the reason, and the other models serve (ConfigError for anything
    else wrong)."""
    try:
        return effective_options(base, overrides, info, where, engine, own), None
    except ConfigError as e:
        if not own:
            raise
        options = effective_options(base, overrides, info, where, engine)
        return options, e.message.removeprefix(f"{where}: ")


def resolve_draft(name: str, models: Callable[[str], CatalogModel | None], base_dir: Path,
                  check_path: Callable[[Path], Path] | None = None) -> Draft:
    """The draft model ``name`` means: a catalogued model's id or alias (``models`` finds
    it), else a GGUF file's path (relative to ``base_dir``; ``check_path`` may refuse it, as
    a runtime registration's roots do). ConfigError naming ``draft`` otherwise."""
    named = models(name)
    if named is not None:
        if named.adapter_of is not None or named.directory:
            what = "a LoRA adapter" if named.adapter_of else \
                "a transcription model" if named.transcribes else "an MLX model"
            raise ConfigError(f"draft: {name!r} is {what}, not a model that generates")
        return Draft(name, named.path, named.size_bytes, named.info,
                     named.path.stat().st_mtime_ns)
    path = Path(name).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if check_path is not None:
        path = check_path(path)
    if not path.is_file():
        raise ConfigError(f"draft: {name!r} is neither a model id nor a GGUF file; name a "
                          "model of `bunkhouse models` or a file's path")
    try:
        info = read_gguf_info(path)
        size = files_size(model_files(path, info.split_count))
        mtime_ns = path.stat().st_mtime_ns
    except GGUFError as e:
        raise ConfigError(f"draft: {e.message}") from e
    except OSError as e:
        raise ConfigError(f"draft: {path} cannot be read: {e.strerror}") from e
    return Draft(name, path.resolve(), size, info, mtime_ns)


def settle(model: CatalogModel, models: Callable[[str], CatalogModel | None], base_dir: Path,
           check_path: Callable[[Path], Path] | None = None) -> CatalogModel:
    """``model`` with the draft model its options name resolved, and the refusal of its
    options if its engine cannot serve it under them (engines' ``refused``)."""
    if model.refused or model.adapter_of is not None:
        return model
    adapter = ENGINES[model.engine]
    name = adapter.draft_name(model)
    if name is not None:
        try:
            model = replace(model, draft=resolve_draft(name, models, base_dir, check_path))
        except ConfigError as e:
            return replace(model, refused=e.message)
    why = adapter.refused(model)
    return replace(model, refused=why) if why else model


def _settle_all(models: dict[str, CatalogModel], settings: Settings) -> None:
    """Every model settled (:func:`settle`); a refused one is logged and stays listed, as
    failed with the reason."""
    base_dir = settings.config_file.parent if settings.config_file else Path.cwd()

    def find(name: str) -> CatalogModel | None:
        named = _resolve(models, name)
        return models[named] if named is not None else None

    for model_id, model in list(models.items()):
        settled = settle(model, find, base_dir)
        if settled.refused:
            log.error("model %r cannot be served: %s; it is listed as failed (the other "
                      "models serve). Fix its options and reload", model_id, settled.refused)
        models[model_id] = settled


def _whisper_model(model_id: str, path: Path, source: str, settings: Settings,
                   entry: ModelEntry | None = None) -> CatalogModel:
    """A CTranslate2 Whisper model directory (catalog/whisper.py): one slot, no context."""
    files = whisper.model_files(path)
    options = _transcription_options(settings.defaults, entry, f"model {model_id!r}")
    return CatalogModel(model_id, path, source, whisper.info(path), options,
                        files_size(files), modified=int(path.stat().st_mtime),
                        pinned=entry.pinned if entry else False,
                        ttl_s=entry.ttl_s if entry else None, engine=whisper.ENGINE,
                        aliases=entry.aliases if entry else ())


def _mlx_model(model_id: str, path: Path, source: str, settings: Settings,
               entry: ModelEntry | None = None) -> CatalogModel:
    """An MLX model directory (catalog/mlx.py), served by the ``mlx`` engine."""
    if entry is not None and entry.engine != mlx.ENGINE:
        raise GGUFError(f"{path}: a directory; engine {entry.engine!r} serves GGUF files (an "
                        f"MLX model directory needs engine = {mlx.ENGINE!r})")
    files = mlx.model_files(path)
    info = mlx.info(path)
    options, refused = _options_or_refusal(settings.defaults, entry.options if entry else {},
                                           info, f"model {model_id!r}", mlx.ENGINE,
                                           entry.engine_keys if entry else ())
    return CatalogModel(model_id, path, source, info, options, files_size(files),
                        modified=int(path.stat().st_mtime),
                        pinned=entry.pinned if entry else False,
                        ttl_s=entry.ttl_s if entry else None,
                        chat_template=entry.chat_template if entry else None,
                        engine=mlx.ENGINE, aliases=entry.aliases if entry else (),
                        request=entry.params if entry else RequestParams(),
                        resolved=tuple(f.resolve() for f in files), refused=refused)


def _transcription_options(base: EngineOptions, entry: ModelEntry | None,
                           where: str) -> EngineOptions:
    """A transcription model's options: its entry's, but one slot (whisper.OPTIONS)."""
    options = engine_options(base, {**(entry.options if entry else {}), **whisper.OPTIONS},
                             where)
    own = engine_keys(whisper.ENGINE, base, entry.engine_keys if entry else (), where)
    return replace(options, engine_keys=own)


def _from_config(settings: Settings) -> Iterator[CatalogModel]:
    for entry in settings.entries:
        if entry.overlay or entry.adapter_of is not None:
            continue
        directory = entry.engine in DIRECTORY_ENGINES
        if not (entry.path.is_dir() if directory else entry.path.is_file()):
            what = {"whisper": "Whisper model directory",
                    mlx.ENGINE: "MLX model directory"}.get(entry.engine, "file")
            raise ConfigError(f"model {entry.id!r}: no {what} at {entry.path}")
        try:
            yield _model(entry.id, entry.path.resolve(), "config", settings, entry)
        except (GGUFError, OSError) as e:
            raise ConfigError(f"model {entry.id!r}: {getattr(e, 'message', e)}") from e


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
    for pd in packaged.DIRECTORIES:
        try:
            directory = packaged.directory_path(pd)
            if directory is None:
                log.debug("packaged model %s is not installed", pd.id)
                continue
            yield _whisper_model(pd.id, directory.resolve(), "package", settings)
        except (PackagedModelError, GGUFError) as e:
            log.warning("skipping packaged model: %s", e.message)


def gguf_files(root: Path) -> Iterator[tuple[str, Path]]:
    """(id, path) of each servable GGUF under ``root``, in a stable order."""
    for path in sorted(root.rglob("*.gguf")):
        if not path.is_file() or path.name.startswith("."):
            continue
        rel = path.relative_to(root).with_suffix("").as_posix()
        if not rel.isprintable():  # a control character: a forged log line, a terminal escape
            log.warning("skipping %r: its name has control characters; rename it", str(path))
            continue
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
        for model_id, path in [*gguf_files(root), *mlx.model_dirs(root)]:
            try:
                yield _model(model_id, path.resolve(), "models_dir", settings)
            except GGUFError as e:
                log.warning("skipping %s: %s", path, e.message)
            except OSError as e:  # unreadable, gone since the listing, a name too long
                log.warning("skipping %s: %s", path, e)


_READERS: dict[str, tuple[Callable[[], list[Path]], Callable[[Path], Iterator[sources.Found]]]] = {
    "hf_cache": (lambda: [sources.hf_cache_root()], sources.hf_cache_models),
    "ollama": (lambda: [sources.ollama_root()], sources.ollama_models),
    "lmstudio": (sources.lmstudio_roots, sources.lmstudio_models),
}


def _from_sources(settings: Settings) -> Iterator[CatalogModel]:
    for name, where in settings.sources:
        if where is False:
            continue
        roots, read = _READERS[name]
        for root in [where] if isinstance(where, Path) else roots():
            for found in read(root):
                try:  # the path as found: a split model's shards are named beside it
                    yield _model(found.id, found.path, found.source, settings, found=found)
                except GGUFError as e:
                    log.warning("skipping %s: %s", found.path, e.message)
                except (OSError, ConfigError) as e:
                    log.warning("skipping %s: %s", found.path, e)


def _from_pulls(pulls: list[Pulled], settings: Settings, listed: dict[str, CatalogModel]
                ) -> Iterator[CatalogModel]:
    """The models `bunkhouse pull` recorded, in the hub cache, but those ``listed`` already
    (hf_cache lists them too where it is on; their names are added below either way)."""
    root = sources.hf_cache_root()
    for pulled in pulls:
        if pulled.model_id in listed:
            continue
        found = sources.pulled_model(root, pulled.repo, pulled.commit, pulled.model,
                                     pulled.model_id)
        if found is None:
            continue
        try:
            yield _model(found.id, found.path, found.source, settings, found=found)
        except GGUFError as e:
            log.warning("skipping %s: %s", found.path, e.message)
        except (OSError, ConfigError) as e:
            log.warning("skipping %s: %s", found.path, e)


def _name_pulled(models: dict[str, CatalogModel], pulls: list[Pulled]) -> None:
    """Each pulled model also answers to the names it was pulled by, where no model's id
    or other alias has that name already (those come first)."""
    taken = {s for m in models.values() for n in (m.id, *m.aliases) for s in _spellings(n)}
    for pulled in pulls:
        model = models.get(pulled.model_id)
        if model is None:
            continue
        names = [n for n in pulled.names if not set(_spellings(n)) & taken]
        taken |= {s for n in names for s in _spellings(n)}
        if names:
            models[model.id] = replace(model, aliases=(*model.aliases, *names))


def build_catalog(settings: Settings, *, engines: Collection[str]) -> Catalog:
    """Scan every source named by ``settings`` into a catalog. ``engines``: the names of the
    engines there are (``bunkhouse.engines.ENGINES``), which a configured model's
    ``engine`` must be one of."""
    _check_engines(settings, engines)
    check_defaults(settings.defaults)
    models: dict[str, CatalogModel] = {}
    readers = [_from_config(settings)]
    if settings.include_packaged:
        readers.append(_from_packages(settings))
    readers.append(_from_dirs(settings))
    readers.append(_from_sources(settings))
    pulls = read_records(settings.data_dir)
    readers.append(_from_pulls(pulls, settings, models))
    for reader in readers:
        for model in reader:
            taken = next((s for s in _spellings(model.id) if s in models), None)
            if taken is not None:  # gemma and gemma:latest are one name
                log.warning(
                    "model id %r from %s is already taken by %s (%r); skipped",
                    model.id,
                    model.path,
                    models[taken].path,
                    taken,
                )
                continue
            models[model.id] = model
    for alias, target in settings.aliases:
        named = _resolve(models, target)
        if named is None:
            raise ConfigError(f"[aliases]: {alias!r} names model {target!r}, which is not in "
                              f"the catalog; known: {', '.join(models) or '(none)'}")
        model = models[named]
        models[named] = replace(model, aliases=(*model.aliases, alias))
    _name_pulled(models, pulls)
    for entry in settings.entries:  # by id or by any alias given above
        if entry.overlay:
            _overlay(models, entry, settings)
    _name_transcription(models)
    _add_adapters(models, settings)
    _settle_all(models, settings)
    return Catalog(models.values(),
                   settings.default_model or _first_default(models, settings.entries))


def make_adapter(model_id: str, path: Path, base: CatalogModel, scale: float, source: str,
                 aliases: tuple[str, ...] = ()) -> CatalogModel:
    """The catalog entry of a LoRA adapter of ``base``: ConfigError naming the key
    (``adapter_of``, ``path``) if ``base`` is an adapter or cannot mount one, or if the file
    is no LoRA GGUF of ``base``'s architecture."""
    if base.adapter_of is not None:
        raise ConfigError(f"adapter_of: {base.id!r} is an adapter itself (of "
                          f"{base.adapter_of!r}); name the base model")
    refused = ENGINES[base.engine].adapters_refused(base)
    if refused:
        raise ConfigError(f"adapter_of: model {base.id!r} cannot mount adapters: {refused}")
    try:
        info = read_gguf_info(path)
        st = path.stat()
    except GGUFError as e:
        raise ConfigError(f"path: not a GGUF file: {e.message}") from e
    except OSError as e:
        raise ConfigError(f"path: {path} cannot be read: {e.strerror}") from e
    if info.general_type != "adapter" or info.adapter_type != "lora":
        raise ConfigError(f"path: {path.name} is not a LoRA adapter (its general.type is "
                          f"{info.general_type!r}, adapter.type {info.adapter_type!r}; a LoRA "
                          'GGUF says "adapter" and "lora")')
    if info.architecture != base.info.architecture:
        raise ConfigError(f"adapter_of: the adapter {path.name} is for {info.architecture!r} "
                          f"models and {base.id!r} is a {base.info.architecture!r} model")
    try:
        misfit = lora_misfit(read_tensor_shapes(base.path), read_tensor_shapes(path))
    except GGUFError as e:
        raise ConfigError(f"path: {e.message}") from e
    if misfit:
        raise ConfigError(f"path: {path.name} does not fit model {base.id!r}: {misfit}")
    return CatalogModel(model_id, path, source, info, base.options, st.st_size,
                        modified=int(st.st_mtime), engine=base.engine, aliases=aliases,
                        adapter_of=base.id, scale=scale)


def _add_adapters(models: dict[str, CatalogModel], settings: Settings) -> None:
    """The [[models]] entries with ``adapter_of``, added as models and mounted on their
    bases; one in error is logged and left out (the other models serve), as is a base's
    ``default_adapter`` that names no adapter of it."""
    for entry in settings.entries:
        if entry.adapter_of is None:
            continue
        where = f"adapter {entry.id!r}"
        try:
            if entry.refused:
                raise ConfigError(entry.refused)
            named = _resolve(models, entry.adapter_of)
            if named is None:
                raise ConfigError(f"adapter_of: no model {entry.adapter_of!r}; known: "
                                  f"{', '.join(sorted(models)) or '(none)'}")
            for name, key in ((entry.id, "id"), *((a, "aliases") for a in entry.aliases)):
                if _resolve(models, name) is not None:
                    raise ConfigError(f"{key}: {name!r} already names a model")
            if not entry.path.is_file():
                raise ConfigError(f"path: no file at {entry.path}")
            adapter = make_adapter(entry.id, entry.path.resolve(), models[named],
                                   entry.scale, "config", entry.aliases)
        except ConfigError as e:
            message = e.message if e.message.startswith(("[[models]]", where)) \
                else f"{where}: {e.message}"
            log.error("%s; it is not served (the other models are)", message)
            continue
        models[adapter.id] = adapter
        mount = adapter.adapter
        assert mount is not None
        base = models[named]
        models[named] = replace(base, adapters=(*base.adapters, mount))
    for entry in settings.entries:
        if entry.adapter_of is not None or entry.default_adapter is None:
            continue
        owner = models.get(_resolve(models, entry.id) or "")
        default = _resolve(models, entry.default_adapter)
        if owner is None:
            continue
        if default is None or models[default].adapter_of != owner.id:
            log.error("model %r: default_adapter %r is not an adapter of it; its requests "
                      "run without one", entry.id, entry.default_adapter)
            continue
        models[owner.id] = replace(owner, default_adapter=default)


def _check_engines(settings: Settings, engines: Collection[str]) -> None:
    """Each [[models]] entry names an engine there is, and [defaults] one that serves GGUF
    files (else ConfigError)."""
    default: object = settings.default_engine
    if default != DEFAULT_ENGINE and (default not in engines or default in DIRECTORY_ENGINES):
        gguf = sorted(set(engines) - DIRECTORY_ENGINES)
        raise ConfigError(f"[defaults]: engine must be one of {gguf}, not {default!r}")
    for index, entry in enumerate(settings.entries):
        engine: object = entry.engine  # the file's value as written: any TOML value
        if not isinstance(engine, str) or engine not in engines:
            raise ConfigError(f"[[models]] #{index + 1}: engine must be one of "
                              f"{sorted(engines)}, not {engine!r}")


def _name_transcription(models: dict[str, CatalogModel]) -> None:
    """OpenAI's clients send ``whisper-1``: it names the first transcription model (a
    configured one before the packaged one) unless a model or alias already has the name."""
    if _resolve(models, whisper.OPENAI_NAME) is not None:
        return
    first = next((m for m in models.values() if m.transcribes), None)
    if first is not None:
        models[first.id] = replace(first, aliases=(*first.aliases, whisper.OPENAI_NAME))


def _resolve(models: dict[str, CatalogModel], name: str) -> str | None:
    """The id ``name`` means among ``models`` as Catalog.resolve reads names (id, alias,
    ``:latest``), without building a catalog for each lookup."""
    for candidate in _spellings(name):
        if candidate in models:
            return candidate
        for model in models.values():
            if candidate in model.aliases:
                return model.id
    return None


def _overlay(models: dict[str, CatalogModel], entry: ModelEntry, settings: Settings) -> None:
    """A [[models]] entry without a path configures the model of another source it names."""
    named = _resolve(models, entry.id)
    if named is None:
        raise ConfigError(f"model {entry.id!r}: no such model found to configure; give its "
                          "entry a path, or name a model of `bunkhouse models`")
    model = models[named]
    where = f"model {entry.id!r}"
    if model.transcribes:  # its engine and its one slot stay
        models[named] = replace(
            model, options=_transcription_options(settings.defaults, entry, where),
            pinned=entry.pinned or model.pinned,
            ttl_s=entry.ttl_s if entry.ttl_s is not None else model.ttl_s,
            aliases=(*model.aliases, *entry.aliases))
        return
    options, refused = _options_or_refusal(settings.defaults, entry.options, model.info,
                                           where, entry.engine, entry.engine_keys)
    models[named] = replace(
        model, options=options, refused=refused,
        pinned=entry.pinned or model.pinned,
        ttl_s=entry.ttl_s if entry.ttl_s is not None else model.ttl_s,
        chat_template=entry.chat_template or model.chat_template,
        engine=entry.engine, aliases=(*model.aliases, *entry.aliases),
        request=entry.params if entry.params != RequestParams() else model.request)


def _first_default(models: dict[str, CatalogModel], entries: Iterable[ModelEntry] = ()
                   ) -> str | None:
    """The first model that generates (never a transcription model): the first [[models]]
    entry's, with a path or configuring a model of another source, else by source."""
    for entry in entries:
        named = _resolve(models, entry.id)
        if named is not None and not models[named].transcribes \
                and models[named].adapter_of is None:
            return named
    for source in ("config", "package", "models_dir", "hf_cache", "pulled", "ollama",
                   "lmstudio"):
        for model in models.values():
            if model.source == source and not model.transcribes and model.adapter_of is None:
                return model.id
    return None
