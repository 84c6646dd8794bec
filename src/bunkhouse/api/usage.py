"""OpenAI's usage rule for chat completions and completions, whatever the engine sends.
Pure functions and small folds; no I/O.

OpenAI's API reports one usage per request: ``completion_tokens`` summed over every choice
(``n`` of them per prompt), ``prompt_tokens`` summed over the prompts (a list of prompts on
``/v1/completions``), each prompt counted once however many choices it has. In a stream,
usage comes only when ``stream_options.include_usage`` asks for it, once, in a last chunk
whose ``choices`` is empty; no other chunk has it.

An engine may instead report one usage per choice (llama.cpp runs each choice and each
prompt as a task of its own, and its answer in one piece counts only the first), put it on
the chunk that finishes a choice, send it unasked, or open a stream with an event that is
not an object. :class:`Tally` adds an answer's usages up; :class:`StreamUsage` rewrites a
stream's lines to the rule, touching only the lines that carry usage.

Completion ids start ``cmpl-`` (chat's ``chatcmpl-``): :func:`completion_id` mends one an
engine gave the chat prefix.
"""

from __future__ import annotations

import json
import re
from typing import Any

COMPLETIONS = "/v1/completions"
_CHAT_PREFIX, _COMPLETION_PREFIX = "chatcmpl-", "cmpl-"
_CHAT_ID = re.compile(rb'("id"\s*:\s*")chatcmpl-')  # a key: a quote in a text is escaped


def completion_id(value: Any) -> Any:
    """A completion's ``id`` with OpenAI's ``cmpl-`` prefix where an engine wrote
    ``chatcmpl-``; anything else unchanged."""
    if isinstance(value, str) and value.startswith(_CHAT_PREFIX):
        return _COMPLETION_PREFIX + value[len(_CHAT_PREFIX):]
    return value


def choices_per_prompt(data: dict[str, Any]) -> int:
    """The request's ``n`` (1 when absent): how many choices each prompt has."""
    n = data.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def _count(usage: dict[str, Any], key: str) -> int:
    value = usage.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _cached(usage: dict[str, Any]) -> int:
    details = usage.get("prompt_tokens_details")
    return _count(details, "cached_tokens") if isinstance(details, dict) else 0


class Tally:
    """The usages an engine reported for one request's choices, added up as OpenAI reports
    them. ``n``: choices per prompt; each choice's usage counts its prompt, so the prompt
    counts (whole and cached) are divided by ``n``."""

    def __init__(self, n: int = 1) -> None:
        self._n = max(1, n)
        self._prompt = self._completion = self._cached = self._seen = 0
        self._details = False  # whether the engine counted cached tokens

    def add(self, usage: Any) -> None:
        """One choice's usage (``prompt_tokens``, ``completion_tokens``,
        ``prompt_tokens_details.cached_tokens``); anything not an object is ignored."""
        if not isinstance(usage, dict):
            return
        self._seen += 1
        self._prompt += _count(usage, "prompt_tokens")
        self._completion += _count(usage, "completion_tokens")
        self._cached += _cached(usage)
        self._details = self._details or isinstance(usage.get("prompt_tokens_details"), dict)

    def total(self) -> dict[str, Any] | None:
        """The request's usage object (``prompt_tokens_details`` where the engine gave
        it); None if no usage was reported."""
        if not self._seen:
            return None
        prompt = self._prompt // self._n
        total: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": self._completion,
                                 "total_tokens": prompt + self._completion}
        if self._details:
            total["prompt_tokens_details"] = {"cached_tokens": min(prompt,
                                                                   self._cached // self._n)}
        return total


class StreamUsage:
    """One OpenAI stream's events brought to the usage rule (module docstring): usage taken
    off every event into a :class:`Tally`, and sent once, if asked, in a chunk with no
    choices just before ``[DONE]``. A completion's id gets its ``cmpl-`` prefix.

    ``line`` takes one SSE line (bytes, no line end) and returns what to send instead (None:
    nothing); ``event`` does the same for a parsed event, and ``closing`` gives the usage
    chunk (or None) for a stream ended by its shaper."""

    def __init__(self, route: str, data: dict[str, Any]) -> None:
        """``data``: the request as sent to the engine (``n``, ``stream_options``)."""
        options = data.get("stream_options")
        self._asked = isinstance(options, dict) and options.get("include_usage") is True
        self._completion = route == COMPLETIONS
        self._tally = Tally(choices_per_prompt(data))
        self._top: dict[str, Any] = {}

    @staticmethod
    def needed(route: str, data: dict[str, Any]) -> bool:
        """Whether the engine's stream of ``route`` must be rewritten: every completions
        stream (its ids, its usage), a chat stream of several choices (one usage each)."""
        return route == COMPLETIONS or choices_per_prompt(data) > 1

    def line(self, raw: bytes) -> bytes | None:
        if not raw.startswith(b"data: "):
            return raw
        if raw == b"data: [DONE]":
            chunk = self.closing()
            return raw if chunk is None else b"data: " + _dumps(chunk) + b"\n\n" + raw
        if b'"usage"' in raw:
            try:
                event = json.loads(raw[6:])
            except ValueError:
                return raw
            if not isinstance(event, dict):
                return None
            shown = self.event(event)
            return None if shown is None else b"data: " + _dumps(shown)
        if raw[6:7] != b"{":  # not an object (``null``): nothing of an answer in it
            return None if raw[6:].strip() in (b"null", b"") else raw
        if self._completion and b"chatcmpl-" in raw:
            return _CHAT_ID.sub(rb"\1cmpl-", raw, count=1)
        return raw

    def event(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """``event`` without its usage (tallied), or None if nothing else was in it."""
        if self._completion and "id" in event:
            event = {**event, "id": completion_id(event["id"])}
        if "usage" not in event:
            return event
        event = dict(event)
        self._tally.add(event.pop("usage"))
        self._top = {k: event[k] for k in ("id", "object", "created", "model",
                                           "system_fingerprint") if k in event}
        return event if event.get("choices") else None

    def closing(self) -> dict[str, Any] | None:
        """The usage chunk to send before ``[DONE]``: only when asked and reported."""
        total = self._tally.total()
        if not self._asked or total is None:
            return None
        return {**self._top, "choices": [], "usage": total}


def _dumps(value: dict[str, Any]) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
