"""The log a user reads: one access line per client request, none of the front's own polling
of its workers (every 5 s per model, every 50 ms during a load) at the default level."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import serve
from tests.models import QWEN


def test_twenty_requests_are_twenty_access_lines_and_no_polling(tmp_path: Path) -> None:
    with serve(tmp_path, "--preload", QWEN, "--probe-interval", "0.5") as server:
        url = server.url
        for i in range(10):
            chat = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
                "max_tokens": 2, "messages": [{"role": "user", "content": f"Hi {i}"}]})
            assert chat.status_code == 200
        for _ in range(5):
            with httpx.stream("POST", f"{url}/v1/completions", timeout=300, json={
                    "model": QWEN, "prompt": "Once", "max_tokens": 2, "stream": True}) as resp:
                assert resp.status_code == 200
                resp.read()
        for path in ("/v1/models", "/v1/models", "/api/tags"):
            assert httpx.get(f"{url}{path}").status_code == 200
        scraped = httpx.get(f"{url}/metrics")  # the 20th: residency as Prometheus reads it
        families = {f.name: f for f in text_string_to_metric_families(scraped.text)}
        ready = [s for s in families["bunkhouse_model_state"].samples
                 if s.labels == {"model": QWEN, "state": "ready"}]
        assert ready[0].value == 1.0
        events = {s.labels["kind"]: s.value
                  for s in families["bunkhouse_residency_events"].samples}
        assert events["ready"] >= 1 and events["loading"] >= 1
        missing = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "nobody", "messages": [{"role": "user", "content": "Hi"}]})
        assert missing.status_code == 404
    log = server.log.read_text().splitlines()
    access = [line for line in log if " bunkhouse.access: " in line]
    assert len(access) == 20, "\n".join(access)
    assert not [line for line in log if "HTTP Request:" in line]  # polling: debug only
    chats = [line for line in access if "POST /v1/chat/completions" in line]
    assert all(f"model={QWEN} status=200" in line for line in chats[:10])
    assert all("tokens=" in line and "tokens=-" not in line for line in chats[:10])
    assert "model=- status=404" in chats[-1]
