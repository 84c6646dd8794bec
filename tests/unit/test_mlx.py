"""MLX models in the catalog and the MLX adapter's pure parts (no MLX imported): directories
found in the config, under the model roots and in the hub cache; what is read from
config.json; slot files' token records; the memory estimate's parts; refused fields."""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from pathlib import Path

import pytest

from bunkhouse.catalog import build_catalog, mlx
from bunkhouse.catalog.sources import hf_cache_models
from bunkhouse.config import EngineOptions, Settings, load_config_file
from bunkhouse.engines import ENGINES
from bunkhouse.engines.mlx import KV_STEP, Mlx, estimate, saved_tokens
from bunkhouse.errors import ConfigError, GGUFError, InvalidRequest
from tests.unit.test_sources import hf_repo

CONFIG = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
          "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
          "max_position_embeddings": 8192, "vocab_size": 49152, "torch_dtype": "float32"}
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def _files(config: dict[str, object] = CONFIG) -> dict[str, bytes]:
    return {"config.json": json.dumps(config).encode(), "model.safetensors": b"x" * 100,
            "tokenizer.json": b"{}",
            "tokenizer_config.json": json.dumps({"chat_template": TEMPLATE}).encode()}


def _directory(path: Path, files: dict[str, bytes] | None = None) -> Path:
    path.mkdir(parents=True)
    for name, data in (files or _files()).items():
        (path / name).write_bytes(data)
    return path


def _settings(**kw: object) -> Settings:
    off = (("hf_cache", False), ("ollama", False), ("lmstudio", False))
    return Settings(include_packaged=False, sources=off, **kw)  # type: ignore[arg-type]


def test_mlx_info_reads_the_kv_shape_context_and_template(tmp_path: Path) -> None:
    info = mlx.info(_directory(tmp_path / "m"))
    assert (info.architecture, info.block_count, info.head_count, info.head_count_kv,
            info.key_length, info.context_length, info.vocab_size) == (
        "llama", 30, 9, 3, 64, 8192, 49152)
    assert info.chat_template == TEMPLATE


@pytest.mark.parametrize("missing, says", [("config.json", "config.json"),
                                           ("model.safetensors", "model*.safetensors"),
                                           ("tokenizer.json", "a tokenizer")])
def test_mlx_a_directory_missing_a_part_is_named(tmp_path: Path, missing: str,
                                                 says: str) -> None:
    files = _files()
    del files[missing]
    with pytest.raises(GGUFError, match=re.escape(f"missing {says}")):
        mlx.model_files(_directory(tmp_path / "m", files))


def test_mlx_directories_under_a_root_and_in_the_config(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _directory(root / "org" / "smol-mlx")
    _directory(root / "org" / "smol-mlx" / "nested")  # inside a model: not searched
    (root / "plain").mkdir()
    config = tmp_path / "bunkhouse.toml"
    mine = _directory(tmp_path / "elsewhere")
    config.write_text(f'[[models]]\nid = "mine"\npath = "{mine}"\nengine = "mlx"\n'
                      'context = 4096\nparallel = 2\n')
    settings = load_config_file(config, _settings(models_dirs=(root,)))
    catalog = build_catalog(settings, engines=ENGINES)
    assert sorted(catalog.ids()) == ["mine", "org/smol-mlx"]
    found = catalog.get("org/smol-mlx")
    assert found.engine == "mlx" and found.directory and found.kind == "chat"
    assert found.size_bytes == sum(len(d) for d in _files().values())
    assert catalog.get("mine").options.context == 4096


def test_mlx_a_config_entry_that_is_no_directory_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "bunkhouse.toml"
    config.write_text(f'[[models]]\nid = "x"\npath = "{tmp_path / "none"}"\nengine = "mlx"\n')
    with pytest.raises(ConfigError, match="no MLX model directory"):
        build_catalog(load_config_file(config, _settings()), engines=ENGINES)


def test_mlx_a_hub_cache_repo_that_is_one_is_listed_as_org_repo(tmp_path: Path) -> None:
    snapshot = hf_repo(tmp_path, "models--mlx-community--Smol-4bit", _files())
    hf_repo(tmp_path, "models--o--g", {"g-q4.gguf": b"GGUF"})
    found = [f for f in hf_cache_models(tmp_path) if f.id == "mlx-community/Smol-4bit"]
    assert found and found[0].path == snapshot


def test_mlx_slot_files_token_record(tmp_path: Path) -> None:
    header = json.dumps({"__metadata__": {"0.tokens": "[1, 2, 3]", "0.model": "m"}}).encode()
    good = tmp_path / "good"
    good.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    assert saved_tokens(good) == [1, 2, 3]
    for data in (b"", b"\xff" * 8, struct.pack("<Q", 5) + b"{}",
                 struct.pack("<Q", 2) + b"{}"):
        bad = tmp_path / "bad"
        bad.write_bytes(data)
        with pytest.raises(ValueError):
            saved_tokens(bad)


def test_mlx_estimate_counts_every_slot_in_whole_steps(tmp_path: Path) -> None:
    _directory(tmp_path / "r" / "m")
    catalog = build_catalog(dataclasses.replace(_settings(), models_dirs=(tmp_path / "r",),
                                                defaults=EngineOptions(context=1000,
                                                                       parallel=2)),
                            engines=ENGINES)
    model = catalog.get("m")
    per_token = 30 * 3 * (64 + 64) * 4  # layers x KV heads x (key + value) x f32
    e = estimate(model)
    slot = model.options.context // 2
    assert e.kv_cache == per_token * -(-slot // KV_STEP) * KV_STEP * 2
    assert e.weights == model.size_bytes and e.total > e.kv_cache * 2


@pytest.mark.parametrize("body, field", [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logprobs": True}, "logprobs"),
    ({"grammar": "root ::= x"}, "grammar"),
    ({"json_schema": {}}, "json_schema"),
    ({"lora": []}, "lora"),
    ({"best_of": 2}, "best_of"),
    ({"echo": True}, "echo"),
    ({"mirostat": 2}, "mirostat"),
    ({"typical_p": 0.5}, "typical_p"),
    ({"n": 2}, "n")])
def test_mlx_fields_it_does_not_do_are_refused_by_name(body: dict[str, object],
                                                      field: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        Mlx().check_request("/v1/chat/completions", {"messages": [], **body})
    assert refused.value.param == field


def test_mlx_plain_requests_pass(tmp_path: Path) -> None:
    body = {"messages": [], "response_format": {"type": "text"}, "logprobs": False,
            "best_of": 1, "top_k": 40}
    assert Mlx().check_request("/v1/chat/completions", body) is body
    unused = {"messages": [], "tools": [{"type": "function"}], "tool_choice": "none"}
    assert Mlx().check_request("/v1/chat/completions", unused) == {"messages": []}
