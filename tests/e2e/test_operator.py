"""The operator's view with real workers: ``GET /admin/events`` followed through a load, an
eviction and a crash, resumed by ``Last-Event-ID``; ``GET /metrics`` moving as requests,
loads and evictions happen; polling that never loads a model or counts as use; the server
stopping cleanly with a stream open; a stream open at once; ``bunkhouse events``, also
piped into ``head`` (ending as head does, also between events)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import Server, serve
from tests.helpers import wait_for
from tests.models import GEMMA, QWEN, WHISPER


class Follower:
    """Reads ``GET /admin/events`` on a thread, keeping every message."""

    def __init__(self, url: str, last_event_id: int | None = None) -> None:
        self.messages: list[dict[str, Any]] = []
        self.ended = threading.Event()
        headers = {} if last_event_id is None else {"last-event-id": str(last_event_id)}
        self._client = httpx.Client(timeout=httpx.Timeout(10, read=600))
        self._stream = self._client.stream("GET", f"{url}/admin/events", headers=headers)
        self.response = self._stream.__enter__()
        assert self.response.status_code == 200
        assert self.response.headers["content-type"].startswith("text/event-stream")
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        message: dict[str, Any] = {}
        try:
            for line in self.response.iter_lines():
                if line.startswith("id:"):
                    message["id"] = int(line[3:].strip())
                elif line.startswith("event:"):
                    message["event"] = line[6:].strip()
                elif line.startswith("data:"):
                    message["data"] = json.loads(line[5:].strip())
                elif line == "" and "data" in message:
                    self.messages.append(message)
                    message = {}
        except httpx.HTTPError:
            pass
        finally:
            self.ended.set()

    def events(self) -> list[dict[str, Any]]:
        return [m["data"] for m in list(self.messages) if "id" in m]

    def has(self, model: str, kind: str) -> bool:
        return any(e["model"] == model and e["kind"] == kind for e in self.events())

    def close(self) -> None:
        self.response.close()
        self._client.close()


def _metrics(server: Server) -> dict[str, list[Any]]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _value(samples: dict[str, list[Any]], family: str, name: str, **labels: str) -> float:
    return sum(s.value for s in samples.get(family, [])
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _chat(server: Server, model: str, stream: bool = False) -> None:
    """A chat with Qwen; a completion with Gemma (a base model: no chat template)."""
    body: dict[str, Any] = {"model": model, "max_tokens": 4, "stream": stream}
    if model == QWEN:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "Hi"}]
    else:
        path, body["prompt"] = "/v1/completions", "Once upon a time"
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=300) as resp:
        resp.read()
        assert resp.status_code == 200, resp.text


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    # a budget for one model at a time: loading the other evicts the first
    with serve(tmp_path, "--budget", "800MiB", "--context", "8192",
               "--probe-interval", "0.5") as s:
        yield s


def test_events_follow_a_load_an_eviction_and_a_crash_and_resume(server: Server) -> None:
    for path in ("/health", "/v1/models", "/metrics", "/", "/stats", "/api/ps", "/api/tags"):
        for _ in range(3):
            assert httpx.get(f"{server.url}{path}", timeout=30).status_code == 200
    assert {m["id"]: m["state"] for m in server.stats()["models"]} == {
        QWEN: "absent", GEMMA: "absent", WHISPER: "absent"}  # polling loads nothing

    # CORS, as a browser asks it: a page on this machine may call, another site may not
    def preflight(origin: str, path: str = "/v1/chat/completions") -> httpx.Response:
        return httpx.options(f"{server.url}{path}", timeout=30, headers={
            "origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "content-type,authorization"})

    local = preflight("http://localhost:3000")
    assert local.status_code == 204
    assert local.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in local.headers["access-control-allow-methods"]
    assert "access-control-allow-origin" not in preflight("http://evil.example").headers
    assert preflight("http://localhost:3000", f"/v1/models/{QWEN}/load").status_code == 403
    crossed = httpx.post(f"{server.url}/v1/models/{QWEN}/load", timeout=30,
                         headers={"origin": "http://localhost:3000"})
    assert crossed.status_code == 403 and "cors-origin" in crossed.json()["error"]["message"]

    follower = Follower(server.url)
    before = _metrics(server)
    try:
        _chat(server, QWEN, stream=True)
        _chat(server, QWEN)
        used = server.model(QWEN)["last_used"]
        for path in ("/health", "/v1/models", f"/v1/models/{QWEN}", "/metrics", "/api/ps"):
            httpx.get(f"{server.url}{path}", timeout=30)
        assert server.model(QWEN)["last_used"] == used  # polling is no use

        _chat(server, GEMMA)  # the budget holds one: qwen is evicted to make room
        pid = server.model(GEMMA)["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: follower.has(GEMMA, "crashed"), 120, "the crash on the stream")
        wait_for(lambda: server.model(GEMMA)["state"] in ("ready", "absent"), 180,
                 "gemma to settle after its crash")
        after = _metrics(server)
        events = follower.events()
    finally:
        follower.close()

    kinds = [(e["model"], e["kind"]) for e in events]
    order = [(QWEN, "loading"), (QWEN, "ready"), (QWEN, "draining"), (QWEN, "absent"),
             (GEMMA, "loading"), (GEMMA, "ready"), (GEMMA, "crashed")]
    positions = [kinds.index(k) for k in order]
    assert positions == sorted(positions), kinds
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    ready = next(e for e in events if (e["model"], e["kind"]) == (QWEN, "ready"))
    assert ready["data"]["measured_bytes"] > 0 and ready["data"]["load_s"] > 0
    drained = next(e for e in events if (e["model"], e["kind"]) == (QWEN, "draining"))
    assert drained["data"]["cause"] == "room" and GEMMA in drained["reason"]

    # resumed after qwen's ready: the first event is the one that followed it
    resumed = Follower(server.url, last_event_id=ready["seq"])
    try:
        wait_for(lambda: len(resumed.events()) >= 3, 60, "the resumed stream's backlog")
        assert resumed.events()[0]["seq"] == ready["seq"] + 1
        assert [e["seq"] for e in resumed.events()[:3]] == [s for s in seqs
                                                            if s > ready["seq"]][:3]
    finally:
        resumed.close()
    # a number the server never gave (it restarted): told so, then everything it holds
    restarted = Follower(server.url, last_event_id=10**9)
    try:
        wait_for(lambda: len(restarted.messages) >= 2, 60, "the gap notice and the backlog")
        assert restarted.messages[0]["event"] == "gap"
        assert restarted.messages[1]["id"] == 1
    finally:
        restarted.close()
    bad = httpx.get(f"{server.url}/admin/events", headers={"last-event-id": "x1"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"

    def moved(family: str, name: str, **labels: str) -> float:
        return (_value(after, family, name, **labels)
                - _value(before, family, name, **labels))

    chat = {"route": "/v1/chat/completions", "protocol": "openai", "status": "200"}
    assert moved("bunkhouse_requests", "bunkhouse_requests_total", model=QWEN, **chat) == 2
    assert moved("bunkhouse_requests", "bunkhouse_requests_total", model=GEMMA,
                 route="/v1/completions", status="200") == 1
    assert moved("bunkhouse_time_to_first_token_seconds",
                 "bunkhouse_time_to_first_token_seconds_count", model=QWEN) == 1
    assert moved("bunkhouse_queue_wait_seconds", "bunkhouse_queue_wait_seconds_count",
                 model=QWEN) == 2
    assert moved("bunkhouse_prompt_tokens", "bunkhouse_prompt_tokens_total", model=QWEN) > 10
    assert moved("bunkhouse_generated_tokens", "bunkhouse_generated_tokens_total",
                 model=QWEN) >= 2
    assert moved("bunkhouse_engine_decode_seconds", "bunkhouse_engine_decode_seconds_total",
                 model=QWEN) > 0
    assert moved("bunkhouse_model_load_seconds", "bunkhouse_model_load_seconds_count",
                 model=QWEN) == 1
    assert moved("bunkhouse_evictions", "bunkhouse_evictions_total", model=QWEN,
                 cause="room") == 1
    assert moved("bunkhouse_residency_events", "bunkhouse_residency_events_total",
                 model=GEMMA, kind="crashed") == 1
    assert _value(after, "bunkhouse_budget_bytes", "bunkhouse_budget_bytes") == 800 * 2**20
    assert _value(after, "bunkhouse_peak_used_bytes", "bunkhouse_peak_used_bytes") > 0
    assert "bunkhouse_compute_gate_waits" in after

    # at most 64 event streams, however many connect at once
    async def connect(n: int) -> list[int]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            responses = await asyncio.gather(*(
                client.send(client.build_request("GET", f"{server.url}/admin/events"),
                            stream=True) for _ in range(n)))
            for resp in responses:
                await resp.aclose()
            return [r.status_code for r in responses]

    statuses = asyncio.run(connect(80))
    assert set(statuses) == {200, 503} and statuses.count(200) <= 64, statuses


def test_an_event_stream_opens_at_once(qwen_server: Server) -> None:
    """Headers and a first line go out as the stream is accepted, not with its first event
    or its first heartbeat 15 s on: a quiet server's stream is open at once for a browser's
    EventSource or a proxy timing the first byte."""
    with httpx.stream("GET", f"{qwen_server.url}/admin/events", timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert next(resp.iter_lines()) == ": connected"


def _ends_with_head_before_the_next_event(server: Server, follower: Follower) -> None:
    """``bunkhouse events --since N | head -2`` with exactly two events held after N and no
    new one: both lines are written before head leaves, so no write meets the closed pipe;
    the command ends as head does (its watch on stdout), quietly, status 1."""
    since = max(m["id"] for m in follower.messages if "id" in m) - 2
    piped = subprocess.Popen([sys.executable, "-m", "bunkhouse", "events", "--since",
                              str(since), "--url", server.url], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    head = subprocess.Popen(["head", "-2"], stdin=piped.stdout, stdout=subprocess.PIPE)
    assert piped.stdout is not None
    piped.stdout.close()
    assert len(head.communicate(timeout=60)[0].splitlines()) == 2
    _, err = piped.communicate(timeout=60)  # no event comes meanwhile
    assert piped.returncode == 1 and err == b"", err


def test_streams_end_when_the_server_stops_and_bunkhouse_events_prints(tmp_path: Path
                                                                       ) -> None:
    with serve(tmp_path, "--context", "8192") as server:
        follower = Follower(server.url)
        cli = subprocess.Popen([sys.executable, "-m", "bunkhouse", "events", "--url",
                                server.url, "--since", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        # `BUNKHOUSE_URL=... bunkhouse events | head -3`: the server from the environment,
        # and an end without a traceback when head has had its lines
        piped = subprocess.Popen([sys.executable, "-m", "bunkhouse", "events", "--since", "0"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env={**os.environ, "BUNKHOUSE_URL": server.url})
        head = subprocess.Popen(["head", "-3"], stdin=piped.stdout, stdout=subprocess.PIPE)
        assert piped.stdout is not None
        piped.stdout.close()  # head alone reads it
        try:
            _chat(server, GEMMA)
            wait_for(lambda: follower.has(GEMMA, "ready"), 120, "gemma ready on the stream")
            _ends_with_head_before_the_next_event(server, follower)
            server.proc.send_signal(signal.SIGHUP)  # a 3rd event at least: head has its lines
            wait_for(lambda: follower.has("*", "config reloaded"), 120, "the reload's event")
        finally:
            cli.send_signal(signal.SIGINT)
            out, err = cli.communicate(timeout=60)
        assert cli.returncode == 0, err
        lines = out.splitlines()
        assert any(f"{GEMMA}: loading" in line for line in lines), out
        assert any(f"{GEMMA}: ready" in line and "measured" in line for line in lines), out
        # serve()'s exit sends SIGTERM and asserts a clean exit 0 within its deadline,
        # with this stream still open
    assert follower.ended.wait(30)
    follower.close()
    assert follower.events()[-1]["kind"] == "stopping"
    # the stop's event came after head's three lines: the piped command met its closed pipe
    assert len(head.communicate(timeout=60)[0].splitlines()) == 3
    _, piped_err = piped.communicate(timeout=60)
    assert piped.returncode == 1 and piped_err == b"", piped_err
