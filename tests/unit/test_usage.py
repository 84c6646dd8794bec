"""OpenAI's usage rule (api/usage.py) and its ids, on the answers and streams llama.cpp
sends for several choices and several prompts (shapes recorded from the packaged Qwen)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from bunkhouse.api.infill import Completions
from bunkhouse.api.usage import StreamUsage, Tally, completion_id
from bunkhouse.engines.llamacpp import LlamaCppClient
from bunkhouse.front.assemble import sse_lines
from bunkhouse.front.protocols import InfillShape
from bunkhouse.front.proxy import forward
from tests.helpers import asgi_body


def _usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _chat(index: int, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": index, "delta": {} if finish else {"content": "Hi"},
                         "finish_reason": finish}], **extra}


def _text(index: int, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-y", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": index, "text": "" if finish else "a", "logprobs": None,
                         "finish_reason": finish}], **extra}


def _only_usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [], "usage": usage, "timings": {"prompt_n": 30, "predicted_n": 3}}


# llama.cpp's chat stream for n=2 with include_usage: one usage-only chunk per choice
CHAT_N2 = [_chat(0), _chat(1), _chat(0), _chat(0, "length"), _only_usage(_usage(30, 3)),
           _chat(1), _chat(1, "length"), _only_usage(_usage(30, 3))]
# its completions stream for two prompts: ``null`` first, usage on each finishing chunk
TWO_PROMPTS: list[Any] = [None, _text(1), _text(0), _text(1, "length", usage=_usage(6, 4)),
                          _text(0), _text(0, "length", usage=_usage(5, 4, cached=4))]


def _sse(events: list[Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + \
        b"data: [DONE]\n\n"


def _events(body: bytes) -> list[Any]:
    return [json.loads(line[6:]) for line in sse_lines(body)
            if line.startswith("data: ") and line != "data: [DONE]"]


def _request() -> Request:
    async def receive() -> dict[str, object]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def _forward(path: str, body: dict[str, Any], events: list[Any]) -> tuple[bytes, list[Any]]:
    """What the front answers ``body`` on ``path`` when the engine streams ``events``; and
    the bodies it sent the engine."""
    sent: list[Any] = []

    def handler(req: httpx.Request) -> httpx.Response:
        sent.append(json.loads(req.content))
        return httpx.Response(200, content=_sse(events),
                              headers={"content-type": "text/event-stream"})

    async def run() -> bytes:
        engine = LlamaCppClient(httpx.MockTransport(handler), "m")
        resp = await forward(engine, path, body, stream=bool(body.get("stream")),
                             request=_request(), model_id="m")
        if not body.get("stream"):
            return bytes(resp.body)
        return await asgi_body(resp)

    return asyncio.run(run()), sent


def test_a_plain_answer_of_two_choices_counts_both() -> None:
    body, sent = _forward("/v1/chat/completions", {"messages": [], "n": 2, "max_tokens": 3},
                          CHAT_N2)
    answer = json.loads(body)
    assert sent[0]["stream"] is True  # asked as a stream: a disconnect frees the slots
    assert answer["usage"] == _usage(30, 6)
    assert [c["message"]["content"] for c in answer["choices"]] == ["HiHi", "HiHi"]


def test_a_plain_answer_of_two_prompts_counts_each_prompt() -> None:
    body, _ = _forward("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 4},
                       TWO_PROMPTS)
    answer = json.loads(body)
    assert answer["usage"] == _usage(11, 8, cached=4)
    assert answer["id"] == "cmpl-y" and answer["object"] == "text_completion"
    assert len(answer["choices"]) == 2


@pytest.mark.parametrize("asked", [True, False, None])
def test_a_stream_of_two_choices_has_one_usage_chunk_last_when_asked(asked: bool | None
                                                                     ) -> None:
    request: dict[str, Any] = {"messages": [], "n": 2, "stream": True}
    if asked is not None:
        request["stream_options"] = {"include_usage": asked}
    body, _ = _forward("/v1/chat/completions", request, CHAT_N2)
    events = _events(body)
    with_usage = [e for e in events if "usage" in e]
    if asked:
        assert with_usage == [events[-1]] and events[-1]["choices"] == []
        assert events[-1]["usage"] == _usage(30, 6) and events[-1]["id"] == "chatcmpl-x"
    else:
        assert with_usage == []
    assert body.endswith(b"data: [DONE]\n\n")
    assert sum(1 for e in events if e["choices"] and e["choices"][0]["finish_reason"]) == 2


@pytest.mark.parametrize("asked", [True, False, None])
def test_a_completions_stream_follows_the_usage_rule(asked: bool | None) -> None:
    """Usage only when asked, once, in a last chunk without choices; no ``null`` event;
    ``cmpl-`` ids on every chunk."""
    request: dict[str, Any] = {"prompt": ["a", "b"], "stream": True}
    if asked is not None:
        request["stream_options"] = {"include_usage": asked}
    body, _ = _forward("/v1/completions", request, TWO_PROMPTS)
    events = _events(body)
    assert None not in events and all(e["id"] == "cmpl-y" for e in events)
    assert all("usage" not in e for e in events[:-1])
    assert ("usage" in events[-1]) is bool(asked)
    if asked:
        assert events[-1]["choices"] == [] and events[-1]["usage"] == _usage(11, 8, 4)
        assert events[-1]["object"] == "text_completion"


def test_a_stream_of_one_prompt_keeps_its_usage_off_the_finishing_chunk() -> None:
    one = [_text(0), _text(0, "length", usage=_usage(1, 2))]
    body, _ = _forward("/v1/completions", {"prompt": "x", "stream": True,
                                           "stream_options": {"include_usage": True}}, one)
    events = _events(body)
    assert events[-2]["choices"][0]["finish_reason"] == "length" and "usage" not in events[-2]
    assert events[-1] == {"id": "cmpl-y", "object": "text_completion", "created": 1,
                          "model": "m", "choices": [], "usage": _usage(1, 2)}


def test_a_single_chat_stream_is_relayed_byte_for_byte() -> None:
    one = [_chat(0), _chat(0, "length"), _only_usage(_usage(30, 2))]
    request = {"messages": [], "stream": True, "stream_options": {"include_usage": True}}
    body, _ = _forward("/v1/chat/completions", request, one)
    assert body == _sse(one)


def test_the_tally_counts_each_prompt_once_and_every_choice() -> None:
    tally = Tally(n=3)
    for _ in range(3):
        tally.add(_usage(10, 4, cached=6))
    tally.add("not a usage")
    assert tally.total() == _usage(10, 12, cached=6)
    assert Tally().total() is None


def test_completion_ids_take_openais_prefix() -> None:
    assert completion_id("chatcmpl-abc") == "cmpl-abc"
    assert completion_id("cmpl-abc") == "cmpl-abc" and completion_id(3) == 3


def test_stream_lines_that_carry_no_usage_pass_untouched() -> None:
    usage = StreamUsage("/v1/chat/completions", {"n": 2})
    line = b'data: {"id":"chatcmpl-1","choices":[{"delta":{"content":"\\"usage"}}]}'
    assert usage.line(b": ping") == b": ping" and usage.line(b"") == b""
    assert usage.line(b'data: {"choices":[]}') == b'data: {"choices":[]}'
    assert usage.line(b"data: null") is None
    assert usage.line(line) == line  # the word in the text is not a field: kept as it was


def test_fill_in_the_middle_follows_the_rule_too() -> None:
    """``suffix`` on /v1/completions: usage only when asked, in its own last chunk, with
    several answers count their one prompt once."""
    stop = {"content": "", "stop": True, "stop_type": "limit", "tokens_evaluated": 12,
            "tokens_predicted": 2}
    for asked in (True, False):
        stream = InfillShape("m", request={"stream_options": {"include_usage": asked}}
                             ).stream()
        body = stream.feed({"content": "a"}) + stream.feed(stop) + stream.end()
        events = _events(body)
        assert all("usage" not in e for e in events[:-1 if asked else None])
        if asked:
            assert events[-1]["choices"] == []
            assert events[-1]["usage"] == {"prompt_tokens": 12, "completion_tokens": 2,
                                           "total_tokens": 14}
    several = Completions("m").convert([stop, stop])
    assert several["usage"]["prompt_tokens"] == 12 and several["id"].startswith("cmpl-")
