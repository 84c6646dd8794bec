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
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("bunkhouse.access")

_QUIET = frozenset({("GET", "/health")})


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

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
            self._log(scope, seen, started)

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
        log.log(level, "%s %s model=%s status=%s tokens=%s ttfb_ms=%s duration_ms=%.0f "
                "client=%s%s", method, path, state.get("model", "-"), seen["status"] or "-",
                f"{tokens[0]}+{tokens[1]}" if tokens else "-",
                f"{(first - started) * 1000:.0f}" if first is not None else "-",
                (time.monotonic() - started) * 1000,
                f"{client[0]}:{client[1]}" if client else "-",
                "" if seen["done"] or seen["status"] is None else " (client left)")
