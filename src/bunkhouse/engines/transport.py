"""The front's HTTP transport to a worker's Unix socket: httpx's API over aiohttp's client.

Every engine client speaks httpx (engines/worker_http.py), but httpx's own transport reads a
stream through httpcore, h11 and anyio's socket wrapper, which costs about 0.3 ms of front CPU
per streamed token more than aiohttp's (its parser is C, its socket an asyncio protocol),
measured on 2 cores under uvloop: 0.42-0.52 ms against 0.20-0.22 ms per token
(docs/benchmarks.md, "Where the front's CPU goes"). On a CPU host that time is taken from the
engine's decode threads. So this transport hands httpx an aiohttp response as its stream;
callers keep httpx's ``Response`` and its exceptions.

A fresh connection per request (``force_close``): llama.cpp's server may close a kept-alive
connection after a stream without saying so, and a Unix socket connect costs microseconds.
A burst of requests may find the worker's listen backlog full (cpp-httplib, which llama.cpp's
server is built on, listens with a backlog of 5 unless built otherwise); a Unix socket then
refuses the connect with EAGAIN at once, which is not a worker gone: the connect is tried
again after 1, 2, 4... ms (at most 50 ms apart) until the request's connect timeout, else
:data:`CONNECT_RETRY_S`.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import httpx

CONNECT_RETRY_S = 10.0
"""How long a connect refused for a full backlog is tried again when the request sets no
connect timeout, seconds."""

# Headers that httpx adds for any request and aiohttp sets itself (or that mean nothing on a
# private socket).
_SKIP = frozenset({"host", "connection", "accept-encoding", "user-agent", "transfer-encoding"})


_READER = "bunkhouse.body_reader"  # the response's extension holding aiohttp's read


class WorkerTransport(httpx.AsyncBaseTransport):
    """An httpx transport to the HTTP server on the Unix socket ``uds``.

    Timeouts come from the request (httpx's ``timeout`` extension): ``connect`` bounds the
    connection, ``read`` each read (the head, then every chunk of the body), as httpx's own.
    Failures are raised as httpx's: ConnectError, ConnectTimeout, ReadTimeout, ReadError,
    RemoteProtocolError (all TransportError).
    """

    def __init__(self, uds: str | None = None, *, url: str | None = None,
                 secret: str | None = None) -> None:
        """``uds``: the worker's Unix socket; or ``url`` (``http://HOST:PORT``), a worker's
        relay on a cluster node (cluster/relay.py), sent ``secret`` as a bearer token."""
        if (uds is None) == (url is None):
            raise ValueError("a worker transport needs a Unix socket or a URL, not both")
        self.uds = uds
        self._url = httpx.URL(url) if url is not None else None
        self._auth = {"Authorization": f"Bearer {secret}"} if secret else {}
        self._session: aiohttp.ClientSession | None = None
        self._open: set[aiohttp.ClientResponse] = set()  # answers still being read
        self._closed = False

    def _client(self, request: httpx.Request) -> aiohttp.ClientSession:
        if self._closed:  # never a new connection once closed (its worker is stopping)
            raise httpx.ConnectError("the worker's client is closed", request=request)
        if self._session is None:  # made on first use, inside the running loop
            connector: aiohttp.BaseConnector = (
                aiohttp.UnixConnector(path=self.uds, force_close=True, limit=0)
                if self.uds is not None else aiohttp.TCPConnector(force_close=True, limit=0))
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeouts.get("connect"),
                                        sock_read=timeouts.get("read"))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP}
        headers.update(self._auth)
        url = request.url
        if self._url is not None:
            url = url.copy_with(scheme=self._url.scheme, host=self._url.host,
                                port=self._url.port)
        # bytes as they are; a streamed body (an upload) as aiohttp's async iterable payload
        data: Any = (request.content if isinstance(request.stream, httpx.ByteStream)
                     else request.stream)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeouts.get("connect") or CONNECT_RETRY_S)
        for attempt in itertools.count():
            try:
                resp = await self._client(request).request(
                    request.method, str(url), data=data, headers=headers, timeout=timeout,
                    allow_redirects=False, skip_auto_headers=("Content-Type",))
                break
            except aiohttp.ClientConnectorError as e:
                # a Unix socket whose listen backlog is full refuses a connect with EAGAIN
                # at once: a burst of requests, not a worker gone; tried again shortly
                if not _backlog_full(e) or loop.time() >= deadline:
                    raise _httpx_error(e, request, connecting=True) from e
                await asyncio.sleep(min(0.001 * 2**attempt, 0.05))
            except Exception as e:
                raise _httpx_error(e, request, connecting=True) from e
        if self._closed:  # closed while this answer's head was awaited
            resp.close()
            raise httpx.ReadError("the worker's client is closed", request=request)
        self._open.add(resp)
        return httpx.Response(resp.status, headers=list(resp.raw_headers),
                              stream=_Body(resp, request, self._open), request=request,
                              extensions={"http_version": b"HTTP/1.1",
                                          _READER: resp.content.readany})

    async def aclose(self) -> None:
        """Close the session and every answer still open: a task reading one wakes with
        httpx's ReadError (closing aiohttp's session alone leaves such a reader waiting).
        A request after this (or whose answer's head arrives after it) gets an httpx error."""
        self._closed = True
        for resp in list(self._open):
            resp.close()
            resp.content.set_exception(aiohttp.ClientConnectionError("worker client closed"))
        self._open.clear()
        if self._session is not None:
            await self._session.close()


class _Body(httpx.AsyncByteStream):
    """An aiohttp response's body as httpx's stream: each chunk as it arrives."""

    def __init__(self, resp: aiohttp.ClientResponse, request: httpx.Request,
                 open_: set[aiohttp.ClientResponse]) -> None:
        self._resp = resp
        self._request = request
        self._open = open_

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except Exception as e:
            raise _httpx_error(e, self._request, connecting=False) from e

    async def aclose(self) -> None:
        """Close the answer; a read waiting on it wakes with a failure (its client left)."""
        self._open.discard(self._resp)
        self._resp.close()
        if not self._resp.content.at_eof():
            self._resp.content.set_exception(aiohttp.ClientConnectionError("answer closed"))


def body_reader(response: httpx.Response) -> Callable[[], Awaitable[bytes]] | None:
    """For a response this transport made: a read of the next bytes of its body as they
    arrive (all that is buffered, ``b""`` at its end) with no iterator between the relay and
    aiohttp's reader (front/relay.py: one read per token at GPU rates). Its failures are
    aiohttp's: :func:`httpx_error` turns them into httpx's. None for another response."""
    read: Callable[[], Awaitable[bytes]] | None = response.extensions.get(_READER)
    return read


def httpx_error(e: Exception, request: httpx.Request) -> Exception:
    """A failure of a :func:`body_reader` read as the httpx exception its callers catch."""
    return _httpx_error(e, request, connecting=False)


def _backlog_full(e: aiohttp.ClientConnectorError) -> bool:
    """Whether a connect failed only because the listener's backlog is full (EAGAIN on a
    Unix socket)."""
    return getattr(e.os_error, "errno", None) in (errno.EAGAIN, errno.EWOULDBLOCK)


def _httpx_error(e: Exception, request: httpx.Request, *, connecting: bool) -> Exception:
    """aiohttp's (or the socket's) failure as the httpx exception its callers catch."""
    if isinstance(e, httpx.HTTPError):
        return e
    if isinstance(e, TimeoutError):  # aiohttp's timeouts are asyncio's (TimeoutError)
        if connecting and isinstance(e, aiohttp.ConnectionTimeoutError):
            return httpx.ConnectTimeout(repr(e), request=request)
        return httpx.ReadTimeout(repr(e), request=request)
    if isinstance(e, aiohttp.ClientConnectorError | FileNotFoundError | ConnectionRefusedError):
        return httpx.ConnectError(repr(e), request=request)
    if isinstance(e, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return httpx.RemoteProtocolError(repr(e), request=request)
    if isinstance(e, aiohttp.ClientError | OSError):
        return httpx.ReadError(repr(e), request=request)
    return e
