"""The MLX engine end to end: `bunkhouse serve` with the SmolLM2 MLX test model
(tests/fixtures/mlx_smollm.py, on mlx-cpu) beside the packaged Qwen (llama.cpp) and Gemma
under one budget that holds two of the three.

Through the openai and anthropic SDKs; greedy answers equal mlx-lm's own ``generate`` on the
same prompt, token for token; an eviction saves the conversation's KV state (an mlx-lm
prompt-cache file), and the follow-up prefills only its new turn; a SIGKILL of the MLX worker
mid-stream ends that stream with an error and the next request respawns it."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from bunkhouse.catalog import Catalog, build_catalog
from bunkhouse.config import Settings, load_config_file
from bunkhouse.engines import ENGINES
from bunkhouse.residency.estimate import estimate
from tests.e2e.server import Server, serve
from tests.e2e.shared import greedy_chat, kill_mid_stream, model_worker
from tests.helpers import wait_for
from tests.models import GEMMA, QWEN

pytestmark = pytest.mark.slow

SMOL = "smollm2-mlx"
BROKEN = "broken-mlx"  # a directory mlx-lm cannot load (an architecture it does not know)
ADMIN = "admin-mlx"
# a system message of our own: SmolLM2's template otherwise adds a 20-token one, and the CPU
# build prefills about 10 tokens a second
HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


def _config(path: Path, smol: Path, broken: Path, budget: int | None = None) -> Path:
    path.write_text(
        "include_packaged = true\nhf_cache = false\nollama = false\nlmstudio = false\n"
        + (f'budget = "{budget}"\n' if budget else "")
        + f'default_model = "{QWEN}"\n[defaults]\ncontext = 2048\nparallel = 2\n'
        + f'[[models]]\nid = "{SMOL}"\npath = "{smol}"\nengine = "mlx"\n'
        + f'[[models]]\nid = "{BROKEN}"\npath = "{broken}"\nengine = "mlx"\n')
    return path


def _broken(root: Path, smol: Path) -> Path:
    """An MLX directory whose config names an architecture mlx-lm has no model for."""
    broken = root / "broken-mlx"
    broken.mkdir()
    config = json.loads((smol / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "no-such-arch"}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / name, broken / name)
    header = b'{"__metadata__":{"format":"mlx"}}'
    (broken / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return broken


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory, mlx_smollm: Path,
         packaged_catalog: Catalog) -> Iterator[Server]:
    """A budget that holds SmolLM2 (MLX) and Qwen (llama.cpp) at once, not Gemma too."""
    root = tmp_path_factory.mktemp("mlx")
    broken = _broken(root, mlx_smollm)
    settings = load_config_file(_config(root / "probe.toml", mlx_smollm, broken), Settings())
    catalog = build_catalog(settings, engines=ENGINES)
    sizes = {m: estimate(catalog.get(m)).total for m in (SMOL, QWEN, GEMMA)}
    budget = sizes[SMOL] + sizes[QWEN] + min(sizes[GEMMA], sizes[SMOL]) // 2
    with serve(root / "serve", "--config", str(_config(root / "bunkhouse.toml", mlx_smollm,
                                                       broken, budget)),
               "--spare-worker", "off", "--kv-min-tokens", "24", "--admin-key", ADMIN) as server:
        yield server


def test_the_sdks_on_mlx_beside_llama_cpp_under_one_budget(host: Server) -> None:
    with openai.OpenAI(base_url=f"{host.url}/v1", api_key="none", timeout=600) as client:
        plain = client.chat.completions.create(model=SMOL, messages=HELLO,  # type: ignore[arg-type]
                                               max_tokens=8, temperature=0)
        assert plain.choices[0].message.content and plain.model == SMOL
        assert plain.usage is not None and plain.usage.completion_tokens > 0
        streamed = "".join(
            chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
                model=SMOL, messages=HELLO, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                stream=True) if chunk.choices)
        assert streamed == plain.choices[0].message.content
        qwen = client.chat.completions.create(model=QWEN, messages=HELLO,  # type: ignore[arg-type]
                                              max_tokens=4, temperature=0)
        assert qwen.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=SMOL, messages=HELLO,  # type: ignore[arg-type]
                                           max_tokens=4, response_format={"type": "json_object"})
        assert "response_format" in str(refused.value)
    assert "bunkhouse.worker.engines.mlx:MlxEngine" in model_worker(host, SMOL).cmdline()
    assert host.model(SMOL)["state"] == "ready" and host.model(QWEN)["state"] == "ready"

    with anthropic.Anthropic(base_url=host.url, api_key="none", timeout=600) as claude:
        with claude.messages.stream(model=SMOL, max_tokens=8, system="Be brief.",
                                    messages=HELLO[1:]) as stream:  # type: ignore[arg-type]
            text = "".join(stream.text_stream)
        assert text and stream.get_final_message().usage.output_tokens > 0


def test_greedy_answers_match_mlx_lm_generate(host: Server, mlx_smollm: Path) -> None:
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(mlx_smollm))
    prompt = "The three primary colors are"
    ids = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=10)]
    resp = httpx.post(f"{host.url}/v1/completions", timeout=600, json={
        "model": SMOL, "prompt": prompt, "max_tokens": 10, "temperature": 0})
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    theirs = [t for t in ids if t not in tokenizer.eos_token_ids]
    assert answer["usage"]["completion_tokens"] == len(theirs)
    assert answer["choices"][0]["text"] == tokenizer.decode(theirs)


def test_an_eviction_keeps_the_conversation(host: Server) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a fruit that is red."}]
    first = greedy_chat(host, SMOL, messages)
    greedy_chat(host, QWEN, HELLO, 2)  # SmolLM2 is now the least recently used
    gemma = httpx.post(f"{host.url}/v1/completions", timeout=600, json={
        "model": GEMMA, "prompt": "Once upon a time", "max_tokens": 2})
    assert gemma.status_code == 200, gemma.text
    wait_for(lambda: host.model(SMOL)["state"] == "absent" or None, 120, "SmolLM2 evicted")
    assert host.model(SMOL)["kv_cache"]["snapshots"] >= 1

    follow = [*messages, {"role": "assistant", "content": first["choices"][0]["message"]
                          ["content"]}, {"role": "user", "content": "And a yellow one?"}]
    again = greedy_chat(host, SMOL, follow, 4)
    usage = again["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    before = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert cached >= before - 1, (usage, first["usage"])  # the first turn and its answer
    assert 0 < usage["prompt_tokens"] - cached < 24, usage  # only the new turn prefilled
    assert host.model(SMOL)["kv_cache"]["restored"] >= 1


def test_a_killed_mlx_worker_ends_its_stream_and_is_respawned(host: Server) -> None:
    greedy_chat(host, SMOL, HELLO, 1)  # resident
    status, lines, victim = kill_mid_stream(host, {
        "model": SMOL, "messages": HELLO, "max_tokens": 400, "ignore_eos": True})
    assert status == 200
    assert any('"error"' in line for line in lines), lines[-3:]
    again = greedy_chat(host, SMOL, HELLO, 2)
    assert again["choices"][0]["message"]["content"]
    assert model_worker(host, SMOL).pid != victim


def test_a_directory_mlx_lm_cannot_load_fails_with_its_reason(host: Server) -> None:
    resp = httpx.post(f"{host.url}/v1/chat/completions", timeout=300, json={
        "model": BROKEN, "messages": HELLO, "max_tokens": 2})
    assert resp.status_code == 503, resp.text
    shown = httpx.get(f"{host.url}/v1/models/{BROKEN}",
                      headers={"authorization": f"Bearer {ADMIN}"}).json()
    assert shown["state"] == "failed", shown  # mlx-lm's own words, for an admin:
    assert "Model type no-such-arch not supported" in shown["last_error_detail"], shown
    assert greedy_chat(host, SMOL, HELLO, 1)["choices"][0]["message"]["content"] is not None
