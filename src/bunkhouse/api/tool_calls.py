"""Tool calls the engine's own template parser misses: pure functions, no I/O.

llama.cpp parses a model's tool calls by the markers its chat template uses (Qwen's
``<tool_call>`` tags) and, for ``tool_choice: "required"``, constrains the output with a
grammar that still allows any text before the first call. A small model (the packaged
Qwen2.5-Coder 0.5B) writes the call as bare JSON or in a Markdown fence instead, so the
engine answered "required" with the call as text and kept going until ``max_tokens``.

So the front:

* **forces** a call when the client requires one (``tool_choice`` ``"required"``, or a named
  function, which llama.cpp does not honour at all): the request goes to the engine with
  ``tool_choice: "none"`` (the template still shows the model its tools) and a JSON schema
  that admits exactly one call ``{"name": <a permitted tool>, "arguments": <its
  parameters>}``; the answer's text is read back as that call (:func:`forced_request`);
* **recovers** a call under ``tool_choice: "auto"`` when the whole answer is one call (or a
  list of calls) naming a declared tool, bare, in a fence or in ``<tool_call>`` tags, and the
  engine found none itself (:func:`calls_from_text`).

:class:`ToolCallReader` applies both to a whole ``chat.completion`` or, event by event, to a
stream: text that may still become a call is held back until it is clear.

Ollama reads calls out of text the same way (its tool-call parser by the template's format).
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Collection, Mapping
from typing import Any

from bunkhouse.api.fields import shown
from bunkhouse.errors import InvalidRequest

_FENCE = re.compile(r"^```[a-zA-Z]*\s*(.*?)\s*```$", re.DOTALL)
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _names(tools: Any) -> list[str]:
    names = []
    for tool in tools if isinstance(tools, list) else []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.append(fn["name"])
    return names


def _required_name(choice: Any) -> str | None:
    """The function a ``tool_choice`` names, or "" for "required", or None (not forced)."""
    if choice == "required":
        return ""
    if isinstance(choice, dict):
        fn = choice.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return str(fn["name"])
        if isinstance(choice.get("name"), str):  # the Responses API's flat form
            return str(choice["name"])
    return None


_DEFS = ("$defs", "definitions")


def _has_refs(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(k in node for k in _DEFS) \
            or any(_has_refs(v) for v in node.values())
    return isinstance(node, list) and any(_has_refs(v) for v in node)


def _hoisted(params: dict[str, Any], tag: str, defs: dict[str, Any]) -> dict[str, Any]:
    """``params`` moved into ``defs`` as ``tag`` (its own definitions as ``tag__NAME``), its
    local ``$ref``s rewritten to match; returns the reference to it. A tool's references
    point at the top of its own schema, which is no longer the top once the schema sits under
    a call's ``arguments``."""
    def ref(target: str) -> str:
        for key in _DEFS:
            head = f"#/{key}/"
            if target.startswith(head):
                return f"#/$defs/{tag}__{target[len(head):]}"
        if target == "#" or target.startswith("#/"):
            return f"#/$defs/{tag}{target[1:]}"
        return target  # not local: left to the engine

    def rewrite(node: Any, top: bool = False) -> Any:
        if isinstance(node, dict):
            return {k: (ref(v) if k == "$ref" and isinstance(v, str) else rewrite(v))
                    for k, v in node.items() if not (top and k in _DEFS)}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for key in _DEFS:
        for name, schema in (params.get(key) or {}).items():
            defs[f"{tag}__{name}"] = rewrite(schema)
    defs[tag] = rewrite(params, top=True)
    return {"$ref": f"#/$defs/{tag}"}


def call_schema(tools: list[dict[str, Any]], only: str = "") -> dict[str, Any]:
    """The JSON schema of one call of ``tools`` (of the tool named ``only``, if given)."""
    options = []
    defs: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") or {}
        if only and fn.get("name") != only:
            continue
        params = fn.get("parameters")
        if not isinstance(params, dict) or not params:
            params = {"type": "object"}
        elif _has_refs(params):
            params = _hoisted(params, f"tool{i}", defs)
        options.append({
            "type": "object",
            "properties": {"name": {"const": fn.get("name")}, "arguments": params},
            "required": ["name", "arguments"]})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs} if defs else schema


def forced_request(data: dict[str, Any]) -> dict[str, Any] | None:
    """The chat request rewritten so that the engine must answer with one tool call, when
    ``data`` requires one and sets no output format of its own; else None.

    Raises nothing: a named function that is not among ``tools`` is left to the engine's own
    checks (see :func:`check_tool_choice`)."""
    tools = data.get("tools")
    only = _required_name(data.get("tool_choice"))
    if not tools or only is None or data.get("response_format") or data.get("json_schema") \
            or data.get("grammar") or data.get("n", 1) != 1:
        return None
    if only and only not in _names(tools):
        return None
    forced = {k: v for k, v in data.items() if k != "stop"}  # a stop word must not cut a call
    return {**forced, "tool_choice": "none", "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "tool_call", "schema": call_schema(tools, only)}}}


def check_tool_choice(data: dict[str, Any]) -> None:
    """InvalidRequest (as OpenAI answers them) for a ``tool_choice`` that names no declared
    function, requires a call without ``tools``, or is an object without a function name;
    and for two tools of one name."""
    choice = data.get("tool_choice")
    names = _names(data.get("tools"))
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise InvalidRequest(f"tools: more than one tool is named {shown(twice[0])}",
                             param="tools")
    if choice is None or choice in ("auto", "none"):
        return
    only = _required_name(choice)
    if only is None:
        raise InvalidRequest("tool_choice must be \"auto\", \"none\", \"required\" or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                             param="tool_choice")
    if not names:
        raise InvalidRequest("tool_choice requires a tool call, but no tools are given",
                             param="tool_choice")
    if only and only not in names:
        raise InvalidRequest(f"tool_choice names the function {shown(only)}, which is not "
                             "in tools", param="tool_choice")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _schemas(tools: Any) -> dict[str, Any]:
    """Each declared tool's name and parameters schema (None where it gives none)."""
    out: dict[str, Any] = {}
    for tool in tools if isinstance(tools, list) else []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters")
    return out


def _fits(args: dict[str, Any], schema: Any) -> bool:
    """Whether arguments have what the tool's schema requires, and no key it forbids (a
    shallow check: enough to tell a call from JSON that merely names a tool)."""
    if not isinstance(schema, dict):
        return True
    required = schema.get("required")
    if isinstance(required, list) and any(k not in args for k in required):
        return False
    props = schema.get("properties")
    return not (isinstance(props, dict) and schema.get("additionalProperties") is False
                and any(k not in props for k in args))


def _arguments(value: Any, names: Collection[str]) -> dict[str, Any] | None:
    """The arguments of ``value`` if it is a call of one of ``names``; else None."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    if isinstance(names, Mapping) and not _fits(args, names[value["name"]]):
        return None
    return args


def _call(value: Any, names: Collection[str]) -> dict[str, Any] | None:
    args = _arguments(value, names)
    if args is None:
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(args)}}


_DECODER = json.JSONDecoder()


def _json_values(text: str) -> list[Any] | None:
    """The JSON values ``text`` is made of, one after another (JSON lines), or None."""
    values: list[Any] = []
    i = 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return values or None
        try:
            value, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def calls_from_text(text: str, names: Collection[str]) -> list[dict[str, Any]] | None:
    """The tool calls ``text`` is made of, in OpenAI's ``tool_calls`` shape, when the whole
    text (stripped) is call objects (one, a list, or one per line: parallel calls) naming
    tools in ``names``: bare, in a Markdown fence, or each in ``<tool_call>`` tags. None if it
    is anything else. Given a mapping of names to parameter schemas, a call's arguments must
    also fit its schema (:func:`_fits`)."""
    text = text.strip()
    if not text or not names:
        return None
    tagged = _TAGGED.findall(text)
    if tagged:
        if _TAGGED.sub("", text).strip():
            return None
        bodies = tagged
    else:
        fenced = _FENCE.match(text)
        bodies = [fenced.group(1) if fenced else text]
    calls: list[dict[str, Any]] = []
    for body in bodies:
        values = _json_values(body)
        if values is None:
            return None
        for item in (v for value in values for v in (value if isinstance(value, list)
                                                      else [value])):
            call = _call(item, names)
            if call is None:
                return None
            calls.append(call)
    return calls or None


_KEYS = ("name", "arguments", "parameters")  # a call object's keys, as calls_from_text reads


def _may_become_call(text: str, names: Collection[str] = ()) -> bool:
    """Whether text an answer began with may still turn out to be tool calls: empty, or the
    start of ``<tool_call>``, of a ```json (or bare) fence, of a list or object whose first
    key is a call's; a complete object must be a call of one of ``names`` (if given), and
    what follows it may be another. Anything else (```python, prose, ``{"city": ...``) is
    text at once, so that a streamed answer is held back only while it really may be calls."""
    head = text.lstrip()
    if not head or "<tool_call>".startswith(head) or head.startswith("<tool_call>") \
            or "```".startswith(head):
        return True
    if head.startswith("```"):
        line, newline, rest = head[3:].partition("\n")
        lang = line.strip().lower()
        if not newline:
            return "json".startswith(lang)
        if lang not in ("", "json"):
            return False
        head = rest.lstrip()
    if head.startswith("["):
        head = head[1:].lstrip()
    if not head:
        return True
    if not head.startswith("{"):
        return False
    if names:
        try:
            value, end = _DECODER.raw_decode(head)
        except ValueError:
            pass  # not complete yet: judged by its first key below
        else:
            if _arguments(value, names) is None:
                return False
            rest = head[end:].lstrip().lstrip(",]").lstrip()
            return not rest or rest.startswith(("```", "</tool_call>")) \
                or _may_become_call(rest, names)
    body = head[1:].lstrip()
    if not body:
        return True
    if not body.startswith('"'):
        return False
    key, closed, _ = body[1:].partition('"')
    return key in _KEYS if closed else any(k.startswith(key) for k in _KEYS)


class ToolCallReader:
    """Reads tool calls out of one chat answer's text (see the module's docstring).

    ``names``: the declared tools; ``forced``: the request was rewritten by
    :func:`forced_request`, so the whole text is the call."""

    def __init__(self, names: Collection[str], forced: bool) -> None:
        self.names = names
        self.forced = forced
        self._held: list[str] = []
        self._holding = True
        self._engine_calls = False

    @classmethod
    def for_request(cls, data: dict[str, Any]) -> tuple[dict[str, Any], ToolCallReader | None]:
        """The request to send and the reader of its answer (None: nothing to read)."""
        names = _schemas(data.get("tools"))
        if not names or data.get("tool_choice") == "none" or data.get("n", 1) != 1:
            return data, None
        forced = forced_request(data)
        if forced is not None:
            return forced, cls(names, forced=True)
        if _required_name(data.get("tool_choice")) is not None \
                or data.get("response_format") or data.get("json_schema"):
            return data, None
        return data, cls(names, forced=False)

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A whole ``chat.completion`` with its calls read out of its text."""
        choices = chat.get("choices") or []
        if len(choices) != 1:
            return chat
        message = choices[0].get("message") or {}
        text = message.get("content")
        if message.get("tool_calls") or not isinstance(text, str):
            return chat
        calls = calls_from_text(text, self.names)
        if calls is None:
            return chat
        out = copy.copy(chat)
        out["choices"] = [{**choices[0], "finish_reason": "tool_calls",
                           "message": {**message, "content": None, "tool_calls": calls}}]
        return out

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """One stream event in, the events to send now out (text that may still become a
        call held back; the calls sent in the event that finishes the answer)."""
        choices = event.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not self._holding:
            return [event]
        choice = choices[0]
        delta = choice.get("delta") or {}
        if delta.get("tool_calls"):
            self._engine_calls = True
        text = delta.get("content")
        if isinstance(text, str) and text and not self._engine_calls:
            self._held.append(text)
            if self.forced or _may_become_call("".join(self._held), self.names):
                delta = {k: v for k, v in delta.items() if k != "content"}
            else:
                delta = {**delta, "content": "".join(self._held)}
                self._held = []
                self._holding = False
        if choice.get("finish_reason") and self._holding:
            return [self._finish(event, choice, delta)]
        if not delta and not choice.get("finish_reason") and text:
            return []  # only held text: nothing to send yet
        return [{**event, "choices": [{**choice, "delta": delta}]}]

    def _finish(self, event: dict[str, Any], choice: dict[str, Any],
                delta: dict[str, Any]) -> dict[str, Any]:
        self._holding = False
        text = "".join(self._held)
        self._held = []
        calls = calls_from_text(text, self.names) if text else None
        if calls is None:
            if text:
                delta = {**delta, "content": text}
            return {**event, "choices": [{**choice, "delta": delta}]}
        delta = {**delta, "tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
        return {**event, "choices": [{**choice, "delta": delta,
                                      "finish_reason": "tool_calls"}]}

    def end(self) -> list[dict[str, Any]]:
        """Text still held when a stream ended without a finishing event, as one event."""
        if not self._held:
            return []
        text = "".join(self._held)
        self._held = []
        self._holding = False
        return [{"object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}]
