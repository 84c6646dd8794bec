"""`bunkhouse serve` as a user runs it, driven by real HTTP clients and the openai SDK."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.server import Server, serve
from tests.helpers import listening_socket, wait_for
from tests.models import GEMMA, QWEN, WHISPER

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("serve")
    config = workdir / "bunkhouse.toml"
    config.write_text("[defaults]\nembeddings = true\n")
    with serve(workdir, "--config", str(config)) as running:
        yield running


def test_curl_style_chat_uses_the_default_model(server: Server) -> None:
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                      json={"messages": FRANCE, "max_tokens": 24, "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["model"] == QWEN
    assert server.model(QWEN)["state"] == "ready"


def test_openai_sdk_sync(server: Server) -> None:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none") as client:
        reply = client.chat.completions.create(model=QWEN, messages=FRANCE,  # type: ignore[arg-type]
                                               max_tokens=24, temperature=0)
        assert "Paris" in (reply.choices[0].message.content or "")
        models = [m.id for m in client.models.list()]
    assert models == [QWEN, GEMMA, WHISPER]  # the packaged ones


def test_openai_sdk_async_streaming(server: Server) -> None:
    async def run() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none") as client:
            stream = await client.chat.completions.create(
                model=QWEN, messages=FRANCE, max_tokens=24, temperature=0,  # type: ignore[arg-type]
                stream=True, stream_options={"include_usage": True})
            return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0


def test_raw_stream_has_usage_and_done(server: Server) -> None:
    body = {"model": QWEN, "messages": FRANCE, "max_tokens": 16, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=120) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] > 0 and usage["prompt_tokens"] > 0


def test_completions_and_two_models_in_turn(server: Server) -> None:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none") as client:
        for model in (GEMMA, QWEN, GEMMA):
            comp = client.completions.create(model=model, prompt="The capital of France is",
                                             max_tokens=8, temperature=0)
            assert comp.model == model
            assert comp.choices[0].text.strip()
            if model == QWEN:
                assert "Paris" in comp.choices[0].text
    assert server.model(GEMMA)["state"] == server.model(QWEN)["state"] == "ready"
    assert server.model(GEMMA)["pid"] != server.model(QWEN)["pid"]


@pytest.mark.parametrize("model", [QWEN, GEMMA])
def test_embeddings_are_unit_vectors(server: Server, model: str) -> None:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none") as client:
        emb = client.embeddings.create(model=model, input=["a cat", "a dog", "a car"])
    assert len(emb.data) == 3
    for item in emb.data:
        assert math.isclose(math.sqrt(sum(x * x for x in item.embedding)), 1.0, rel_tol=1e-3)


def _worker_slots(server: Server, model: str) -> list[dict[str, Any]]:
    """The engine's own /slots, read over the worker's socket (found from its command line)."""
    sock = listening_socket(server.model(model)["pid"])
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock)) as c:
        slots: list[dict[str, Any]] = c.get("http://worker/slots").json()
        return slots


def test_client_disconnect_mid_stream_frees_the_slot(server: Server) -> None:
    body = {"model": QWEN, "stream": True, "max_tokens": 2000, "temperature": 1.0,
            "messages": [{"role": "user", "content": "Write a very long story about ships."}]}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=120) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens, then hang up
    assert any(line.startswith("data: ") for line in got)
    # 2000 tokens would keep a slot busy for about a minute; the disconnect must end it now.
    wait_for(lambda: not any(s["is_processing"] for s in _worker_slots(server, QWEN)),
             10, "every slot of the worker to be idle after the disconnect")
    wait_for(lambda: server.model(QWEN)["leases"] == 0, 10, "the stream's lease to end")
    reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                       json={"model": QWEN, "messages": FRANCE, "max_tokens": 16})
    assert reply.status_code == 200 and "Paris" in reply.text


def test_errors_are_openai_envelopes(server: Server) -> None:
    resp = httpx.post(f"{server.url}/v1/chat/completions",
                      json={"model": "gpt-4", "messages": FRANCE})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"
    assert QWEN in resp.json()["error"]["message"]
    resp = httpx.post(f"{server.url}/v1/chat/completions", content=b"{oops")
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    # Unknown request fields are ignored, not refused.
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      json={"messages": FRANCE, "max_tokens": 4, "frobnicate": {"x": 1}})
    assert resp.status_code == 200


def test_requests_right_after_streams_never_meet_a_stale_connection(server: Server) -> None:
    """Regression: the engine may close a kept-alive connection after a stream; the next
    request on it failed with 502 ("Server disconnected without sending a response")."""
    stream = {"model": GEMMA, "prompt": "Once upon a time", "max_tokens": 16,
              "stream": True, "ignore_eos": True}
    plain = {"model": GEMMA, "prompt": "Once upon a time", "max_tokens": 2}
    with httpx.Client(timeout=60) as client:
        for _ in range(10):
            with client.stream("POST", f"{server.url}/v1/completions", json=stream) as resp:
                assert resp.status_code == 200
                assert "data: [DONE]" in list(resp.iter_lines())
            resp2 = client.post(f"{server.url}/v1/completions", json=plain)
            assert resp2.status_code == 200, resp2.text
