"""Frozen, validated settings: command-line flags plus the optional TOML config file.

The TOML file (``--config FILE``) looks like::

    default_model = "qwen"          # optional; else the first [[models]], else the packaged one
    models_dirs = ["~/models"]      # optional; added to --models-dir
    include_packaged = true         # optional; serve the models shipped in Python packages
    budget = "8GiB"                 # optional; memory all workers together may use
    llama_server = "/opt/llama.cpp/build/bin/llama-server"  # optional; the binary of the
                                    # engine "llama-server" (else --llama-server, else PATH)

    strict_context = false          # optional; true: a prompt + max_tokens past one slot is
                                    # OpenAI's 400, not generated until the slot is full
    hf_cache = true                 # optional; serve GGUFs in the Hugging Face hub cache
    ollama = true                   # optional; serve the models of Ollama's store
    lmstudio = true                 # optional; serve LM Studio's models folder
                                    # (each: true, false, or the folder to read instead)

    [aliases]                       # optional; more names for any model of the catalog
    "gpt-4o-mini" = "qwen2.5-coder-0.5b-instruct"

    [defaults]                      # optional; per-model defaults for every model
    context = 32768                 # total context shared by the slots (tokens); default:
                                    # 8192 a slot, within the model's trained context
    parallel = 4                    # slots: requests decoded at once
    queue = 8                       # requests waiting for a slot; beyond: 429 queue_full
    embeddings = false              # serve /v1/embeddings (default: only embedding models);
                                    # it raises the model's memory estimate
    # an engine's own options, checked by its adapter (bunkhouse.engines) when the catalog
    # is built; llama.cpp's:
    cache_ram_mib = 0               # engine's RAM prompt cache (counted in the estimate)
    threads = 2                     # CPU threads of each worker (whisper's too)
    swa_full = false                # sliding-window models: keep the whole context in every
                                    # layer's KV cache (more memory, counted in the estimate),
                                    # so that any saved prefix can be reused

    ttl = 0                         # idle seconds before a model is unloaded; 0: never
    engine = "llama.cpp"            # the engine of every GGUF model without its own

    [[models]]
    id = "qwen"
    engine = "llama.cpp"            # optional; the engine that serves it: "llama.cpp"
                                    # (xllamacpp, the default) or "llama-server" (the binary)
    args = ["--jinja"]              # llama-server only: flags passed to the binary
    path = "~/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    context = 4096                  # any key of [defaults] may be set per model
    pinned = true                   # never evicted
    aliases = ["coder", "qwen:7b"]  # other names it answers to
    chat_template = "chatml"        # for a GGUF without one: a name llama.cpp knows, or a
                                    # .jinja file (relative paths: to this file)

Unknown keys are errors, so that a typo never silently does nothing: the keys of no engine
in [defaults], and in a model's entry the keys its engine does not know (the catalog checks
those, with the engine's adapter).
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bunkhouse import defaults as d
from bunkhouse.errors import ConfigError

DEFAULT_ENGINE = "llama.cpp"

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How one model is served: what every engine is told (each set explicitly on it), its
    admission queue in the front, and its engine's own options."""

    context: int = d.DEFAULT_SLOT_TOKENS * 4
    parallel: int = 4
    queue: int = 8  # requests waiting for a slot beyond the ones running; more: 429
    embeddings: bool | None = None  # serve embeddings; None: if the GGUF is an embedding model
    # context set by no one: the catalog makes it parallel x DEFAULT_SLOT_TOKENS, within the
    # model's trained context (catalog.effective_options)
    context_auto: bool = True
    # the engine's own keys, as written: in [defaults], those of any engine; in a catalogued
    # model, its engine's, checked by its adapter (EngineAdapter.options), which types them
    engine_keys: tuple[tuple[str, Any], ...] = ()

    def validate(self, where: str) -> EngineOptions:
        for name in ("context", "parallel"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}: {name} must be >= 1")
        if self.queue < 0:
            raise ConfigError(f"{where}: queue must be >= 0")
        if self.context < 64 * self.parallel:
            raise ConfigError(
                f"{where}: context {self.context} leaves fewer than 64 tokens for each of "
                f"{self.parallel} slots; raise context or lower parallel"
            )
        return self


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """A model named in the config file."""

    id: str
    path: Path
    options: dict[str, Any]  # EngineOptions' fields it sets
    pinned: bool = False
    ttl_s: float | None = None  # None: the global ttl
    chat_template: str | None = None  # a template name llama.cpp knows, or a .jinja file
    engine: str = DEFAULT_ENGINE
    aliases: tuple[str, ...] = ()
    params: RequestParams = field(default_factory=lambda: RequestParams())
    # no path: it configures a model of another source (packaged, a model folder) by its id
    overlay: bool = False
    engine_keys: tuple[tuple[str, Any], ...] = ()  # its keys for its engine, as written
    adapter_of: str | None = None  # a LoRA adapter of this base model (id or alias)
    scale: float = 1.0  # an adapter's: the scale its requests run it at
    default_adapter: str | None = None  # a base's: the adapter its own id's requests run
    refused: str | None = None  # an adapter's entry in error: logged, not served (the rest is)


ADAPTER_KEYS = frozenset({"id", "path", "adapter_of", "scale", "aliases"})
"""The keys an adapter's [[models]] entry may have: its model's options are its base's."""

MAX_ADAPTER_SCALE = 10.0
"""The largest adapter scale taken: llama.cpp takes any float; past a few the adapter's
weights swamp the base's and the model answers noise (the adapters bunkhouse tests with
answer noise at 4)."""


def check_scale(value: object, where: str) -> float:
    """An adapter's ``scale``: a finite number from 0 to :data:`MAX_ADAPTER_SCALE`; else
    ConfigError naming the key."""
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not 0 <= value <= MAX_ADAPTER_SCALE:  # NaN fails too
        raise ConfigError(f"{where}: scale must be a number from 0 to "
                          f"{MAX_ADAPTER_SCALE:g}, not {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class RequestParams:
    """A model's request defaults and filters (llama-swap's setParams/stripParams, Ollama's
    Modelfile PARAMETER): ``defaults`` fill fields a request leaves out, ``fixed`` replace
    what a request says, ``strip`` fields are dropped from every request."""

    defaults: tuple[tuple[str, Any], ...] = ()
    fixed: tuple[tuple[str, Any], ...] = ()
    strip: tuple[str, ...] = ()

    def apply(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with the defaults, fixed values and stripped fields applied."""
        if not (self.defaults or self.fixed or self.strip):
            return body
        out = {k: v for k, v in body.items() if k not in self.strip}
        for name, value in self.defaults:
            if out.get(name) is None and name not in self.strip:
                out[name] = value
        out.update(self.fixed)
        return out


REQUEST_PARAMS: dict[str, tuple[type, float, float]] = {
    "temperature": (float, 0, 2), "top_p": (float, 0, 1), "top_k": (int, 0, (1 << 31) - 1),
    "min_p": (float, 0, 1), "typical_p": (float, 0, 1),
    "seed": (int, -(1 << 63), (1 << 63) - 1),
    "repeat_penalty": (float, 0, 10), "repeat_last_n": (int, 0, (1 << 31) - 1),
    "presence_penalty": (float, -2, 2), "frequency_penalty": (float, -2, 2),
    "max_tokens": (int, 1, 1 << 24), "stop": (list, 0, 4),
}
"""Fields a model's params may set: (type, lowest, highest; for ``stop``, how many strings),
as a request's fields are bounded (OpenAI's ranges; the engine's for its own fields:
engines/llamacpp.EXTENSION_BOUNDS), so a config value no request could send is refused
when the config is read, naming its key."""


def param_error(name: str, value: object) -> str | None:
    """Why ``value`` cannot be the request field ``name`` of a model's params; None if it
    can."""
    rule = REQUEST_PARAMS.get(name)
    if rule is None:
        return f"a model's params may set {', '.join(sorted(REQUEST_PARAMS))}"
    kind, lo, hi = rule
    if kind is list:  # stop: one text, or at most 4
        ok = (isinstance(value, str) and bool(value)) or (
            isinstance(value, list) and len(value) <= hi
            and all(isinstance(v, str) and v for v in value))
        return None if ok else "must be a text or an array of at most 4 non-empty texts"
    number = isinstance(value, int | float) and not isinstance(value, bool) and (
        kind is float or isinstance(value, int))
    if not number or not lo <= value <= hi:  # type: ignore[operator]  # NaN fails too
        what, shown = ("an integer", int) if kind is int else ("a number", float)
        return f"must be {what} from {shown(lo)} to {shown(hi)}, not {value!r}"
    return None

_STRIPPABLE = frozenset(REQUEST_PARAMS) | {"logit_bias", "logprobs", "top_logprobs", "n",
                                           "response_format", "tools", "tool_choice",
                                           "parallel_tool_calls", "reasoning_effort"}


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    models_dirs: tuple[Path, ...] = ()
    config_file: Path | None = None
    preload: tuple[str, ...] = ()
    default_model: str | None = None
    include_packaged: bool = True
    defaults: EngineOptions = field(default_factory=EngineOptions)
    entries: tuple[ModelEntry, ...] = ()
    budget_bytes: int | None = None  # None: a share of this machine's memory
    ttl_s: float = 0.0  # idle unload after this many seconds; 0: never
    admission_wait_s: float = d.ADMISSION_WAIT_S  # a load's wait for leased models to let go
    probe_interval_s: float = d.PROBE_INTERVAL_S  # liveness probes of each ready worker
    worker_engine: str | None = None  # module:Class overriding every worker's engine (tests)
    compute_gate: bool = True  # one model computes at a time (CPU hosts)
    compute_turn_s: float = d.COMPUTE_TURN_S  # a turn's time slice while another model waits
    spare_worker: bool = True  # keep a worker with the engine imported for the next load
    api_keys: tuple[str, ...] = ()  # client keys; none: inference is open
    admin_keys: tuple[str, ...] = ()
    max_body_bytes: int = d.MAX_BODY_BYTES
    max_audio_bytes: int = d.MAX_AUDIO_BYTES  # an upload to POST /v1/audio/transcriptions
    allow_runtime_load: bool = False  # POST /v1/models by path (admin key needed as well)
    allowed_roots: tuple[Path, ...] = ()  # for runtime paths; empty: the model roots
    allowed_hosts: tuple[str, ...] = ()  # Host names served besides local ones (front/site.py)
    cors_origins: tuple[str, ...] = ()  # browser origins allowed besides loopback (front/cors.py)
    cache_dir: Path = field(default_factory=lambda: default_cache_dir())
    kv_cache_dir: Path = field(default_factory=lambda: default_kv_cache_dir())
    llama_server: Path | None = None  # the llama-server binary; None: llama-server on PATH
    ray_address: str | None = None  # a Ray cluster whose nodes run the workers; None: local
    default_engine: str = DEFAULT_ENGINE  # of a GGUF model without an engine of its own
    kv_cache_max: int | None = None  # bytes; None: a share of the free disk; 0: no snapshots
    kv_min_tokens: int = d.KV_MIN_TOKENS  # fewest tokens a KV snapshot is saved/restored for
    responses_db: Path = field(default_factory=lambda: default_data_dir() / "responses.db")
    # where `bunkhouse pull` records what it pulled (pulled.json): those models are served
    # whatever hf_cache says
    data_dir: Path = field(default_factory=lambda: default_data_dir())
    responses_keep: int = d.RESPONSES_KEEP  # stored Responses API answers; 0: none stored
    responses_max_age_s: float = d.RESPONSES_MAX_AGE_S
    responses_max_bytes: int = d.RESPONSES_MAX_BYTES  # all stored responses together
    ready_timeout_s: float = d.READY_TIMEOUT_S
    stop_grace_s: float = d.STOP_GRACE_S
    log_level: str = "info"
    strict_context: bool = False  # prompt + max_tokens past a slot: 400, not generate to full
    sse_ping_s: float = 10.0  # pings to a streamed request while it waits (front/waiting.py)
    send_loading_state: bool = False  # and what it waits for, in reasoning_content
    aliases: tuple[tuple[str, str], ...] = ()  # (alias, model id) of the [aliases] table
    # the other tools' model folders: name -> True (the tool's default place), a folder, or
    # False (off); see catalog/sources.py
    sources: tuple[tuple[str, bool | Path], ...] = (("hf_cache", True), ("ollama", True),
                                                    ("lmstudio", True))


def default_cache_dir() -> Path:
    env = os.environ.get("BUNKHOUSE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "bunkhouse"


def default_data_dir() -> Path:
    """Where bunkhouse keeps what is not a cache (stored responses): $BUNKHOUSE_DATA_DIR, or
    bunkhouse/ in $XDG_DATA_HOME (~/.local/share)."""
    env = os.environ.get("BUNKHOUSE_DATA_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "bunkhouse"


def default_kv_cache_dir() -> Path:
    """Where KV snapshots are kept unless ``--kv-cache-dir`` says otherwise."""
    return default_cache_dir() / "kv"


def check_model_id(model_id: str, where: str, what: str = "model id") -> str:
    """``model_id`` if it is 1-128 letters, digits and ``. _ : / -``, starting with a letter
    or digit, and survives a trip through a URL path (no empty, ``.`` or ``..`` segment,
    which clients collapse); else ConfigError."""
    if not _ID_RE.fullmatch(model_id):
        raise ConfigError(
            f"{where}: {what} {model_id!r} must be 1-128 characters of letters, digits "
            "and . _ : / - (starting with a letter or digit)"
        )
    if any(part in ("", ".", "..") for part in model_id.split("/")):
        raise ConfigError(f"{where}: {what} {model_id!r} has an empty, '.' or '..' path "
                          "segment, which no URL can reach; name it without one")
    return model_id


_OPTION_KEYS = frozenset({"context", "parallel", "queue"})
_BOOL_OPTION_KEYS = frozenset({"embeddings"})
SOURCES = ("hf_cache", "ollama", "lmstudio")
_TOP_KEYS = frozenset({"default_model", "models_dirs", "include_packaged", "defaults", "models",
                       "budget", "strict_context", "aliases", "llama_server", *SOURCES})
# Binary and decimal units as written; a bare K/M/G/T (Docker's and Ollama's "8G") is binary.
_UNITS = {"": 1, "b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4,
          "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4,
          "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes from ``"8GiB"``, ``"8G"`` (binary), ``"512 MiB"``, ``"1.5GB"`` (decimal) or
    ``"1000000"``. Raises ConfigError for anything else, and for a size of 0."""
    m = _SIZE_RE.match(text)
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if m is None or unit is None:
        raise ConfigError(f"{text!r} is not a size; write e.g. 8GiB, 8G, 512MiB or 2000000000")
    size = int(float(m.group(1)) * unit)
    if size <= 0:
        raise ConfigError(f"{text!r}: a size must be more than 0 bytes")
    return size


def _ttl(value: object, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{where}: ttl must be a number of seconds >= 0, not {value!r}")
    return float(value)


def engine_options(base: EngineOptions, overrides: dict[str, Any], where: str) -> EngineOptions:
    return replace(base, **overrides).validate(where)


def _options(table: dict[str, Any], where: str) -> dict[str, Any]:
    """The EngineOptions fields ``table`` sets (its engine's keys: :func:`_engine_keys`)."""
    out: dict[str, Any] = {}
    for key in _BOOL_OPTION_KEYS & set(table):
        if not isinstance(table[key], bool):
            raise ConfigError(f"{where}: {key} must be true or false")
        out[key] = table[key]
    for key in _OPTION_KEYS & set(table):
        value = table[key]
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be an integer, not {value!r}")
        out[key] = value
    if "context" in out:
        out["context_auto"] = False
    return out


def _engine_keys(table: dict[str, Any], extra: frozenset[str]) -> tuple[tuple[str, Any], ...]:
    """The keys of ``table`` that are an engine's own options (or no one's: the catalog
    refuses those, once it knows the engines): every key but the table's own (``extra``) and
    :class:`EngineOptions`'."""
    ours = _OPTION_KEYS | _BOOL_OPTION_KEYS | extra | {"ttl"}
    return tuple((k, v) for k, v in table.items() if k not in ours)


def _defaults(table: dict[str, Any], base: EngineOptions) -> EngineOptions:
    """``base`` with what the [defaults] ``table`` sets (an engine's keys added to its)."""
    options = engine_options(base, _options(table, "[defaults]"), "[defaults]")
    keys = {**dict(options.engine_keys), **dict(_engine_keys(table, frozenset({"engine"})))}
    return replace(options, engine_keys=tuple(keys.items()))


def _entry(table: Any, index: int, base_dir: Path, defaults: EngineOptions,
           default_engine: str = DEFAULT_ENGINE) -> ModelEntry:
    where = f"[[models]] #{index + 1}"
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table")
    entry_keys = frozenset({"id", "path", "pinned", "chat_template", "engine", "aliases",
                            "params", "fixed_params", "strip_params", "default_adapter"})
    model_id, path = table.get("id"), table.get("path", "")
    if "adapter_of" in table and isinstance(model_id, str):  # one in error is left out
        try:
            check_model_id(model_id, where)
            return _adapter_entry(table, where, model_id, path, base_dir)
        except ConfigError as e:
            return ModelEntry(model_id, Path(), {}, adapter_of=str(table["adapter_of"]),
                              refused=e.message)
    options = _options(table, where)
    if not isinstance(model_id, str) or not isinstance(path, str):
        raise ConfigError(f"{where}: needs a string key 'id' (and 'path', a GGUF file, unless "
                          "it configures a model found elsewhere)")
    check_model_id(model_id, where)
    default_adapter = table.get("default_adapter")
    if default_adapter is not None and not isinstance(default_adapter, str):
        raise ConfigError(f"{where}: default_adapter must be the id of one of its adapters")
    engine_options(defaults, options, f"model {model_id!r}")
    resolved = Path(path).expanduser()
    if path and not resolved.is_absolute():
        resolved = base_dir / resolved
    pinned = table.get("pinned", False)
    if not isinstance(pinned, bool):
        raise ConfigError(f"{where}: pinned must be true or false")
    ttl = _ttl(table["ttl"], where) if "ttl" in table else None
    template = _chat_template(table.get("chat_template"), base_dir, where)
    engine = table.get("engine", default_engine)  # checked where the catalog is built
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ConfigError(f"{where}: aliases must be an array of strings")
    for alias in aliases:
        check_model_id(alias, f"{where} aliases", "alias")
    return ModelEntry(model_id, resolved, options, pinned, ttl, template, engine,
                      tuple(dict.fromkeys(aliases)), _params(table, where), overlay=not path,
                      engine_keys=_engine_keys(table, entry_keys),
                      default_adapter=default_adapter)


def _adapter_entry(table: dict[str, Any], where: str, model_id: str, path: object,
                   base_dir: Path) -> ModelEntry:
    """A LoRA adapter's entry: ``adapter_of`` a base model, ``path`` its GGUF, ``scale``. What
    depends on the base (that it exists, is no adapter, has the adapter's architecture) is
    the catalog's to check."""
    where = f"{where} (adapter {model_id!r})"
    unknown = sorted(set(table) - ADAPTER_KEYS)
    if unknown:
        raise ConfigError(f"{where}: an adapter takes only {', '.join(sorted(ADAPTER_KEYS))} "
                          f"(it is served with its base's settings), not {', '.join(unknown)}")
    base = table["adapter_of"]
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{where}: adapter_of must be the id of the base model")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}: needs 'path', the adapter's LoRA GGUF file")
    resolved = Path(path).expanduser()
    resolved = resolved if resolved.is_absolute() else base_dir / resolved
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ConfigError(f"{where}: aliases must be an array of strings")
    for alias in aliases:
        check_model_id(alias, f"{where} aliases", "alias")
    return ModelEntry(model_id, resolved, {}, aliases=tuple(dict.fromkeys(aliases)),
                      adapter_of=base, scale=check_scale(table.get("scale", 1.0), where))


def _params(table: dict[str, Any], where: str) -> RequestParams:
    tables = []
    for key in ("params", "fixed_params"):
        given = table.get(key, {})
        if not isinstance(given, dict):
            raise ConfigError(f"{where}: {key} must be a table, e.g. {{ temperature = 0.2 }}")
        for name, value in given.items():
            error = param_error(name, value)
            if error is not None:
                raise ConfigError(f"{where}: {key}.{name}: {error}")
        tables.append(tuple(given.items()))
    strip = table.get("strip_params", [])
    if not isinstance(strip, list) or not all(n in _STRIPPABLE for n in strip):
        raise ConfigError(f"{where}: strip_params must be an array of request fields among "
                          f"{', '.join(sorted(_STRIPPABLE))}")
    both = sorted(set(strip) & {n for t in tables for n, _ in t})
    if both:
        raise ConfigError(f"{where}: {', '.join(both)} both set and stripped; keep one")
    return RequestParams(tables[0], tables[1], tuple(strip))


def _chat_template(value: object, base_dir: Path, where: str) -> str | None:
    """A template name (``"chatml"``), or the absolute path of a ``.jinja`` file that exists."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: chat_template must be a template name or a .jinja file")
    if not value.endswith((".jinja", ".j2")) and "/" not in value:
        return value
    path = Path(value).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if not path.is_file():
        raise ConfigError(f"{where}: chat_template file {path} does not exist")
    return str(path.resolve())


def load_config_file(path: Path, settings: Settings) -> Settings:
    """Merge the TOML file at ``path`` into ``settings`` (flags given explicitly win)."""
    try:
        data = tomllib.loads(_read_config(path))
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
    except RecursionError as e:  # arrays or tables nested thousands deep
        raise ConfigError(f"config file {path} nests too deeply to be read") from e
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}")
    defaults_table = data.get("defaults", {})
    if not isinstance(defaults_table, dict):
        raise ConfigError(f"{path}: [defaults] must be a table")
    defaults = _defaults(defaults_table, settings.defaults)
    models = data.get("models", [])
    if not isinstance(models, list):
        raise ConfigError(f"{path}: 'models' must be an array of tables ([[models]])")
    engine = defaults_table.get("engine", settings.default_engine)
    if not isinstance(engine, str):
        raise ConfigError(f"{path}: [defaults] engine must be a string, such as \"llama-server\"")
    entries = tuple(_entry(t, i, path.parent, defaults, engine) for i, t in enumerate(models))
    _check_unique(entries)
    dirs = data.get("models_dirs", [])
    if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
        raise ConfigError(f"{path}: 'models_dirs' must be an array of strings")
    default_model = data.get("default_model")
    if default_model is not None and not isinstance(default_model, str):
        raise ConfigError(f"{path}: 'default_model' must be a string")
    ttl_s = _ttl(defaults_table["ttl"], "[defaults]") if "ttl" in defaults_table else settings.ttl_s
    budget = data.get("budget")
    if budget is not None and not isinstance(budget, str | int):
        raise ConfigError(f"{path}: 'budget' must be a size such as \"8GiB\"")
    budget_bytes = settings.budget_bytes or (None if budget is None else parse_size(str(budget)))
    include_packaged = data.get("include_packaged", settings.include_packaged)
    if not isinstance(include_packaged, bool):
        raise ConfigError(f"{path}: 'include_packaged' must be true or false")
    strict = data.get("strict_context", False)
    if not isinstance(strict, bool):
        raise ConfigError(f"{path}: 'strict_context' must be true or false")
    return replace(
        settings,
        config_file=path,
        defaults=defaults,
        default_engine=engine,
        llama_server=settings.llama_server or _binary(data.get("llama_server"), path),
        entries=entries,
        models_dirs=settings.models_dirs + tuple(path.parent / Path(d).expanduser()
                                                 for d in dirs),  # relative: to the file
        default_model=settings.default_model or default_model,
        include_packaged=include_packaged,
        ttl_s=ttl_s,
        budget_bytes=budget_bytes,
        strict_context=settings.strict_context or strict,
        aliases=_aliases(data.get("aliases", {}), path),
        sources=tuple((name, _source(data.get(name), dict(settings.sources)[name], path, name))
                      for name in SOURCES),
    )


def _binary(value: object, path: Path) -> Path | None:
    """The ``llama_server`` key: a path (relative: to the config file); checked at first use."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: 'llama_server' must be the path of a llama-server binary")
    return path.parent / Path(value).expanduser()


def _aliases(table: object, path: Path) -> tuple[tuple[str, str], ...]:
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        raise ConfigError(f'{path}: [aliases] must be a table of names, alias = "model id"')
    for alias in table:
        check_model_id(alias, f"{path} [aliases]", "alias")
    return tuple(table.items())


def _source(value: object, given: bool | Path, path: Path, name: str) -> bool | Path:
    """A model source's setting: a flag that turned it off wins; else the file's."""
    if value is None or given is False:
        return given
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip():
        folder = Path(value).expanduser()
        return folder if folder.is_absolute() else path.parent / folder
    raise ConfigError(f"{path}: '{name}' must be true, false or a folder")


MAX_CONFIG_BYTES = 4 * 1024 * 1024
"""Largest config file read (a config of thousands of models is a few hundred KiB)."""


def _read_config(path: Path) -> str:
    """The file's text: a regular file (a FIFO must not block a reload), at most
    MAX_CONFIG_BYTES, UTF-8. Raises OSError or ConfigError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"config file {path} is not a regular file")
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES // 2**20} MiB")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text: {e}") from e


def _check_unique(entries: tuple[ModelEntry, ...]) -> None:
    seen: set[str] = set()
    for entry in entries:
        if entry.id in seen:
            raise ConfigError(f"model id {entry.id!r} is configured twice")
        seen.add(entry.id)
