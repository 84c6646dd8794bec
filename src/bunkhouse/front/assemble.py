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

_TOP_FIELDS = ("id", "created", "model", "system_fingerprint")


class StreamError(Exception):
    """The engine's stream carried an error instead of an answer."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(str(body))
        self.body = body


_LINE_END = re.compile(rb"\r\n|\r|\n")


def sse_lines(data: bytes) -> list[str]:
    """An event stream's lines, split only where the SSE format ends a line (CRLF, LF, CR).

    Not ``str.splitlines``: it also splits at U+2028, U+2029, U+0085 and other characters
    that JSON leaves unescaped, so a generated text holding one would break its event apart.
    """
    return [line.decode("utf-8", errors="replace") for line in _LINE_END.split(data)]


def sse_events(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The JSON payloads of ``data:`` lines, up to ``[DONE]``; errors raise StreamError."""
    events: list[dict[str, Any]] = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            break
        event = json.loads(payload)
        if not isinstance(event, dict):
            continue  # nothing of an answer in it
        if "error" in event:
            raise StreamError(event)
        events.append(event)
    return events


def _top(events: list[dict[str, Any]], obj: str) -> dict[str, Any]:
    out: dict[str, Any] = {"object": obj}
    for event in events:
        for key in _TOP_FIELDS:
            if key in event and key not in out:
                out[key] = event[key]
        for key in ("usage", "timings"):
            if key in event:
                out[key] = event[key]
    return out


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


def assemble_chat(events: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``chat.completion`` from ``chat.completion.chunk`` events."""
    choices: dict[int, dict[str, Any]] = {}
    for event in events:
        for ch in event.get("choices") or []:
            c = choices.setdefault(ch.get("index", 0), {"content": [], "reasoning": [],
                                                        "tools": {}, "logprobs": [],
                                                        "finish_reason": None})
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
    out = _top(events, "chat.completion")
    out["choices"] = [_chat_choice(i, c) for i, c in sorted(choices.items())]
    return out


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


def assemble_completion(events: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``text_completion`` from streamed completion events."""
    texts: dict[int, list[str]] = {}
    logprobs: dict[int, list[Any]] = {}
    finish: dict[int, str | None] = {}
    for event in events:
        for ch in event.get("choices") or []:
            i = ch.get("index", 0)
            texts.setdefault(i, []).append(ch.get("text") or "")
            if (ch.get("logprobs") or {}).get("content"):
                logprobs.setdefault(i, []).extend(ch["logprobs"]["content"])
            if ch.get("finish_reason"):
                finish[i] = ch["finish_reason"]
    out = _top(events, "text_completion")
    out["choices"] = [{"index": i, "text": "".join(t),
                       "logprobs": {"content": logprobs[i]} if i in logprobs else None,
                       "finish_reason": finish.get(i)} for i, t in sorted(texts.items())]
    return out
