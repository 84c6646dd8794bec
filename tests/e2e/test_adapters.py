"""LoRA adapters as models of their own, through `bunkhouse serve` with the real worker and the
packaged Qwen, two random adapters made at test time (tests/lora.py).

Every answer is compared token for token (greedy) with a reference: the answer of a fresh
server that serves only that model or adapter. One server with both adapters serves them
alternately, concurrently in two slots, after an eviction (the adapter's KV state restored,
never the base's from the adapter's snapshot), across a runtime registration that re-mounts
the base while a stream runs, and across a DELETE (409 while held, 204 once free)."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bunkhouse.catalog import Catalog, build_catalog
from bunkhouse.config import Settings, load_config_file
from bunkhouse.engines import ENGINES
from bunkhouse.residency.estimate import estimate
from bunkhouse.supervisor.handle import process_memory
from tests.e2e.server import Server, serve
from tests.e2e.shared import post_stream
from tests.lora import write_lora, write_pair
from tests.models import GEMMA, QWEN

pytestmark = pytest.mark.slow

ADMIN = {"authorization": "Bearer admin-lora"}
PROMPT = [{"role": "user", "content": "Write a haiku about the sea."}]
MODULE = "".join(f"def g{i}(x):\n    return x - {i}\n" for i in range(44))
CONVERSATION = [{"role": "system", "content": "You review Python code."},
                {"role": "user", "content": f"{MODULE}\nWhich function returns x - 17?"}]
QUESTION = {"role": "user", "content": "And which one returns x - 30?"}
EXPLAIN = [CONVERSATION[0], {"role": "user", "content": f"{MODULE}\nSay what each does."}]
LONG = [{"role": "user", "content": "Count from 1 to 200, one number a line."}]


def _config(path: Path, loras: dict[str, Path], extra: str = "") -> Path:
    """Qwen (two slots of 2,048 tokens) with ``loras`` (id -> file) as its adapters."""
    text = "include_packaged = true\nhf_cache = false\nollama = false\nlmstudio = false\n" \
        "[defaults]\ncontext = 4096\nparallel = 2\n"
    for adapter_id, file in loras.items():
        text += f'[[models]]\nid = "{adapter_id}"\nadapter_of = "{QWEN}"\npath = "{file}"\n'
    path.write_text(text + extra)
    return path


def _ask(server: Server, model: str, messages: list[dict[str, Any]] = PROMPT,
         tokens: int = 24) -> dict[str, Any]:
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=600, json={
        "model": model, "messages": messages, "max_tokens": tokens, "temperature": 0})
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()
    assert data["model"] == model  # the adapter's own id, not its base's
    return data


def _text(data: dict[str, Any]) -> str:
    content: str = data["choices"][0]["message"]["content"]
    return content


def _follow_up(first: str) -> list[dict[str, Any]]:
    return [*CONVERSATION, {"role": "assistant", "content": first}, QUESTION]


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory, packaged_catalog: Catalog) -> Path:
    """The adapters' folder (the server's allowed root): lora-a.gguf, lora-b.gguf."""
    root = tmp_path_factory.mktemp("loras")
    write_pair(packaged_catalog.get(QWEN).path, root)
    return root


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory, loras: Path) -> dict[str, str]:
    """Each model's greedy answers from a fresh server that serves only it: the base, then
    adapter A (the prompt, a conversation and its follow-up), then B."""
    workdir = tmp_path_factory.mktemp("lora-references")
    ref: dict[str, str] = {}
    for name, files in (("a", {"a": loras / "lora-a.gguf"}), ("base", {}),
                        ("b", {"b": loras / "lora-b.gguf"})):
        config = _config(workdir / f"{name}.toml", files)
        with serve(workdir / name, "--config", str(config)) as server:
            model = QWEN if name == "base" else name
            ref[name] = _text(_ask(server, model))
            if name == "a":
                ref["a-first"] = _text(_ask(server, "a", CONVERSATION))
                ref["a-follow"] = _text(_ask(server, "a", _follow_up(ref["a-first"])))
            if name == "base":  # the same words as A's follow-up
                ref["base-follow"] = _text(_ask(server, QWEN, _follow_up(ref["a-first"])))
    return ref


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory, loras: Path) -> Iterator[Server]:
    """Qwen with adapters a and b, a budget that holds Qwen or Gemma but not both, runtime
    registration of adapters under ``loras``."""
    workdir = tmp_path_factory.mktemp("lora-host")
    config = _config(workdir / "bunkhouse.toml", {"a": loras / "lora-a.gguf",
                                                  "b": loras / "lora-b.gguf"})
    catalog = build_catalog(load_config_file(config, Settings()), engines=ENGINES)
    qwen, gemma = (estimate(catalog.get(m)).total for m in (QWEN, GEMMA))
    budget = max(qwen, gemma) + (qwen + gemma - max(qwen, gemma)) // 2  # one, never both
    with serve(workdir, "--config", str(config), "--budget", str(budget), "--admin-key",
               "admin-lora", "--allow-runtime-load", "--allowed-root", str(loras),
               "--stop-grace", "1") as server:
        yield server


def test_each_adapter_answers_as_its_reference_alternated_and_concurrent(
        host: Server, references: dict[str, str]) -> None:
    """Base, A and B answer the same prompt differently, each as a server serving only it;
    the same, alternated six times in a row, and two at once in two slots."""
    names = {QWEN: "base", "a": "a", "b": "b"}
    assert len({references["base"], references["a"], references["b"]}) == 3
    listed = {m["id"]: m for m in httpx.get(f"{host.url}/v1/models").json()["data"]}
    assert listed["a"]["parent"] == QWEN and listed["b"]["parent"] == QWEN
    assert listed[QWEN]["adapters"] == ["a", "b"]
    for _ in range(6):
        for model, name in names.items():
            assert _text(_ask(host, model)) == references[name], model
    answers: dict[str, str] = {}

    def ask(model: str) -> None:
        answers[model] = _text(_ask(host, model))

    for pair in ((QWEN, "a"), ("a", "b"), ("b", QWEN)) * 2:
        threads = [threading.Thread(target=ask, args=(m,)) for m in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        for model in pair:
            assert answers.pop(model) == references[names[model]], (pair, model)


def test_a_conversation_on_an_adapter_comes_back_after_eviction_and_never_to_the_base(
        host: Server, references: dict[str, str]) -> None:
    """A's conversation (about 600 tokens) is saved when Gemma evicts Qwen; A's follow-up then
    prefills only its new turn and answers as the reference; the base's follow-up on the same
    words is not served from A's snapshot (it prefills all of it) and answers as the base."""
    first = _ask(host, "a", CONVERSATION)
    assert _text(first) == references["a-first"]
    assert first["usage"]["prompt_tokens"] > 500
    gemma = httpx.post(f"{host.url}/v1/completions", timeout=600,
                       json={"model": GEMMA, "prompt": "Hello", "max_tokens": 2})
    assert gemma.status_code == 200, gemma.text
    assert host.model(QWEN)["state"] == "absent"
    follow = _ask(host, "a", _follow_up(_text(first)))
    assert _text(follow) == references["a-follow"]
    assert follow["timings"]["prompt_n"] < 100 < follow["timings"]["cache_n"], follow["timings"]
    base = _ask(host, QWEN, _follow_up(_text(first)))
    assert _text(base) == references["base-follow"]
    assert base["timings"]["cache_n"] < 100, base["timings"]  # nothing of A's KV state
    assert host.model(QWEN)["kv_cache"]["restored"] >= 1


def test_registering_an_adapter_while_another_streams_remounts_the_base(
        host: Server, loras: Path, references: dict[str, str]) -> None:
    """Adapter C (B's file) is registered at runtime while A streams on the same base: A's
    stream runs to its end, C then answers as B's reference, and A's next turn keeps its KV
    state across the re-mount (it prefills only the new turn)."""
    shutil.copy(loras / "lora-b.gguf", loras / "lora-c.gguf")
    started, done = threading.Event(), threading.Event()
    streamed: dict[str, Any] = {}

    def stream() -> None:
        streamed["status"], streamed["lines"] = post_stream(
            host.url, "/v1/chat/completions", {"model": "a", "messages": EXPLAIN,
                                               "max_tokens": 60, "temperature": 0}, started)
        done.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(300)
    resp = httpx.post(f"{host.url}/v1/models", headers=ADMIN, timeout=120, json={
        "id": "c", "path": str(loras / "lora-c.gguf"), "adapter_of": QWEN})
    assert resp.status_code == 200, resp.text
    assert resp.json()["parent"] == QWEN
    assert not done.is_set()  # registered while A streams (60 tokens: a second or more)
    assert _text(_ask(host, "c")) == references["b"]  # after A's stream: the base re-mounted
    thread.join(timeout=300)
    assert streamed["status"] == 200 and streamed["lines"][-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in streamed["lines"][-2]  # all 60 tokens
    text = "".join(_delta(line) for line in streamed["lines"])
    follow = _ask(host, "a", [*EXPLAIN, {"role": "assistant", "content": text}, QUESTION])
    assert follow["timings"]["prompt_n"] < 100 < follow["timings"]["cache_n"], follow["timings"]
    assert "c" in host.model(QWEN)["adapters"]


def _delta(line: str) -> str:
    if not line.startswith("data: {"):
        return ""
    choices = json.loads(line[6:]).get("choices") or [{}]
    return str(choices[0].get("delta", {}).get("content") or "")


def test_an_adapter_held_by_a_stream_is_not_deleted_until_it_ends(
        host: Server, references: dict[str, str]) -> None:
    """DELETE of an adapter while its request streams: 409; after: 204, its requests are 404
    naming the known models, and the base answers as before."""
    started = threading.Event()
    streamed: dict[str, Any] = {}

    def stream() -> None:
        streamed["status"], streamed["lines"] = post_stream(
            host.url, "/v1/chat/completions",
            {"model": "c", "messages": LONG, "max_tokens": 80, "temperature": 0}, started)

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(300)
    held = httpx.delete(f"{host.url}/v1/models/c", headers=ADMIN, timeout=60)
    assert held.status_code == 409 and "in use" in held.json()["error"]["message"], held.text
    thread.join(timeout=300)
    assert streamed["status"] == 200 and streamed["lines"][-1] == "data: [DONE]"
    assert httpx.delete(f"{host.url}/v1/models/c", headers=ADMIN, timeout=60).status_code == 204
    gone = httpx.post(f"{host.url}/v1/chat/completions", timeout=60,
                      json={"model": "c", "messages": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404 and "known models" in gone.text, gone.text
    assert "'c' not found" in gone.json()["error"]["message"]
    assert _text(_ask(host, QWEN)) == references["base"]


def test_an_adapter_the_engine_cannot_mount_fails_alone(
        host: Server, loras: Path, packaged_catalog: Catalog,
        references: dict[str, str]) -> None:
    """An adapter whose file passes the front's checks (its header and tensor shapes) but
    fails in the engine (its tensors' data cut short) is registered, then not mounted: its
    requests are a 503 naming it, while the base and the other adapters answer as their
    references. One whose shapes do not fit is refused at once, naming ``path``."""
    misfit = write_lora(packaged_catalog.get(QWEN).path, loras / "misfit.gguf", 4, broken=True)
    refused = httpx.post(f"{host.url}/v1/models", headers=ADMIN, timeout=120, json={
        "id": "misfit", "path": str(misfit), "adapter_of": QWEN})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "path"
    assert "does not fit" in refused.json()["error"]["message"]
    broken = write_lora(packaged_catalog.get(QWEN).path, loras / "broken.gguf", 4)
    broken.write_bytes(broken.read_bytes()[:broken.stat().st_size // 2])
    resp = httpx.post(f"{host.url}/v1/models", headers=ADMIN, timeout=120, json={
        "id": "broken", "path": str(broken), "adapter_of": QWEN})
    assert resp.status_code == 200, resp.text
    failed = httpx.post(f"{host.url}/v1/chat/completions", timeout=600, json={
        "model": "broken", "messages": PROMPT, "max_tokens": 2})
    assert failed.status_code == 503, failed.text
    assert "'broken'" in failed.json()["error"]["message"]
    assert _text(_ask(host, "a")) == references["a"]
    assert _text(_ask(host, QWEN)) == references["base"]
    assert httpx.delete(f"{host.url}/v1/models/broken", headers=ADMIN,
                        timeout=60).status_code == 204


def test_adapters_refuse_what_cannot_be(host: Server, loras: Path,
                                        packaged_catalog: Catalog) -> None:
    """A request's own ``lora``, and registrations naming an unknown base, an adapter as base,
    a scale out of range, a LoRA of another architecture or a file that is no LoRA: each a
    400 naming its field; the models serve on."""
    lora = httpx.post(f"{host.url}/v1/chat/completions", timeout=60, json={
        "model": QWEN, "messages": PROMPT, "lora": [{"id": 0, "scale": 1}]})
    assert lora.status_code == 400 and lora.json()["error"]["param"] == "lora"
    other = write_lora(packaged_catalog.get(QWEN).path, loras / "llama.gguf", 3, arch="llama")
    (loras / "junk.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    path = str(loras / "lora-a.gguf")
    for body, param in (({"adapter_of": "nope", "path": path}, "adapter_of"),
                        ({"adapter_of": "a", "path": path}, "adapter_of"),
                        ({"adapter_of": QWEN, "path": path, "scale": 11}, "scale"),
                        ({"adapter_of": QWEN, "path": path, "scale": -1}, "scale"),
                        ({"adapter_of": QWEN, "path": str(other)}, "adapter_of"),
                        ({"adapter_of": QWEN, "path": str(loras / "junk.gguf")}, "path"),
                        ({"adapter_of": QWEN, "path": path, "context": 512}, "context")):
        resp = httpx.post(f"{host.url}/v1/models", headers=ADMIN, timeout=60,
                          json={"id": "x", **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, \
            (body, resp.text)
    assert "x" not in [m["id"] for m in httpx.get(f"{host.url}/v1/models").json()["data"]]
    assert _ask(host, "a", tokens=2)["model"] == "a"


def test_every_protocol_serves_an_adapter_by_its_id(host: Server) -> None:
    """Anthropic's Messages, the Responses API, Ollama's chat and /infill name the adapter,
    and the token and template routes take its id;
    the base's worker, with its adapters mounted, stayed within its memory estimate."""
    base = host.url
    claude = httpx.post(f"{base}/v1/messages", timeout=120, json={
        "model": "b", "max_tokens": 4, "messages": PROMPT})
    assert claude.status_code == 200 and claude.json()["model"] == "b", claude.text
    responses = httpx.post(f"{base}/v1/responses", timeout=120, json={
        "model": "b", "input": "Say hi", "max_output_tokens": 4})
    assert responses.status_code == 200 and responses.json()["model"] == "b", responses.text
    ollama = httpx.post(f"{base}/api/chat", timeout=120, json={
        "model": "b", "messages": PROMPT, "stream": False, "options": {"num_predict": 4}})
    assert ollama.status_code == 200 and ollama.json()["model"].startswith("b"), ollama.text
    tags = {m["name"]: m for m in httpx.get(f"{base}/api/tags").json()["models"]}
    assert tags["b:latest"]["details"]["parent_model"] == f"{QWEN}:latest"
    show = httpx.post(f"{base}/api/show", json={"model": "b"}, timeout=60).json()
    assert "\nADAPTER " in show["modelfile"] and show["template"]  # its base's template
    infill = httpx.post(f"{base}/infill", timeout=120, json={
        "model": "b", "input_prefix": "def add(a, b):\n", "input_suffix": "\n", "n_predict": 4})
    assert infill.status_code == 200 and infill.json()["model"] == "b", infill.text
    for path, body in (("/v1/messages/count_tokens", {"messages": PROMPT}),
                       ("/tokenize", {"content": "hi"}), ("/apply-template", {"messages": PROMPT})):
        assert httpx.post(f"{base}{path}", json={"model": "b", **body},
                          timeout=120).status_code == 200, path  # its base's tokens, template
    metrics = httpx.get(f"{base}/metrics").text  # requests and tokens under the adapter's id
    assert 'bunkhouse_requests_total{model="b",protocol="anthropic"' in metrics
    assert 'bunkhouse_generated_tokens_total{model="b"}' in metrics
    qwen = host.model(QWEN)  # after every test here: its worker's high-water mark
    memory = process_memory(qwen["pid"])
    assert memory is not None and memory.peak <= qwen["estimated_bytes"], (memory, qwen)
