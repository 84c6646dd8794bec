"""Streamed answers in every protocol the front speaks, on the benchmark engine
(tests/bench_engine.py), and what a client received for each: the front's relay must keep
sending exactly these bytes (ids and clocks masked), whatever it does to cost less.

``python -m tests.relay_cases record URL`` asks a running ``bunkhouse serve`` (on the
benchmark engine, model ``bench``) every case and writes :data:`GOLDEN`; the test
(tests/e2e/test_relay.py) asks the same of this checkout's front and compares.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import httpx

GOLDEN = Path(__file__).parent / "fixtures" / "relay_golden.json"

MODEL = "bench"

_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
_CALL = 'say: <tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>'
_TEXT = "say: Hello there, how are you today? Fine “quotes” and ünïcode\u2028too."


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "stream": True, "max_tokens": 24,
            "messages": [{"role": "user", "content": content}], **extra}


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # OpenAI chat completions: relayed as the engine wrote them, or rewritten where a rule says
    "chat-text": ("/v1/chat/completions", _chat(_TEXT)),
    "chat-length": ("/v1/chat/completions", _chat("hi", max_tokens=6)),
    "chat-usage": ("/v1/chat/completions",
                   _chat(_TEXT, stream_options={"include_usage": True})),
    "chat-tool-call": ("/v1/chat/completions", _chat(_CALL, tools=_TOOLS)),
    "chat-tool-held-then-text": ("/v1/chat/completions",
                                 _chat("say: { this is not a call } at all", tools=_TOOLS)),
    "chat-error": ("/v1/chat/completions", _chat("[error after 3] " + _TEXT)),
    "chat-cut": ("/v1/chat/completions", _chat("[cut after 3] " + _TEXT)),
    "chat-two-choices": ("/v1/chat/completions", _chat("hi", max_tokens=4, n=2)),
    "completions": ("/v1/completions", {"model": MODEL, "stream": True, "max_tokens": 6,
                                        "prompt": _TEXT}),
    "completions-usage": ("/v1/completions", {
        "model": MODEL, "stream": True, "max_tokens": 6, "prompt": "say: one two three",
        "stream_options": {"include_usage": True}}),
    # Anthropic Messages
    "messages-text": ("/v1/messages", _chat(_TEXT)),
    "messages-length": ("/v1/messages", _chat("hi", max_tokens=6)),
    "messages-tool-call": ("/v1/messages", _chat(_CALL, tools=[{
        "name": "get_weather", "description": "The weather in a city",
        "input_schema": _TOOLS[0]["function"]["parameters"]}])),
    "messages-error": ("/v1/messages", _chat("[error after 3] " + _TEXT)),
    "messages-cut": ("/v1/messages", _chat("[cut after 3] " + _TEXT)),
    # the Responses API
    "responses-text": ("/v1/responses", {"model": MODEL, "stream": True, "input": _TEXT,
                                         "max_output_tokens": 24}),
    "responses-length": ("/v1/responses", {"model": MODEL, "stream": True, "input": "hi",
                                           "max_output_tokens": 6}),
    "responses-tool-call": ("/v1/responses", {
        "model": MODEL, "stream": True, "input": _CALL, "max_output_tokens": 24,
        "tools": [{"type": "function", **_TOOLS[0]["function"]}]}),
    "responses-error": ("/v1/responses", {"model": MODEL, "stream": True,
                                          "input": "[error after 3] " + _TEXT}),
    # Ollama
    "ollama-chat": ("/api/chat", {"model": MODEL, "messages": [
        {"role": "user", "content": _TEXT}], "options": {"num_predict": 24}}),
    "ollama-generate": ("/api/generate", {"model": MODEL, "prompt": _TEXT,
                                          "options": {"num_predict": 24}}),
    "ollama-error": ("/api/chat", {"model": MODEL, "messages": [
        {"role": "user", "content": "[error after 3] " + _TEXT}]}),
}

# What differs from one run to the next: ids made per answer, clocks, durations, and the
# keepalive comments a wait sends (a constraint's first measure, text held back a second).
_COMMENT = re.compile(rb"^:[^\n]*\n\n", re.MULTILINE)
_ID = re.compile(rb'"((?:chatcmpl|cmpl|msg|resp|fc|call|toolu|rs)[-_])[A-Za-z0-9_-]+"')
_CLOCK = re.compile(rb'("(?:created|created_at|completed_at|total_duration|load_duration|'
                    rb'prompt_eval_duration|eval_duration)": ?)("[^"]*"|[0-9.e+-]+)')


def masked(body: bytes) -> str:
    """``body`` with ids, clocks and durations replaced by placeholders and keepalive
    comments left out, the rest as it was."""
    body = _ID.sub(rb'"\1*"', _COMMENT.sub(b"", body))
    return _CLOCK.sub(rb'\1"*"', body).decode("utf-8", errors="replace")


def ask(url: str, case: str, client: httpx.Client) -> dict[str, Any]:
    """One case's status, content type and masked body."""
    path, body = CASES[case]
    with client.stream("POST", url + path, json=body) as r:
        content = r.read()
    return {"status": r.status_code, "type": r.headers.get("content-type"),
            "body": masked(content)}


def record(url: str) -> None:
    with httpx.Client(timeout=120) as client:
        answers = {case: ask(url, case, client) for case in CASES}
    GOLDEN.write_text(json.dumps(answers, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(answers)} cases to {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:2] != ["record"] or len(sys.argv) != 3:
        raise SystemExit("usage: python -m tests.relay_cases record URL")
    record(sys.argv[2])
