"""The engine llama-server end to end: `bunkhouse serve --llama-server BINARY` with both
packaged models on the binary (Qwen with embeddings, Gemma as a second id), Gemma on
xllamacpp beside them under one budget, and three entries whose ``args`` are refused.

Through the README's clients (openai, anthropic, ollama): answers, streams, embeddings,
``/infill``; the worker is the binary (no Python process for the model); an eviction saves the
conversation's KV state, which the follow-up reuses (``cached_tokens``: all but its new turn);
a SIGKILL of the binary mid-stream ends that stream with an error and the next request
respawns it. Skipped, saying why, where no binary is built (tests/llama_server.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from bunkhouse.catalog import Catalog, build_catalog
from bunkhouse.config import Settings, load_config_file
from bunkhouse.engines import ENGINES, LLAMA_SERVER
from bunkhouse.residency.estimate import estimate
from tests import llama_server
from tests.e2e.server import Server, serve
from tests.e2e.shared import greedy_chat, kill_mid_stream, model_worker
from tests.helpers import wait_for
from tests.models import GEMMA, QWEN

pytestmark = pytest.mark.slow

GEMMA_LS = "gemma-ls"  # the packaged Gemma's file, on llama-server
ADMIN = "admin-ls"
REFUSED = {  # model id -> (its args, what its refusal says)
    "bad-context": ('["-c", "4096"]', "-c is not passed to llama-server: set context"),
    "bad-port": ('["--port", "9000"]', "--port is not passed to llama-server"),
    "bad-flag": ('["--no-such-flag"]', "--no-such-flag is not a flag of this llama-server"),
}
NOTES = "".join(f"Note {i}: the shelf {i} holds {i * 3} jars.\n" for i in range(30))


def _config(path: Path, gemma: Path, qwen: Path, budget: int | None = None) -> Path:
    text = ("include_packaged = true\nhf_cache = false\nollama = false\nlmstudio = false\n"
            + (f'budget = "{budget}"\n' if budget else "")
            + '[defaults]\nengine = "llama-server"\ncontext = 8192\nparallel = 2\n'
            + f'[[models]]\nid = "{QWEN}"\nembeddings = true\nargs = ["--jinja", "-t", "2"]\n'
            + f'[[models]]\nid = "{GEMMA}"\nengine = "llama.cpp"\n'
            + f'[[models]]\nid = "{GEMMA_LS}"\npath = "{gemma}"\n')
    for model, (args, _) in REFUSED.items():
        text += f'[[models]]\nid = "{model}"\npath = "{qwen}"\nargs = {args}\n'
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory, packaged_catalog: Catalog
         ) -> Iterator[Server]:
    """A budget that holds Qwen (llama-server) and Gemma (xllamacpp) at once, not a third."""
    binary = llama_server.require()
    root = tmp_path_factory.mktemp("llama-server")
    gemma, qwen = packaged_catalog.get(GEMMA).path, packaged_catalog.get(QWEN).path
    LLAMA_SERVER.locate(binary)
    settings = load_config_file(_config(root / "probe.toml", gemma, qwen), Settings())
    catalog = build_catalog(settings, engines=ENGINES)
    sizes = {m: estimate(catalog.get(m)).total for m in (QWEN, GEMMA, GEMMA_LS)}
    budget = sizes[QWEN] + sizes[GEMMA] + min(sizes[GEMMA_LS], sizes[GEMMA]) // 2
    config = _config(root / "bunkhouse.toml", gemma, qwen, budget)
    with serve(root / "serve", "--config", str(config), "--llama-server", str(binary),
               "--spare-worker", "off", "--admin-key", ADMIN, "--allow-runtime-load",
               "--allowed-root", str(gemma.parent)) as server:
        yield server


def test_the_readme_clients_on_a_binary_worker(host: Server) -> None:
    with openai.OpenAI(base_url=f"{host.url}/v1", api_key="none", timeout=600) as client:
        plain = client.chat.completions.create(
            model=QWEN, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
            temperature=0)
        assert plain.choices[0].message.content and plain.model == QWEN
        streamed = "".join(
            chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
                model=QWEN, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
                temperature=0, stream=True) if chunk.choices)
        assert streamed == plain.choices[0].message.content
        embedded = client.embeddings.create(model=QWEN, input=["a cat", "a dog"])
        assert len(embedded.data) == 2 and len(embedded.data[0].embedding) > 100
    worker = model_worker(host, QWEN)
    assert os.path.basename(worker.exe()) == "llama-server", worker.cmdline()
    assert worker.ppid() == host.proc.pid  # the binary itself: no Python between

    with anthropic.Anthropic(base_url=host.url, api_key="none", timeout=600) as claude:
        message = claude.messages.create(model=QWEN, max_tokens=8,
                                         messages=[{"role": "user", "content": "Say hello."}])
    assert message.content[0].type == "text" and message.content[0].text
    local = ollama.Client(host=host.url, timeout=600)
    try:
        answer = local.chat(model=QWEN, messages=[{"role": "user", "content": "Say hello."}],
                            options={"num_predict": 8, "temperature": 0})
    finally:
        local._client.close()
    assert answer.message.content

    infill = httpx.post(f"{host.url}/infill", timeout=600, json={
        "model": QWEN, "input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n",
        "n_predict": 8, "temperature": 0})
    assert infill.status_code == 200 and "a" in infill.json()["content"], infill.text


def test_side_by_side_with_xllamacpp_then_an_eviction_keeps_the_conversation(
        host: Server) -> None:
    messages = [{"role": "system", "content": "You answer from the notes."},
                {"role": "user", "content": f"{NOTES}How many jars does shelf 7 hold?"}]
    first = greedy_chat(host, QWEN, messages, 12)
    gemma = httpx.post(f"{host.url}/v1/completions", timeout=600, json={
        "model": GEMMA, "prompt": "Once upon a time", "max_tokens": 4})
    assert gemma.status_code == 200, gemma.text
    assert host.model(QWEN)["state"] == "ready" and host.model(GEMMA)["state"] == "ready"
    assert "python" in model_worker(host, GEMMA).name().lower()  # xllamacpp's worker

    third = httpx.post(f"{host.url}/v1/completions", timeout=600, json={
        "model": GEMMA_LS, "prompt": "Once upon a time", "max_tokens": 4})
    assert third.status_code == 200, third.text
    wait_for(lambda: host.model(QWEN)["state"] == "absent" or None, 120, "Qwen evicted")
    assert host.model(QWEN)["kv_cache"]["snapshots"] >= 1  # saved (when idle, or now)

    follow = [*messages, {"role": "assistant", "content": first["choices"][0]["message"]
                          ["content"]}, {"role": "user", "content": "And shelf 8?"}]
    again = greedy_chat(host, QWEN, follow, 8)
    usage = again["usage"]
    new_turn = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 < new_turn < 40, usage  # every earlier token came back from the snapshot
    assert host.model(QWEN)["kv_cache"]["restored"] >= 1


def test_a_killed_binary_ends_its_stream_and_is_respawned(host: Server) -> None:
    greedy_chat(host, QWEN, [{"role": "user", "content": "Hi"}], 2)  # resident
    status, lines, victim = kill_mid_stream(host, {
        "model": QWEN, "messages": [{"role": "user", "content": "Count to 200."}],
        "max_tokens": 400})
    assert status == 200
    assert any('"error"' in line for line in lines), lines[-3:]
    assert "data: [DONE]" not in lines[-1:] or len(lines) < 400
    again = greedy_chat(host, QWEN, [{"role": "user", "content": "Say hello."}], 4)
    assert again["choices"][0]["message"]["content"]
    assert model_worker(host, QWEN).pid != victim


def test_refused_args_name_the_flag_and_the_rest_serve(host: Server) -> None:
    for model, (_, says) in REFUSED.items():
        shown = host.model(model)
        assert shown["state"] == "failed" and says in shown["last_error"], shown
        resp = httpx.post(f"{host.url}/v1/chat/completions", timeout=60, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "model_misconfigured" and says in resp.text
    assert json.loads(httpx.get(f"{host.url}/v1/models/{QWEN}").text)["state"] != "failed"


def test_a_model_registered_at_run_time_on_the_binary(host: Server,
                                                      packaged_catalog: Catalog) -> None:
    admin = {"authorization": f"Bearer {ADMIN}"}
    resp = httpx.post(f"{host.url}/v1/models", headers=admin, timeout=300, json={
        "id": "rt-gemma", "path": str(packaged_catalog.get(GEMMA).path),
        "engine": "llama-server", "cache_type_k": "q8_0"})
    assert resp.status_code == 200 and resp.json()["state"] == "ready", resp.text
    worker = model_worker(host, "rt-gemma")
    assert os.path.basename(worker.exe()) == "llama-server"
    assert "-ctk q8_0" in " ".join(worker.cmdline())
    assert httpx.delete(f"{host.url}/v1/models/rt-gemma", headers=admin,
                        timeout=120).status_code == 204
