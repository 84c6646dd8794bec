"""Slow and greedy clients against the front's shared budgets, over real connections (the app
behind uvicorn and bunkhouse's HTTP protocol, in a thread; no worker is ever reached): a
body or an upload has a ceiling on its time, one client holds at most its share of the
bodies being read, the uploads held and the event streams, and a page of another site
cannot open an event stream."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bunkhouse import defaults
from bunkhouse.front import audio
from bunkhouse.front.auth import Keys
from bunkhouse.front.heads import HeadLimits
from bunkhouse.front.watch import MAX_READERS
from bunkhouse.shares import CLIENT_SHARE, Shares
from tests.helpers import app_without_workers, served, wait_for

KEYS = Keys(["greedy", "other"])
SMALL_BUDGET = 4 << 20  # a share of 1 MiB
SENT = 600_000  # what each slow connection sends of its declared 1 MB


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=60)


def _answer(sock: socket.socket) -> bytes | None:
    """What the server has answered on ``sock`` so far (b"" once closed), None if nothing."""
    sock.setblocking(False)
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""
    finally:
        sock.setblocking(True)


def _start_slow(url: str, head: bytes, first: bytes, count: int) -> list[socket.socket]:
    """``count`` connections that each send ``head`` and ``first`` of a longer body, then
    stall."""
    socks = []
    for _ in range(count):
        sock = _connect(url)
        with contextlib.suppress(OSError):  # refused mid-body: the server may close
            sock.sendall(head + first)
        socks.append(sock)
    return socks


def _refusals(socks: list[socket.socket], answers: dict[int, bytes]) -> int:
    for i, sock in enumerate(socks):
        if i not in answers and (got := _answer(sock)) is not None:
            answers[i] = got
    return len(answers)


@pytest.fixture
def small_budgets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(defaults, "BODIES_IN_FLIGHT_BYTES", SMALL_BUDGET)
    monkeypatch.setattr(audio, "UPLOADS_IN_FLIGHT_BYTES", SMALL_BUDGET)


def _hold_a_share(url: str, path: str, content_type: str, body: bytes,
                  key: str = "greedy") -> tuple[list[socket.socket], dict[int, bytes]]:
    """Eight slow requests from ``key``, 4.8 MB in all: past its share of 1 MiB every one
    but the first is refused (before shares, they held the whole 4 MiB budget)."""
    head = (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: 1000000\r\n\r\n").encode()
    socks = _start_slow(url, head, body, 8)
    answers: dict[int, bytes] = {}
    wait_for(lambda: _refusals(socks, answers) >= 7, 120,
             "the greedy client's requests past its share to be refused")
    return socks, answers


def test_a_slow_client_holds_only_its_share_of_the_bodies_being_read(
        tmp_path: Path, small_budgets: None) -> None:
    with served(app_without_workers(tmp_path, keys=KEYS)) as url:
        socks, answers = _hold_a_share(url, "/v1/completions", "application/json",
                                       b'{"prompt": "' + b"a" * (SENT - 12))
        try:
            busy = [a for a in answers.values() if a]
            assert busy and all(a.startswith(b"HTTP/1.1 503 ") for a in busy), busy
            assert b"server_busy" in busy[0] and b"retry-after: 1" in busy[0].lower()
            assert b"its share" in busy[0]
            # Another client's body is read whole while the greedy one holds its share.
            other = httpx.post(f"{url}/v1/completions", timeout=60,
                               headers={"authorization": "Bearer other"},
                               json={"model": "nope", "prompt": "a" * SENT})
            assert other.status_code == 404, other.text  # read, then: no such model
        finally:
            for sock in socks:
                sock.close()


def test_a_slow_uploader_holds_only_its_share_of_the_uploads(
        tmp_path: Path, small_budgets: None) -> None:
    boundary = "bh"
    part = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF").encode()
    with served(app_without_workers(tmp_path, keys=KEYS)) as url:
        socks, answers = _hold_a_share(url, "/v1/audio/transcriptions",
                                       f"multipart/form-data; boundary={boundary}",
                                       part + b"\0" * (SENT - len(part)))
        try:
            busy = [a for a in answers.values() if a]
            assert busy and all(a.startswith(b"HTTP/1.1 503 ") for a in busy), busy
            assert b"server_busy" in busy[0]
            other = httpx.post(f"{url}/v1/audio/transcriptions", timeout=60,
                               headers={"authorization": "Bearer other"},
                               files={"file": ("a.wav", b"not audio" * (SENT // 9))})
            assert other.status_code == 400 and other.json()["error"]["param"] == "file"
        finally:
            for sock in socks:
                sock.close()


@pytest.mark.parametrize(("path", "content_type"), [
    ("/v1/completions", "application/json"),
    ("/v1/audio/transcriptions", "multipart/form-data; boundary=bh"),
])
def test_a_body_sent_steadily_is_closed_at_the_ceiling(tmp_path: Path, path: str,
                                                       content_type: str) -> None:
    # The rate's deadline recedes 4 s with each 2,000 bytes sent: only the ceiling ends it.
    limits = HeadLimits(body_timeout_s=20.0, body_min_rate=500, body_max_s=1.0)
    with served(app_without_workers(tmp_path), limits) as url, _connect(url) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                     f"{content_type}\r\nContent-Length: 10000000\r\n\r\n".encode())

        def closed() -> bool:
            try:
                sock.sendall(b" " * 2000)
            except OSError:
                return True
            return _answer(sock) == b""

        wait_for(closed, 120, "the body's connection to close at the ceiling", 0.2)
        assert httpx.get(f"{url}/health").status_code == 200


@contextlib.contextmanager
def _streams(url: str, count: int, headers: dict[str, str]) -> Iterator[list[int]]:
    """``count`` event streams opened at once; yields their statuses (held open)."""
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(
            timeout=60, limits=httpx.Limits(max_connections=MAX_READERS + 8)))
        statuses = []
        for _ in range(count):
            response = stack.enter_context(client.stream("GET", f"{url}/admin/events",
                                                         headers=headers))
            statuses.append(response.status_code)
        yield statuses


def test_one_client_holds_only_its_share_of_the_event_streams(tmp_path: Path) -> None:
    share = MAX_READERS // CLIENT_SHARE
    with served(app_without_workers(tmp_path, keys=KEYS)) as url:
        greedy = {"authorization": "Bearer greedy"}
        with _streams(url, share, greedy) as statuses:
            assert statuses == [200] * share
            busy = httpx.get(f"{url}/admin/events", headers=greedy, timeout=60)
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy"
            assert busy.headers["retry-after"] == "1"
            # a key that matches none is no other client: it is refused at the door
            assert httpx.get(f"{url}/admin/events", timeout=60,
                             headers={"x-api-key": "made-up"}).status_code == 401
            with _streams(url, 1, {"x-api-key": "other"}) as others:
                assert others == [200]
        with _streams(url, 1, greedy) as again:  # given back when they closed
            assert again == [200]


@pytest.mark.parametrize("dest", ["iframe", "embed", "object", "document", "empty"])
def test_a_page_of_another_site_cannot_open_an_event_stream(tmp_path: Path, dest: str) -> None:
    with served(app_without_workers(tmp_path)) as url:  # no keys: the stream is open
        page = {"sec-fetch-site": "cross-site", "sec-fetch-dest": dest}
        refused = httpx.get(f"{url}/admin/events", headers=page, timeout=60)
        assert refused.status_code == 403 and "another site" in refused.json()["error"]["message"]
        with _streams(url, 1, {"sec-fetch-site": "same-origin", "sec-fetch-dest": "empty"}) \
                as console:
            assert console == [200]
        # the console's own stream, and curl's, are served; other pages' never count
        with _streams(url, 1, {}) as plain:
            assert plain == [200]


def test_shares_bound_each_client_and_all_together() -> None:
    budget = Shares(100, "units")
    assert budget.share == 100 // CLIENT_SHARE
    budget.take("a", 25)
    with pytest.raises(Exception, match="its share"):
        budget.take("a", 1)
    for client in ("b", "c", "d"):
        budget.take(client, 25)
    with pytest.raises(Exception, match="as many units"):
        budget.take("e", 1)
    budget.give("a", 25)
    assert budget.held == 75 and budget.held_by("a") == 0
    budget.take("e", 25)
