"""A user of Ollama and of the Hugging Face hub switches to bunkhouse: their model files are
served where those tools keep them, under the names those tools give them, and the real
`ollama` client lists, chats, generates and embeds against bunkhouse as it would against
Ollama. The stores are laid out as the tools lay them out: Ollama's manifests and blobs named
by digest (the packaged Gemma as the model layer), the hub cache's blobs, refs/main and
snapshot links (the packaged Qwen)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from bunkhouse.catalog import Catalog
from bunkhouse.catalog.packaged import GEMMA3_270M, QWEN_CODER_05B
from tests.e2e.server import Server, serve
from tests.helpers import wait_for
from tests.models import GEMMA, QWEN

OLLAMA_NAME = "gemma3:270m"
HF_NAME = "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF:qwen2.5-coder-0.5b-instruct-q4_k_m"
GREEDY = {"temperature": 0, "num_predict": 8}
ASK = [{"role": "user", "content": "What is the capital of France? One word."}]
EMBED_ALIAS = "gemma-embed"


def _place(source: Path, target: Path) -> None:
    """The model's bytes at ``target`` without a second copy where the disk allows."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _blob(root: Path, text: str) -> dict[str, object]:
    digest = hashlib.sha256(text.encode()).hexdigest()
    (root / "blobs" / f"sha256-{digest}").write_text(text)
    return {"digest": f"sha256:{digest}", "size": len(text.encode())}


def ollama_store(root: Path, gguf: Path) -> None:
    """Ollama's store as `ollama pull gemma3:270m` leaves it."""
    (root / "blobs").mkdir(parents=True)
    _place(gguf, root / "blobs" / f"sha256-{GEMMA3_270M.sha256}")
    layers = [
        {"mediaType": "application/vnd.ollama.image.model",
         "digest": f"sha256:{GEMMA3_270M.sha256}", "size": GEMMA3_270M.size},
        {"mediaType": "application/vnd.ollama.image.template",
         **_blob(root, "{{ .Prompt }}")},
        {"mediaType": "application/vnd.ollama.image.params",
         **_blob(root, json.dumps({"stop": ["<end_of_turn>"], "top_k": 64}))},
    ]
    config = _blob(root, json.dumps({"model_format": "gguf", "model_family": "gemma3"}))
    manifest = {"schemaVersion": 2,
                "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                           **config},
                "layers": layers}
    path = root / "manifests" / "registry.ollama.ai" / "library" / "gemma3" / "270m"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(manifest))


def hf_cache(root: Path, gguf: Path) -> None:
    """The hub cache as `hf download Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF FILE` leaves it."""
    repo = root / "models--Qwen--Qwen2.5-Coder-0.5B-Instruct-GGUF"
    commit = "9f5e3c4b2a1d0e8f7c6b5a4d3e2f1a0b9c8d7e6f"
    _place(gguf, repo / "blobs" / QWEN_CODER_05B.sha256)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / QWEN_CODER_05B.filename).symlink_to(f"../../blobs/{QWEN_CODER_05B.sha256}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, packaged_catalog: Catalog
           ) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("drop-in")
    ollama_store(root / "ollama", packaged_catalog.get(GEMMA).path)
    hf_cache(root / "hub", packaged_catalog.get(QWEN).path)
    config = root / "bunkhouse.toml"
    config.write_text(f'[[models]]\nid = "{OLLAMA_NAME}"\nembeddings = true\n'
                      f'[aliases]\n"qwen-coder" = "{HF_NAME}"\n"{EMBED_ALIAS}" = "{OLLAMA_NAME}"\n')
    with serve(root / "serve", "--no-packaged", "--no-source", "lmstudio", "--config",
               str(config), env={"OLLAMA_MODELS": str(root / "ollama"),
                                 "HF_HUB_CACHE": str(root / "hub")}) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[ollama.Client]:
    sdk = ollama.Client(host=server.url, timeout=300)
    yield sdk
    sdk._client.close()


def test_the_stores_are_served_under_their_tools_names(server: Server,
                                                       client: ollama.Client) -> None:
    listed = {m.model: m for m in client.list().models}  # each alias too, as `ollama cp`
    assert set(listed) == {OLLAMA_NAME, HF_NAME, "qwen-coder:latest", f"{EMBED_ALIAS}:latest"}
    assert listed["qwen-coder:latest"].digest == listed[HF_NAME].digest
    models = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert models[OLLAMA_NAME]["source"] == "ollama"
    assert models[HF_NAME]["source"] == "hf_cache"
    assert models[HF_NAME]["aliases"] == ["qwen-coder"]
    assert models[OLLAMA_NAME]["aliases"] == [EMBED_ALIAS]
    # each slot holds 8,192 tokens by default
    assert models[HF_NAME]["slot_context"] == 8192


def test_chat_streamed_and_not_and_ps(client: ollama.Client) -> None:
    whole = client.chat(model=HF_NAME, messages=ASK, options=GREEDY, stream=False)
    assert "Paris" in whole.message.content and whole.done
    parts = list(client.chat(model="qwen-coder", messages=ASK, options=GREEDY, stream=True))
    assert parts[-1].done and "".join(p.message.content or "" for p in parts) == \
        whole.message.content
    assert HF_NAME in {m.model for m in client.ps().models}


def test_generate_and_embed_on_the_ollama_model(client: ollama.Client) -> None:
    raw = client.generate(model=OLLAMA_NAME, prompt="The capital of France is",
                          options=GREEDY, raw=True)
    assert raw.done and raw.response.strip()
    embedded = client.embed(model="gemma3:270m", input=["a cat", "a dog"])
    assert len(embedded.embeddings) == 2
    assert all(math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-3)
               for v in embedded.embeddings)  # unit length, as Ollama's
    older = client.embeddings(model=OLLAMA_NAME, prompt="a cat")
    assert len(older.embedding) == len(embedded.embeddings[0])


def test_unknown_names_suggest_the_closest(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="gemma3:27b", messages=ASK)
    assert e.value.status_code == 404 and "did you mean 'gemma3:270m'" in e.value.error


def test_keep_alive_zero_unloads(client: ollama.Client) -> None:
    client.generate(model=OLLAMA_NAME, prompt="Hi", options=GREEDY, raw=True, keep_alive=0)
    wait_for(lambda: OLLAMA_NAME not in {m.model for m in client.ps().models}, 120,
             "keep_alive 0 to unload the model")
    cold = client.generate(model=OLLAMA_NAME, prompt="Hi", options=GREEDY, raw=True)
    assert cold.load_duration and cold.total_duration  # it waited for the load: not 0
    assert cold.total_duration >= cold.load_duration
    client.generate(model=OLLAMA_NAME, keep_alive="10m")  # Ollama's way to load
    (loaded,) = [m for m in client.ps().models if m.model == OLLAMA_NAME]
    assert loaded.expires_at is not None


def test_every_route_answers_with_the_id_the_request_used_an_alias_for(
        server: Server, client: ollama.Client) -> None:
    """One rule for `model` in answers: the model's id, on every route and protocol, in
    whole answers and each streamed piece, whatever alias (or `:latest`) the request used."""
    few = {"max_tokens": 2, "temperature": 0}
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=300) as sdk:
        chat = sdk.chat.completions.create(model="qwen-coder", messages=ASK, **few)
        chunks = list(sdk.chat.completions.create(model="qwen-coder:latest", messages=ASK,
                                                  stream=True, **few))
        text = sdk.completions.create(model="qwen-coder", prompt="Paris is", **few)
        middle = sdk.completions.create(model="qwen-coder", prompt="def f(", suffix="):",
                                        **few)
        said = sdk.responses.create(model="qwen-coder", input="Hi", max_output_tokens=2)
        vectors = sdk.embeddings.create(model=EMBED_ALIAS, input="a cat")
        with pytest.raises(openai.BadRequestError) as refused:  # an error names the id too
            sdk.chat.completions.create(model=EMBED_ALIAS, messages=ASK)
    assert OLLAMA_NAME in refused.value.message and EMBED_ALIAS not in refused.value.message
    assert {chat.model, text.model, middle.model, said.model} == {HF_NAME}
    assert chunks and {c.model for c in chunks} == {HF_NAME} and vectors.model == OLLAMA_NAME
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                             timeout=300) as claude:
        message = claude.messages.create(model="qwen-coder", max_tokens=2, messages=ASK)
        with claude.messages.stream(model="qwen-coder", max_tokens=2, messages=ASK) as events:
            streamed = events.get_final_message()
    assert message.model == streamed.model == HF_NAME
    infill = httpx.post(f"{server.url}/infill", timeout=300, json={
        "model": "qwen-coder", "input_prefix": "def f(", "input_suffix": "):", "n_predict": 2})
    assert infill.status_code == 200 and infill.json()["model"] == HF_NAME
    options = {"num_predict": 2, "temperature": 0}
    parts = list(client.chat(model="qwen-coder", messages=ASK, options=options, stream=True))
    generated = client.generate(model="qwen-coder", prompt="Hi", options=options)
    embedded = client.embed(model=EMBED_ALIAS, input="a cat")
    assert {p.model for p in parts} | {generated.model} == {HF_NAME}
    assert embedded.model == OLLAMA_NAME
