"""DNS rebinding and cross-site simple requests (front/site.py), through the app's edge."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.datastructures import Headers
from starlette.testclient import TestClient

from bunkhouse.front.site import SitePolicy, is_loopback_bind
from tests.helpers import app_without_workers

CHAT = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    app = app_without_workers(tmp_path, site=SitePolicy.for_bind("127.0.0.1", ["box.lan"]))
    with TestClient(app, base_url="http://localhost:8080") as c:
        yield c


@pytest.mark.parametrize("host", ["localhost:8080", "127.0.0.1:8080", "[::1]:8080",
                                  "dev.localhost", "10.0.0.7", "box.lan:8080", "LOCALHOST"])
def test_local_and_allowed_hosts_are_served(client: TestClient, host: str) -> None:
    assert client.get("/health", headers={"host": host}).status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "localhost.evil.example",
                                  "box.lan.evil.example", "127.0.0.1.nip.io"])
def test_a_rebinding_host_is_refused_on_every_route(client: TestClient, host: str) -> None:
    for method, path in (("GET", "/health"), ("GET", "/v1/models"),
                         ("POST", "/v1/chat/completions")):
        resp = client.request(method, path, headers={"host": host}, json=CHAT)
        assert resp.status_code == 403, (method, path)
        err = resp.json()["error"]
        assert err["code"] == "permission_denied" and "--allowed-host" in err["message"]


def test_bound_to_all_interfaces_any_host_is_served(tmp_path: Path) -> None:
    app = app_without_workers(tmp_path, site=SitePolicy.for_bind("0.0.0.0"))
    with TestClient(app, base_url="http://evil.example") as c:
        assert c.get("/health").status_code == 200


@pytest.mark.parametrize(("headers", "refused"), [
    ({"content-type": "text/plain"}, False),  # curl -H, no browser
    ({"content-type": "application/x-www-form-urlencoded"}, False),  # curl -d
    ({"content-type": "text/plain", "origin": "https://evil.example"}, True),
    ({"content-type": "text/plain;charset=UTF-8", "origin": "null"}, True),
    ({"content-type": "multipart/form-data; boundary=x", "origin": "http://evil.example"}, True),
    ({"content-type": "text/plain", "sec-fetch-site": "cross-site"}, True),
    ({"content-type": "text/plain", "origin": "http://localhost:8080"}, False),  # same origin
    ({"content-type": "text/plain", "origin": "http://localhost:3000"}, False),  # a local page
    ({"content-type": "text/plain", "sec-fetch-site": "same-origin"}, False),
    ({"content-type": "application/json", "origin": "https://evil.example"}, False),  # preflight
    ({"origin": "https://evil.example"}, True),  # a fetch of raw bytes: no content type
    ({"content-type": "", "sec-fetch-site": "cross-site"}, True),
    ({"content-type": "text/plain", "origin": "http://203.0.113.7"}, True),  # another machine
    ({"content-type": "text/plain", "origin": "http://127.0.0.1:3000"}, False),
    ({"content-type": "text/plain", "origin": "http://[::1"}, True),  # unparseable
    ({}, False),  # curl --data-binary with the content type removed, no Origin
])
def test_cross_site_simple_bodies_are_refused(client: TestClient, headers: dict[str, str],
                                              refused: bool) -> None:
    import json
    resp = client.post("/v1/chat/completions", content=json.dumps(CHAT), headers=headers)
    if refused:
        assert resp.status_code == 403 and "application/json" in resp.json()["error"]["message"]
    else:
        assert resp.status_code == 404  # reached the route: the model is unknown


@pytest.mark.parametrize(("bind", "loopback"), [("127.0.0.1", True), ("127.0.0.2", True),
                                                ("::1", True), ("localhost", True),
                                                ("0.0.0.0", False), ("::", False),
                                                ("192.168.1.4", False), ("myhost", False)])
def test_loopback_binds(bind: str, loopback: bool) -> None:
    assert is_loopback_bind(bind) is loopback


def test_no_host_header_is_served() -> None:
    assert SitePolicy().refusal("GET", Headers({}), "/health") is None


def test_an_http11_request_needs_exactly_one_host() -> None:
    import asyncio

    from bunkhouse.front.site import SiteGuard

    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("refused before the app")

    async def status(headers: list[tuple[bytes, bytes]], version: str) -> int:
        sent: list[dict[str, object]] = []

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": b""}

        scope = {"type": "http", "method": "GET", "path": "/health", "headers": headers,
                 "http_version": version, "query_string": b""}
        await SiteGuard(app, SitePolicy())(scope, receive, send)  # type: ignore[arg-type]
        return int(sent[0]["status"])  # type: ignore[call-overload]

    two = [(b"host", b"localhost"), (b"host", b"evil.example")]
    assert asyncio.run(status(two, "1.1")) == 400
    assert asyncio.run(status([], "1.1")) == 400


def test_an_origin_named_with_cors_origin_may_send_simple_bodies() -> None:
    named = SitePolicy.for_bind("127.0.0.1", cors_origins=["https://App.example", "*"])
    browser = {"content-type": "text/plain", "sec-fetch-site": "cross-site"}
    assert named.refusal("POST", Headers({**browser, "origin": "https://app.example"}),
                         "/v1/completions") is None
    assert named.refusal("POST", Headers({**browser, "origin": "https://evil.example"}),
                         "/v1/completions")
    assert named.trusted_origins == ("https://app.example",)  # never "*"
