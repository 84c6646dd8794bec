"""CORS through the whole front (Starlette's middleware): pages on this machine may call the
API from a browser, other sites may not unless named, and admin routes answer only origins
named explicitly."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tests.helpers import app_without_workers


def _preflight(c: TestClient, path: str, origin: str, method: str = "POST") -> dict[str, str]:
    resp = c.options(path, headers={"origin": origin, "access-control-request-method": method,
                                    "access-control-request-headers": "content-type"})
    return {"status": str(resp.status_code),
            "allow": resp.headers.get("access-control-allow-origin", "")}


@pytest.mark.parametrize(("path", "method"), [
    ("/v1/chat/completions", "POST"), ("/api/chat", "POST"), ("/v1/models", "GET"),
    ("/v1/messages", "POST"), ("/infill", "POST")])
def test_loopback_pages_may_call_the_api_and_other_sites_may_not(tmp_path: Path, path: str,
                                                                  method: str) -> None:
    with TestClient(app_without_workers(tmp_path), base_url="http://localhost:8080") as c:
        local = _preflight(c, path, "http://localhost:3000", method)
        assert local == {"status": "204", "allow": "http://localhost:3000"}
        assert _preflight(c, path, "http://127.0.0.1:5173", method)["allow"] == \
            "http://127.0.0.1:5173"
        evil = _preflight(c, path, "http://evil.example", method)
        assert evil["allow"] == ""
        listed = c.get("/v1/models", headers={"origin": "http://localhost:3000"})
        assert listed.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_admin_routes_answer_only_origins_named_explicitly(tmp_path: Path) -> None:
    app = app_without_workers(tmp_path, cors_origins=["https://ops.example", "*"])
    with TestClient(app, base_url="http://localhost:8080") as c:
        for origin in ("http://localhost:3000", "http://evil.example"):
            assert _preflight(c, "/admin/reload", origin)["status"] == "403"
            refused = c.post("/admin/reload", headers={"origin": origin})
            assert refused.status_code == 403 and "--cors-origin" in refused.text
            assert c.post("/v1/models/tiny/unload",
                          headers={"origin": origin}).status_code == 403
        named = _preflight(c, "/admin/reload", "https://ops.example")
        assert named == {"status": "204", "allow": "https://ops.example"}
        # * opens the API to any page, never the admin routes
        assert _preflight(c, "/v1/chat/completions", "http://evil.example")["allow"] == "*"
        # the server's own pages and callers without an Origin are not cross-origin
        for headers in ({"origin": "http://localhost:8080"}, {}):  # the key check answers
            assert "--cors-origin" not in c.post("/admin/reload", headers=headers).text
