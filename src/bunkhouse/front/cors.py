"""Cross-origin requests from browsers (CORS), answered by Starlette's ``CORSMiddleware``.

Two instances, one per kind of route:

- **API routes** (inference, listings, Ollama's and llama.cpp's routes): the origins given
  with ``--cors-origin`` (``*`` for any), and by default only loopback origins
  (``http://localhost:PORT``, ``http://127.0.0.1:PORT``, ``http://[::1]:PORT``), so that a
  page on another site cannot drive a local server, while a web UI on this machine can.
- **Admin routes** (every change of state: ``/admin/*``, registering, deleting, loading,
  unloading, pinning models): only origins named explicitly with ``--cors-origin`` (never
  ``*``, never the loopback default). A cross-origin request to one from any other origin
  is refused with 403 before it is served, preflight or not.

A preflight is answered by the middleware before any route or key check (a browser sends no
key on it); the request that follows goes through the keys as any other.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from bunkhouse.errors import Forbidden, error_body

LOOPBACK_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?"
"""Origins allowed by default: pages served from this machine."""

_ADMIN_METHODS = frozenset({"POST", "DELETE", "PUT", "PATCH"})


def admin_route(method: str, path: str) -> bool:
    """Whether ``method path`` changes the server's state (front/auth.py's admin level)."""
    if path.startswith("/admin/"):
        return True
    return path.startswith("/v1/models") and method in _ADMIN_METHODS


class _Preflight(CORSMiddleware):
    """Starlette's middleware, with an allowed preflight answered ``204 No Content`` (as
    browsers, the Fetch standard's examples and other servers answer it) rather than
    ``200 OK`` with a body."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 200:
            return response
        headers = {k: v for k, v in response.headers.items()
                   if k.lower() not in ("content-length", "content-type")}
        return Response(status_code=204, headers=headers)


class Cors:
    def __init__(self, app: ASGIApp, origins: Iterable[str] = ()) -> None:
        given = tuple(origins)
        self.app = app
        self.explicit = frozenset(o for o in given if o != "*")
        common = {"allow_methods": ["*"], "allow_headers": ["*"], "max_age": 600}
        self.api = _Preflight(app, allow_origins=list(given),
                                  allow_origin_regex=LOOPBACK_ORIGINS, **common)  # type: ignore[arg-type]
        self.admin = _Preflight(app, allow_origins=sorted(self.explicit), **common)  # type: ignore[arg-type]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        method = scope["method"]
        if method == "OPTIONS" and "access-control-request-method" in headers:
            method = headers["access-control-request-method"].upper()
        if not admin_route(method, scope["path"]):
            await self.api(scope, receive, send)
            return
        if origin is not None and origin not in self.explicit \
                and not _same_origin(origin, headers.get("host")):
            err = Forbidden("admin routes answer no cross-origin request: name this origin "
                            "with --cors-origin to allow it")
            await JSONResponse(error_body(err), status_code=403)(scope, receive, send)
            return
        await self.admin(scope, receive, send)


def _same_origin(origin: str, host: str | None) -> bool:
    """Whether ``origin`` is this server as the request addressed it."""
    return host is not None and re.fullmatch(rf"https?://{re.escape(host)}", origin) is not None
