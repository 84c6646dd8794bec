"""Answers in another shape than the engine's: the shapes (front/proxy.py ``Shape``) the
generation path takes for Anthropic's Messages API, OpenAI's Responses API, and tool calls
read out of an answer's text; the translations themselves are pure, in api/anthropic.py,
api/responses.py and api/tool_calls.py."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from bunkhouse.api import anthropic, infill, ollama, responses
from bunkhouse.api.fields import renamed
from bunkhouse.api.tool_calls import ToolCallReader
from bunkhouse.api.usage import COMPLETIONS, StreamUsage
from bunkhouse.errors import BunkhouseError, error_body
from bunkhouse.front.proxy import Shape
from bunkhouse.front.relay import StreamShaper


def error_envelope(path: str, err: BunkhouseError, detail: bool = False) -> dict[str, Any]:
    """``err`` in the envelope of the protocol ``path`` belongs to: Anthropic's on its
    routes (its clients read no other), OpenAI's everywhere else; ``detail``: with the
    error's private detail (admins)."""
    if path.startswith("/v1/messages"):
        return anthropic.error_envelope(err, detail)
    if path.startswith("/api/"):  # Ollama's
        return ollama.error(err.full_message() if detail else err.message)
    return error_body(err, detail=detail)


def _message(body: dict[str, Any]) -> str:
    err = body.get("error")
    message = err.get("message") if isinstance(err, dict) else None
    return message if isinstance(message, str) else "the engine failed"


class _Once:
    """A stream shaper whose closing bytes go out once, whatever calls ``end`` again; an
    error ends it too."""

    def __init__(self) -> None:
        self._ended = False

    def end(self) -> bytes:
        if self._ended:
            return b""
        self._ended = True
        return self._closing()

    def prompt(self, tokens: int) -> None:
        """The prompt's token count before the answer: only Anthropic's stream shows it."""

    def _closing(self) -> bytes:
        raise NotImplementedError


class _AnthropicStream(_Once):
    def __init__(self, model: str, stops: list[str]) -> None:
        super().__init__()
        self._events = anthropic.MessageStream(model, stops)

    def feed(self, event: dict[str, Any]) -> bytes:
        return b"".join(anthropic.sse(e) for e in self._events.feed(event))

    def _closing(self) -> bytes:
        return b"".join(anthropic.sse(e) for e in self._events.end())

    def prompt(self, tokens: int) -> None:
        self._events.prompt(tokens)

    def error(self, body: dict[str, Any]) -> bytes:
        self._ended = True  # an error event ends an Anthropic stream
        kind = anthropic.error_type(None, body)  # the type it has before a stream too
        return anthropic.sse(("error", anthropic.error_object(kind, _message(body))))

    def keepalive(self) -> bytes:
        if not self._events.started:  # message_start waits for the prompt's count
            return _COMMENT
        return anthropic.sse(("ping", {"type": "ping"}))


class AnthropicShape:
    """A chat completion answer as an Anthropic Messages answer, for ``model``."""

    media_type = "text/event-stream"

    def __init__(self, model: str, stops: list[str] | None = None) -> None:
        self.model = model
        self.stops = stops or []

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        return anthropic.message_from_chat(chat, self.model, self.stops)

    def error(self, status: int, body: dict[str, Any]) -> dict[str, Any]:
        return anthropic.error_object(anthropic.error_type(status, body), _message(body))

    def stream(self) -> _AnthropicStream:
        return _AnthropicStream(self.model, self.stops)


class _ChatStream(_Once):
    """Chat completion events sent as they are (OpenAI's own protocol)."""

    def feed(self, event: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    def _closing(self) -> bytes:
        return b"data: [DONE]\n\n"

    def error(self, body: dict[str, Any]) -> bytes:
        self._ended = True
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"

    def keepalive(self) -> bytes:
        return _COMMENT


class ChatShape:
    """OpenAI's chat completion protocol itself: for a chat answer another shape rewrites
    (:class:`ToolCallShape`) when the client speaks OpenAI."""

    media_type = "text/event-stream"

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        return chat

    def error(self, status: int, body: dict[str, Any]) -> dict[str, Any]:
        return body

    def stream(self) -> StreamShaper:
        return _ChatStream()


_COMMENT = b": waiting\n\n"
"""An event-stream comment: every SSE client skips it (the WHATWG event-stream format)."""

KEEPALIVE_S = 1.0
"""Most seconds between keepalives while answer text is held back."""


class _ToolCallStream(_Once):
    def __init__(self, reader: ToolCallReader, inner: StreamShaper) -> None:
        super().__init__()
        self._reader = reader
        self._inner = inner
        self._quiet_since = time.monotonic()

    def feed(self, event: dict[str, Any]) -> bytes:
        out = b"".join(self._inner.feed(e) for e in self._reader.feed(event))
        now = time.monotonic()
        if out:
            self._quiet_since = now
        elif now - self._quiet_since >= KEEPALIVE_S:  # text held back: tell the client
            self._quiet_since = now
            out = self._inner.keepalive()
        return out

    def _closing(self) -> bytes:
        return b"".join(self._inner.feed(e) for e in self._reader.end()) + self._inner.end()

    def prompt(self, tokens: int) -> None:
        self._inner.prompt(tokens)

    def error(self, body: dict[str, Any]) -> bytes:
        self._ended = True
        return self._inner.error(body)

    def keepalive(self) -> bytes:
        return self._inner.keepalive()


class ToolCallShape:
    """``inner``'s answer with the tool calls ``reader`` finds in the text (api/tool_calls.py)
    read out of it first."""

    def __init__(self, reader: ToolCallReader, inner: Shape) -> None:
        self.reader = reader
        self.inner = inner
        self.media_type = inner.media_type

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        return self.inner.answer(self.reader.answer(chat))

    def error(self, status: int, body: dict[str, Any]) -> dict[str, Any]:
        err = body.get("error")
        if self.reader.forced and isinstance(err, dict) and err.get("param") == "response_format":
            # the schema the engine refused is the one made of the tools' parameters
            body = {**body, "error": {**err, "param": "tools", "message": str(
                err.get("message", "")).replace("response_format", "a tool's parameters")}}
        return self.inner.error(status, body)

    def stream(self) -> StreamShaper:
        return _ToolCallStream(self.reader, self.inner.stream())


Stored = Callable[[dict[str, Any]], None]
"""Called with a finished response object (where the front stores it)."""


class _ResponseStream(_Once):
    def __init__(self, events: responses.ResponseStream) -> None:
        super().__init__()
        self._events = events

    def feed(self, event: dict[str, Any]) -> bytes:
        return b"".join(responses.sse(e) for e in self._events.feed(event))

    def _closing(self) -> bytes:
        return b"".join(responses.sse(e) for e in self._events.end())

    def error(self, body: dict[str, Any]) -> bytes:
        self._ended = True  # a failed response ends the stream
        err = body.get("error")
        code = err.get("code") if isinstance(err, dict) else None
        return b"".join(responses.sse(e) for e in self._events.failed(
            _message(body), code if isinstance(code, str) else None))

    def keepalive(self) -> bytes:
        return self.feed({}) + _COMMENT  # response.created first, if not sent yet

    def cut(self) -> None:
        """The client left before the stream ended (nothing more can be sent)."""
        if not self._ended:
            self._ended = True
            self._events.cut()


class ResponsesShape:
    """A chat completion answer as an OpenAI Responses ``response``; ``on_done`` gets each
    response that ends: a whole one, or at the end of its stream, however it ends (completed,
    incomplete, failed, or cut by its client: :meth:`sent`)."""

    media_type = "text/event-stream"

    def __init__(self, echo: responses.Echo, on_done: Stored | None = None) -> None:
        self.echo = echo
        self.on_done = on_done
        self._streams: list[_ResponseStream] = []

    def sent(self) -> None:
        """The answer's sending is over: a stream that did not end was cut by its client."""
        for stream in self._streams:
            stream.cut()

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        response = responses.response_from_chat(chat, self.echo)
        if self.on_done is not None:
            self.on_done(response)
        return response

    def error(self, status: int, body: dict[str, Any]) -> dict[str, Any]:
        err = body.get("error")  # OpenAI's envelope, its field named as this API names it
        if isinstance(err, dict) and isinstance(err.get("param"), str):
            return {**body, "error": {**err, "param": renamed(err["param"],
                                                              responses.CHAT_FIELDS)}}
        return body

    def stream(self) -> StreamShaper:
        stream = _ResponseStream(responses.ResponseStream(self.echo, self.on_done))
        self._streams.append(stream)
        return stream


class _OllamaStream(_Once):
    def __init__(self, objects: ollama.OllamaStream) -> None:
        super().__init__()
        self._objects = objects

    def feed(self, event: dict[str, Any]) -> bytes:
        return b"".join(ollama.line(o) for o in self._objects.feed(event))

    def _closing(self) -> bytes:
        return b"".join(ollama.line(o) for o in self._objects.end())

    def error(self, body: dict[str, Any]) -> bytes:
        self._ended = True
        return ollama.line(ollama.error(_message(body)))

    def keepalive(self) -> bytes:
        return b""  # newline-delimited JSON has no comment: nothing to send


class _OllamaErrors:
    """Errors of an Ollama route: its ``{"error": "..."}``."""

    def error(self, status: int, body: dict[str, Any]) -> dict[str, Any]:
        return ollama.error(_message(body))


class OllamaShape(_OllamaErrors):
    """A chat completion (``chat``) or completion answer as Ollama's ``/api/chat`` or
    ``/api/generate`` objects, for the model the client named."""

    media_type = "application/x-ndjson"

    def __init__(self, model: str, chat: bool, timing: ollama.Timing | None = None) -> None:
        self.model = model
        self.chat = chat
        self.timing = timing

    def answer(self, result: dict[str, Any]) -> dict[str, Any]:
        return ollama.answer(result, self.model, self.chat, self.timing)

    def stream(self) -> StreamShaper:
        return _OllamaStream(ollama.OllamaStream(self.model, self.chat, self.timing))


class OllamaEmbedShape(_OllamaErrors):
    """An embeddings answer as ``/api/embed``'s, or the older ``/api/embeddings``'
    (``legacy``), for the model the client named."""

    media_type = "application/json"

    def __init__(self, model: str, legacy: bool) -> None:
        self.model = model
        self.legacy = legacy

    def answer(self, result: dict[str, Any]) -> dict[str, Any]:
        return ollama.embed_answer(result, self.model, self.legacy)

    def stream(self) -> StreamShaper:
        raise AssertionError("embeddings are never streamed")


class _CompletionEvents(_Once):
    """OpenAI completion objects as SSE ``data:`` events, ``[DONE]`` last; usage as
    ``usage`` rules (api/usage.py: only when asked, in a last chunk of its own)."""

    def __init__(self, usage: StreamUsage) -> None:
        super().__init__()
        self._usage = usage

    def feed(self, event: dict[str, Any]) -> bytes:
        shown = self._usage.event(event)
        return b"" if shown is None else b"data: " + json.dumps(shown).encode() + b"\n\n"

    def _closing(self) -> bytes:
        chunk = self._usage.closing()
        usage = b"" if chunk is None else b"data: " + json.dumps(chunk).encode() + b"\n\n"
        return usage + b"data: [DONE]\n\n"

    def error(self, body: dict[str, Any]) -> bytes:
        self._ended = True
        return self.feed(body)

    def keepalive(self) -> bytes:
        return b": ping\n\n"


class _Converted:
    """A stream whose events are converted before another shaper takes them."""

    def __init__(self, convert: Callable[[dict[str, Any]], dict[str, Any]],
                 then: StreamShaper) -> None:
        self._convert = convert
        self._then = then

    def feed(self, event: dict[str, Any]) -> bytes:
        return self._then.feed(self._convert(event))

    def end(self) -> bytes:
        return self._then.end()

    def prompt(self, tokens: int) -> None:
        self._then.prompt(tokens)

    def error(self, body: dict[str, Any]) -> bytes:
        return self._then.error(body)

    def keepalive(self) -> bytes:
        return self._then.keepalive()


class InfillShape:
    """llama.cpp's ``/infill`` answer as OpenAI completion objects for ``model``, or, given
    ``then`` (a shape of completions: Ollama's), in that protocol. ``request``: the OpenAI
    completion request it answers (its ``stream_options`` and ``n`` rule a stream's usage)."""

    def __init__(self, model: str, then: Shape | None = None,
                 request: dict[str, Any] | None = None) -> None:
        self._convert = infill.Completions(model).convert
        self._then = then
        self._request = request or {}
        self.media_type = then.media_type if then is not None else "text/event-stream"

    def answer(self, result: dict[str, Any]) -> dict[str, Any]:
        completion = self._convert(result)
        return self._then.answer(completion) if self._then is not None else completion

    def error(self, status: int, body: dict[str, Any]) -> dict[str, Any]:
        return self._then.error(status, body) if self._then is not None else body

    def stream(self) -> StreamShaper:
        return _Converted(self._convert, self._then.stream() if self._then is not None
                          else _CompletionEvents(StreamUsage(COMPLETIONS, self._request)))
