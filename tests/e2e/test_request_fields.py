"""How requests' fields reach the engine, on every protocol, driven by the real SDKs on the
shared Qwen server: a null field is an omitted one (nested ones too), tools the model cannot
run are skipped and named in a header, and an integer the engine cannot hold is clamped (a
token ceiling) or refused naming its field, never wrapped."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.e2e.server import Server
from tests.models import QWEN

SKIPPED = "x-bunkhouse-skipped-tools"
SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string", "default": None}}}


@pytest.fixture(scope="module")
def server(qwen_server: Server) -> Server:
    return qwen_server  # tests/e2e/conftest.py: one server for the modules that share it


@pytest.fixture(scope="module")
def oai(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=300) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def claude(server: Server) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                             timeout=300) as sdk:
        yield sdk


def test_null_fields_are_omitted_on_every_protocol(server: Server, oai: openai.OpenAI,
                                                   claude: anthropic.Anthropic) -> None:
    tool: Any = {"type": "function", "function": {"name": "run", "description": None,
                                                  "parameters": SCHEMA, "strict": None}}
    messages: Any = [
        {"role": "system", "content": "Be terse.", "name": None},
        {"role": "user", "content": "Run ls.", "name": None},
        {"role": "assistant", "content": None, "name": None, "refusal": None,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "run", "arguments": "{\"cmd\": \"ls\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt", "name": None},
        {"role": "user", "content": "And now?", "name": None}]
    chat = oai.chat.completions.create(model=QWEN, messages=messages, tools=[tool],
                                       max_tokens=2, temperature=None, top_p=None,
                                       stop=None, seed=None, tool_choice=None,
                                       extra_body={"top_k": None, "n_probs": None})
    assert chat.choices[0].finish_reason in ("length", "stop", "tool_calls")
    done = oai.completions.create(model=QWEN, prompt="Hi", max_tokens=2, suffix=None,
                                  logprobs=None, echo=None, stop=None)
    assert done.choices[0].text is not None

    made = oai.responses.create(
        model=QWEN, input=[{"type": "message", "role": "user", "content": "Hi", "id": None}],
        instructions=None, max_output_tokens=2, temperature=None, top_p=None,
        tool_choice=None, metadata=None, previous_response_id=None,
        tools=[{"type": "function", "name": "run", "description": None, "parameters": None,
                "strict": None}])
    assert made.status in ("completed", "incomplete")

    message = claude.messages.create(
        model=QWEN, max_tokens=2, system=None, stop_sequences=None, metadata=None,
        tool_choice=None, extra_body={"top_k": None, "temperature": None, "top_p": None},
        messages=[{"role": "user", "content": "Hi"}],
        tools=[{"name": "run", "description": None, "input_schema": SCHEMA}])  # type: ignore[typeddict-item]
    assert message.stop_reason in ("max_tokens", "end_turn", "tool_use")
    counted = claude.messages.count_tokens(model=QWEN, system=None, tool_choice=None,
                                           messages=[{"role": "user", "content": "Hi"}])
    assert counted.input_tokens > 0

    # the ollama SDK leaves nulls out itself: what other clients send, sent as they do
    answer = httpx.post(server.url + "/api/chat", timeout=300, json={
        "model": QWEN, "stream": False, "format": None, "keep_alive": None,
        "options": {"num_predict": 2, "seed": None, "top_k": None},
        "messages": [{"role": "user", "content": "Hi", "images": None, "tool_calls": None}],
        "tools": [tool]})
    assert answer.status_code == 200, answer.text
    generated = httpx.post(server.url + "/api/generate", timeout=300, json={
        "model": QWEN, "prompt": "Hi", "stream": False, "system": None, "suffix": None,
        "raw": None, "options": {"num_predict": 2, "stop": None}})
    assert generated.status_code == 200, generated.text


def test_tools_the_model_cannot_run_are_skipped_and_named(
        server: Server, oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    # Codex CLI's list: a function tool, a hosted one, a custom (freeform) one
    codex: Any = [{"type": "function", "name": "shell", "parameters": SCHEMA},
                  {"type": "web_search"},
                  {"type": "custom", "name": "apply_patch", "format": {"type": "text"}}]
    raw = oai.responses.with_raw_response.create(model=QWEN, input="Hi", tools=codex,
                                                 max_output_tokens=2)
    assert raw.headers[SKIPPED] == "web_search, custom:apply_patch"
    assert raw.parse().status in ("completed", "incomplete")

    custom: Any = {"type": "custom", "custom": {"name": "apply_patch"}}
    function: Any = {"type": "function", "function": {"name": "run", "parameters": SCHEMA}}
    chat = oai.chat.completions.with_raw_response.create(
        model=QWEN, messages=[{"role": "user", "content": "Hi"}], tools=[function, custom],
        max_tokens=2)
    assert chat.headers[SKIPPED] == "custom:apply_patch"

    message = claude.messages.with_raw_response.create(
        model=QWEN, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
        tools=[{"type": "web_search_20250305", "name": "web_search"},
               {"name": "run", "input_schema": SCHEMA}])
    assert message.headers[SKIPPED] == "web_search_20250305:web_search"
    counted = claude.messages.with_raw_response.count_tokens(
        model=QWEN, messages=[{"role": "user", "content": "Hi"}],
        tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert counted.headers[SKIPPED] == "web_search_20250305:web_search"
    assert counted.parse().input_tokens == claude.messages.count_tokens(
        model=QWEN, messages=[{"role": "user", "content": "Hi"}]).input_tokens

    with ollama.Client(host=server.url, timeout=300) as client:
        answer = client.chat(model=QWEN, messages=[{"role": "user", "content": "Hi"}],
                             options={"num_predict": 2}, stream=False)
    assert answer.message.role == "assistant"
    skipped = httpx.post(server.url + "/api/chat", timeout=300, json={
        "model": QWEN, "stream": False, "options": {"num_predict": 2},
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"type": "web_search"}, function]})
    assert skipped.status_code == 200 and skipped.headers[SKIPPED] == "web_search"
    only = httpx.post(server.url + "/v1/responses", timeout=300, json={
        "model": QWEN, "input": "Hi", "tool_choice": "required",
        "tools": [{"type": "web_search"}]})  # a refusal says which tools it was left without
    assert only.status_code == 400 and only.headers[SKIPPED] == "web_search", only.text


COUNT = "1 2 3 4 5 6 7 8 9 10"


def test_integers_the_engine_cannot_hold(server: Server, oai: openai.OpenAI,
                                         claude: anthropic.Anthropic) -> None:
    # a ceiling past the slot is the slot: the same answer as none, never a wrapped count
    plain = oai.completions.create(model=QWEN, prompt=COUNT, stop=[" 16"], temperature=0)
    for ceiling in (2147483648, 4294967296, 4294967301):
        done = oai.completions.create(model=QWEN, prompt=COUNT, stop=[" 16"], temperature=0,
                                      max_tokens=ceiling)
        assert (done.choices[0].text, done.choices[0].finish_reason) == (
            plain.choices[0].text, plain.choices[0].finish_reason)
        chat = oai.chat.completions.create(
            model=QWEN, messages=[{"role": "user", "content": "Say hi."}], temperature=0,
            max_tokens=ceiling, seed=ceiling)
        assert chat.choices[0].finish_reason == "stop"
    generated = httpx.post(server.url + "/api/generate", timeout=300, json={
        "model": QWEN, "prompt": COUNT, "raw": True, "stream": False,
        "options": {"num_predict": 4294967301, "stop": [" 16"], "temperature": 0}})
    assert generated.json()["response"] == plain.choices[0].text

    refused = [
        ("seed", {"messages": [{"role": "user", "content": "x"}], "seed": 1 << 64}),
        ("n_predict", {"prompt": "x", "n_predict": 1 << 31}),
        ("top_k", {"prompt": "x", "top_k": 1 << 32}),
        ("logit_bias", {"prompt": "x", "logit_bias": {"4294967301": 5}}),
        ("prompt", {"prompt": [4294967296]})]
    for param, body in refused:
        route = "chat/completions" if "messages" in body else "completions"
        answer = httpx.post(f"{server.url}/v1/{route}", json={"model": QWEN, **body},
                            timeout=300)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, \
            answer.text
    with pytest.raises(anthropic.BadRequestError, match="top_k"):
        claude.messages.create(model=QWEN, max_tokens=2, extra_body={"top_k": 1 << 32},
                               messages=[{"role": "user", "content": "Hi"}])


def test_bounds_are_the_engines_and_every_refusal_names_its_field(
        server: Server, oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    """The engine's own ranges are the front's (``repeat_last_n: -1`` was the engine's 400,
    after the front's wrong bound); ``lora`` with no adapters, a Responses integer, a token
    limit of 0 and a schema's huge bounds are refused at the edge, each naming its field as
    the caller's protocol spells it."""
    user = [{"role": "user", "content": "x"}]
    chat, completions = "/v1/chat/completions", "/v1/completions"
    costly = {"type": "object", "properties": {"a": {"type": "array", "maxItems": 1000}}}
    huge = {"type": "integer", "minimum": -(1 << 64), "maximum": 1 << 64}
    refused = [
        (chat, {"messages": user, "repeat_last_n": -1}, "repeat_last_n", "from 0 to"),
        (chat, {"messages": user, "repeat_last_n": -2}, "repeat_last_n", "from 0 to"),
        (completions, {"prompt": "x", "dry_penalty_last_n": -2}, "dry_penalty_last_n", "0"),
        (chat, {"messages": user, "lora": [{"id": 1 << 64, "scale": 1}]}, "lora", "LoRA"),
        (chat, {"messages": user, "max_tokens": 0}, "max_tokens", "1"),
        (completions, {"prompt": "hi", "max_tokens": 0}, "max_tokens", "1"),
        (completions, {"prompt": "hi", "n_predict": 0}, "n_predict", "-1"),
        (chat, {"messages": user, "response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "schema": huge}}}, "response_format", "response_format"),
        ("/v1/responses", {"input": "x", "top_logprobs": 1 << 64}, "top_logprobs", "20"),
        ("/v1/responses", {"input": "x", "max_tool_calls": -1}, "max_tool_calls", "0"),
        ("/v1/responses", {"input": "x", "seed": 1 << 64}, "seed", "9223372036854775807"),
        ("/v1/responses", {"input": "x", "tool_choice": "required", "tools": [
            {"type": "function", "name": "f", "parameters": costly}]},
         "tools.0.parameters", "tools.0.parameters would take")]
    for route, body, param, says in refused:
        answer = httpx.post(server.url + route, json={"model": QWEN, **body}, timeout=300)
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["param"] == param, answer.text
        assert says in error["message"], answer.text
    for extra, says in (({"top_k": -1}, "top_k must be an integer from 0 to 2147483647"),
                        ({"top_k": 1 << 64}, "top_k must be an integer from 0 to 2147483647"),
                        ({"tools": [{"name": "f", "input_schema": costly}],
                          "tool_choice": {"type": "any"}}, "tools.0.input_schema would take")):
        with pytest.raises(anthropic.BadRequestError, match=says):
            claude.messages.create(model=QWEN, max_tokens=2, extra_body=extra, messages=user)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        claude.messages.create(model=QWEN, max_tokens=0, messages=user)
    with pytest.raises(anthropic.BadRequestError, match=r"tools\.0\.input_schema would take"):
        claude.messages.count_tokens(model=QWEN, messages=user,
                                     tools=[{"name": "f", "input_schema": costly}])
    bound = httpx.post(server.url + "/api/chat", timeout=300, json={
        "model": QWEN, "messages": user, "stream": False, "options": {"seed": 1 << 64}})
    assert "from -9223372036854775808 to 9223372036854775807" in bound.json()["error"]
    schema = httpx.post(server.url + "/api/chat", timeout=300, json={
        "model": QWEN, "messages": user, "stream": False, "format": huge})
    assert schema.json()["error"].startswith("format: a JSON schema's minimum"), schema.text
    for option, value in (("repeat_last_n", -2), ("mirostat", 3), ("num_keep", -5),
                          ("num_ctx", 1 << 64)):  # the engine's ranges, in Ollama's names
        refused = httpx.post(server.url + "/api/chat", timeout=300, json={
            "model": QWEN, "messages": user, "stream": False, "options": {option: value}})
        assert refused.status_code == 400, (option, refused.text)
        assert f"options.{option}" in refused.json()["error"], refused.text
