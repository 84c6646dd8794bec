"""An engine's own options: checked by its adapter, sent to its worker as one JSON object.

A model's options that only one engine reads (llama.cpp's ``cache_ram_mib``, ``swa_full``,
``threads``) are written in the config file beside the common ones, kept as written by the
config (``EngineOptions.engine_keys``), and typed by the engine's adapter
(``EngineAdapter.options``: a frozen dataclass of its own, or ConfigError naming the key).
The worker gets them as ``--engine-options JSON`` (:func:`worker_args`); its engine class
decodes them with the same parser (:func:`decode`), so that one definition types both sides.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from bunkhouse.errors import ConfigError

T = TypeVar("T")

Check = Callable[[Any, str, str], Any]
"""(value, key, where) -> the value, typed; ConfigError naming ``key`` if it is wrong."""

FLAG = "--engine-options"
"""The worker's command-line option that carries them (worker/main.py)."""


def cpu_threads() -> int:
    """Every core: the default of an engine's ``threads``."""
    return os.cpu_count() or 1


def integer(least: int, most: int | None = None) -> Check:
    """An integer of at least ``least`` (and at most ``most``, when given)."""

    def check(value: Any, key: str, where: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be an integer, not {value!r}")
        if most is not None and not least <= value <= most:
            raise ConfigError(f"{where}: {key} must be an integer from {least} to {most}, "
                              f"not {value!r}")
        if value < least:
            raise ConfigError(f"{where}: {key} must be >= {least}")
        return value

    return check


def flag(value: Any, key: str, where: str) -> bool:
    """True or false."""
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {key} must be true or false")
    return value


def checked(raw: Mapping[str, Any], checks: Mapping[str, Check], where: str) -> dict[str, Any]:
    """``raw``'s values as ``checks`` type them (a dataclass's keyword arguments); a key
    without a check is unknown."""
    unknown = set(raw) - set(checks)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}")
    return {key: checks[key](value, key, where) for key, value in raw.items()}


def worker_args(options: Any) -> list[str]:
    """The worker command line's part that carries ``options`` (an adapter's dataclass; an
    option that is None is left out: its default)."""
    given = {k: v for k, v in dataclasses.asdict(options).items() if v is not None}
    return [FLAG, json.dumps(given, sort_keys=True)]


def decode(text: str, parse: Callable[[Mapping[str, Any], str], T]) -> T:
    """The options :func:`worker_args` wrote, typed by the adapter's ``parse``; ConfigError
    for anything else."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{FLAG}: not JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{FLAG}: must be a JSON object")
    return parse(raw, FLAG)
