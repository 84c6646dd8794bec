"""Request heads against a real `bunkhouse serve`: size, header count and time are bounded,
and the front's memory stays flat under the probe."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from bunkhouse import defaults
from tests.e2e.server import Server, serve
from tests.helpers import wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the three probes: none restarts it, each measures from where it
    starts; what they all logged is read once it has stopped."""
    with serve(tmp_path_factory.mktemp("heads"), "--no-packaged") as running:
        yield running
    log = running.log.read_text()
    assert "Traceback" not in log and "internal error" not in log


def _address(server: Server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def _send_head(server: Server, head: bytes) -> bytes:
    """Send ``head`` (as much as the server takes) and return what it answers."""
    with socket.create_connection(_address(server), timeout=60) as sock:
        with contextlib.suppress(OSError):  # the server may close before it has it all
            sock.sendall(head)
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                answer += chunk
        return answer


def test_oversized_and_overfull_heads_are_431_and_memory_stays_flat(server: Server) -> None:
    front = psutil.Process(server.proc.pid)
    before = front.memory_info().rss
    huge = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * (64 << 20) + \
        b"\r\n\r\n"
    assert _send_head(server, huge).startswith(b"HTTP/1.1 431 ")
    answers: list[bytes] = []
    big = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"b" * (128 << 20)
    threads = [threading.Thread(target=lambda: answers.append(_send_head(server, big)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(a.startswith(b"HTTP/1.1 431 ") for a in answers), answers
    many = b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + b"X: y\r\n" * 200_000 + b"\r\n"
    assert _send_head(server, many).startswith(b"HTTP/1.1 431 ")
    grown = front.memory_info().rss - before
    assert grown < 64 << 20, f"the front grew by {grown >> 20} MiB"
    # Heads within the bounds are served.
    ok = httpx.get(f"{server.url}/health", headers={"x-long": "t" * 32_000,
                                                    **{f"x-h{i}": "v" for i in range(50)}})
    assert ok.status_code == 200


def test_connections_dribbling_their_heads_are_closed(server: Server) -> None:
    socks = [socket.create_connection(_address(server), timeout=5) for _ in range(300)]
    try:
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        open_socks = list(socks)

        def dribble_until_closed() -> bool:
            for s in list(open_socks):
                try:
                    s.sendall(b"X")
                    s.setblocking(False)
                    try:
                        data = s.recv(4096)
                    except BlockingIOError:
                        continue
                    finally:
                        s.setblocking(True)
                    if data == b"" or data.startswith(b"HTTP/1.1 408"):
                        open_socks.remove(s)
                except OSError:
                    open_socks.remove(s)
            time.sleep(0.5)
            return not open_socks

        wait_for(dribble_until_closed, defaults.HEAD_TIMEOUT_S + 120,
                 "every dribbling connection to be closed")
    finally:
        for s in socks:
            s.close()
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_trailers_slow_bodies_and_cut_bodies_hold_nothing(server: Server) -> None:
    front = psutil.Process(server.proc.pid)
    before = front.memory_info().rss
    # Endless trailers after a chunked body: refused once they pass the head bound.
    trailer = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-T: " + b"a" * (32 << 20))
    assert _send_head(server, trailer).startswith(b"HTTP/1.1 400 ")
    assert front.memory_info().rss - before < 64 << 20
    # A body dribbled a byte at a time is cut once it falls behind the minimum rate.
    with socket.create_connection(_address(server), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n")

        def closed() -> bool:
            try:
                sock.sendall(b" ")
                sock.setblocking(False)
                try:
                    return sock.recv(4096) == b""
                except BlockingIOError:
                    return False
                finally:
                    sock.setblocking(True)
            except OSError:
                return True
            finally:
                time.sleep(1)

        wait_for(closed, defaults.BODY_TIMEOUT_S + 120, "the slow body's connection to close")
    # A client gone mid-body is no server error.
    with socket.create_connection(_address(server), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mod")
    assert httpx.get(f"{server.url}/health").status_code == 200
    limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
    soft = next(line for line in limits.splitlines() if line.startswith("Max open files"))
    assert int(soft.split()[3]) > 1024 or "unlimited" in soft or \
        int(soft.split()[3]) == int(soft.split()[4])  # raised as far as the hard limit
