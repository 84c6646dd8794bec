"""A plain answer assembled from the engine's stream (what the front sends a plain request's
client) against the engine's own plain answer to the same request: no field may be lost."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bunkhouse.front.assemble import assemble_chat, assemble_completion, sse_events, sse_lines

ASK = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

CHAT = [
    {"messages": ASK, "max_tokens": 12},
    {"messages": ASK, "max_tokens": 6, "logprobs": True, "top_logprobs": 2},
    {"messages": ASK, "max_tokens": 40, "stop": ["."]},
    {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
     "tools": [WEATHER], "tool_choice": "required", "max_tokens": 64},
]
COMPLETIONS = [
    {"prompt": "The capital of France is", "max_tokens": 8},
    {"prompt": "The capital of France is", "max_tokens": 4, "logprobs": 2},
    {"prompt": "One, two, three,", "max_tokens": 30, "stop": [" six"]},
]
_VOLATILE = {"id", "created", "timings", "system_fingerprint"}


@pytest.fixture(scope="module")
def worker(qwen_worker: Path) -> Iterator[httpx.Client]:
    # A fresh connection per request, as the front makes them (supervisor/process.py).
    transport = httpx.HTTPTransport(uds=str(qwen_worker),
                                    limits=httpx.Limits(max_keepalive_connections=0))
    with httpx.Client(transport=transport, base_url="http://w", timeout=120) as client:
        yield client


def _both(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    # Greedy, and no reuse of the previous request's KV cache: the two runs must compute alike.
    body = {**body, "temperature": 0, "seed": 7, "cache_prompt": False}
    plain = client.post(path, json=body)
    assert plain.status_code == 200, plain.text
    streamed = client.post(path, json={**body, "stream": True,
                                       "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200, streamed.text
    assemble = assemble_chat if path == "/v1/chat/completions" else assemble_completion
    return _stable(plain.json()), _stable(assemble(sse_events(sse_lines(streamed.content))))


def _stable(answer: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in answer.items() if k not in _VOLATILE}
    usage = out.get("usage") or {}
    out["usage"] = {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens",
                                              "total_tokens")}
    for choice in out["choices"]:
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            call.pop("id", None)  # generated per answer
    return out


@pytest.mark.slow
@pytest.mark.parametrize("body", CHAT, ids=["plain", "logprobs", "stop", "tools"])
def test_chat_answers_assembled_from_the_stream_lose_nothing(worker: httpx.Client,
                                                             body: dict[str, Any]) -> None:
    plain, assembled = _both(worker, "/v1/chat/completions", body)
    assert assembled == plain, json.dumps({"engine": plain, "assembled": assembled}, indent=1)


@pytest.mark.slow
@pytest.mark.parametrize("body", COMPLETIONS, ids=["plain", "logprobs", "stop"])
def test_completions_assembled_from_the_stream_lose_nothing(worker: httpx.Client,
                                                            body: dict[str, Any]) -> None:
    plain, assembled = _both(worker, "/v1/completions", body)
    assert assembled == plain, json.dumps({"engine": plain, "assembled": assembled}, indent=1)
