"""The authenticated relay in front of a worker on a cluster node: TCP on the node's address
to the worker's Unix socket, for requests that carry the worker's own secret.

A worker's HTTP server listens only on a private Unix socket (as on the front's machine);
the front on another machine reaches it through this relay, which answers 401 to any request
without ``Authorization: Bearer SECRET`` (compared in constant time) and streams everything
else through as it comes, both ways. Written here rather than taken from a proxy package
because it is 60 lines of aiohttp, which the front already uses for its worker transport
(engines/transport.py), and a proxy that knows nothing of the secret would need one more
process per worker.
"""

from __future__ import annotations

import hmac
import json

import aiohttp
from aiohttp import web

# Per-connection headers (RFC 9110 7.6.1) and those the relay sets itself.
_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
                  "trailer", "upgrade", "host", "authorization", "content-length"})


class Relay:
    """One worker's relay; :meth:`start` binds it, :meth:`close` ends it and every stream."""

    def __init__(self, uds: str, secret: str) -> None:
        self._uds = uds
        self._expected = f"Bearer {secret}".encode()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    async def start(self, host: str) -> int:
        """Listen on ``host`` (the node's address) on a free port; returns the port."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self._uds, force_close=True, limit=0),
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=0)
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0)
        await site.start()
        return int(self._runner.addresses[0][1])

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, self._expected):
            return web.Response(status=401, content_type="application/json",
                                text=json.dumps({"error": "this worker answers only its "
                                                 "front: a request without its secret"}))
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self._session.request(
                request.method, f"http://worker{request.rel_url}", headers=headers,
                data=request.content if request.body_exists else None,
                allow_redirects=False, skip_auto_headers=("Content-Type",)) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
