"""The worker transport (engines/transport.py): httpx's API over aiohttp on a Unix socket,
against a small HTTP server on a real socket."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvloop

from bunkhouse.engines.transport import WorkerTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + (await reader.readexactly(length) if length else b"")


async def _serve(path: Path, handler: Handler) -> asyncio.Server:
    async def wrapped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    return await asyncio.start_unix_server(wrapped, str(path))


def _client(path: Path) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=WorkerTransport(str(path)), base_url="http://worker",
                             timeout=httpx.Timeout(None, connect=5))


def test_a_stream_arrives_chunk_by_chunk_and_a_body_whole(tmp_path: Path) -> None:
    sock = tmp_path / "w.sock"

    async def go() -> None:
        second = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            request = await _read_head(reader)
            if b"POST /stream" in request:
                assert request.endswith(b'{"a": 1}')
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                writer.write(b"7\r\ndata: 1\r\n")
                await writer.drain()
                await second.wait()  # the client has the first chunk before the second is sent
                writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 5\r\n\r\nnope!")
            await writer.drain()

        server = await _serve(sock, handler)
        async with _client(sock) as client:
            req = client.build_request("POST", "/stream", content=b'{"a": 1}',
                                       headers={"content-type": "application/json"})
            resp = await client.send(req, stream=True)
            assert resp.status_code == 200
            assert resp.headers["content-type"] == "text/event-stream"
            chunks = []
            async for chunk in resp.aiter_raw():
                chunks.append(chunk)
                second.set()
            assert b"".join(chunks) == b"data: 1data: 2" and len(chunks) == 2
            await resp.aclose()
            missing = await client.get("/other")
            assert missing.status_code == 404 and missing.content == b"nope!"
        server.close()

    run(go())


def test_closing_the_transport_wakes_a_reader_with_a_read_error(tmp_path: Path) -> None:
    """How a stop ends a stream whose worker is still generating (supervisor/process.py)."""
    sock = tmp_path / "w.sock"

    async def go() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_head(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
            await writer.drain()
            await asyncio.sleep(60)  # a long generation

        server = await _serve(sock, handler)
        client = _client(sock)
        resp = await client.send(client.build_request("POST", "/s", content=b"x"), stream=True)
        first = asyncio.Event()

        async def read() -> None:
            async for _ in resp.aiter_raw():
                first.set()

        reader = asyncio.create_task(read())
        await asyncio.wait_for(first.wait(), 5)
        await client.aclose()
        with pytest.raises(httpx.ReadError):
            await asyncio.wait_for(reader, 5)
        server.close()

    run(go())


def test_failures_are_httpx_errors(tmp_path: Path) -> None:
    sock = tmp_path / "w.sock"

    async def go() -> None:
        async with _client(tmp_path / "absent.sock") as client:
            with pytest.raises(httpx.ConnectError):
                await client.get("/health")

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            request = await _read_head(reader)
            if b"/cut" in request:  # the worker dies mid-answer
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
                await writer.drain()
            else:  # a worker that does not answer in time
                await asyncio.sleep(5)

        server = await _serve(sock, handler)
        async with _client(sock) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.get("/slow", timeout=0.2)
            with pytest.raises(httpx.TransportError):
                await client.get("/cut")
        server.close()

    run(go())


def test_a_full_listen_backlog_is_waited_out_not_a_failure(tmp_path: Path) -> None:
    """Eight requests at once to a worker whose listen backlog (1 here; llama.cpp's server:
    5) is full until it accepts: the connects refused with EAGAIN meanwhile are tried again,
    and every request is answered (once they failed, and three in a row got the worker
    replaced, with every stream on it). Under uvloop, the front's loop: asyncio's own takes
    the EAGAIN for a connect in progress and fails at the first write instead."""
    sock = tmp_path / "w.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock))
    listener.listen(1)
    accepting = threading.Event()

    def serve() -> None:
        accepting.wait(20)
        for _ in range(8):
            conn, _ = listener.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(4096)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n"
                             b"connection: close\r\n\r\nok")

    server = threading.Thread(target=serve, daemon=True)
    server.start()

    async def go() -> None:
        async with _client(sock) as client:
            asked = [asyncio.ensure_future(client.get("/health")) for _ in range(8)]
            await asyncio.sleep(0.3)  # the backlog stays full meanwhile
            accepting.set()
            answers = await asyncio.gather(*asked)
        assert [a.text for a in answers] == ["ok"] * 8

    try:
        uvloop.run(asyncio.wait_for(go(), 20))
    finally:
        listener.close()
        server.join(10)
