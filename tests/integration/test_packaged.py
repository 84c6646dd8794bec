"""The models shipped in Python packages, as installed: found through their distributions'
metadata, assembled into the cache, read and given their kinds in the catalog."""

from __future__ import annotations

from pathlib import Path

import pytest

from bunkhouse.catalog import Catalog, build_catalog, packaged
from bunkhouse.catalog.packaged import PackagedModel, Part, part_paths
from bunkhouse.config import Settings, load_config_file
from bunkhouse.engines import ENGINES
from bunkhouse.errors import PackagedModelError
from bunkhouse.gguf.meta import read_fields
from bunkhouse.residency.estimate import estimate
from tests.helpers import whisper_dir
from tests.models import GEMMA, QWEN, WHISPER


def test_some_parts_missing_is_an_error() -> None:
    real = packaged.QWEN_CODER_05B.parts[0]
    model = PackagedModel("x", "x.gguf", 1, "0" * 64,
                          (real, Part("no-such-distribution-bunkhouse", "x/y.bin")))
    with pytest.raises(PackagedModelError, match="no-such-distribution-bunkhouse"):
        part_paths(model)


@pytest.mark.parametrize("model", packaged.KNOWN, ids=lambda m: m.id)
def test_installed_parts_found_through_metadata(model: PackagedModel) -> None:
    paths = part_paths(model)
    assert paths is not None and len(paths) == len(model.parts)
    assert sum(p.stat().st_size for p in paths) == model.size


def test_packaged_default_is_qwen(packaged_catalog: Catalog) -> None:
    assert packaged_catalog.default_id == QWEN
    assert packaged_catalog.get(None).info.has_chat_template


def test_packaged_models_metadata(packaged_catalog: Catalog) -> None:
    qwen = packaged_catalog.get(QWEN).info
    assert (qwen.architecture, qwen.block_count, qwen.head_count_kv) == ("qwen2", 24, 2)
    assert (qwen.key_length, qwen.value_length, qwen.context_length) == (64, 64, 32768)
    assert qwen.has_chat_template
    gemma = packaged_catalog.get(GEMMA).info
    assert (gemma.architecture, gemma.block_count, gemma.sliding_window) == ("gemma3", 18, 512)
    assert (gemma.head_count_kv, gemma.key_length) == (1, 256)
    assert not gemma.has_chat_template
    assert (qwen.vocab_size, gemma.vocab_size) == (151936, 262144)
    for model_id in (QWEN, GEMMA):  # within every budget
        model = packaged_catalog.get(model_id)
        fields, _ = read_fields(model.path, frozenset({"tokenizer.ggml.tokens"}))
        assert len(fields["tokenizer.ggml.tokens"]) == model.info.vocab_size


def test_the_packaged_whisper_is_a_transcription_model_named_whisper_1(
        packaged_catalog: Catalog) -> None:
    catalog = packaged_catalog
    whisper = catalog.get("whisper-1")
    assert whisper.id == WHISPER and whisper.kind == "transcription"
    assert whisper.engine == "whisper" and whisper.options.parallel == 1
    assert catalog.default_id != whisper.id
    assert catalog.get(QWEN).kind == "chat"
    assert catalog.get(GEMMA).kind == "completion"
    need = estimate(whisper)
    assert need.weights == whisper.size_bytes > 70_000_000
    # measured with tiny.en: 507 MiB at its peak on a 10-minute file (docs/benchmarks.md)
    assert 507 * 2**20 < need.total < 700 * 2**20


def test_a_configured_whisper_directory_is_served_and_takes_whisper_1(tmp_path: Path) -> None:
    own = whisper_dir(tmp_path)
    config = tmp_path / "bunkhouse.toml"
    config.write_text(f'[[models]]\nid = "mine"\npath = "{own}"\nengine = "whisper"\n'
                      f'aliases = ["dictation"]\n\n'
                      f'[[models]]\nid = "{WHISPER}"\nttl = 600\n')
    catalog = build_catalog(load_config_file(config, Settings()),  # the packaged ones assembled
                            engines=ENGINES)
    mine = catalog.get("dictation")
    assert mine.id == "mine" and mine.transcribes and mine.size_bytes == sum(
        f.stat().st_size for f in own.iterdir())
    assert catalog.get("whisper-1").id == "mine"  # a configured one comes first
    packaged = catalog.get(WHISPER)  # configured by the overlay, still Whisper
    assert packaged.engine == "whisper" and packaged.ttl_s == 600
    assert packaged.options.parallel == 1
    assert catalog.default_id == QWEN
