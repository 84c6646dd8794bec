"""Anthropic's Messages API in terms of OpenAI chat completions: pure functions, no I/O.

The front serves ``POST /v1/messages`` by translating the request into a chat completion
request (:func:`to_chat`), sending it down the one generation path every protocol shares, and
translating the answer back: a whole one with :func:`message_from_chat`, a stream chunk by
chunk with :class:`MessageStream`. Errors use Anthropic's envelope (:func:`error_envelope`).

Source: Anthropic's API reference, "Messages" and "Streaming Messages" (event order
``message_start``, then per content block ``content_block_start``, deltas,
``content_block_stop``, then ``message_delta`` with the stop reason and output usage, then
``message_stop``; tool input streams as ``input_json_delta``).

Errors: :func:`to_chat` raises :class:`bunkhouse.errors.InvalidRequest` naming the field.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from bunkhouse.api.fields import (
    Paths,
    Renames,
    integer,
    need,
    omit_nulls,
    shown,
    stream_and_sampling,
    tools,
)
from bunkhouse.api.schemas import INT32_MAX
from bunkhouse.errors import BunkhouseError, InvalidRequest

MAX_MESSAGES = 10_000  # turns in one request
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # Anthropic's "Tool use" page
MAX_BLOCKS = 10_000  # content blocks in one message
MAX_STOP_SEQUENCES = 16

FREE_FORM: Paths = (("tools", "*", "input_schema"), ("messages", "*", "content", "*", "input"),
                    ("metadata",))
"""Where a request's null is a value, not an omitted field (api/fields.omit_nulls)."""

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                 "function_call": "tool_use", "content_filter": "refusal"}

_TYPES_BY_CODE = {
    "invalid_api_key": "authentication_error", "permission_denied": "permission_error",
    "not_found": "not_found_error", "model_not_found": "not_found_error",
    "request_too_large": "request_too_large", "queue_full": "rate_limit_error",
    "stalled_too_often": "rate_limit_error", "insufficient_memory": "overloaded_error",
    "paused": "overloaded_error", "server_busy": "overloaded_error"}
"""bunkhouse's error codes (errors.py) whose cause has an Anthropic type of its own;
``overloaded_error`` (Anthropic's 529) only for a lack of capacity that passes (memory held
by other requests, paused models, a shared budget full). Every other cause is told by its
status, or, in a stream, by its OpenAI type: see docs/protocols.md."""

_TYPES_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 529: "overloaded_error"}


def error_type(status: int | None, body: dict[str, Any]) -> str:
    """Anthropic's error type for an error in OpenAI's envelope (``body``), one per cause
    whether it is answered with a status (``status``) or in a stream (None): by its code,
    else by its status (a stream's: an engine's numeric ``code``, else 400 for an
    ``invalid_request_error`` and 500 for the rest); a 5xx without a type of its own is an
    ``api_error``."""
    err = body.get("error")
    err = err if isinstance(err, dict) else {}
    code = err.get("code")
    if isinstance(code, str) and code in _TYPES_BY_CODE:
        return _TYPES_BY_CODE[code]
    if status is None:
        numeric = isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600
        status = 400 if err.get("type") == "invalid_request_error" else 500
        if numeric and isinstance(code, int):
            status = code
    return _TYPES_BY_STATUS.get(status, "invalid_request_error" if status < 500
                                else "api_error")


def error_object(kind: str, message: str) -> dict[str, Any]:
    """An error as Anthropic sends it: ``{"type": "error", "error": {"type", "message"}}``
    (Anthropic's "Errors" page); ``kind`` from :func:`error_type`."""
    return {"type": "error", "error": {"type": kind, "message": message}}


CHAT_FIELDS: Renames = (
    (r"^tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"),
    (r"^stop$", "stop_sequences"),
    (r"^messages(\..*)?$", "messages"),  # a system prompt is chat's first message
)
"""The chat completion fields a refusal may name, as this API names them (api/fields.py)."""


def error_envelope(err: BunkhouseError, detail: bool = False) -> dict[str, Any]:
    """``err`` in Anthropic's envelope; ``detail``: its private detail too (admins)."""
    kind = error_type(err.status, {"error": {"code": err.code, "type": err.type}})
    return error_object(kind, err.full_message() if detail else err.message)


def _text_of(content: Any, param: str) -> str:
    """A string, or text blocks joined (a system prompt, a tool result)."""
    if isinstance(content, str):
        return content
    need(isinstance(content, list), f"{param} must be a string or an array of text blocks",
         param)
    parts = []
    for i, block in enumerate(content):
        need(isinstance(block, dict) and block.get("type") == "text"
             and isinstance(block.get("text"), str),
             f"{param}[{i}] must be a text block ({{\"type\": \"text\", \"text\": ...}})",
             f"{param}.{i}")
        parts.append(block["text"])
    return "\n".join(parts)


def _message(i: int, message: Any, last: bool, calls_seen: set[str]) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI chat messages (tool results become tool messages).
    ``calls_seen``: the ids of the tool_use blocks before it (this one's are added)."""
    where = f"messages.{i}"
    need(isinstance(message, dict), f"{where} must be an object", where)
    role = message.get("role")
    need(role in ("user", "assistant"), f"{where}.role must be \"user\" or \"assistant\"",
         f"{where}.role")
    content = message.get("content")
    need(bool(content) or (last and role == "assistant"),
         f"{where}.content must not be empty (only a final assistant turn may be)",
         f"{where}.content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    need(isinstance(content, list), f"{where}.content must be a string or an array of "
                                     "content blocks", f"{where}.content")
    need(len(content) <= MAX_BLOCKS, f"{where}.content has more than {MAX_BLOCKS} blocks",
         f"{where}.content")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        need(isinstance(block, dict) and isinstance(block.get("type"), str),
             f"{at} must be a content block with a type", at)
        kind = block["type"]
        if kind == "text":
            need(isinstance(block.get("text"), str), f"{at}.text must be a string", at)
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            need(isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                 and isinstance(block.get("input", {}), dict),
                 f"{at} needs a string id, a string name and an object input", at)
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
            calls_seen.add(block["id"])
        elif kind == "tool_result" and role == "user":
            need(isinstance(block.get("tool_use_id"), str),
                 f"{at}.tool_use_id must be a string", f"{at}.tool_use_id")
            need(block["tool_use_id"] in calls_seen,
                 f"{at}.tool_use_id: no tool_use block with the id "
                 f"{shown(block['tool_use_id'])} in an earlier assistant turn",
                 f"{at}.tool_use_id")
            text = _text_of(block.get("content", ""), f"{at}.content")
            if block.get("is_error") is True:
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": text})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier reasoning: not sent back to the model
        else:
            raise InvalidRequest(f"{at}.type {shown(kind)} is not supported here (text, tool_use "
                                 "in assistant turns, tool_result in user turns)",
                                 param=f"{at}.type")
    out: list[dict[str, Any]] = list(results)
    if calls:
        out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
    elif texts or not results:
        out.append({"role": role, "content": "".join(texts)})
    return out


def _check_answered(i: int, message: Any, ids: set[str]) -> None:
    """The turn after an assistant's tool_use blocks answers every one with a tool_result
    (Anthropic refuses a conversation that leaves one unanswered)."""
    content = message.get("content") if isinstance(message, dict) else None
    given = {b.get("tool_use_id") for b in content if isinstance(b, dict)
             and b.get("type") == "tool_result"} if isinstance(content, list) else set()
    missing = sorted(ids - given)
    need(not missing, f"messages.{i}: tool_use {shown(missing[0]) if missing else ''} has no "
         "tool_result block in the turn after it", f"messages.{i}.content")


def served(tool: Any) -> bool:
    """Whether a tool is one the model can call: a client tool (no type, or ``custom``),
    not one of Anthropic's server or built-in tools (``web_search_20250305``,
    ``bash_20250124``, ...), which are skipped (api/fields.py)."""
    return not isinstance(tool, dict) or tool.get("type") in (None, "custom")


def _tool(i: int, tool: Any) -> dict[str, Any] | None:
    at = f"tools.{i}"
    if not served(tool):
        return None
    need(isinstance(tool, dict) and isinstance(tool.get("name"), str),
         f"{at} must be an object with a string name", at)
    need(bool(_TOOL_NAME.fullmatch(tool["name"])),
         f"{at}.name must be 1-64 letters, digits, _ or - (Anthropic's rule)", f"{at}.name")
    schema = tool.get("input_schema")
    need(isinstance(schema, dict), f"{at}.input_schema is required: a JSON schema object",
         f"{at}.input_schema")
    function: dict[str, Any] = {"name": tool["name"], "parameters": schema}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    need(isinstance(choice, dict) and choice.get("type") in ("auto", "any", "tool", "none"),
         "tool_choice must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}",
         "tool_choice")
    kind = choice["type"]
    if kind == "tool":
        need(isinstance(choice.get("name"), str), "tool_choice.name must be a string",
             "tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request as an OpenAI chat completion request (the same model,
    stream flag, limits and sampling). A field set to null is omitted. Raises
    InvalidRequest naming the field."""
    body = omit_nulls(body, FREE_FORM)
    max_tokens = body.get("max_tokens")
    need(isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1,
         "max_tokens is required: a positive integer", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty array", param="messages")
    need(len(messages) <= MAX_MESSAGES, f"messages has more than {MAX_MESSAGES} turns",
         "messages")
    chat: list[dict[str, Any]] = []
    if body.get("system") is not None:
        chat.append({"role": "system", "content": _text_of(body["system"], "system")})
    calls_seen: set[str] = set()
    for i, message in enumerate(messages):
        asked = set(calls_seen)
        chat += _message(i, message, i == len(messages) - 1, calls_seen)
        if i > 0 and calls_seen - asked and i + 1 < len(messages):
            _check_answered(i + 1, messages[i + 1], calls_seen - asked)
    out: dict[str, Any] = {"messages": chat, "max_tokens": max_tokens}
    model = body.get("model")
    if model is not None:
        need(isinstance(model, str), "model must be a string", "model")
        out["model"] = model
    stream_and_sampling(body, out, temperature_max=1)  # Anthropic's range
    top_k = integer(body, "top_k", 0, INT32_MAX)  # as every protocol bounds it
    if top_k is not None:
        out["top_k"] = top_k
    stops = body.get("stop_sequences")
    if stops is not None:
        need(isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)
             and len(stops) <= MAX_STOP_SEQUENCES,
             f"stop_sequences must be at most {MAX_STOP_SEQUENCES} non-empty strings",
             "stop_sequences")
        if stops:
            out["stop"] = stops
    tools(body, out, _tool, _tool_choice)
    metadata = body.get("metadata")
    need(metadata is None or isinstance(metadata, dict), "metadata must be an object",
         "metadata")
    _thinking(body.get("thinking"))
    return out


def _thinking(given: Any) -> None:
    """Checks ``thinking`` as Anthropic's reference shapes it (``{"type": "enabled",
    "budget_tokens": >= 1024}``, ``{"type": "disabled"}`` or ``{"type": "adaptive"}``);
    it is not passed on: a local model thinks as its template has it."""
    if given is None:
        return
    need(isinstance(given, dict) and given.get("type") in ("enabled", "disabled", "adaptive"),
         'thinking must be an object with type "enabled", "disabled" or "adaptive"',
         "thinking")
    budget = given.get("budget_tokens")
    if given["type"] == "enabled" or budget is not None:
        need(budget is not None, "thinking.budget_tokens is required: an integer from 1024",
             "thinking.budget_tokens")
        integer({"thinking.budget_tokens": budget}, "thinking.budget_tokens", 1024, INT32_MAX)


def _stop(finish: str | None, text: str, stops: list[str]) -> tuple[str, str | None]:
    """Anthropic's stop reason (and the stop sequence that ended it, if one did)."""
    if finish == "stop":
        # the engine drops a matched stop word from the text; which one ended it is the one
        # the answer does not contain past its end (a best guess when several could)
        for seq in stops:
            if seq not in text:
                return "stop_sequence", seq
        return "end_turn", None
    return _STOP_REASONS.get(finish or "stop", "end_turn"), None


def _tool_id(chat_id: Any) -> str:
    """A tool call's id as Anthropic spells them (``toolu_``)."""
    if isinstance(chat_id, str) and chat_id:
        return chat_id if chat_id.startswith("toolu_") else "toolu_" + chat_id.removeprefix(
            "call_")
    return f"toolu_{uuid.uuid4().hex[:24]}"


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    """A usage object as Anthropic's "Messages" reference gives it: ``input_tokens`` is the
    whole prompt (what count_tokens says), so the cache fields are 0: a local engine's reuse
    of its KV cache bills nobody, and input + cache creation + cache read stays the prompt."""
    return {"input_tokens": input_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0, "output_tokens": output_tokens}


def _usage(chat: dict[str, Any]) -> dict[str, int]:
    given = chat.get("usage") or {}
    return usage(int(given.get("prompt_tokens") or 0), int(given.get("completion_tokens") or 0))


def _tool_input(arguments: Any) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except (TypeError, ValueError):
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"value": value}


def message_from_chat(chat: dict[str, Any], model: str,
                      stops: list[str] | None = None) -> dict[str, Any]:
    """A ``chat.completion`` answer as an Anthropic ``message``."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"],
                       "signature": ""})
    text = message.get("content") or ""
    if text:
        blocks.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        blocks.append({"type": "tool_use", "id": _tool_id(call.get("id")),
                       "name": fn.get("name", ""), "input": _tool_input(fn.get("arguments"))})
    reason, sequence = _stop(choice.get("finish_reason"), text, stops or [])
    if message.get("tool_calls"):
        reason, sequence = "tool_use", None
    return {"id": message_id(), "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
            "usage": _usage(chat)}


Event = tuple[str, dict[str, Any]]


class MessageStream:
    """Chat completion chunks in, Anthropic stream events out, block by block: text, then
    each tool call (its arguments as ``input_json_delta``). Feed every chunk's JSON object to
    :meth:`feed`; :meth:`end` gives the closing events."""

    def __init__(self, model: str, stops: list[str] | None = None) -> None:
        self.model = model
        self.stops = stops or []
        self._started = False
        self._block: tuple[str, int] | None = None  # (kind, tool call index) now open
        self._index = -1
        self._text: list[str] = []
        self._finish: str | None = None
        self._usage = usage(0, 0)
        self._tool_ids: dict[int, str] = {}

    def prompt(self, tokens: int) -> None:
        """The prompt's token count, known before the answer: ``message_start`` says it, as
        Anthropic's does (the engine's own count, at the end, has the last word)."""
        self._usage = usage(tokens, self._usage["output_tokens"])

    @property
    def started(self) -> bool:
        """Whether ``message_start`` was sent."""
        return self._started

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        return [("message_start", {"type": "message_start", "message": {
            "id": message_id(), "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": dict(self._usage)}})]

    def _open(self, kind: str, tool: int, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self._index += 1
        self._block = (kind, tool)
        events.append(("content_block_start", {"type": "content_block_start",
                                               "index": self._index, "content_block": block}))
        return events

    def _close(self) -> list[Event]:
        if self._block is None:
            return []
        self._block = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        events = self._start()
        if isinstance(chunk.get("usage"), dict):
            self._usage = _usage(chunk)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                if self._block != ("text", -1):
                    events += self._open("text", -1, {"type": "text", "text": ""})
                self._text.append(text)
                events.append(("content_block_delta", {
                    "type": "content_block_delta", "index": self._index,
                    "delta": {"type": "text_delta", "text": text}}))
            for call in delta.get("tool_calls") or []:
                events += self._tool_delta(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return events

    def _tool_delta(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        i = int(call.get("index", 0))
        fn = call.get("function") or {}
        if self._block != ("tool", i):
            tool_id = self._tool_ids.get(i) or _tool_id(call.get("id"))
            self._tool_ids[i] = tool_id
            events += self._open("tool", i, {"type": "tool_use", "id": tool_id,
                                             "name": fn.get("name", ""), "input": {}})
        if fn.get("arguments"):
            events.append(("content_block_delta", {
                "type": "content_block_delta", "index": self._index,
                "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}}))
        return events

    def end(self) -> list[Event]:
        events = self._start() + self._close()
        reason, sequence = _stop(self._finish, "".join(self._text), self.stops)
        if self._tool_ids:
            reason, sequence = "tool_use", None
        events.append(("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            # the engine's own counts (its last chunk): the SDKs take them over
            # message_start's
            "usage": dict(self._usage)}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events


def sse(event: Event) -> bytes:
    """One event in the event-stream format Anthropic's SDKs read."""
    name, data = event
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
