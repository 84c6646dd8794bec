"""llama.cpp's server routes that editor plugins and scripts use, routed by model through
`bunkhouse serve`: /infill (fill-in-the-middle on the packaged Qwen coder), OpenAI's and
Ollama's `suffix`, /tokenize, /detokenize, /apply-template; and their bad input."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.server import Server
from tests.models import GEMMA, QWEN

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def server(qwen_server: Server) -> Server:
    return qwen_server  # tests/e2e/conftest.py: one server for the modules that share it


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=300)


def _sensible(middle: str) -> None:
    assert middle.splitlines()[0].strip() in ("return a + b", "return a+b"), middle


def test_infill_fills_the_middle_of_a_function(server: Server) -> None:
    resp = _post(server, "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX,
                                     "max_tokens": 12, "temperature": 0})
    assert resp.status_code == 200, resp.text
    _sensible(resp.json()["content"])
    streamed = []
    with httpx.stream("POST", f"{server.url}/infill", timeout=300, json={
            "model": QWEN, "input_prefix": PREFIX, "input_suffix": SUFFIX, "max_tokens": 12,
            "temperature": 0, "stream": True}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                streamed.append(json.loads(line[6:]))
    assert streamed[-1]["stop"] is True
    assert "".join(e["content"] for e in streamed) == resp.json()["content"]


def test_openai_suffix_is_fill_in_the_middle(server: Server) -> None:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none") as client:
        whole = client.completions.create(model=QWEN, prompt=PREFIX, suffix=SUFFIX,
                                          max_tokens=12, temperature=0)
        _sensible(whole.choices[0].text)
        assert whole.usage is not None and whole.usage.completion_tokens > 0
        parts = list(client.completions.create(model=QWEN, prompt=PREFIX, suffix=SUFFIX,
                                               max_tokens=12, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason in ("stop", "length")


def test_ollama_suffix_is_fill_in_the_middle(server: Server) -> None:
    resp = _post(server, "/api/generate", {"model": QWEN, "prompt": PREFIX, "suffix": SUFFIX,
                                           "stream": False,
                                           "options": {"num_predict": 12, "temperature": 0}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["done"] is True
    _sensible(resp.json()["response"])


def test_tokenize_detokenize_and_apply_template(server: Server) -> None:
    tokens = _post(server, "/tokenize", {"model": QWEN, "content": "hello world"}).json()
    ids = tokens["tokens"]
    assert len(ids) == 2
    assert _post(server, "/detokenize", {"tokens": ids}).json() == {"content": "hello world"}
    pieces = _post(server, "/tokenize", {"content": "hello world", "with_pieces": True}).json()
    assert [p["piece"] for p in pieces["tokens"]] == ["hello", " world"]
    prompt = _post(server, "/apply-template", {"model": QWEN, "messages": [
        {"role": "user", "content": "hi"}]}).json()["prompt"]
    assert "<|im_start|>user\nhi<|im_end|>" in prompt


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/infill", {"model": GEMMA, "input_prefix": "a", "input_suffix": "b"}, "model"),
    ("/infill", {"input_prefix": 3}, "input_prefix"),
    ("/infill", {"input_extra": [{"name": "x"}]}, "input_extra.0.text"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens.1"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/tokenize", {"contents": "typo"}, "content"),
    ("/apply-template", {"model": GEMMA, "messages": [{"role": "user", "content": "hi"}]},
     None),
    ("/tokenize", {"model": "nobody", "content": "x"}, "model"),
    # past the model's trained context (32,768): megabytes grew the worker past its estimate
    ("/tokenize", {"content": "word " * 3_000_000}, "content"),
    ("/detokenize", {"tokens": [1] * 40_000}, "tokens"),
])
def test_bad_input_is_a_4xx_naming_the_field(server: Server, path: str, body: dict[str, Any],
                                            param: str | None) -> None:
    resp = _post(server, path, body)
    assert 400 <= resp.status_code < 500, resp.text
    if param is not None:
        assert resp.json()["error"]["param"] == param, resp.text
    # the worker is as healthy as before
    assert _post(server, "/tokenize", {"content": "ok"}).status_code == 200
