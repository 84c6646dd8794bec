"""Schemathesis over the front's own OpenAPI description: no input may produce a 5xx.

Workers are fakes answering like llama.cpp's server (through httpx.MockTransport), so this
exercises the front's edge (validation, auth, admin, admission, assembly) in seconds. The
longer run against a real engine is in docs/configuration.md.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from starlette.routing import Route
from starlette.testclient import TestClient

from bunkhouse.catalog import CatalogModel, build_catalog
from bunkhouse.config import Settings
from bunkhouse.engines import ENGINES
from bunkhouse.front.admin import AdminOptions
from bunkhouse.front.auth import Keys
from bunkhouse.front.constraints import ConstraintGate
from bunkhouse.front.response_store import ResponseStore
from bunkhouse.front.site import SitePolicy
from bunkhouse.residency.manager import ResidencyManager, ResidencyOptions
from tests.fakes import FakeWorker
from tests.helpers import front_app, write_tiny_gguf


async def _streamed(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _reply(payload: Any, content_type: str = "application/json") -> httpx.Response:
    """A response whose body streams, as a real transport's does."""
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return httpx.Response(200, content=_streamed(data), headers={"content-type": content_type})


def _engine(request: httpx.Request) -> httpx.Response:
    path = request.url.path
    body = json.loads(request.content or b"{}")
    if path == "/apply-template":
        return _reply({"prompt": "x"})
    if path == "/tokenize":
        return _reply({"tokens": [{"id": 1, "piece": "x"}] if body.get("with_pieces") else [1]})
    if path == "/detokenize":
        return _reply({"content": "x"})
    if path == "/v1/embeddings":
        return _reply({"object": "list", "data": [
            {"object": "embedding", "index": 0, "embedding": [1.0]}]})
    text = "choices" if path == "/v1/completions" else "delta"
    chunk = ({"choices": [{"index": 0, "text": "hi"}]} if text == "choices"
             else {"choices": [{"index": 0, "delta": {"content": "hi"}}]})
    if body.get("stream"):
        sse = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
        return _reply(sse.encode(), "text/event-stream")
    return _reply(chunk)


class Unmeasured(ConstraintGate):
    """No constraint is measured: the workers are fakes (the probe is tested against a real
    model in tests/e2e/test_constraints.py)."""

    async def check(self, model: CatalogModel, path: str, body: dict[str, Any],
                    client: str = "") -> bool:
        return False


class MockWorker(FakeWorker):
    def __init__(self, model: CatalogModel) -> None:
        super().__init__(model, transport=httpx.MockTransport(_engine))


def _app(root: Path) -> Any:
    write_tiny_gguf(root / "tiny.gguf", context=4096)
    catalog = build_catalog(Settings(models_dirs=(root,), include_packaged=False), engines=ENGINES)

    async def start(model: CatalogModel) -> Any:
        return MockWorker(model)

    residency = ResidencyManager(catalog, ResidencyOptions(budget_bytes=2**34), start)
    return front_app(catalog, residency, keys=Keys(admin=["fuzz"]),
                     responses=ResponseStore(root / "responses.db"),
                     admin_options=AdminOptions(allow_runtime_load=True, roots=(root,)),
                     site=SitePolicy(allowed_hosts=("testserver",)),  # the test client's Host
                     constraints=Unmeasured())


ROOT = Path(tempfile.mkdtemp(prefix="bh-fuzz-"))
APP = _app(ROOT)
# a pause holds every request for up to its max_s, the event stream ends only when the
# server stops, and a pull reaches the Hugging Face hub, which the tests cannot (a 502 by
# design): their own tests cover them (tests/e2e/test_pull.py, against a local hub)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP).exclude(
    path=["/admin/pause", "/admin/events", "/admin/pull", "/api/pull"])


@pytest.fixture(scope="module", autouse=True)
def _cleanup() -> Iterator[None]:
    yield
    shutil.rmtree(ROOT, ignore_errors=True)


def test_the_description_lists_every_route_the_app_serves() -> None:
    """The paths and methods of /openapi.json are the app's route table, both ways: a route
    added without its description (or one described but not served) fails here. Starlette
    answers HEAD wherever it answers GET; the description leaves that out."""
    served = {(method, route.path_format) for route in APP.routes if isinstance(route, Route)
              for method in route.methods or ()
              if not (method == "HEAD" and "GET" in (route.methods or ()))}
    document = TestClient(APP).get("/openapi.json").json()
    described = {(method.upper(), path) for path, operations in document["paths"].items()
                 for method in operations}
    assert served - described == set(), "served but not described"
    assert described - served == set(), "described but not served"
    for path, operations in document["paths"].items():  # each path parameter is described
        for operation in operations.values():
            named = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
            assert named == set(re.findall(r"{(\w+)}", path)), (path, named)


@schemathesis.check
def not_an_undescribed_server_error(ctx: Any, response: Any, case: Any) -> bool | None:
    """No 5xx, but the 501 the description gives for Ollama's routes that are not served."""
    if response.status_code == 501 and "501" in case.operation.definition.raw["responses"]:
        return None
    return not_a_server_error(ctx, response, case)


@schema.parametrize()
@hypothesis.settings(max_examples=25, deadline=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_no_input_gets_a_server_error(case: Any) -> None:
    case.call_and_validate(headers={"authorization": "Bearer fuzz"},
                           checks=[not_an_undescribed_server_error])
