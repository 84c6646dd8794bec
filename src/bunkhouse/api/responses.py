"""OpenAI's Responses API in terms of chat completions: pure functions, no I/O.

The front serves ``POST /v1/responses`` by translating the request, with the conversation of
its ``previous_response_id`` (kept by front/responses_store.py), into a chat completion
request (:func:`to_chat`), sending it down the one generation path every protocol shares, and
translating the answer back: a whole one with :func:`response_from_chat`, a stream chunk by
chunk with :class:`ResponseStream`. The conversation a response continues is kept as chat
messages (:func:`conversation`), so that the next turn is one lookup, whatever became of the
worker that answered.

Source: OpenAI's API reference, "Responses" (create, retrieve, delete, input items) and
"Streaming events" (``response.created``, ``response.in_progress``, per output item
``response.output_item.added``, its content part or arguments deltas and their ``.done``,
``response.output_item.done``, then ``response.completed``; every event carries a
``sequence_number`` from 0).

Errors: :func:`to_chat` raises :class:`bunkhouse.errors.InvalidRequest` naming the field.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from bunkhouse.api.fields import (
    Paths,
    Renames,
    function_tool,
    integer,
    need,
    shown,
    stream_and_sampling,
    tools,
)
from bunkhouse.api.schemas import INT32_MAX, INT64
from bunkhouse.errors import InvalidRequest

MAX_INPUT_ITEMS = 10_000  # items in one request's input
MAX_CONTENT_PARTS = 10_000  # parts in one message item
MAX_METADATA_KEYS = 16  # OpenAI's limit: 16 pairs, keys 64 and values 512 characters

_ROLES = ("user", "assistant", "system", "developer")

FREE_FORM: Paths = (("tools", "*", "parameters"), ("text", "format", "schema"), ("metadata",))
"""Where a request's null is a value, not an omitted field (api/fields.omit_nulls)."""


CHAT_FIELDS: Renames = (
    (r"^tools\.(\d+)\.function\.parameters", r"tools.\1.parameters"),
    (r"^response_format.*", "text.format"),
    (r"^max_tokens$", "max_output_tokens"),
    (r"^messages(\..*)?$", "input"),  # chat's message indices are not the input's
)
"""The chat completion fields a refusal may name, as this API names them (api/fields.py)."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _content_text(content: Any, where: str) -> str:
    """A message item's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    need(isinstance(content, list), f"{where} must be a string or an array of content parts",
         where)
    need(len(content) <= MAX_CONTENT_PARTS,
         f"{where} has more than {MAX_CONTENT_PARTS} parts", where)
    parts = []
    for i, part in enumerate(content):
        at = f"{where}.{i}"
        need(isinstance(part, dict), f"{at} must be an object", at)
        kind = part.get("type")
        need(kind in ("input_text", "output_text", "text", "refusal"),
             f"{at}.type {shown(kind)} is not supported here (input_text, output_text)",
             f"{at}.type")
        text = part.get("refusal" if kind == "refusal" else "text")
        need(isinstance(text, str), f"{at}.text must be a string", f"{at}.text")
        parts.append(text)
    return "".join(parts)


def input_items(value: Any) -> list[dict[str, Any]]:
    """A request's ``input`` as a list of items, each checked and given an id (as the
    input-items listing shows them). Raises InvalidRequest naming the field."""
    if isinstance(value, str):
        return [{"type": "message", "id": new_id("msg"), "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": value}]}]
    need(isinstance(value, list) and bool(value),
         "input must be a string or a non-empty array of items", "input")
    need(len(value) <= MAX_INPUT_ITEMS, f"input has more than {MAX_INPUT_ITEMS} items",
         "input")
    items = []
    for i, item in enumerate(value):
        at = f"input.{i}"
        need(isinstance(item, dict), f"{at} must be an object", at)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            need(role in _ROLES, f"{at}.role must be one of {', '.join(_ROLES)}",
                 f"{at}.role")
            text = _content_text(item.get("content"), f"{at}.content")
            part = "output_text" if role == "assistant" else "input_text"
            items.append({"type": "message", "id": item.get("id") or new_id("msg"),
                          "role": role, "status": "completed",
                          "content": [{"type": part, "text": text}]})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                need(isinstance(item.get(name), str), f"{at}.{name} must be a string",
                     f"{at}.{name}")
            need(_json_object(item["arguments"]),
                 f"{at}.arguments must be a JSON object, as a string", f"{at}.arguments")
            items.append({"type": "function_call", "id": item.get("id") or new_id("fc"),
                          "call_id": item["call_id"], "name": item["name"],
                          "arguments": item["arguments"], "status": "completed"})
        elif kind == "function_call_output":
            need(isinstance(item.get("call_id"), str), f"{at}.call_id must be a string",
                 f"{at}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output,
                                                                       f"{at}.output")
            items.append({"type": "function_call_output", "id": item.get("id") or new_id("fco"),
                          "call_id": item["call_id"], "output": text, "status": "completed"})
        elif kind == "reasoning":
            continue  # earlier reasoning is not sent back to the model
        else:
            raise InvalidRequest(f"{at}.type {shown(kind)} is not supported here (message, "
                                 "function_call, function_call_output)", param=f"{at}.type")
    return items


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def check_outputs(items: list[dict[str, Any]], history: list[dict[str, Any]]) -> None:
    """InvalidRequest for a ``function_call_output`` whose ``call_id`` no function call
    before it made (in this input or the conversation it continues), as OpenAI refuses it."""
    made = {call.get("id") for m in history for call in m.get("tool_calls") or []}
    for i, item in enumerate(items):
        if item["type"] == "function_call":
            made.add(item["call_id"])
        elif item["type"] == "function_call_output":
            need(item["call_id"] in made,
                 f"input.{i}.call_id: no function call {shown(item['call_id'])} before this "
                 "output, here or in the previous response", f"input.{i}.call_id")


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checked input or output items (:func:`input_items`) as chat messages: consecutive
    function calls become one assistant message's tool calls."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "".join(p.get("text", "") for p in item["content"])
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant" and last.get("content"):
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": item["output"]})
    return messages


def _tool(i: int, tool: Any) -> dict[str, Any] | None:
    """A function tool as a chat one; None for a hosted or built-in tool (``web_search``,
    ``custom``, ...): skipped (api/fields.py)."""
    at = f"tools.{i}"
    need(isinstance(tool, dict), f"{at} must be a tool object", at)
    if not function_tool(tool):
        return None
    need(isinstance(tool.get("name"), str) and bool(tool["name"]),
         f"{at}.name must be a non-empty string", f"{at}.name")
    params = tool.get("parameters")
    need(params is None or isinstance(params, dict), f"{at}.parameters must be an object",
         f"{at}.parameters")
    function: dict[str, Any] = {"name": tool["name"],
                                "parameters": params or {"type": "object", "properties": {}}}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    need(isinstance(choice, dict) and choice.get("type") == "function"
         and isinstance(choice.get("name"), str),
         "tool_choice must be \"auto\", \"none\", \"required\" or "
         "{\"type\": \"function\", \"name\": ...}", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _text_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as a chat ``response_format`` (None for plain text)."""
    need(isinstance(text, dict), "text must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    need(isinstance(fmt, dict) and fmt.get("type") in ("text", "json_object", "json_schema"),
         "text.format.type must be \"text\", \"json_object\" or \"json_schema\"",
         "text.format.type")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    need(isinstance(fmt.get("schema"), dict), "text.format.schema must be an object",
         "text.format.schema")
    return {"type": "json_schema", "json_schema": {
        "name": fmt.get("name") if isinstance(fmt.get("name"), str) else "output",
        "schema": fmt["schema"]}}


def check_metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    need(isinstance(value, dict) and len(value) <= MAX_METADATA_KEYS
         and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                  for k, v in value.items()),
         f"metadata must be an object of at most {MAX_METADATA_KEYS} string pairs (keys up "
         "to 64, values up to 512 characters)", "metadata")
    return dict(value)


def check_request(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's fields checked (everything :func:`to_chat` does not read from the
    history); returns its input items. Raises InvalidRequest naming the field."""
    need("input" in body, "input is required: a string or an array of items", "input")
    items = input_items(body["input"])
    for name, kind in (("model", str), ("instructions", str), ("previous_response_id", str)):
        need(body.get(name) is None or isinstance(body[name], kind),
             f"{name} must be a string", name)
    need(body.get("previous_response_id") != "",
         "previous_response_id must be a response id, not empty", "previous_response_id")
    for name in ("stream", "store", "parallel_tool_calls", "background"):
        need(body.get(name) is None or isinstance(body[name], bool),
             f"{name} must be a boolean", name)
    need(body.get("background") is not True,
         "background responses are not supported: leave background unset", "background")
    need(body.get("conversation") is None,
         "conversation objects are not supported: chain turns with previous_response_id",
         "conversation")
    check_metadata(body.get("metadata"))
    integer(body, "top_logprobs", 0, 20)  # bounded as on chat completions, not returned
    integer(body, "max_tool_calls", 0, INT32_MAX)  # no built-in tools run here
    return items


def to_chat(body: dict[str, Any], items: list[dict[str, Any]],
            history: list[dict[str, Any]]) -> dict[str, Any]:
    """A Responses request (checked by :func:`check_request`, ``items`` its input) as a chat
    completion request, after the chat messages of the conversation it continues
    (``history``). Raises InvalidRequest naming the field."""
    check_outputs(items, history)
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):  # not carried over from a previous response (as OpenAI)
        messages.append({"role": "system", "content": body["instructions"]})
    messages += history
    messages += chat_messages(items)
    out: dict[str, Any] = {"messages": messages}
    if body.get("model") is not None:
        out["model"] = body["model"]
    limit = body.get("max_output_tokens")
    if limit is not None:
        need(isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1,
             "max_output_tokens must be a positive integer", "max_output_tokens")
        out["max_tokens"] = limit
    stream_and_sampling(body, out, temperature_max=2)  # OpenAI's range
    seed = integer(body, "seed", *INT64)  # as chat completions take it
    if seed is not None:
        out["seed"] = seed
    tools(body, out, _tool, _tool_choice)
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("text") is not None:
        fmt = _text_format(body["text"])
        if fmt is not None:
            out["response_format"] = fmt
    return out


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    usage = chat.get("usage") or {}
    given = int(usage.get("prompt_tokens") or 0)
    made = int(usage.get("completion_tokens") or 0)
    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    return {"input_tokens": given, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": made, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": given + made}


def _message_item(text: str, status: str = "completed",
                  item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def _reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _call_item(call: dict[str, Any], item_id: str | None = None) -> dict[str, Any]:
    fn = call.get("function") or {}
    return {"type": "function_call", "id": item_id or new_id("fc"),
            "call_id": call.get("id") or new_id("call"), "name": fn.get("name", ""),
            "arguments": fn.get("arguments") or "", "status": "completed"}


class Echo:
    """What a response object repeats of its request (OpenAI sends these back)."""

    def __init__(self, body: dict[str, Any], model: str) -> None:
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.fields: dict[str, Any] = {
            "model": model,
            "instructions": body.get("instructions"),
            "previous_response_id": body.get("previous_response_id"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "text": body.get("text") or {"format": {"type": "text"}},
            "store": body.get("store", True),
            "metadata": body.get("metadata") or {},
            "reasoning": {"effort": None, "summary": None},
            "truncation": "disabled",
            "background": False,
        }

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None, finish: str | None = None,
                 error: dict[str, Any] | None = None,
                 reason: str | None = None) -> dict[str, Any]:
        """The response object; ``reason``: why it is incomplete, when not the engine's
        ``finish`` (a client that left: :data:`CLIENT_LEFT`)."""
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": reason or ("max_output_tokens" if finish == "length"
                                               else "content_filter")}
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "error": error, "incomplete_details": incomplete,
                "output": output, "usage": usage, **self.fields}


CLIENT_LEFT = "client_disconnected"
"""``incomplete_details.reason`` of a stored response whose client left its stream: the
generation stopped there (as OpenAI's does when a stream that is not in the background is
closed), and what was generated is kept."""


def _status(finish: str | None) -> str:
    return "incomplete" if finish in ("length", "content_filter") else "completed"


def response_from_chat(chat: dict[str, Any], echo: Echo) -> dict[str, Any]:
    """A ``chat.completion`` answer as a ``response`` object."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    finish = choice.get("finish_reason")
    status = _status(finish)
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content") or not message.get("tool_calls"):
        output.append(_message_item(message.get("content") or "",
                                    "incomplete" if status == "incomplete" else "completed"))
    output += [_call_item(call) for call in message.get("tool_calls") or []]
    return echo.response(status, output, _usage(chat), finish)


def conversation(history: list[dict[str, Any]], items: list[dict[str, Any]],
                 response: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages a later turn continues from: ``history``, this turn's input and its
    output (instructions excluded: they are not carried over)."""
    output = [item for item in response["output"] if item["type"] != "reasoning"]
    return [*history, *chat_messages(items), *chat_messages(output)]


Event = dict[str, Any]


class ResponseStream:
    """Chat completion chunks in, Responses stream events out. Feed every chunk's JSON
    object to :meth:`feed`; :meth:`end` gives the closing events and calls ``on_done`` with
    the final response object first (where the front stores it)."""

    def __init__(self, echo: Echo,
                 on_done: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.echo = echo
        self.on_done = on_done
        self._seq = 0
        self._started = False
        self._output: list[dict[str, Any]] = []
        self._open: tuple[str, int] | None = None  # (kind, tool index) of the item now open
        self._parts: list[str] = []
        self._calls: dict[int, int] = {}  # tool call index -> output index
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        begun = self.echo.response("in_progress", [], None)
        return [self._event("response.created", response=begun),
                self._event("response.in_progress", response=begun)]

    def _add(self, item: dict[str, Any], kind: str, tool: int = -1) -> list[Event]:
        events = self._close()
        self._output.append(item)
        self._open = (kind, tool)
        self._parts = []
        index = len(self._output) - 1
        added = {**item, "status": "in_progress"}
        if kind in ("message", "reasoning"):
            added["content"] = []  # its part comes with content_part.added (as OpenAI)
        events.append(self._event("response.output_item.added", output_index=index,
                                  item=added))
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=index, content_index=0, part=part))
        return events

    def _close(self, cut: bool = False) -> list[Event]:
        """The open item's closing events. ``cut``: the answer broke off in it (an error,
        a client that left): it is incomplete, whatever its kind."""
        if self._open is None:
            return []
        kind, _ = self._open
        self._open = None
        index = len(self._output) - 1
        item = self._output[index]
        text = "".join(self._parts)
        events: list[Event] = []
        # done, as every item is once the next one opens or the answer ends: an answer cut
        # at max_output_tokens leaves its message incomplete (the finish is known by then)
        short = kind == "message" and _status(self._finish) == "incomplete"
        item["status"] = "incomplete" if cut or short else "completed"
        if kind == "message":
            item["content"][0]["text"] = text
            events.append(self._event("response.output_text.done", item_id=item["id"],
                                      output_index=index, content_index=0, text=text,
                                      logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item["id"],
                                      output_index=index, content_index=0,
                                      part=item["content"][0]))
        elif kind == "reasoning":
            item["content"][0]["text"] = text
            events.append(self._event("response.reasoning_text.done", item_id=item["id"],
                                      output_index=index, content_index=0, text=text))
        else:
            item["arguments"] = text
            events.append(self._event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=index,
                                      arguments=text))
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=item))
        return events

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        events = self._start()
        if isinstance(chunk.get("usage"), dict):
            self._usage = _usage(chunk)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self._open != ("reasoning", -1):
                    events += self._add(_reasoning_item(""), "reasoning")
                events += self._delta("response.reasoning_text.delta",
                                      delta["reasoning_content"], content_index=0)
            if delta.get("content"):
                if self._open != ("message", -1):
                    events += self._add(_message_item("", "in_progress"), "message")
                events += self._delta("response.output_text.delta", delta["content"],
                                      content_index=0, logprobs=[])
            for call in delta.get("tool_calls") or []:
                events += self._tool_delta(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return events

    def _delta(self, kind: str, text: str, **fields: Any) -> list[Event]:
        self._parts.append(text)
        index = len(self._output) - 1
        return [self._event(kind, item_id=self._output[index]["id"], output_index=index,
                            delta=text, **fields)]

    def _tool_delta(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        i = int(call.get("index", 0))
        fn = call.get("function") or {}
        if self._open != ("call", i):
            item = _call_item({"id": call.get("id"), "function": {"name": fn.get("name", "")}})
            events += self._add(item, "call", i)
        if fn.get("arguments"):
            events += self._delta("response.function_call_arguments.delta", fn["arguments"])
        return events

    def end(self) -> list[Event]:
        events = self._start() + self._close()
        status = _status(self._finish)
        if not self._output:
            self._output.append(_message_item("", "incomplete" if status == "incomplete"
                                              else "completed"))
        final = self.echo.response(status, self._output, self._usage, self._finish)
        if self.on_done is not None:
            self.on_done(final)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self._event(kind, response=final))
        return events

    def failed(self, message: str, code: str | None = None) -> list[Event]:
        """The stream ending in an error: the item it broke off in closed as incomplete
        (its done events), then ``response.failed`` holding what was streamed before it;
        ``on_done`` gets that failed response first (where the front stores it)."""
        events = self._start() + self._close(cut=True)
        final = self.echo.response("failed", self._output, self._usage,
                                   error={"code": code or "server_error", "message": message})
        if self.on_done is not None:
            self.on_done(final)
        events.append(self._event("response.failed", response=final))
        return events

    def cut(self) -> None:
        """The client left the stream (no event can reach it): ``on_done`` gets the response
        as far as it went, ``incomplete`` (reason :data:`CLIENT_LEFT`), its open item
        incomplete; nothing if ``response.created`` never went out (no one knows its id)."""
        if not self._started:
            return
        self._close(cut=True)
        final = self.echo.response("incomplete", self._output, self._usage,
                                   reason=CLIENT_LEFT)
        if self.on_done is not None:
            self.on_done(final)


def sse(event: Event) -> bytes:
    """One event in the event-stream format OpenAI's SDKs read."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def input_items_page(items: list[dict[str, Any]], *, limit: int, order: str,
                     after: str | None) -> dict[str, Any]:
    """A page of a response's input items, as ``GET /v1/responses/{id}/input_items`` lists
    them (newest first unless ``order`` is "asc")."""
    ordered = list(reversed(items)) if order == "desc" else list(items)
    if after is not None:
        ids = [item.get("id") for item in ordered]
        need(after in ids, f"after: no input item {shown(after)} in this response", "after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(ordered) > limit}
