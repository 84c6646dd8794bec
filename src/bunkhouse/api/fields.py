"""Checks of a request's fields for the translated protocols (api/anthropic.py,
api/responses.py): each raises :class:`bunkhouse.errors.InvalidRequest` naming the field."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from bunkhouse.errors import InvalidRequest

MAX_TOOLS = 512
"""Tools in one request (docs/security.md: each tool's schema may become a grammar)."""


def shown(value: Any, limit: int = 100) -> str:
    """``value`` as an error message quotes it: its repr, cut to ``limit`` characters (a
    client's value may be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def need(cond: bool, message: str, param: str) -> None:
    """InvalidRequest(``message``) naming ``param`` unless ``cond``."""
    if not cond:
        raise InvalidRequest(message, param=param)


def number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    """``body[name]`` as a float from ``lo`` to ``hi``, or None if absent."""
    value = body.get(name)
    if value is None:
        return None
    need(isinstance(value, int | float) and not isinstance(value, bool) and lo <= value <= hi,
         f"{name} must be a number from {lo:g} to {hi:g}", name)
    return float(value)


def stream_and_sampling(body: dict[str, Any], out: dict[str, Any],
                        temperature_max: float) -> None:
    """``stream`` (usage included in a stream), ``temperature`` (0 to ``temperature_max``)
    and ``top_p`` (0 to 1) of ``body``, checked, into the chat request ``out``."""
    stream = body.get("stream", False)
    need(isinstance(stream, bool), "stream must be a boolean", "stream")
    if stream:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    for name, hi in (("temperature", temperature_max), ("top_p", 1.0)):
        value = number(body, name, 0, hi)
        if value is not None:
            out[name] = value


def tools(body: dict[str, Any], out: dict[str, Any],
          tool: Callable[[int, Any], dict[str, Any]], choice: Callable[[Any], Any]) -> None:
    """``tools`` (at most MAX_TOOLS, each made a chat tool by ``tool(i, given)``) and
    ``tool_choice`` (made a chat one by ``choice``) of ``body`` into ``out``."""
    given = body.get("tools")
    if given is not None:
        need(isinstance(given, list) and len(given) <= MAX_TOOLS,
             f"tools must be an array of at most {MAX_TOOLS} tools", "tools")
        if given:
            out["tools"] = [tool(i, t) for i, t in enumerate(given)]
    if body.get("tool_choice") is not None:
        out["tool_choice"] = choice(body["tool_choice"])


Renames = tuple[tuple[str, str], ...]
"""(regex over a chat completion field's name, its replacement in another protocol)."""


def renamed(param: str | None, rules: Renames) -> str | None:
    """A chat completion field's name (``tools.2.function.parameters``) as another protocol
    calls it (``tools.2.input_schema``), by the first of ``rules`` that matches; else as
    it is."""
    if param is None:
        return None
    for pattern, replacement in rules:
        if re.match(pattern, param):
            return re.sub(pattern, replacement, param, count=1)
    return param
