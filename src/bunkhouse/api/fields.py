"""Checks of a request's fields for the translated protocols (api/anthropic.py,
api/responses.py): each raises :class:`bunkhouse.errors.InvalidRequest` naming the field.

Two rules every protocol's request follows, applied here:

- A field set to null means the field is omitted (:func:`omit_nulls`, at any depth), as
  OpenAI's, Anthropic's and Ollama's schemas mark their optional fields nullable; except in
  free-form JSON (a tool's JSON schema, a call's arguments), where null is a value.
- Tools the model cannot run (hosted or built-in tools: ``web_search``, ``custom``, an
  Anthropic server tool) are left out of the request (:func:`served_tools`) and named in the
  answer's ``x-bunkhouse-skipped-tools`` header; the function tools are served.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from bunkhouse.api.schemas import parse_json_object
from bunkhouse.errors import BunkhouseError, InvalidRequest

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


def integer(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    """``body[name]`` as an integer from ``lo`` to ``hi``, or None if absent; one message
    whatever is wrong with it (a float, a string, a value past either end)."""
    value = body.get(name)
    if value is None:
        return None
    need(isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi,
         f"{name} must be an integer from {lo} to {hi}", name)
    return int(value)


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
          tool: Callable[[int, Any], dict[str, Any] | None],
          choice: Callable[[Any], Any]) -> None:
    """``tools`` (at most MAX_TOOLS, each made a chat tool by ``tool(i, given)``, or left
    out when that is None: a tool the model cannot run) and ``tool_choice`` (made a chat one
    by ``choice``) of ``body`` into ``out``."""
    given = body.get("tools")
    if given is not None:
        need(isinstance(given, list) and len(given) <= MAX_TOOLS,
             f"tools must be an array of at most {MAX_TOOLS} tools", "tools")
        made = [t for t in (tool(i, t) for i, t in enumerate(given)) if t is not None]
        if made:
            out["tools"] = made
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


def rename_error(err: BunkhouseError, rules: Renames) -> None:
    """``err``, raised for a chat completion request made from another protocol's, naming
    the field (its ``param`` and where its message quotes it) as that protocol does."""
    old = err.param
    err.param = renamed(old, rules)
    if old and err.param != old:
        err.message = re.sub(rf"\b{re.escape(old)}\b", err.param or old, err.message)


Paths = tuple[tuple[str, ...], ...]
"""Places in a request, as keys from its top; ``*`` stands for any key or array index."""


def omit_nulls(value: Any, free_form: Paths = (), at: tuple[str, ...] = ()) -> Any:
    """``value`` (a parsed JSON body) without the object keys whose value is null, at any
    depth, as if they were omitted; the free-form JSON at the ``free_form`` paths is kept as
    it is (null is a value in a JSON schema or a call's arguments). Nulls in arrays stay
    (``"stop": [null]`` is still refused by its type). Objects without nulls are shared, not
    copied."""
    if at and any(len(p) == len(at) and all(k in ("*", a) for k, a in zip(p, at, strict=True))
                  for p in free_form):
        return value
    if isinstance(value, dict):
        kept = {k: omit_nulls(v, free_form, (*at, k)) for k, v in value.items()
                if v is not None}
        return value if len(kept) == len(value) and all(
            kept[k] is value[k] for k in kept) else kept
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        items = [omit_nulls(v, free_form, (*at, "*")) for v in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    return value


def read_object(body: bytes, free_form: Paths = ()) -> dict[str, Any]:
    """The request body as a JSON object (api/schemas.parse_json_object), its null fields
    omitted (:func:`omit_nulls`)."""
    data: dict[str, Any] = omit_nulls(parse_json_object(body), free_form)
    return data


CHAT_FREE_FORM: Paths = (
    ("tools", "*", "function", "parameters"), ("response_format", "json_schema", "schema"),
    ("response_format", "schema"), ("json_schema",), ("chat_template_kwargs",),
    ("metadata",))
"""The free-form JSON of OpenAI's chat completions, completions and embeddings requests
(with llama.cpp's extension fields)."""


def skipped_tools(body: dict[str, Any], served: Callable[[Any], bool]) -> list[str]:
    """The tools of ``body`` that ``served`` says the model cannot run, named as the
    skipped-tools header names them (:func:`tool_label`). Tools that are not objects count
    as served: their checks refuse them."""
    given = body.get("tools")
    if not isinstance(given, list):
        return []
    return [tool_label(t) for t in given if isinstance(t, dict) and not served(t)]


def without_tools(body: dict[str, Any], served: Callable[[Any], bool]) -> dict[str, Any]:
    """``body`` without its tools that ``served`` says the model cannot run (``tools``
    left out when none is left)."""
    given = body.get("tools")
    if not isinstance(given, list):
        return body
    kept = [t for t in given if not isinstance(t, dict) or served(t)]
    if len(kept) == len(given):
        return body
    out = {k: v for k, v in body.items() if k != "tools"}
    if kept:
        out["tools"] = kept
    return out


def function_tool(tool: Any) -> bool:
    """Whether a tool is a function tool (``"type": "function"``): OpenAI's and Ollama's
    tools the model can call. One without a type counts as one, for its checks to refuse
    it or serve it."""
    return not isinstance(tool, dict) or tool.get("type") in (None, "function")


_LABEL = re.compile(r"[^A-Za-z0-9_.:-]")


def tool_label(tool: dict[str, Any]) -> str:
    """A skipped tool as the skipped-tools header names it: its type, and its name when it
    has one (``custom:apply_patch``), in header-safe characters."""
    kind = str(tool.get("type"))
    inner = tool.get(kind)
    name = tool.get("name") or (inner.get("name") if isinstance(inner, dict) else None)
    label = f"{kind}:{name}" if isinstance(name, str) and name else kind
    return _LABEL.sub("_", label[:128])
