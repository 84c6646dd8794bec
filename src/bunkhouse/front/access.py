"""One access log line per client request, at info: method, route, model, status, tokens,
time to first byte, duration, client.

Written here rather than taken from uvicorn's access log: uvicorn logs when the response
starts, before a stream has sent anything, and knows nothing of the model or the tokens.
This middleware logs when the last byte has gone (or the client left), with what the
handlers noted on the request's state: ``model`` (the catalog id served) and ``tokens``
(prompt and generated, from the engine's timings). Liveness polls (``GET /health``) are
logged at debug, so that a health checker does not fill the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("bunkhouse.access")

_QUIET = frozenset({("GET", "/health")})


Observer = Callable[[Scope, "int | None", "float | None", float], None]
"""Called once per request when it ends: its scope (whose ``state`` has what the handlers
noted), status (None: no answer started), seconds to the first body byte (None: none sent)
and seconds in all."""


class AccessLog:
    def __init__(self, app: ASGIApp, observe: Observer | None = None) -> None:
        self.app = app
        self.observe = observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        seen: dict[str, Any] = {"status": None, "first": None, "done": False}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body":
                if seen["first"] is None and message.get("body"):
                    seen["first"] = time.monotonic()
                if not message.get("more_body", False):
                    seen["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            state = scope.get("state") or {}
            if "first_byte_at" in state:  # a waiting stream: its pings are not its answer
                seen["first"] = state["first_byte_at"]
            self._log(scope, seen, started)
            if self.observe is not None:
                first = seen["first"]
                try:
                    self.observe(scope, seen["status"],
                                 None if first is None else first - started,
                                 time.monotonic() - started)
                except Exception:
                    log.exception("noting a request's figures failed")

    @staticmethod
    def _log(scope: Scope, seen: dict[str, Any], started: float) -> None:
        method, path = scope.get("method", ""), scope.get("path", "")
        level = logging.DEBUG if (method, path) in _QUIET else logging.INFO
        if not log.isEnabledFor(level):
            return
        state = scope.get("state") or {}
        client = scope.get("client")
        tokens = state.get("tokens")
        first = seen["first"]
        fields = {
            "method": method, "path": path, "model": state.get("model"),
            "status": seen["status"],
            "prompt_tokens": tokens[0] if tokens else None,
            "generated_tokens": tokens[1] if tokens else None,
            "ttfb_ms": round((first - started) * 1000) if first is not None else None,
            "duration_ms": round((time.monotonic() - started) * 1000),
            "client": f"{client[0]}:{client[1]}" if client else None,
            "client_left": not seen["done"] and seen["status"] is not None,
        }
        log.log(level, "%s %s model=%s status=%s tokens=%s ttfb_ms=%s duration_ms=%d "
                "client=%s%s", method, path, fields["model"] or "-", fields["status"] or "-",
                f"{tokens[0]}+{tokens[1]}" if tokens else "-",
                "-" if fields["ttfb_ms"] is None else fields["ttfb_ms"],
                fields["duration_ms"], fields["client"] or "-",
                " (client left)" if fields["client_left"] else "",
                extra={"fields": fields})
