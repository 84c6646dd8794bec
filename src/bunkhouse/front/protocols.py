"""Answers in another protocol than OpenAI's: the shapes (front/proxy.py ``Shape``) the
generation path takes for Anthropic's Messages API; the translation itself is pure, in
api/anthropic.py."""

from __future__ import annotations

from typing import Any

from bunkhouse.api import anthropic


def _message(body: dict[str, Any]) -> str:
    err = body.get("error")
    message = err.get("message") if isinstance(err, dict) else None
    return message if isinstance(message, str) else "the engine failed"


class _AnthropicStream:
    def __init__(self, model: str, stops: list[str]) -> None:
        self._events = anthropic.MessageStream(model, stops)
        self._ended = False

    def feed(self, event: dict[str, Any]) -> bytes:
        return b"".join(anthropic.sse(e) for e in self._events.feed(event))

    def end(self) -> bytes:
        if self._ended:
            return b""
        self._ended = True
        return b"".join(anthropic.sse(e) for e in self._events.end())

    def error(self, body: dict[str, Any]) -> bytes:
        self._ended = True  # an error event ends an Anthropic stream
        err = body.get("error")
        code = err.get("code") if isinstance(err, dict) else None
        status = 503 if code in ("shutting_down", "insufficient_memory") else 500
        return anthropic.sse(("error", anthropic.error_object(status, _message(body))))


class AnthropicShape:
    """A chat completion answer as an Anthropic Messages answer, for ``model``."""

    def __init__(self, model: str, stops: list[str] | None = None) -> None:
        self.model = model
        self.stops = stops or []

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        return anthropic.message_from_chat(chat, self.model, self.stops)

    def error(self, status: int, body: dict[str, Any]) -> dict[str, Any]:
        return anthropic.error_object(status, _message(body))

    def stream(self) -> _AnthropicStream:
        return _AnthropicStream(self.model, self.stops)
