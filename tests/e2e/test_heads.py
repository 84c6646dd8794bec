"""Request heads against a real `bunkhouse serve`: size, header count and time are bounded,
and the front's memory stays flat under the probe."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import httpx
import psutil

from bunkhouse import defaults
from tests.e2e.server import Server, serve
from tests.helpers import wait_for


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


def test_oversized_and_overfull_heads_are_431_and_memory_stays_flat(tmp_path: Path) -> None:
    with serve(tmp_path, "--no-packaged") as server:
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


def test_connections_dribbling_their_heads_are_closed(tmp_path: Path) -> None:
    with serve(tmp_path, "--no-packaged") as server:
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
