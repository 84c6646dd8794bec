"""Error envelopes at the HTTP edge: every bad request is a clear 4xx in the OpenAI shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from bunkhouse.api.responses import Echo
from bunkhouse.errors import (
    BunkhouseError,
    ContextLengthExceeded,
    EngineUnavailable,
    Forbidden,
    InsufficientMemory,
    InvalidRequest,
    ModelFailed,
    ModelNotFound,
    ModelTooLarge,
    Paused,
    QueueFull,
    RequestTooLarge,
    ServerBusy,
    ShuttingDown,
    StalledTooOften,
    Unauthorized,
    WorkerLoadFailed,
    error_body,
)
from bunkhouse.front.protocols import (
    AnthropicShape,
    ChatShape,
    OllamaShape,
    ResponsesShape,
    error_envelope,
)
from tests.helpers import app_without_workers


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(app_without_workers(tmp_path), base_url="http://localhost") as c:
        yield c


def _assert_envelope(resp: Any, status: int, code: str) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "code", "param"}
    assert err["code"] == code and err["message"]
    return dict(err)


MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", b"{not json", None),
        ("/v1/chat/completions", b"", None),
        ("/v1/chat/completions", b"[1, 2]", None),
        ("/v1/chat/completions", b'{"model": "tiny"}', "messages"),
        ("/v1/chat/completions", b'{"messages": []}', "messages"),
        ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', "messages.0.role"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "stream": "yes"}', "stream"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "model": 7}', "model"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "max_tokens": "9"}',
         "max_tokens"),
        ("/v1/completions", b'{"model": "tiny"}', "prompt"),
        ("/v1/completions", b'{"prompt": {"a": 1}}', "prompt"),
        ("/v1/embeddings", b'{"inputs": "x"}', "input"),
        ("/v1/chat/completions", b"\xff\xfe", None),
        ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, None),
    ],
)
def test_bad_requests_are_400(client: TestClient, path: str, body: bytes,
                              param: str | None) -> None:
    err = _assert_envelope(client.post(path, content=body), 400, "invalid_request")
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_unknown_model_is_404_naming_known_ids(client: TestClient, path: str) -> None:
    body = {"model": "gpt-4", "messages": MSGS, "prompt": "x", "input": "x"}
    err = _assert_envelope(client.post(path, json=body), 404, "model_not_found")
    assert "tiny" in str(err["message"]) and err["param"] == "model"


def test_unknown_route_and_method(client: TestClient) -> None:
    _assert_envelope(client.get("/v2/nothing"), 404, "not_found")
    _assert_envelope(client.delete("/health"), 405, "method_not_allowed")
    _assert_envelope(client.get("/v1/chat/completions"), 405, "method_not_allowed")


def test_models_listing_without_workers(client: TestClient) -> None:
    listing = client.get("/v1/models").json()
    assert listing["object"] == "list"
    (model,) = listing["data"]
    assert model["id"] == "tiny" and model["object"] == "model"
    assert model["state"] == "absent" and model["default"] is True
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    _assert_envelope(client.get("/v1/models/nope"), 404, "model_not_found")
    assert client.get("/health").json() == {"status": "ok", "models": {"tiny": "absent"}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
         "messages.0.content.0.type"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "input_audio"}]}]},
         "messages.0.content.1.type"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "x"}]}]},
         "messages.0.content"),
        ("/v1/chat/completions", {"messages": MSGS, "temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"messages": MSGS, "temperature": 2.5}, "temperature"),
        ("/v1/chat/completions", {"messages": MSGS, "top_p": -1}, "top_p"),
        ("/v1/chat/completions", {"messages": MSGS, "top_logprobs": 300000}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": MSGS, "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": MSGS, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]},
         "messages.0.role"),
        ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 5,
                                  "max_completion_tokens": 6}, "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": -1},
         "max_completion_tokens"),
        ("/v1/completions", {"prompt": "x", "logprobs": 9}, "logprobs"),
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": ["ok", ""]}, "input"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ("/v1/chat/completions", {"messages": MSGS, "tools": [{"type": "function"}]},
         "tools.0.function"),
        ("/v1/chat/completions", {"messages": MSGS, "tools": [{"function": {"name": "f"}}]},
         "tools.0.type"),
        ("/v1/chat/completions", {"messages": MSGS, "tools": [
            {"type": "function", "function": {"name": 5}}]}, "tools.0.function.name"),
        ("/v1/chat/completions", {"messages": [*MSGS, {"role": "assistant", "tool_calls": [
            {"id": "1"}]}]}, "messages.1.tool_calls.0.type"),
        ("/v1/chat/completions", {"messages": [*MSGS, {"role": "assistant",
                                                       "tool_calls": "x"}]},
         "messages.1.tool_calls"),
        ("/v1/chat/completions", {"messages": MSGS, "tool_choice": "bogus"}, "tool_choice"),
        ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "bogus"}},
         "response_format.type"),
        ("/v1/chat/completions", {"messages": MSGS, "stream_options": {"include_usage": "x"}},
         "stream_options.include_usage"),
        ("/v1/chat/completions", {"messages": MSGS, "n": 100}, "n"),
        ("/v1/chat/completions", {"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
        ("/v1/chat/completions", {"messages": MSGS, "ignore_eos": "x"}, "ignore_eos"),
        ("/v1/chat/completions", {"messages": MSGS, "n_probs": True}, "n_probs"),
        ("/v1/chat/completions", {"messages": MSGS, "grammar": 5}, "grammar"),
        ("/v1/chat/completions", {"messages": MSGS, "json_schema": "x"}, "json_schema"),
        ("/v1/chat/completions", {"messages": MSGS, "logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": [-1]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/embeddings", {"input": [-5]}, "input"),
        # work and output multipliers are bounded
        ("/v1/completions", {"prompt": "a", "max_tokens": 16, "n_probs": 300000}, "n_probs"),
        ("/v1/chat/completions", {"messages": MSGS, "logprobs": True,
                                  "top_logprobs": 300000}, "top_logprobs"),
        ("/v1/embeddings", {"input": ["a"] * 2049}, "input"),
        ("/v1/embeddings", {"input": [[1]] * 2049}, "input"),
        ("/v1/completions", {"prompt": "a", "logit_bias": {str(i): 1 for i in range(1025)}},
         "logit_bias"),
        ("/v1/completions", {"prompt": "a", "logit_bias": [[i, 1] for i in range(1025)]},
         "logit_bias"),
        ("/v1/chat/completions", {"messages": MSGS, "reasoning_format": "zzz"},
         "reasoning_format"),
        ("/v1/completions", {"model": "'" * 100_000, "prompt": "a"}, "model"),
        ("/v1/chat/completions", {"messages": MSGS, "tools": [
            {"type": "function", "function": {"name": f"f{i}", "description": "x" * 1000}}
            for i in range(300)]}, "tools"),
    ],
)
def test_what_the_front_can_know_is_wrong_is_400_naming_the_field(
        client: TestClient, path: str, body: dict[str, Any], param: str) -> None:
    err = _assert_envelope(client.post(path, json=body), 400, "invalid_request")
    assert err["param"] == param, err


def test_chat_on_a_model_without_a_template_is_400_saying_how_to_fix_it(tmp_path: Path) -> None:
    from tests.helpers import write_tiny_gguf

    write_tiny_gguf(tmp_path / "base.gguf", chat_template=None)
    with TestClient(app_without_workers(tmp_path), base_url="http://localhost") as c:
        err = _assert_envelope(c.post("/v1/chat/completions", json={
            "model": "base", "messages": MSGS}), 400, "invalid_request")
    assert err["param"] == "messages" and "chat_template" in str(err["message"])


def test_only_openai_and_engine_extension_fields_are_forwarded(tmp_path: Path) -> None:
    from bunkhouse.api.schemas import ChatCompletionRequest
    from bunkhouse.catalog import build_catalog
    from bunkhouse.config import Settings
    from bunkhouse.engines import ENGINES
    from bunkhouse.front.edge import prepare
    from tests.helpers import write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    model = build_catalog(Settings(models_dirs=(tmp_path,), include_packaged=False),
                          engines=ENGINES).get("tiny")
    body = prepare("/v1/chat/completions", ChatCompletionRequest, model, {
        "messages": MSGS, "max_completion_tokens": 7, "ignore_eos": True, "n_probs": 2,
        "temprature": 0.5, "secret_debug": 1})
    assert body == {"messages": MSGS, "max_tokens": 7, "ignore_eos": True, "n_probs": 2,
                    "model": "tiny"}  # named by its id, whatever the request said


@pytest.mark.parametrize(("body", "param"), [
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    (b'{"prompt": "\\udfff x"}', "prompt"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + b"0" * 5000 + b"}",
     None),
    (b'{"messages": [{"role": "user", "content": "hi", "\\ud800": 1}]}', "messages.0"),
])
def test_text_that_cannot_be_encoded_and_huge_numbers_are_400(client: TestClient, body: bytes,
                                                              param: str | None) -> None:
    path = "/v1/completions" if b"prompt" in body else "/v1/chat/completions"
    err = _assert_envelope(client.post(path, content=body), 400, "invalid_request")
    assert err["param"] == param and len(str(err["message"])) < 400


def test_a_huge_integer_is_not_called_invalid_json(client: TestClient) -> None:
    body = b'{"messages": [{"role": "user", "content": "hi"}], "seed": 1' + b"0" * 5000 + b"}"
    err = _assert_envelope(client.post("/v1/chat/completions", content=body), 400,
                           "invalid_request")
    assert "thousands of digits" in str(err["message"])
    assert "sys.set_int_max_str_digits" not in str(err["message"])


def test_an_unknown_model_is_named_in_at_most_a_few_hundred_characters(
        client: TestClient) -> None:
    err = _assert_envelope(client.post("/v1/models/" + "x" * 5000), 405, "method_not_allowed")
    resp = client.get("/v1/models/" + "x" * 5000)
    assert resp.status_code == 404 and len(resp.content) < 1000
    assert err["message"]


ANTHROPIC_TYPES = {  # one cause, one type (docs/protocols.md)
    "invalid_request": "invalid_request_error", "context_length_exceeded":
    "invalid_request_error", "invalid_api_key": "authentication_error",
    "permission_denied": "permission_error", "model_not_found": "not_found_error",
    "request_too_large": "request_too_large", "queue_full": "rate_limit_error",
    "stalled_too_often": "rate_limit_error", "model_load_failed": "api_error",
    "model_too_large": "api_error", "model_failed": "api_error",
    "insufficient_memory": "overloaded_error", "paused": "overloaded_error",
    "server_busy": "overloaded_error", "shutting_down": "api_error",
    "engine_unavailable": "api_error", "internal_error": "api_error"}

CAUSES = [InvalidRequest("bad", param="messages"), ContextLengthExceeded("long"),
          Unauthorized("key"), Forbidden("no"), ModelNotFound("who"), RequestTooLarge("big"),
          QueueFull("full"), StalledTooOften("stalls", 3.0), WorkerLoadFailed("load failed"),
          ModelTooLarge("too large"), ModelFailed("kept dying"), InsufficientMemory("held"),
          Paused("paused"), ServerBusy("busy"), ShuttingDown("m"),
          EngineUnavailable("worker gone"), BunkhouseError("internal")]


def _event_data(raw: bytes) -> dict[str, Any]:
    data = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    event: dict[str, Any] = json.loads(data[-1])
    return event


@pytest.mark.parametrize("err", CAUSES, ids=lambda e: e.code)
def test_one_cause_is_one_error_type_before_a_stream_and_in_it(err: BunkhouseError) -> None:
    body = error_body(err)
    # Anthropic's: the route's envelope, a shape's and the stream's error event agree
    answered = error_envelope("/v1/messages", err)["error"]["type"]
    assert answered == ANTHROPIC_TYPES[err.code]
    assert AnthropicShape("m").error(err.status, body)["error"]["type"] == answered
    assert _event_data(AnthropicShape("m").stream().error(body))["error"]["type"] == answered
    # OpenAI's chat and completions: the same envelope in the stream as with the status
    assert _event_data(ChatShape().stream().error(body)) == body
    # the Responses API: response.failed has the code the envelope has
    failed = ResponsesShape(Echo({"input": "x"}, "m")).stream().error(body)
    assert _event_data(failed)["response"]["error"]["code"] == err.code
    # Ollama's: the one message, before the stream and in it
    line = json.loads(OllamaShape("m", chat=True).stream().error(body))
    assert line == error_envelope("/api/chat", err) == {"error": err.message}
