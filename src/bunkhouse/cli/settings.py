"""Settings from the parsed flags, the config file and the key variables: what ``serve`` and
``models`` run with. Flags given explicitly win over the file."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from bunkhouse import defaults
from bunkhouse.config import Settings, engine_options, load_config_file
from bunkhouse.errors import ConfigError


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
        llama_server=getattr(args, "llama_server", None),
    )
    if args.command == "serve":
        settings = _serve_settings(settings, args)
    if args.config is not None:
        settings = load_config_file(args.config.expanduser(), settings)
        if args.no_packaged:
            settings = dataclasses.replace(settings, include_packaged=False)
    if getattr(args, "ttl", None) is not None:
        settings = dataclasses.replace(settings, ttl_s=args.ttl)
    return _flags_win(settings, args)


def _serve_settings(settings: Settings, args: argparse.Namespace) -> Settings:
    """What only ``serve`` has flags for: keys, site rules, limits and stores."""
    settings = dataclasses.replace(
        settings,
        allow_runtime_load=args.allow_runtime_load,
        allowed_roots=tuple(args.allowed_root),
        allowed_hosts=tuple(args.allowed_host),
        cors_origins=tuple(args.cors_origin),
        api_keys=_keys(args.api_key, args.api_key_file, "BUNKHOUSE_API_KEYS", "--api-key"),
        admin_keys=_keys(args.admin_key, args.admin_key_file, "BUNKHOUSE_ADMIN_KEYS",
                         "--admin-key"),
        max_body_bytes=args.max_body,
        max_audio_bytes=args.max_audio,
        ray_address=args.ray,
        kv_cache_max=args.kv_cache_max,
        kv_min_tokens=args.kv_min_tokens,
        responses_keep=args.responses_keep,
        responses_max_age_s=args.responses_days * 86400,
        responses_max_bytes=args.responses_max,
    )
    if args.responses_db:
        settings = dataclasses.replace(settings, responses_db=args.responses_db)
    if args.kv_cache_dir:
        settings = dataclasses.replace(settings, kv_cache_dir=args.kv_cache_dir)
    return settings


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
