"""One client's bad request never hurts another: `bunkhouse serve` with the packaged models."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bunkhouse.catalog import Catalog
from tests.e2e.server import Server, serve
from tests.models import GEMMA, QWEN

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, packaged_catalog: Catalog
           ) -> Iterator[Server]:
    """Qwen and Gemma as packaged, and Gemma again as "gemma-chat" with a chat template."""
    workdir = tmp_path_factory.mktemp("bad")
    config = workdir / "bunkhouse.toml"
    config.write_text(f"""
[defaults]
embeddings = true

[[models]]
id = "gemma-chat"
path = "{packaged_catalog.get(GEMMA).path}"
chat_template = "gemma"
context = 2048
parallel = 1
embeddings = false
""")
    with serve(workdir, "--config", str(config), "--default-model", QWEN) as running:
        yield running


def _post(server: Server, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


@pytest.mark.slow
def test_image_requests_get_400_while_another_clients_stream_completes(server: Server) -> None:
    assert _post(server, "/v1/chat/completions", {
        "model": QWEN, "max_tokens": 1,
        "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    pid = server.model(QWEN)["pid"]
    first = threading.Event()
    lines: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=300, json={
                "model": QWEN, "max_tokens": 64, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": "Tell me about ships."}]}) as resp:
            for line in resp.iter_lines():
                if line:
                    lines.append(line)
                    first.set()

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(stream)
        assert first.wait(120)
        for _ in range(3):
            resp = _post(server, "/v1/chat/completions", {"model": QWEN, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE]}]})
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] == "messages.0.content.1.type" and "text only" in err["message"]
        done.result(timeout=300)
    assert lines[-1] == "data: [DONE]" and "event: error" not in lines
    assert server.model(QWEN)["pid"] == pid and server.model(QWEN)["state"] == "ready"


@pytest.mark.slow
def test_embeddings_longer_than_the_model_takes_are_400_and_shorter_ones_embed(
        server: Server) -> None:
    long = _post(server, "/v1/embeddings", {"model": GEMMA, "input": "word " * 700})
    assert long.status_code == 400, long.text
    err = long.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "input"
    assert "at most 512 tokens" in err["message"]
    ok = _post(server, "/v1/embeddings", {"model": GEMMA, "input": "word " * 400})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["data"][0]["embedding"]) > 100
    empty = _post(server, "/v1/embeddings", {"model": GEMMA, "input": ""})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"


def test_embeddings_from_a_model_serving_none_are_400_saying_how_to_turn_them_on(
        server: Server) -> None:
    resp = _post(server, "/v1/embeddings", {"model": "gemma-chat", "input": "hello"})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "model" and "embeddings = true" in err["message"]
    assert server.model("gemma-chat")["state"] == "absent"  # refused before any load
    assert server.model("gemma-chat")["embeddings"] is False


def test_embedding_dimensions_other_than_the_models_are_400(server: Server) -> None:
    width = server.model(GEMMA)
    short = _post(server, "/v1/embeddings", {"model": GEMMA, "input": "hi", "dimensions": 8})
    assert short.status_code == 400 and short.json()["error"]["param"] == "dimensions"
    assert "640" in short.json()["error"]["message"]
    exact = _post(server, "/v1/embeddings", {"model": GEMMA, "input": "hi", "dimensions": 640})
    assert exact.status_code == 200 and len(exact.json()["data"][0]["embedding"]) == 640
    assert width["embeddings"] is True


@pytest.mark.slow
@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
def test_both_token_limit_names_behave_the_same(server: Server, name: str) -> None:
    # more than the slot holds: a ceiling (--strict-context makes it a 400)
    too_many = _post(server, "/v1/chat/completions", {
        "model": QWEN, name: 50000, "messages": [{"role": "user", "content": "Say hi."}]})
    assert too_many.status_code == 200, too_many.text
    few = _post(server, "/v1/chat/completions", {
        "model": QWEN, name: 3, "messages": [{"role": "user", "content": "Count to ten."}]})
    assert few.status_code == 200 and few.json()["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_plain_completions_carry_logprobs(server: Server) -> None:
    resp = _post(server, "/v1/completions", {"model": GEMMA, "prompt": "The capital of France is",
                                             "max_tokens": 3, "logprobs": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    logprobs = resp.json()["choices"][0]["logprobs"]
    assert len(logprobs["content"]) == 3
    assert all(len(t["top_logprobs"]) == 2 for t in logprobs["content"])


@pytest.mark.slow
def test_chat_on_gemma_needs_a_template_and_answers_with_one(server: Server) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    bare = _post(server, "/v1/chat/completions", {"model": GEMMA, "messages": messages})
    assert bare.status_code == 400
    err = bare.json()["error"]
    assert err["param"] == "messages" and "chat_template" in err["message"]
    templated = _post(server, "/v1/chat/completions", {"model": "gemma-chat", "max_tokens": 8,
                                                       "messages": messages})
    assert templated.status_code == 200, templated.text
    reply = templated.json()["choices"][0]["message"]["content"]
    assert reply and "<|im_end" not in reply and "<end_of_turn>" not in reply
    assert server.model("gemma-chat")["chat_template"] is True


def test_bad_engine_fields_never_reach_the_engine(server: Server) -> None:
    resp = _post(server, "/v1/chat/completions", {"model": QWEN, "temperature": "hot",
                                                  "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "temperature" and "json.exception" not in err["message"]
    assert json.dumps(err).count("engine") == 0


def test_a_port_in_use_exits_before_saying_it_serves(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "bunkhouse", "serve", "--no-packaged",
                              "--models-dir", str(tmp_path), "--port", str(port)],
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "serving" not in run.stderr and "is another server using that port" in run.stderr
