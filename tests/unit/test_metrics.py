"""GET /metrics through the whole front, read back with prometheus-client's own parser."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from tests.helpers import app_without_workers


def test_metrics_parse_and_show_residency(tmp_path: Path) -> None:
    with TestClient(app_without_workers(tmp_path), base_url="http://localhost:8080") as c:
        resp = c.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    for name in ("bunkhouse_model_state", "bunkhouse_model_estimated_bytes",
                 "bunkhouse_model_leases", "bunkhouse_model_queued_requests",
                 "bunkhouse_budget_bytes", "bunkhouse_used_bytes", "bunkhouse_residency_events"):
        assert name in families, sorted(families)
    states = {s.labels["state"]: s.value for s in families["bunkhouse_model_state"].samples
              if s.labels["model"] == "tiny"}
    assert states["absent"] == 1.0 and states["ready"] == 0.0
    assert families["bunkhouse_budget_bytes"].samples[0].value == 2**30


def test_request_labels_stay_bounded_whatever_a_client_sends(tmp_path: Path) -> None:
    from bunkhouse.front.metrics import protocol_of

    with TestClient(app_without_workers(tmp_path), base_url="http://localhost:8080") as c:
        for i in range(20):
            c.get(f"/no/such/path/{i}")
            c.post("/v1/chat/completions", json={"model": f"nobody-{i}", "messages": [
                {"role": "user", "content": "hi"}]})
        c.options("/v1/models", headers={"origin": "http://localhost:3000",
                                         "access-control-request-method": "GET"})
        text = c.get("/metrics").text
    samples = [s for f in text_string_to_metric_families(text)
               if f.name == "bunkhouse_requests" for s in f.samples
               if s.name == "bunkhouse_requests_total"]
    labels = {(s.labels["route"], s.labels["model"], s.labels["status"]): s.value
              for s in samples}
    assert labels[("unmatched", "-", "404")] == 20
    assert labels[("/v1/chat/completions", "-", "404")] == 20
    assert len(labels) <= 4, labels
    assert [protocol_of(r) for r in ("/v1/messages", "/v1/responses/{response_id}", "/api/chat",
                                     "/v1/embeddings", "/infill", "/admin/events", "/health")
            ] == ["anthropic", "responses", "ollama", "openai", "llamacpp", "admin", "other"]
    assert protocol_of("/v1/models/{model_id:path}/{action}", "POST") == "admin"
    assert protocol_of("/v1/models/{model_id:path}", "GET") == "openai"
