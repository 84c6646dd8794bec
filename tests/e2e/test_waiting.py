"""Waiting is visible: a streamed request that waits for its model to load gets its headers
at once, pings while it waits and (opted in) what it waits for; real SDKs read through the
wait; one that waits in vain gets its protocol's error event; polling never loads."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import Server, serve
from tests.helpers import wait_for
from tests.models import GEMMA, QWEN

ADMIN = {"authorization": "Bearer admin-secret"}


def _unload(server: Server, model: str) -> None:
    resp = httpx.post(f"{server.url}/v1/models/{model}/unload", headers=ADMIN, timeout=120)
    assert resp.status_code in (200, 204)  # 200: absent already


def test_a_stream_waiting_for_a_load_gets_headers_pings_and_loading_state(tmp_path: Path
                                                                          ) -> None:
    with serve(tmp_path, "--context", "8192", "--sse-ping-interval", "0.2",
               "--send-loading-state", "--admin-key", "admin-secret") as server:
        body = {"model": QWEN, "stream": True, "max_tokens": 8,
                "messages": [{"role": "user", "content": "Say hello"}]}
        lines: list[str] = []
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                          timeout=300) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            state_at_headers = server.model(QWEN)["state"]
            for line in resp.iter_lines():
                lines.append(line)
        assert state_at_headers in ("absent", "loading"), state_at_headers
        pings = [line for line in lines if line.startswith(":")]
        assert lines[0].startswith(":"), lines[:3]  # a first ping with the headers
        assert pings, lines[:20]
        chunks = [json.loads(line[6:]) for line in lines
                  if line.startswith("data: {")]
        reasoning = [c["choices"][0]["delta"].get("reasoning_content") for c in chunks]
        assert any(r and f"loading model {QWEN}" in r for r in reasoning), chunks[:5]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
        assert text.strip()
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"

        # the SDKs read through a wait: pings, loading state and all
        _unload(server, QWEN)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(
            model=QWEN, stream=True, max_tokens=8,
            messages=[{"role": "user", "content": "Say hello"}])
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip()
        client.close()
        _unload(server, QWEN)
        sdk = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        with sdk.messages.stream(model=QWEN, max_tokens=8, messages=[
                {"role": "user", "content": "Say hello"}]) as s:
            events = list(s)
            final = s.get_final_message()
        assert "".join(b.text for b in final.content if b.type == "text").strip()
        # its message_start, sent once the wait ended, already counts the prompt
        start = next(e for e in events if e.type == "message_start")
        assert start.message.usage.input_tokens == final.usage.input_tokens > 0
        sdk.close()

        # each answer's first token came after its wait ended, pings or not
        families = {f.name: f for f in text_string_to_metric_families(
            httpx.get(f"{server.url}/metrics", timeout=30).text)}

        def total(family: str) -> float:
            return sum(x.value for x in families[family].samples
                       if x.name == f"{family}_sum" and x.labels["model"] == QWEN)

        assert total("bunkhouse_time_to_first_token_seconds") >= \
            total("bunkhouse_queue_wait_seconds") > 0
    log = server.log.read_text()
    assert f"model {QWEN}: ready" in log


def _long_qwen(server: Server, stop: threading.Event) -> None:
    """A long generation holding qwen until ``stop`` is set (then the client leaves)."""
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=300, json={
            "model": QWEN, "prompt": "Count:", "stream": True, "max_tokens": 4000,
            "ignore_eos": True}) as resp:
        for _ in resp.iter_lines():
            if stop.is_set():
                return


def test_a_stream_that_waits_in_vain_gets_an_error_event(tmp_path: Path) -> None:
    # a budget for one model, held by a busy qwen: gemma waits for memory, in vain
    with serve(tmp_path, "--context", "8192", "--budget", "800MiB", "--sse-ping-interval",
               "0.2", "--admission-wait", "3", "--preload", QWEN) as server:
        stop = threading.Event()
        busy = threading.Thread(target=_long_qwen, args=(server, stop))
        busy.start()
        try:
            wait_for(lambda: server.model(QWEN)["running"] == 1, 120, "qwen to be busy")
            lines: list[str] = []
            with httpx.stream("POST", f"{server.url}/v1/completions", timeout=300, json={
                    "model": GEMMA, "prompt": "Once", "stream": True,
                    "max_tokens": 4}) as resp:
                assert resp.status_code == 200  # committed while it waited
                lines = list(resp.iter_lines())
            errors = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            assert "event: error" in lines, lines
            assert errors[-1]["error"]["code"] == "insufficient_memory", errors
            assert any(line.startswith(":") for line in lines)

            # a client that leaves while waiting gives its place up at once
            with httpx.stream("POST", f"{server.url}/v1/completions", timeout=300, json={
                    "model": GEMMA, "prompt": "Once", "stream": True,
                    "max_tokens": 4}) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith(":"):
                        break  # gone after the first ping
            wait_for(lambda: "load given up" in server.log.read_text(), 60,
                     "gemma's load to be given up")
            assert server.model(GEMMA)["waiting"] == 0
            # and so does a plain request whose client gives up waiting
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{server.url}/v1/completions", json={
                    "model": GEMMA, "prompt": "Once", "max_tokens": 4},
                    timeout=httpx.Timeout(30, read=1.0))
            wait_for(lambda: server.log.read_text().count("load given up") >= 2, 60,
                     "the plain request's load to be given up")
            wait_for(lambda: server.model(GEMMA)["waiting"] == 0, 60, "its place given up")
            assert server.model(QWEN)["running"] == 1  # the busy stream went on throughout
        finally:
            stop.set()
            busy.join(300)
        wait_for(lambda: server.model(QWEN)["running"] == 0, 60, "qwen's stream to end")
        # nobody waits for gemma any more: qwen is not evicted for it
        events = [(e["model"], e["kind"]) for e in server.stats()["events"]]
        assert (QWEN, "draining") not in events and (GEMMA, "loading") not in events, events
        assert server.model(GEMMA)["state"] == "absent"
