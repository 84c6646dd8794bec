"""Anthropic's Messages API through `bunkhouse serve`, driven by the real `anthropic` SDK:
create, stream, count_tokens, stop sequences, and errors in Anthropic's envelope. (Tool
calls are translated, tests/unit/test_anthropic.py; end to end they wait for the engine to
return parsed tool calls for the packaged Qwen, which it does not yet on any protocol.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest

from tests.e2e.server import Server, serve

QWEN = "qwen2.5-coder-0.5b-instruct"
GREEDY = {"temperature": 0}  # the SDK has no sampling arguments: sent as extra fields


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("anthropic"), "--preload", QWEN) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                             timeout=300) as sdk:
        yield sdk


def test_create_stream_and_count_tokens(client: anthropic.Anthropic) -> None:
    messages: list[anthropic.types.MessageParam] = [
        {"role": "user", "content": "What is the capital of France? Answer in one word."}]
    made = client.messages.create(model=QWEN, max_tokens=16, extra_body=GREEDY,
                                  system="You are terse.", messages=messages)
    assert made.type == "message" and made.role == "assistant" and made.model == QWEN
    text = "".join(b.text for b in made.content if b.type == "text")
    assert "Paris" in text
    assert made.stop_reason in ("end_turn", "max_tokens")
    assert made.usage.input_tokens > 0 and made.usage.output_tokens > 0

    with client.messages.stream(model=QWEN, max_tokens=16, extra_body=GREEDY,
                                system="You are terse.", messages=messages) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == made.stop_reason

    counted = client.messages.count_tokens(model=QWEN, system="You are terse.",
                                           messages=messages)
    assert counted.input_tokens == made.usage.input_tokens

    stopped = client.messages.create(model=QWEN, max_tokens=32, extra_body=GREEDY,
                                     messages=[{"role": "user",
                                                "content": "Count from 1 to 10 with commas."}],
                                     stop_sequences=["5"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "5"


def test_errors_come_in_anthropics_envelope(client: anthropic.Anthropic,
                                            server: Server, tmp_path: Path) -> None:
    import httpx

    resp = httpx.post(f"{server.url}/v1/messages", json={
        "model": QWEN, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 400
    assert resp.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens is required: a positive integer"}}
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="no-such-model", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 404
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=QWEN, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url",
                                                                      "url": "x"}}]}])
    bad = httpx.post(f"{server.url}/v1/messages", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
