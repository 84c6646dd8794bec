"""Command-line entry points. Builds Settings from flags and the config file, nothing else."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from bunkhouse import __version__, defaults
from bunkhouse.catalog import Catalog, build_catalog
from bunkhouse.config import SOURCES, Settings, engine_options, load_config_file, parse_size
from bunkhouse.errors import BunkhouseError, ConfigError
from bunkhouse.residency.events import EventLog

if TYPE_CHECKING:
    from bunkhouse.front.auth import Keys
    from bunkhouse.front.response_store import ResponseStore
    from bunkhouse.kvcache.keeper import SnapshotKeeper

log = logging.getLogger("bunkhouse")

DESCRIPTION = """\
bunkhouse serves every local model you have behind one OpenAI-compatible endpoint.
Each model runs in its own worker process, started when a request first names it.
"""

SERVE_EPILOG = """\
examples:
  bunkhouse serve                                 # the packaged models, Qwen2.5-Coder 0.5B default
  bunkhouse serve --models-dir ~/models           # also every *.gguf under ~/models
  bunkhouse serve --config bunkhouse.toml --preload qwen
  curl localhost:8080/v1/chat/completions -H 'content-type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hello"}]}'
"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models-dir",
        action="append",
        type=Path,
        default=[],
        metavar="DIR",
        help="serve every *.gguf under DIR (repeatable)",
    )
    p.add_argument(
        "--config", type=Path, metavar="FILE", help="TOML config file (see docs/configuration.md)"
    )
    p.add_argument(
        "--no-packaged",
        action="store_true",
        help="do not serve the models shipped in Python packages",
    )
    p.add_argument("--no-source", action="append", default=[], choices=SOURCES,
                   metavar="NAME",
                   help="do not serve the models of this other tool's folder (repeatable): "
                        "hf_cache (the Hugging Face hub cache), ollama (Ollama's store), "
                        "lmstudio (LM Studio's models folder)")
    p.add_argument("--context", type=_tokens, metavar="TOKENS",
                   help="every model's context, shared by its slots (default: 8192 tokens "
                        "a slot, within the model's trained context)")
    p.add_argument("--parallel", type=_slots, metavar="N",
                   help="every model's slots: requests decoded at once (default 4)")
    p.add_argument("--default-model", metavar="ID", help="model for requests that name none")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="text lines (default), or one JSON object a line for log collectors")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bunkhouse",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"bunkhouse {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="serve the models over HTTP",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (%(default)s)")
    serve.add_argument("--port", type=_port, default=8080,
                       help="port to listen on, 1-65535 (%(default)s)")
    serve.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="ID",
        help="start this model's worker before serving (repeatable)",
    )
    serve.add_argument(
        "--ready-timeout",
        type=float,
        default=defaults.READY_TIMEOUT_S,
        metavar="S",
        help="seconds a worker may take to load its model (%(default)s)",
    )
    serve.add_argument(
        "--stop-grace",
        type=float,
        default=defaults.STOP_GRACE_S,
        metavar="S",
        help="seconds a worker gets to stop before SIGKILL (%(default)s)",
    )
    serve.add_argument("--budget", type=_size, metavar="SIZE",
                       help="memory all workers together may use, e.g. 8GiB or 512MiB "
                            "(default: half of this machine's RAM)")
    serve.add_argument("--ttl", type=float, metavar="S",
                       help="unload a model idle for S seconds (default 0: never)")
    serve.add_argument("--admission-wait", type=float, default=defaults.ADMISSION_WAIT_S,
                       metavar="S",
                       help="how long a load waits for models in use to make room before "
                            "503 insufficient_memory, and a request waits out an operator's "
                            "pause before 503 paused (%(default)s)")
    serve.add_argument("--probe-interval", type=float, default=defaults.PROBE_INTERVAL_S,
                       metavar="S",
                       help="liveness: a worker whose engine does not answer two probes in a "
                            "row, S seconds apart, is replaced (%(default)s)")
    serve.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="require this client key on inference endpoints (repeatable; "
                            "also --api-key-file and $BUNKHOUSE_API_KEYS, comma-separated)")
    serve.add_argument("--api-key-file", action="append", default=[], type=Path,
                       metavar="FILE", help="client keys, one a line (repeatable)")
    serve.add_argument("--admin-key", action="append", default=[], metavar="KEY",
                       help="an admin key: inference and control endpoints (repeatable; "
                            "also --admin-key-file and $BUNKHOUSE_ADMIN_KEYS)")
    serve.add_argument("--admin-key-file", action="append", default=[], type=Path,
                       metavar="FILE", help="admin keys, one a line (repeatable)")
    serve.add_argument("--allow-runtime-load", action="store_true",
                       help="let admin-key holders register models by path (POST /v1/models)")
    serve.add_argument("--allowed-root", action="append", default=[], type=Path,
                       metavar="DIR", help="where runtime-registered model files may live "
                                           "(repeatable; default: the --models-dir roots)")
    serve.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                       help="also serve requests whose Host is NAME (repeatable; .example.com "
                            "for every name under it, * for any). Bound to a loopback address, "
                            "only localhost and IP addresses are served: a web page cannot "
                            "reach this server through DNS rebinding")
    serve.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                       help="let web pages from ORIGIN (e.g. https://app.example.com, or * "
                            "for any) call the API from a browser (repeatable); pages on "
                            "this machine (http://localhost:PORT) may by default. Admin routes "
                            "answer only origins named here, never *")
    serve.add_argument("--max-body", type=_size, default=defaults.MAX_BODY_BYTES,
                       metavar="SIZE",
                       help="largest request body; larger ones get 413 (16MiB)")
    serve.add_argument("--max-audio", type=_size, default=defaults.MAX_AUDIO_BYTES,
                       metavar="SIZE",
                       help="largest audio file for POST /v1/audio/transcriptions; larger "
                            "ones get 413 (25MB, as OpenAI's)")
    serve.add_argument("--kv-cache-dir", type=_dir_path, metavar="DIR",
                       help="where slots' saved KV state is kept, a private directory per "
                            "model (default: the cache directory's kv/)")
    serve.add_argument("--kv-cache-max", type=_size_or_zero, metavar="SIZE",
                       help="disk the KV snapshots may take, all models together, least "
                            "recently used removed first (default: 10%% of the free disk, at "
                            "most 32 GiB; 0 turns snapshots off)")
    serve.add_argument("--responses-db", type=_file_path, metavar="FILE",
                       help="the SQLite file that keeps Responses API answers for "
                            "previous_response_id and GET /v1/responses/{id}; it holds "
                            "conversations (default: responses.db in the data directory, "
                            "~/.local/share/bunkhouse)")
    serve.add_argument("--responses-keep", type=_count, default=defaults.RESPONSES_KEEP,
                       metavar="N", help="stored responses kept, oldest dropped first "
                                         "(%(default)s; 0 stores none)")
    serve.add_argument("--responses-max", type=_size, default=defaults.RESPONSES_MAX_BYTES,
                       metavar="SIZE",
                       help="bytes the stored responses may take together, oldest dropped "
                            "first (1GiB); a request that could not be stored within it "
                            "gets 400 naming store")
    serve.add_argument("--responses-days", type=_positive, metavar="DAYS",
                       default=defaults.RESPONSES_MAX_AGE_S / 86400,
                       help="stored responses older than this are dropped (%(default)g)")
    serve.add_argument("--strict-context", action="store_true",
                       help="refuse (400) a request whose prompt plus max_tokens does not fit "
                            "a slot, as OpenAI does; by default it generates until the slot "
                            "is full (finish_reason length), as local servers do")
    serve.add_argument("--sse-ping-interval", type=_ping_interval, default=10.0, metavar="S",
                       help="a streamed request still waiting for its model to load or for a "
                            "slot after 250 ms gets its headers, then a ping every S seconds "
                            "(%(default)g; at least 0.1), so that proxies and clients keep "
                            "the connection")
    serve.add_argument("--send-loading-state", action="store_true",
                       help="while a streamed chat request waits, also send what it waits "
                            "for (\"loading model X: 3 s\") as reasoning_content deltas")
    serve.add_argument("--compute-gate", choices=["on", "off"], default="on",
                       help="on: one model computes at a time, so that workers never "
                            "oversubscribe the CPU; off: for GPU hosts (%(default)s)")
    serve.add_argument("--compute-turn", type=_non_negative, default=defaults.COMPUTE_TURN_S,
                       metavar="S",
                       help="with the gate on, a model that has computed for S seconds while "
                            "another model waits is suspended (SIGSTOP) and the other goes; "
                            "it continues where it stopped on its next turn, so a short "
                            "request never waits out another model's long generation "
                            "(%(default)g; 0: a turn lasts until its requests end)")
    serve.add_argument("--spare-worker", choices=["on", "off"], default="on",
                       help="on: while the host is idle, keep a worker process with the "
                            "engine imported and no model (64 MiB of the budget), so that "
                            "the next load pays only for its model (%(default)s)")
    serve.add_argument("--worker-engine", default=None, metavar="MODULE:CLASS",
                       help="load this worker engine class for every model instead of each "
                            "model's own (for tests and experiments; models pick their engine "
                            "with the 'engine' key of the config file)")
    _common(serve)
    models = sub.add_parser("models", help="list the model catalog")
    _common(models)
    ps = sub.add_parser("ps", help="show a running server's models, memory and budget")
    ps.add_argument("--url", default="http://127.0.0.1:8080",
                    help="the server's address (%(default)s)")
    ps.add_argument("--api-key", default=os.environ.get("BUNKHOUSE_API_KEY"),
                    help="a client or admin key, if the server needs one "
                         "(default: $BUNKHOUSE_API_KEY)")
    ps.add_argument("--watch", type=_positive, nargs="?", const=2.0, metavar="S",
                    help="redraw every S seconds (2 if not given) until Ctrl-C")
    events = sub.add_parser("events", help="follow a running server's residency events "
                                           "(loads, evictions, crashes) until Ctrl-C")
    events.add_argument("--url", default="http://127.0.0.1:8080",
                        help="the server's address (%(default)s)")
    events.add_argument("--api-key", default=os.environ.get("BUNKHOUSE_API_KEY"),
                        help="a client or admin key, if the server needs one "
                             "(default: $BUNKHOUSE_API_KEY)")
    events.add_argument("--since", type=int, metavar="SEQ",
                        help="begin after this event's sequence number (what the server still "
                             "holds of them), not with the next one")
    events.add_argument("--json", action="store_true", help="print each event's JSON")
    for verb, what in (("load", "load a model (with --path: register it first)"),
                       ("unload", "drain and unload a model"),
                       ("pin", "never evict a model"), ("unpin", "let a model be evicted")):
        cmd = sub.add_parser(verb, help=f"{what} on a running server (admin key)")
        cmd.add_argument("model", metavar="ID")
        cmd.add_argument("--url", default="http://127.0.0.1:8080",
                         help="the server's address (%(default)s)")
        cmd.add_argument("--admin-key", default=os.environ.get("BUNKHOUSE_ADMIN_KEY"),
                         help="default: $BUNKHOUSE_ADMIN_KEY")
        if verb == "load":
            cmd.add_argument("--path", help="a GGUF file inside the server's allowed roots")
    for verb, what in (("reload", "re-read the config file and model folders"),
                       ("default", "make a model the default one"),
                       ("pause", "hold every model paused once its requests in flight "
                                 "finish (new ones wait)"),
                       ("resume", "end a pause: waiting requests go on")):
        cmd = sub.add_parser(verb, help=f"{what} on a running server (admin key)")
        if verb == "default":
            cmd.add_argument("model", metavar="ID")
        if verb == "pause":
            cmd.add_argument("--max", type=_positive, default=300.0, metavar="S",
                             help="resume by itself after S seconds (%(default)s; at most "
                                  "3600)")
        cmd.add_argument("--url", default="http://127.0.0.1:8080",
                         help="the server's address (%(default)s)")
        cmd.add_argument("--admin-key", default=os.environ.get("BUNKHOUSE_ADMIN_KEY"),
                         help="default: $BUNKHOUSE_ADMIN_KEY")
    transcribe = sub.add_parser(
        "transcribe", help="transcribe an audio file with a running server's Whisper model",
        description="Send FILE (wav, mp3, m4a, flac, ogg, webm, ...) to POST "
                    "/v1/audio/transcriptions and print the text as it comes.")
    transcribe.add_argument("file", type=Path, metavar="FILE")
    transcribe.add_argument("--url", default="http://127.0.0.1:8080",
                            help="the server's address (%(default)s)")
    transcribe.add_argument("--api-key", default=os.environ.get("BUNKHOUSE_API_KEY"),
                            help="a client key, if the server needs one "
                                 "(default: $BUNKHOUSE_API_KEY)")
    transcribe.add_argument("--model", default="whisper-1",
                            help="the transcription model (%(default)s: the first one)")
    transcribe.add_argument("--language", help="the spoken language, ISO-639-1 (en, de, ...)")
    transcribe.add_argument("--format", default="text",
                            choices=["text", "json", "srt", "vtt", "verbose_json"],
                            help="what to print (%(default)s: the text, streamed)")
    cache = sub.add_parser(
        "cache", help="list or remove saved KV snapshots (conversations' KV state on disk)",
        description="Work on the KV snapshot directory itself. Stop the server first, or use "
                    "its admin API (DELETE /admin/cache[/MODEL]) while it runs.")
    cache.add_argument("action", choices=["list", "purge"])
    cache.add_argument("model", nargs="?", metavar="ID", help="only this model's snapshots")
    cache.add_argument("--kv-cache-dir", type=_dir_path, metavar="DIR",
                       help="the snapshot directory (default: the cache directory's kv/)")
    return p


def _keys(given: list[str], files: list[Path], env: str, flag: str) -> tuple[str, ...]:
    """Keys from flags, files (one a line, # comments) and a comma-separated variable.

    Fails closed: a flag, file or variable that is given but yields no key is a ConfigError
    naming it (else a key file left empty would start the server open to anyone)."""
    keys = []
    for key in given:
        if not key.strip():
            raise ConfigError(f"{flag} was given an empty key; give a key, or drop the flag")
        keys.append(key.strip())
    for path in files:
        try:
            lines = path.expanduser().read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"cannot read key file {path}: {e.strerror}") from e
        found = [s for line in lines if (s := line.strip()) and not s.startswith("#")]
        if not found:
            raise ConfigError(f"key file {path} ({flag}-file) holds no key, only blank or "
                              "comment lines; put one key a line in it, or drop the flag")
        keys += found
    if env in os.environ:
        found = [s for k in os.environ[env].split(",") if (s := k.strip())]
        if not found:
            raise ConfigError(f"${env} is set but holds no key; give comma-separated keys, "
                              "or unset it")
        keys += found
    return tuple(keys)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; use 1-65535")
    return port


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(e.message) from e


def _dir_path(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("needs a directory")
    return Path(text).expanduser()


def _file_path(text: str) -> Path:
    if not text.strip() or text.endswith("/"):
        raise argparse.ArgumentTypeError("needs a file name")
    return Path(text).expanduser()


def _count(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 10**9:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 0 to 10^9")
    return int(text)


def _ping_interval(text: str) -> float:
    value = _positive(text)
    if value < 0.1:
        raise argparse.ArgumentTypeError(f"{text!r} is below 0.1 s: pings that often only "
                                         "flood the client")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds, 0 or more")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def _tokens(text: str) -> int:
    if not text.strip().isdigit() or not 64 <= int(text) <= 1 << 24:
        raise argparse.ArgumentTypeError(f"{text!r} is not a context size from 64 to 16777216 "
                                         "tokens")
    return int(text)


def _slots(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= 256:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of slots from 1 to 256")
    return int(text)


def _size_or_zero(text: str) -> int:
    return 0 if text.strip() == "0" else _size(text)


def settings_from(args: argparse.Namespace) -> Settings:
    settings = Settings(
        host=getattr(args, "host", "127.0.0.1"),
        port=getattr(args, "port", 8080),
        models_dirs=tuple(d.expanduser() for d in args.models_dir),
        preload=tuple(getattr(args, "preload", ())),
        default_model=args.default_model,
        include_packaged=not args.no_packaged,
        ready_timeout_s=getattr(args, "ready_timeout", defaults.READY_TIMEOUT_S),
        stop_grace_s=getattr(args, "stop_grace", defaults.STOP_GRACE_S),
        log_level=args.log_level,
        budget_bytes=getattr(args, "budget", None),
        admission_wait_s=getattr(args, "admission_wait", defaults.ADMISSION_WAIT_S),
        probe_interval_s=getattr(args, "probe_interval", defaults.PROBE_INTERVAL_S),
        worker_engine=getattr(args, "worker_engine", None),
        compute_gate=getattr(args, "compute_gate", "on") == "on",
        compute_turn_s=getattr(args, "compute_turn", defaults.COMPUTE_TURN_S),
        spare_worker=getattr(args, "spare_worker", "on") == "on",
    )
    if args.command == "serve":
        settings = dataclasses.replace(
            settings,
            allow_runtime_load=args.allow_runtime_load,
            allowed_roots=tuple(args.allowed_root),
            allowed_hosts=tuple(args.allowed_host),
            cors_origins=tuple(args.cors_origin),
            api_keys=_keys(args.api_key, args.api_key_file, "BUNKHOUSE_API_KEYS",
                           "--api-key"),
            admin_keys=_keys(args.admin_key, args.admin_key_file, "BUNKHOUSE_ADMIN_KEYS",
                             "--admin-key"),
            max_body_bytes=args.max_body,
            max_audio_bytes=args.max_audio,
            kv_cache_max=args.kv_cache_max,
            responses_keep=args.responses_keep,
            responses_max_age_s=args.responses_days * 86400,
            responses_max_bytes=args.responses_max,
        )
        if args.responses_db:
            settings = dataclasses.replace(settings, responses_db=args.responses_db)
        if args.kv_cache_dir:
            settings = dataclasses.replace(settings, kv_cache_dir=args.kv_cache_dir)
    if args.config is not None:
        settings = load_config_file(args.config.expanduser(), settings)
        if args.no_packaged:
            settings = dataclasses.replace(settings, include_packaged=False)
    if getattr(args, "ttl", None) is not None:
        settings = dataclasses.replace(settings, ttl_s=args.ttl)
    return _flags_win(settings, args)


def _flags_win(settings: Settings, args: argparse.Namespace) -> Settings:
    """What flags say over what the config file says."""
    given: dict[str, Any] = {}
    if args.context is not None:
        given.update(context=args.context, context_auto=False)
    if args.parallel is not None:
        given["parallel"] = args.parallel
    if given:
        settings = dataclasses.replace(
            settings, defaults=engine_options(settings.defaults, given, "--context/--parallel"))
    off = set(args.no_source)
    return dataclasses.replace(
        settings,
        strict_context=settings.strict_context or getattr(args, "strict_context", False),
        sse_ping_s=getattr(args, "sse_ping_interval", settings.sse_ping_s),
        send_loading_state=getattr(args, "send_loading_state", False),
        sources=tuple((name, False if name in off else where)
                      for name, where in settings.sources))


def print_catalog(catalog: Catalog) -> None:
    header = ("ID", "SIZE", "ARCH", "CONTEXT", "KIND", "SOURCE", "PATH")
    rows = [header]
    for m in catalog:
        marker = " *" if m.id == catalog.default_id else ""
        rows.append(
            (
                m.id + marker,
                f"{m.size_bytes / 2**20:.0f} MiB",
                m.info.architecture,
                "-" if m.transcribes else
                f"{m.options.parallel}x{m.options.context // m.options.parallel}"
                f"/{m.info.context_length or '?'}",
                m.kind,
                m.source,
                str(m.path),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
    if not len(catalog):
        print(
            'no models: install the packaged ones (pip install -e ".[models]") '
            "or pass --models-dir DIR",
            file=sys.stderr,
        )
    else:
        print("\n* default model; CONTEXT is slots x tokens a slot / trained tokens; KIND: "
              "chat (has a chat template), completion (raw prompts), embedding, "
              "transcription (POST /v1/audio/transcriptions)")
        for m in catalog:
            if m.projector is not None:
                print(f"{m.id}: a vision projector beside it, {m.projector} (noted; images "
                      "are not served yet)")


def serve(settings: Settings, catalog: Catalog,
          rebuild: Callable[[], tuple[Catalog, Keys]] | None = None) -> int:
    """Serve until stopped. ``rebuild()``: the catalog the configuration describes now and
    the keys its key files hold, for reloads (SIGHUP, ``POST /admin/reload``)."""
    from bunkhouse.front.admin import AdminOptions
    from bunkhouse.front.admission import ComputeGate
    from bunkhouse.front.app import FrontOptions, Parts, build_app
    from bunkhouse.front.auth import Keys
    from bunkhouse.front.heads import HeadLimits, bounded_http
    from bunkhouse.front.reload import Reloader
    from bunkhouse.front.site import SitePolicy, is_loopback_bind
    from bunkhouse.front.waiting import WaitingOptions
    from bunkhouse.residency.estimate import default_budget_bytes
    from bunkhouse.residency.manager import ResidencyManager, ResidencyOptions
    from bunkhouse.supervisor.launcher import LocalLauncher
    from bunkhouse.supervisor.process import LaunchOptions

    budget = settings.budget_bytes or default_budget_bytes()
    _check_preload(catalog, settings.preload, budget)
    if settings.worker_engine:
        _check_importable(settings.worker_engine)
    _check_port_free(settings.host, settings.port)
    _raise_open_files_limit()
    events = EventLog()
    keeper = _snapshot_keeper(settings, events)
    launcher = LocalLauncher(LaunchOptions(settings.ready_timeout_s, settings.stop_grace_s,
                                           settings.worker_engine),
                             snapshot_dir=keeper.store.worker_dir if keeper else None)
    residency = ResidencyManager(
        catalog,
        ResidencyOptions(budget_bytes=budget, ttl_s=settings.ttl_s,
                         admission_wait_s=settings.admission_wait_s,
                         probe_interval_s=settings.probe_interval_s,
                         probe_timeout_s=settings.probe_interval_s),
        launcher.start, events=events, flush=keeper.flush if keeper else None,
        spare=launcher if settings.spare_worker else None,
    )
    keys = Keys(settings.api_keys, settings.admin_keys)
    app = build_app(catalog, residency, Parts(
        preload=settings.preload, on_shutdown=launcher.close, keeper=keeper,
        responses=_response_store(settings), keys=keys,
        compute=ComputeGate(enabled=settings.compute_gate, turn_s=settings.compute_turn_s,
                            suspend=residency.suspend, resume=residency.resume),
        reloader=Reloader(rebuild, residency, keys) if rebuild else None,
    ), FrontOptions(
        max_body_bytes=settings.max_body_bytes, max_audio_bytes=settings.max_audio_bytes,
        admin=AdminOptions(allow_runtime_load=settings.allow_runtime_load,
                           roots=settings.allowed_roots or settings.models_dirs,
                           defaults=settings.defaults, drain_grace_s=settings.stop_grace_s),
        site=SitePolicy.for_bind(settings.host, settings.allowed_hosts, settings.cors_origins),
        strict_context=settings.strict_context,
        waiting=WaitingOptions(ping_s=settings.sse_ping_s,
                               send_loading_state=settings.send_loading_state),
        cors_origins=settings.cors_origins))
    if not is_loopback_bind(settings.host) and not settings.api_keys:
        log.warning("listening on %s without --api-key: anyone who can reach this address "
                    "can use every model; set keys (docs/security.md)", settings.host)
    if settings.allow_runtime_load and not settings.admin_keys:
        log.warning("--allow-runtime-load has no effect without an --admin-key")
    if settings.api_keys:
        log.info("inference endpoints need one of %d client key(s)", len(settings.api_keys))
    _warn_never_fit(catalog, budget)
    serving = (f"serving {len(catalog)} model(s) on http://{settings.host}:{settings.port} "
               f"(default: {catalog.default_id}), memory budget {budget // 2**20} MiB")
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        # Only a last resort: _Server cuts every stream cleanly after the grace, by then.
        timeout_graceful_shutdown=int(2 * settings.stop_grace_s) + 10,
        log_config=None,
        http=bounded_http(HeadLimits()),  # size, count and time bounds on request heads
    )

    async def stop_workers() -> None:
        await residency.close()
        launcher.close()

    def stopping() -> None:
        residency.stop_loads()  # the grace is for running requests, not for new loads
        if not events.closed:  # open streams would hold uvicorn's wait for connections
            events.emit("*", "stopping", "the server is stopping; event streams end")
            events.close()

    server = _Server(config, stop_workers, settings.stop_grace_s, serving, on_stop=stopping)
    server.run()
    return 0 if server.started else 1


def _snapshot_keeper(settings: Settings, events: EventLog) -> SnapshotKeeper | None:
    """The KV snapshot keeper over its store, or None when snapshots are off."""
    from bunkhouse.kvcache.keeper import SnapshotKeeper
    from bunkhouse.kvcache.store import SnapshotStore

    root = settings.kv_cache_dir
    limit = settings.kv_cache_max
    if limit == 0:
        log.info("KV snapshots off (--kv-cache-max 0)")
        return None
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if limit is None:
            free = shutil.disk_usage(root).free
            limit = min(int(free * defaults.KV_CACHE_DISK_SHARE), defaults.KV_CACHE_MAX_BYTES)
        store = SnapshotStore(root, limit)
    except OSError as e:
        log.warning("KV snapshots off: cannot use %s: %s; pass another --kv-cache-dir DIR",
                    root, e)
        return None
    log.info("KV snapshots in %s, at most %d MiB (%d kept, %d MiB)", root, limit // 2**20,
             len(store.snapshots()), store.stats.bytes // 2**20)
    return SnapshotKeeper(store, events)


def _response_store(settings: Settings) -> ResponseStore | None:
    """Where Responses API answers are stored, or None when none are (opened by the app)."""
    from bunkhouse.front.response_store import ResponseStore

    if settings.responses_keep == 0:
        log.info("responses not stored (--responses-keep 0)")
        return None
    return ResponseStore(settings.responses_db, settings.responses_keep,
                         settings.responses_max_age_s, settings.responses_max_bytes)


def _raise_open_files_limit(target: int = 65536) -> None:
    """Raise this process's open-files soft limit towards ``target`` (within the hard limit),
    as nginx's worker_rlimit_nofile does: each client connection holds a descriptor, and the
    common default of 1,024 lets a thousand idle connections lock every client out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError) as e:
            log.warning("could not raise the open-files limit from %d: %s", soft, e)


def _check_port_free(host: str, port: int) -> None:
    """Fail before any model loads if the address is taken (uvicorn binds only after the
    app's startup, which may preload models)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e}") from e
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}; is another "
                              "server using that port? Pick another with --port") from e


def _check_preload(catalog: Catalog, preload: tuple[str, ...], budget: int) -> None:
    """Every model to preload exists and fits the budget on its own (else ConfigError)."""
    from bunkhouse.residency.estimate import estimate

    for model_id in preload:
        need = estimate(catalog.get(model_id)).total
        if need > budget:
            raise ConfigError(f"--preload {model_id}: it needs {need // 2**20} MiB "
                              f"({need:,} bytes) and the memory budget is {budget // 2**20} MiB "
                              f"({budget:,} bytes); raise --budget or lower its context")


def _check_importable(import_path: str) -> None:
    """A --worker-engine must name a class a worker can import (checked in a child process
    started as workers are, so that the front imports no engine)."""
    module, _, attr = import_path.partition(":")
    if not module or not attr:
        raise ConfigError(f"--worker-engine must be MODULE:CLASS, not {import_path!r}")
    check = (f"import importlib, sys; m = importlib.import_module({module!r}); "
             f"sys.exit(0 if hasattr(m, {attr!r}) else 1)")
    try:
        done = subprocess.run([sys.executable, "-c", check], capture_output=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        raise ConfigError(f"--worker-engine {import_path}: importing it took over 60 s") from e
    if done.returncode != 0:
        raise ConfigError(f"--worker-engine {import_path}: no such module or class for the "
                          "workers' Python")


def _warn_never_fit(catalog: Catalog, budget: int) -> None:
    """Say at start which models the budget can never hold (each would answer 503)."""
    import psutil

    from bunkhouse.residency.estimate import estimate

    ram = psutil.virtual_memory().total
    if budget > ram:
        log.warning("the memory budget of %d MiB is more than this machine's %d MiB of RAM: "
                    "models may be loaded until the system runs out of memory",
                    budget // 2**20, ram // 2**20)
    for model in catalog:
        need = estimate(model).total
        if need > budget:
            log.warning("model %s needs about %d MiB, more than the whole memory budget of %d "
                        "MiB: every request for it will fail; raise --budget or lower its "
                        "context", model.id, need // 2**20, budget // 2**20)


class _Server(uvicorn.Server):
    """uvicorn's server with bunkhouse's stop (SIGINT/SIGTERM):

    - it stops accepting and gives running requests ``grace_s`` to finish; then it stops every
      worker, which ends each stream still running with an SSE error event (no stream is
      left truncated, and nothing is cancelled under a request);
    - every worker is stopped even on a forced exit (a second ^C), when uvicorn skips the
      app's shutdown;
    - a requested stop exits 0: uvicorn re-raises the captured signal after its shutdown,
      which makes the exit status look like a crash to supervisors (systemd, tests).
    """

    def __init__(self, config: uvicorn.Config, stop_workers: Callable[[], Awaitable[None]],
                 grace_s: float, serving: str,
                 on_stop: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._on_stop = on_stop  # called as the stop begins
        self._stop_workers = stop_workers
        self._grace_s = grace_s
        self._serving = serving

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # bound: only now is "serving" true (a port in use exits before)
            log.info("%s", self._serving)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        cut: list[asyncio.Future[None]] = []
        if self._on_stop is not None:
            self._on_stop()
        timer = loop.call_later(self._grace_s,
                                lambda: cut.append(asyncio.ensure_future(self._cut())))
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
            await self._stop_workers()
            if self.force_exit:  # uvicorn skipped the app's shutdown: let it end cleanly
                await self.lifespan.shutdown()

    async def _cut(self) -> None:
        log.info("stop grace of %.0f s passed; stopping workers, which ends running streams",
                 self._grace_s)
        await self._stop_workers()


def ps(url: str, key: str | None = None, watch_s: float | None = None) -> int:
    """``bunkhouse ps``: once, or redrawn every ``watch_s`` seconds until interrupted."""
    if watch_s is None:
        return min(_ps_once(url, key), 1)
    try:
        while True:
            print("\033[H\033[2J", end="")  # clear the terminal, as watch(1) does
            code = _ps_once(url, key)
            if code and code != _UNREACHABLE:  # a refused key: no retry helps
                return code
            print(f"\nevery {watch_s:g} s; Ctrl-C to stop")
            time.sleep(watch_s)
    except KeyboardInterrupt:
        return 0


def follow_events(url: str, key: str | None, since: int | None, as_json: bool) -> int:
    """``bunkhouse events``: print the server's residency events as they come, resuming by
    sequence number after a lost connection, until interrupted."""
    import httpx

    # Ctrl-C (SIGINT) stops it even when it was started with SIGINT ignored or blocked (as a
    # child of a process that ignores it): it has nothing to finish
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    base = url.rstrip("/")
    last = since
    warned = False
    try:
        while True:
            headers = {"authorization": f"Bearer {key}"} if key else {}
            if last is not None:
                headers["last-event-id"] = str(last)
            try:
                with httpx.stream("GET", f"{base}/admin/events", headers=headers,
                                  timeout=httpx.Timeout(10, read=120)) as resp:
                    if resp.status_code >= 400:
                        resp.read()
                        print(f"bunkhouse: error: {resp.status_code}: {_message(resp)}"
                              f"{' (--api-key)' if resp.status_code in (401, 403) else ''}",
                              file=sys.stderr)
                        return 1
                    warned = False
                    for line in resp.iter_lines():
                        if line.startswith("id:"):
                            last = int(line[3:].strip())
                        elif line.startswith("data:"):
                            print(_event_line(line[5:].strip(), as_json), flush=True)
            except httpx.HTTPError as e:
                if not warned:
                    print(f"bunkhouse: {base}/admin/events: {e}; retrying every 2 s "
                          "(Ctrl-C to stop)", file=sys.stderr)
                    warned = True
            time.sleep(2)
    except KeyboardInterrupt:
        return 0


def _message(resp: Any) -> str:
    """An error answer's message: the envelope's, else its text."""
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return str(resp.text)


def _event_line(data: str, as_json: bool) -> str:
    """One event as ``bunkhouse events`` prints it."""
    if as_json:
        return data  # JSON escapes every control character itself
    try:
        event = json.loads(data)
        when = time.strftime("%H:%M:%S", time.localtime(event["time"]))
        seq = f"#{event['seq']}" if "seq" in event else "--"
        return printable(f"{when} {seq:>6} {event.get('model', '-')}: {event['kind']} "
                         f"({event['reason']})")
    except (ValueError, KeyError, TypeError):
        return printable(data)


class JsonLogFormatter(logging.Formatter):
    """One JSON object a line: time (ISO 8601, UTC), level, logger, message, and the
    exception's traceback if any (``--log-format json``)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)  # an access line's figures, one by one
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


_UNREACHABLE = 3  # bunkhouse ps: no server answered (--watch tries again)


def _ps_once(url: str, key: str | None) -> int:
    import httpx

    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        resp = httpx.get(f"{url.rstrip('/')}/stats", timeout=10, headers=headers)
        if resp.status_code in (401, 403):
            print(f"bunkhouse: error: {resp.json()['error']['message']} (--api-key)",
                  file=sys.stderr)
            return 1
        stats = resp.json()
    except (httpx.HTTPError, ValueError) as e:
        print(f"bunkhouse: error: cannot read {url}/stats: {e}; is `bunkhouse serve` running "
              "there? (--url sets the address)", file=sys.stderr)
        return _UNREACHABLE
    print(format_ps(stats))
    return 0


def _admin_post(base: str, path: str, key: str | None, body: dict[str, Any] | None
                ) -> Any:
    """POST to a running server's admin route: the answer, or None once the failure is
    printed (unreachable, or an error status with its message)."""
    import httpx

    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        resp = httpx.post(f"{base}{path}", json=body, headers=headers, timeout=600)
    except httpx.HTTPError as e:
        print(f"bunkhouse: error: cannot reach {base}: {e}; is `bunkhouse serve` running "
              "there? (--url sets the address)", file=sys.stderr)
        return None
    if resp.status_code >= 400:
        print(f"bunkhouse: error: {resp.status_code}: {_message(resp)}", file=sys.stderr)
        return None
    return resp


def control(verb: str, model: str, url: str, key: str | None, path: str | None) -> int:
    base = url.rstrip("/")
    if verb == "load" and path:
        resp = _admin_post(base, "/v1/models", key, {"id": model, "path": path})
    else:
        resp = _admin_post(base, f"/v1/models/{model}/{verb}", key, None)
    if resp is None:
        return 1
    outcome = {202: "draining: it is freed when its running requests end",
               204: "unloaded"}.get(resp.status_code)
    print(f"{model}: {outcome or resp.json()['state']}")
    return 0


def server_call(verb: str, model: str | None, url: str, key: str | None,
                max_s: float | None = None) -> int:
    """``bunkhouse reload``, ``default ID``, ``pause`` and ``resume`` against a running
    server."""
    body: dict[str, Any] = {"model": model} if verb == "default" else {}
    if verb == "pause" and max_s is not None:
        body["max_s"] = max_s
    resp = _admin_post(url.rstrip("/"), f"/admin/{verb}", key, body)
    if resp is None:
        return 1
    data = resp.json()
    if verb == "default":
        print(f"default model: {data['id']}")
    elif verb == "pause":
        if not data["paused"]:
            print("the pause ended before the requests in flight finished")
            return 1
        until = time.strftime("%H:%M:%S", time.localtime(data["resumes_at"]))
        print(f"paused: no request in flight; resumes by itself at {until} "
              "(bunkhouse resume ends it)")
    elif verb == "resume":
        print("resumed" if data["resumed"] else "no pause was held")
    else:
        for change in ("added", "removed", "changed"):
            print(f"{change}: {', '.join(data[change]) or 'none'}")
    return 0


def transcribe(path: Path, url: str, key: str | None, model: str, language: str | None,
               fmt: str) -> int:
    """``bunkhouse transcribe FILE``: the text streamed as it is transcribed, or the answer
    in another format printed whole."""
    import httpx

    try:
        audio = path.expanduser().open("rb")
    except OSError as e:
        print(f"bunkhouse: error: cannot read {path}: {e.strerror}", file=sys.stderr)
        return 2
    fields = {"model": model, "response_format": "json" if fmt == "text" else fmt,
              **({"language": language} if language else {}),
              **({"stream": "true"} if fmt == "text" else {})}
    headers = {"authorization": f"Bearer {key}"} if key else {}
    base = url.strip().rstrip("/").removesuffix("/v1")  # an OpenAI client's base URL too
    if "://" not in base:
        base = f"http://{base}"
    try:
        with audio, httpx.stream("POST", f"{base}/v1/audio/transcriptions", data=fields,
                                 files={"file": (path.name, audio)}, headers=headers,
                                 timeout=httpx.Timeout(600, connect=10)) as resp:
            if resp.status_code >= 400:
                resp.read()
                print(f"bunkhouse: error: {resp.status_code}: {_message(resp)}",
                      file=sys.stderr)
                return 1
            if fmt != "text":
                print(resp.read().decode("utf-8", errors="replace").rstrip("\n"))
                return 0
            try:
                return _print_deltas(resp.iter_lines())
            except httpx.HTTPError:
                print("\nbunkhouse: error: the server closed the stream before the "
                      "transcription ended", file=sys.stderr)
                return 1
    except httpx.HTTPError as e:
        print(f"bunkhouse: error: cannot reach {base}: {e}; is `bunkhouse serve` running "
              "there? (--url sets the address)", file=sys.stderr)
        return 1


def _print_deltas(lines: Iterator[str]) -> int:
    """Print a transcription stream's deltas as they come; 1 on its error event."""
    started = False
    for line in lines:
        if not line.startswith("data:"):
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        if event.get("type") == "transcript.text.delta":
            delta = printable(str(event.get("delta", "")))
            print(delta if started else delta.lstrip(), end="", flush=True)
            started = True
        elif event.get("type") == "transcript.text.done":
            print()
            return 0
        elif event.get("type") == "error":
            print(f"\nbunkhouse: error: {event.get('error', {}).get('message')}",
                  file=sys.stderr)
            return 1
    print()
    return 1


def cache(action: str, model: str | None, root: Path | None) -> int:
    """``bunkhouse cache list|purge [MODEL]`` on the snapshot directory."""
    from bunkhouse.config import default_kv_cache_dir
    from bunkhouse.kvcache.store import NotAStore, SnapshotStore, StoreInUse

    root = root or default_kv_cache_dir()
    if not root.is_dir():
        print(f"no KV snapshots: {root} does not exist")
        return 0
    try:  # a listing reads only; a purge holds the directory as a server would
        store = SnapshotStore(root, 1 << 62, read_only=action == "list")
    except StoreInUse:
        print(f"bunkhouse: error: a running bunkhouse uses {root}; stop it first, or remove "
              "snapshots through it: DELETE /admin/cache[/MODEL] with an admin key",
              file=sys.stderr)
        return 1
    except NotAStore as e:
        print(f"bunkhouse: error: {e}; nothing done", file=sys.stderr)
        return 1
    if action == "purge":
        removed = store.purge(model)
        print(f"removed {removed} snapshot(s) of {model or 'every model'} from {root}")
        return 0
    totals: dict[str, list[int]] = {}
    for model_id, _, size in store.snapshots(model):
        totals.setdefault(model_id, [0, 0])
        totals[model_id][0] += 1
        totals[model_id][1] += size
    for model_id, (count, size) in sorted(totals.items()):
        print(f"{model_id}  {count} snapshot(s)  {_mib(size)}")
    print(f"{sum(c for c, _ in totals.values())} snapshot(s), "
          f"{_mib(sum(s for _, s in totals.values()))} in {root}")
    return 0


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def _idle(model: dict[str, Any], now: float) -> str:
    """How long a loaded model has served nothing; "-" for one not loaded or in use."""
    if model["state"] != "ready" or model["leases"] or not model["last_used"]:
        return "-"
    return f"{max(0.0, now - model['last_used']):.0f} s"


_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(32), *range(127, 160))}


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\x1b``), so that a name from a file or
    a server can neither forge a log line nor drive a terminal."""
    return text.translate(_CONTROLS)


class TextLogFormatter(logging.Formatter):
    """The text log: one line a message, its control characters escaped (a traceback
    keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)


def format_ps(stats: dict[str, Any]) -> str:
    header = ("ID", "STATE", "PINNED", "LEASES", "RUN/QUEUE/WAIT", "ESTIMATED", "MEASURED",
              "IDLE", "PID")
    now = time.time()
    rows = [header] + [
        (printable(str(m["id"])), printable(str(m["state"])), "yes" if m["pinned"] else "no",
         str(m["leases"]),
         f"{m.get('running', 0)}/{m.get('queued', 0)}/{m.get('waiting', 0)}",
         _mib(m["estimated_bytes"]), _mib(m["measured_bytes"]),
         _idle(m, now), str(m["pid"] or "-"))
        for m in stats["models"]
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    lines.append("")
    spare = stats.get("spare_worker")
    if spare:
        lines.append(f"spare worker pid {spare['pid']} ({_mib(spare['bytes'])} of the used): "
                     "the next model to load takes it")
    lines.append(f"budget {_mib(stats['budget_bytes'])}, used {_mib(stats['used_bytes'])}, "
                 f"free {_mib(stats['free_bytes'])}, peak {_mib(stats['peak_used_bytes'])}")
    pause = stats.get("pause") or {}
    if pause.get("paused"):
        until = time.strftime("%H:%M:%S", time.localtime(pause["resumes_at"]))
        lines.append(f"PAUSED by an operator until {until} at the latest (bunkhouse resume); "
                     f"{pause.get('in_flight', 0)} request(s) in flight")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "ps":
        return ps(args.url, args.api_key, args.watch)
    if args.command == "events":
        return follow_events(args.url, args.api_key, args.since, args.json)
    if args.command in ("reload", "default", "pause", "resume"):
        return server_call(args.command, getattr(args, "model", None), args.url,
                           args.admin_key, getattr(args, "max", None))
    if args.command == "transcribe":
        return transcribe(args.file, args.url, args.api_key, args.model, args.language,
                          args.format)
    if args.command in ("load", "unload", "pin", "unpin"):
        return control(args.command, args.model, args.url, args.admin_key,
                       getattr(args, "path", None))
    if args.command == "cache":
        if args.model is not None and not args.model.strip():
            print("bunkhouse: error: give a model id, or none for every model", file=sys.stderr)
            return 2
        return cache(args.action, args.model, args.kv_cache_dir)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if args.log_format == "json" else TextLogFormatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    if args.log_level != "debug":  # the front's own polling of its workers: debug only
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        settings = settings_from(args)
        catalog = build_catalog(settings)
        if args.command == "models":
            print_catalog(catalog)
            return 0
        def rebuild() -> tuple[Catalog, Keys]:
            from bunkhouse.front.auth import Keys

            again = settings_from(args)  # key files are read again: a rotated key applies
            return build_catalog(again), Keys(again.api_keys, again.admin_keys)

        return serve(settings, catalog, rebuild)
    except BunkhouseError as e:
        print(f"bunkhouse: error: {e.message}", file=sys.stderr)
        return 2
