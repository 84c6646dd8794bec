"""The web console: three static files shipped in the package (``bunkhouse/console``), served
at ``GET /`` and ``GET /console/{name}``. No build step and nothing fetched from elsewhere: the
page works offline. It holds no data itself; it reads the API with the keys entered in it
(kept in the tab's session storage), so the page is open and the data is not.

Served here, rather than with Starlette's StaticFiles, because the files are three and named
in advance (nothing else under the folder can be asked for) and each answer carries a
Content-Security-Policy that keeps the page to this server.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response

from bunkhouse.errors import NotFound

_FILES = {"index.html": "text/html; charset=utf-8",
          "console.js": "text/javascript; charset=utf-8",
          "console.css": "text/css; charset=utf-8"}

_HEADERS = {
    # the page's own files and this server's API only; no inline script, no frames
    "content-security-policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


class Console:
    def __init__(self) -> None:
        folder = resources.files("bunkhouse") / "console"
        self._files = {name: (folder / name).read_bytes() for name in _FILES}

    def _answer(self, name: str) -> Response:
        return Response(self._files[name], media_type=_FILES[name], headers=_HEADERS)

    async def page(self, request: Request) -> Response:
        return self._answer("index.html")

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in _FILES or name == "index.html":
            raise NotFound(f"no console file {name[:80]!r}")
        return self._answer(name)
