"""Ollama's API through `bunkhouse serve`, driven by the real `ollama` Python client: list,
ps, show, chat (streamed and not, with a tool call), generate (through the chat template,
and raw on the base model), the 501s for what bunkhouse does not do, errors as Ollama's."""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterator

import httpx
import ollama
import pytest

from tests.e2e.server import Server
from tests.models import GEMMA, QWEN

GREEDY = {"temperature": 0, "num_predict": 8}
ASK = [{"role": "user", "content": "What is the capital of France? One word."}]


@pytest.fixture(scope="module")
def server(qwen_server: Server) -> Server:
    return qwen_server  # tests/e2e/conftest.py: one server for the modules that share it


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[ollama.Client]:
    sdk = ollama.Client(host=server.url, timeout=300)
    yield sdk
    sdk._client.close()  # the client keeps its connections open until told


def test_list_ps_and_show(client: ollama.Client) -> None:
    """Listed as Ollama lists: `name:tag` (`:latest` for an id without a tag), with the
    file's parameter count and quantization."""
    listed = {m.model: m for m in client.list().models}
    assert set(listed) == {f"{QWEN}:latest", f"{GEMMA}:latest"}
    details = listed[f"{QWEN}:latest"].details
    assert details is not None and details.quantization_level == "Q4_K_M"  # as its file name
    assert re.fullmatch(r"\d+\.\d\dM", details.parameter_size or "")  # about 0.5B: "630.17M"
    running = {m.model: m for m in client.ps().models}
    assert f"{QWEN}:latest" in running and (running[f"{QWEN}:latest"].size or 0) > 0
    assert running[f"{QWEN}:latest"].details == details
    shown = client.show(f"{QWEN}:latest")
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert shown.details == details and shown.modelinfo
    assert shown.modelinfo["general.parameter_count"] > 0
    assert shown.modelinfo["qwen2.block_count"] > 0
    # the model's own template (the GGUF's Jinja), its options, and a Modelfile of both
    assert "<|im_start|>" in (shown.template or "")
    assert re.search(r"^num_ctx +\d+$", shown.parameters or "", re.M)
    assert shown.modelfile is not None and "\nFROM /" in shown.modelfile
    assert f'TEMPLATE """{shown.template}"""' in shown.modelfile
    assert shown.capabilities == ["completion", "tools"]


def test_chat_streamed_and_not(client: ollama.Client) -> None:
    whole = client.chat(model=QWEN, messages=ASK, options=GREEDY, stream=False)
    assert "Paris" in whole.message.content and whole.done and whole.done_reason == "stop"
    assert whole.model == f"{QWEN}:latest"  # answered as listed
    assert (whole.prompt_eval_count or 0) > 0 and (whole.eval_count or 0) > 0
    parts = list(client.chat(model=QWEN, messages=ASK, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert {p.model for p in parts} == {f"{QWEN}:latest"}
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    # a name with Ollama's default tag is the model
    tagged = client.chat(model=f"{QWEN}:latest", messages=ASK, options=GREEDY)
    assert tagged.message.content == whole.message.content


def test_a_tool_call(client: ollama.Client) -> None:
    answer = client.chat(model=QWEN, options={"temperature": 0}, messages=[
        {"role": "user", "content": "What is the weather in Paris?"}], tools=[
        {"type": "function", "function": {
            "name": "get_weather", "description": "Get the current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}])
    (call,) = answer.message.tool_calls or []
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}


def test_generate_through_the_template_and_raw(client: ollama.Client) -> None:
    templated = client.generate(model=QWEN, prompt="What is the capital of France? One word.",
                                options=GREEDY)
    assert "Paris" in templated.response and templated.done
    assert templated.model == f"{QWEN}:latest"
    raw = client.generate(model=GEMMA, prompt="The capital of France is", options=GREEDY,
                          raw=True)
    assert raw.response and raw.done_reason in ("stop", "length")
    streamed = "".join(p.response for p in client.generate(
        model=GEMMA, prompt="The capital of France is", options=GREEDY, raw=True, stream=True))
    assert streamed == raw.response and raw.model == f"{GEMMA}:latest"


def test_what_bunkhouse_does_not_do_and_bad_input(client: ollama.Client,
                                                  server: Server) -> None:
    with pytest.raises(ollama.ResponseError) as info:  # a pull changes what is served
        client.pull("hf.co/org/repo:Q4_K_M")
    assert info.value.status_code == 403 and "--admin-key" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.push("gemma")
    assert info.value.status_code == 501 and "uploads nothing" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="no-such-model", messages=ASK)
    assert info.value.status_code == 404
    bad = httpx.post(f"{server.url}/api/chat", timeout=60, json={
        "model": QWEN, "messages": ASK, "options": {"temperature": "hot"}})
    assert bad.status_code == 400 and "options.temperature" in bad.json()["error"]
    # an Ollama release's version (docs/architecture.md): clients that check it go on
    version = httpx.get(f"{server.url}/api/version").json()
    assert tuple(int(n) for n in version["version"].split(".")) >= (0, 5, 0)
    assert version["bunkhouse"] == importlib.metadata.version("bunkhouse")
