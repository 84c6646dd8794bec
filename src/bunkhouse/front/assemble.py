"""Plain (non-streaming) answers assembled from the engine's stream.

The front asks the engine for a stream even when the client wants one JSON answer: llama.cpp
notices that a client went away only while it writes to it, so a plain request whose client
disconnected kept its slot busy to the end while any other slot was generating. Streaming
upstream makes every disconnect free the slot at the next token; the chunks are folded here
into the answer the client asked for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from bunkhouse.api.usage import Tally, completion_id

_TOP_FIELDS = ("id", "created", "model", "system_fingerprint")
_FOLDED = frozenset({*_TOP_FIELDS, "object", "choices", "usage"})


class StreamError(Exception):
    """The engine's stream carried an error instead of an answer."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(str(body))
        self.body = body


_LINE_END = re.compile(rb"\r\n|\r|\n")


class LineSplitter:
    """An event stream's lines as its bytes arrive, split only where the SSE format ends a
    line (CRLF, LF, CR).

    Not ``str.splitlines``, nor httpx's ``aiter_lines`` (which behaves like it): they also
    split at U+2028, U+2029, U+0085 and other characters that JSON leaves unescaped, so a
    generated text holding one would break its event apart."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, chunk: bytes) -> list[str]:
        """The lines ``chunk`` completes; a trailing CR waits for a possible LF."""
        return [p.decode("utf-8", errors="replace") for p in self.feed_raw(chunk)]

    def feed_raw(self, chunk: bytes) -> list[bytes]:
        """As :meth:`feed`, the lines' bytes undecoded."""
        data = self._rest + chunk if self._rest else chunk
        if b"\r" not in data:  # the usual: lines end in LF alone
            parts = data.split(b"\n")
            self._rest = parts.pop()
            return parts
        parts = _LINE_END.split(data)
        self._rest = parts.pop()
        if self._rest == b"" and chunk.endswith(b"\r"):  # CR now, maybe LF next
            last = parts.pop()
            self._rest = last + b"\r"
        return parts

    def close(self) -> list[str]:
        return [line.decode("utf-8", errors="replace") for line in self.close_raw()]

    def close_raw(self) -> list[bytes]:
        """The last line, if the stream did not end it (its bytes)."""
        rest, self._rest = self._rest, b""
        return _LINE_END.split(rest) if rest else []


def sse_lines(data: bytes) -> list[str]:
    """All of an event stream's lines (see :class:`LineSplitter`)."""
    lines = LineSplitter()
    return lines.feed(data) + lines.close()


DONE = "[DONE]"


def data_event(line: str | bytes) -> dict[str, Any] | str | None:
    """The JSON object of a ``data:`` line (text, or its bytes undecoded: bytes that are not
    UTF-8 read as replaced); :data:`DONE` at the end of the stream; None for anything else.
    An error event raises StreamError; unreadable JSON raises ValueError."""
    if isinstance(line, bytes):
        if not line.startswith(b"data: "):
            return None
        if line == b"data: [DONE]":
            return DONE
        try:
            event = json.loads(line[6:])
        except UnicodeDecodeError:
            event = json.loads(line[6:].decode("utf-8", errors="replace"))
    else:
        if not line.startswith("data: "):
            return None
        payload = line[len("data: "):]
        if payload == DONE:
            return DONE
        event = json.loads(payload)
    if not isinstance(event, dict):
        return None  # nothing of an answer in it
    if "error" in event:
        raise StreamError(event)
    return event


def sse_events(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The JSON payloads of ``data:`` lines, up to ``[DONE]``; errors raise StreamError."""
    events: list[dict[str, Any]] = []
    for line in lines:
        event = data_event(line)
        if event == DONE:
            break
        if isinstance(event, dict):
            events.append(event)
    return events


class Assembly:
    """Folds a stream's events, one at a time, into one plain answer: what it holds grows
    with the answer, never with the stream's bytes. ``n``: the request's choices per prompt;
    the usage of every choice and prompt is added up (api/usage.py)."""

    object = ""

    def __init__(self, n: int = 1) -> None:
        self._top: dict[str, Any] = {"object": self.object}
        self._usage = Tally(n)

    def add(self, event: dict[str, Any]) -> None:
        for key in _TOP_FIELDS:
            if key in event and key not in self._top:
                self._top[key] = event[key]
        for key, value in event.items():  # an engine's own (its figures): the last
            if key not in _FOLDED:
                self._top[key] = value
        if "usage" in event:
            self._usage.add(event["usage"])
        for ch in event.get("choices") or []:
            if isinstance(ch, dict):
                self._choice(ch)

    def _choice(self, ch: dict[str, Any]) -> None:
        raise NotImplementedError

    def result(self) -> dict[str, Any]:
        raise NotImplementedError

    def _whole(self) -> dict[str, Any]:
        """The answer's fields but its choices: its usage (if any was reported) added up."""
        usage = self._usage.total()
        return self._top if usage is None else {**self._top, "usage": usage}


def _merge_tool_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    call = calls.setdefault(delta.get("index", len(calls)),
                            {"type": "function", "function": {"name": "", "arguments": ""}})
    for key in ("id", "type"):
        if delta.get(key):
            call[key] = delta[key]
    fn = delta.get("function") or {}
    for key in ("name", "arguments"):
        if fn.get(key):
            call["function"][key] += fn[key]


class ChatAssembly(Assembly):
    """One ``chat.completion`` from ``chat.completion.chunk`` events."""

    object = "chat.completion"

    def __init__(self, n: int = 1) -> None:
        super().__init__(n)
        self._choices: dict[int, dict[str, Any]] = {}

    def _choice(self, ch: dict[str, Any]) -> None:
        c = self._choices.setdefault(ch.get("index", 0), {
            "content": [], "reasoning": [], "tools": {}, "logprobs": [], "finish_reason": None})
        delta = ch.get("delta") or {}
        if delta.get("content"):
            c["content"].append(delta["content"])
        if delta.get("reasoning_content"):
            c["reasoning"].append(delta["reasoning_content"])
        for call in delta.get("tool_calls") or []:
            _merge_tool_call(c["tools"], call)
        if (ch.get("logprobs") or {}).get("content"):
            c["logprobs"].extend(ch["logprobs"]["content"])
        if ch.get("finish_reason"):
            c["finish_reason"] = ch["finish_reason"]

    def result(self) -> dict[str, Any]:
        return {**self._whole(),
                "choices": [_chat_choice(i, c) for i, c in sorted(self._choices.items())]}


def _chat_choice(index: int, c: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant",
                               "content": "".join(c["content"]) if c["content"] else None}
    if c["reasoning"]:
        message["reasoning_content"] = "".join(c["reasoning"])
    if c["tools"]:
        message["tool_calls"] = [c["tools"][k] for k in sorted(c["tools"])]
    choice: dict[str, Any] = {"index": index, "message": message,
                              "finish_reason": c["finish_reason"]}
    if c["logprobs"]:
        choice["logprobs"] = {"content": c["logprobs"]}
    return choice


class CompletionAssembly(Assembly):
    """One ``text_completion`` from streamed completion events (its id ``cmpl-``)."""

    object = "text_completion"

    def __init__(self, n: int = 1) -> None:
        super().__init__(n)
        self._texts: dict[int, list[str]] = {}
        self._logprobs: dict[int, list[Any]] = {}
        self._finish: dict[int, str | None] = {}

    def _choice(self, ch: dict[str, Any]) -> None:
        i = ch.get("index", 0)
        self._texts.setdefault(i, []).append(ch.get("text") or "")
        if (ch.get("logprobs") or {}).get("content"):
            self._logprobs.setdefault(i, []).extend(ch["logprobs"]["content"])
        if ch.get("finish_reason"):
            self._finish[i] = ch["finish_reason"]

    def result(self) -> dict[str, Any]:
        lp = self._logprobs
        top = self._whole()
        if "id" in top:
            top = {**top, "id": completion_id(top["id"])}
        return {**top, "choices": [
            {"index": i, "text": "".join(t),
             "logprobs": {"content": lp[i]} if i in lp else None,
             "finish_reason": self._finish.get(i)} for i, t in sorted(self._texts.items())]}


def _fold(assembly: Assembly, events: list[dict[str, Any]]) -> dict[str, Any]:
    for event in events:
        assembly.add(event)
    return assembly.result()


def assemble_chat(events: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``chat.completion`` from all of a stream's events (see :class:`ChatAssembly`)."""
    return _fold(ChatAssembly(), events)


def assemble_completion(events: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``text_completion`` from all of a stream's events."""
    return _fold(CompletionAssembly(), events)
