"""API keys and request limits at the HTTP edge, without workers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.requests import Request
from starlette.testclient import TestClient

from bunkhouse.errors import Forbidden, Unauthorized
from bunkhouse.front.auth import Keys, Level
from tests.helpers import app_without_workers

KEYS = Keys(client=["client-secret"], admin=["admin-secret"])


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(app_without_workers(tmp_path, keys=KEYS, max_body_bytes=1000),
                    base_url="http://localhost") as c:
        yield c


def _request(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "GET", "path": "/", "headers": raw})


@pytest.mark.parametrize(
    ("headers", "level", "expected"),
    [
        ({}, Level.OPEN, None),
        ({}, Level.CLIENT, Unauthorized),
        ({"authorization": "Bearer wrong"}, Level.CLIENT, Unauthorized),
        ({"authorization": "Bearer client-secret"}, Level.CLIENT, None),
        ({"x-api-key": "client-secret"}, Level.CLIENT, None),
        ({"authorization": "Bearer admin-secret"}, Level.CLIENT, None),
        ({}, Level.ADMIN, Unauthorized),
        ({"authorization": "Bearer wrong"}, Level.ADMIN, Unauthorized),
        ({"authorization": "Bearer client-secret"}, Level.ADMIN, Forbidden),
        ({"x-api-key": "admin-secret"}, Level.ADMIN, None),
        ({"authorization": "Basic admin-secret"}, Level.ADMIN, Unauthorized),
    ],
)
def test_key_matrix(headers: dict[str, str], level: Level, expected: type | None) -> None:
    if expected is None:
        KEYS.check(_request(headers), level)
    else:
        with pytest.raises(expected):
            KEYS.check(_request(headers), level)


def test_without_client_keys_inference_is_open_but_admin_is_not() -> None:
    keys = Keys(admin=["a"])
    keys.check(_request({}), Level.CLIENT)
    with pytest.raises(Unauthorized):
        keys.check(_request({}), Level.ADMIN)
    with pytest.raises(Forbidden, match=r"admin endpoints are off.*--admin-key"):
        Keys().check(_request({"x-api-key": "anything"}), Level.ADMIN)
    with pytest.raises(Forbidden, match="restart it with --admin-key"):
        Keys(client=["c"]).check(_request({"x-api-key": "c"}), Level.ADMIN)


def test_inference_endpoints_need_a_key(client: TestClient) -> None:
    body = {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert "client-secret" not in resp.text
    ok = client.post("/v1/chat/completions", json=body,
                     headers={"authorization": "Bearer client-secret"})
    assert ok.status_code == 404  # past the key check: the model is unknown
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"x-api-key": "client-secret"}).status_code == 200
    assert client.get("/stats").status_code == 401
    assert client.get("/health").status_code == 200  # liveness stays open


def test_oversize_body_is_413(client: TestClient) -> None:
    headers = {"x-api-key": "client-secret"}
    resp = client.post("/v1/completions", content=b"{" + b" " * 2000 + b"}", headers=headers)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_deeply_nested_json_is_400(client: TestClient) -> None:
    headers = {"x-api-key": "client-secret"}
    body = b'{"prompt": "x", "x": ' + b"[" * 70 + b"]" * 70 + b"}"
    resp = client.post("/v1/completions", content=body, headers=headers)
    assert resp.status_code == 400 and "nests deeper" in resp.json()["error"]["message"]


def test_a_body_of_millions_of_values_is_400_before_it_is_parsed(tmp_path: Path) -> None:
    """16 MiB of ``[{},{},...]`` in an unknown field parsed into 400 MB of objects."""
    body = b'{"prompt": "x", "junk": [' + b",".join([b"{}"] * 5_000_000) + b"]}"
    with TestClient(app_without_workers(tmp_path, keys=KEYS),
                    base_url="http://localhost") as client:
        resp = client.post("/v1/completions", content=body,
                           headers={"x-api-key": "client-secret"})
    assert resp.status_code == 400 and "JSON values" in resp.json()["error"]["message"]


def test_a_million_token_ids_and_long_texts_are_still_read() -> None:
    """The count is about values, not bytes: strings of any length count once."""
    from bunkhouse.api.schemas import MAX_JSON_VALUES, json_values, parse_json_object

    ids = b'{"tokens": [' + b",".join([b"151643"] * 1_048_576) + b"]}"
    assert len(parse_json_object(ids)["tokens"]) == 1_048_576
    text = b'{"prompt": "' + b'a, [b], {c}, ' * 1_000_000 + b'"}'
    assert json_values(text) < 10 < MAX_JSON_VALUES
    assert parse_json_object(text)["prompt"].startswith("a, [b]")


def test_every_route_is_in_the_access_table_and_the_table_names_no_dead_route(
        tmp_path: Path) -> None:
    from starlette.routing import Route

    from bunkhouse.front.auth import ACCESS
    app = app_without_workers(tmp_path, keys=KEYS)
    served = {(m, r.path) for r in app.routes if isinstance(r, Route) for m in r.methods or ()
              if m != "HEAD"}
    assert served == set(ACCESS)
    assert {p for (_, p), level in ACCESS.items() if level is Level.OPEN} == {
        "/health", "/openapi.json", "/", "/console/{name}"}
    inference = {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages",
                 "/v1/messages/count_tokens", "/v1/responses",
                 "/v1/responses/{response_id}",  # a client deletes its own stored responses
                 "/api/chat", "/api/generate", "/api/show", "/api/embed", "/api/embeddings",
                 "/infill", "/tokenize", "/detokenize", "/apply-template",
                 "/v1/audio/transcriptions",
                 "/api/push", "/api/create", "/api/copy", "/api/delete"}  # 501s
    assert all(level is Level.ADMIN for (m, p), level in ACCESS.items()
               if m in ("POST", "DELETE") and p not in inference)


def test_health_shows_model_states_only_to_a_client_level_caller(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/health", headers={"x-api-key": "wrong"}).json() == {"status": "ok"}
    for key in ("client-secret", "admin-secret"):
        assert "models" in client.get("/health", headers={"x-api-key": key}).json()


def test_level_of() -> None:
    assert KEYS.level_of(_request({})) is Level.OPEN
    assert KEYS.level_of(_request({"x-api-key": "client-secret"})) is Level.CLIENT
    assert KEYS.level_of(_request({"authorization": "Bearer admin-secret"})) is Level.ADMIN
    assert Keys().level_of(_request({})) is Level.CLIENT  # no client key: inference is open
    assert Keys().level_of(_request({"x-api-key": "x"})) is Level.CLIENT


def test_bodies_held_at_once_are_bounded() -> None:
    import asyncio

    from bunkhouse.api.schemas import read_body
    from bunkhouse.errors import ServerBusy
    from bunkhouse.shares import Shares

    def request(chunks: list[bytes], gate: asyncio.Event) -> Request:
        async def receive() -> dict[str, object]:
            if len(chunks) == 1:
                await gate.wait()  # hold the last chunk back: the body is still being read
            return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)}

        return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)

    async def run() -> None:
        budget, gate = Shares(1000, "bytes", share=1000), asyncio.Event()
        slow = asyncio.create_task(read_body(request([b"a" * 600, b"b"], gate), 10_000, budget))
        await asyncio.sleep(0.1)
        assert budget.held == 600
        with pytest.raises(ServerBusy):
            await read_body(request([b"c" * 600, b""], asyncio.Event()), 10_000, budget)
        gate.set()
        assert await slow == b"a" * 600 + b"b"
        assert budget.held == 0
        assert await read_body(request([b"c" * 600, b""], gate), 10_000, budget) == b"c" * 600

    asyncio.run(run())
