from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import pytest

from bunkhouse.errors import GGUFError
from bunkhouse.gguf.meta import read_fields, read_gguf_info
from tests.helpers import write_tiny_gguf


def test_reads_serving_facts(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", "gemma3", context=4096, sliding_window=512,
                           chat_template="{{ x }}")
    info = read_gguf_info(path)
    assert info.architecture == "gemma3"
    assert info.name == "tiny gemma3"
    assert info.context_length == 4096
    assert info.block_count == 4
    assert (info.head_count, info.head_count_kv) == (8, 2)
    assert info.key_length == info.value_length == 64 // 8  # embedding / heads by default
    assert info.sliding_window == 512
    assert info.chat_template == "{{ x }}" and info.has_chat_template
    assert info.tensor_count == 1


def test_agrees_with_the_gguf_package_reader(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", vocab=5000)
    reader = gguf.GGUFReader(str(path))
    texts = frozenset(name for name, field in reader.fields.items()
                      if gguf.GGUFValueType.STRING in field.types)
    fields, tensor_count = read_fields(path, strings=texts)
    assert tensor_count == len(reader.tensors)
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert fields[name] is None or fields[name] == list(field.contents())
        else:
            assert fields[name] == pytest.approx(field.contents()), name
    unasked = read_fields(path)[0]  # strings not asked for: seeked over, never read
    assert texts and all(unasked.get(name) is None for name in texts)


def test_no_chat_template(tmp_path: Path) -> None:
    info = read_gguf_info(write_tiny_gguf(tmp_path / "m.gguf", chat_template=None))
    assert info.chat_template is None and not info.has_chat_template


@pytest.mark.parametrize(
    "content",
    [b"", b"GGUF", b"not a gguf file at all", b"GGUF\x09\x00\x00\x00" + b"\x00" * 16],
)
def test_bad_files_raise_gguf_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError):
        read_gguf_info(path)


def test_truncated_file_says_truncated(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", vocab=2000)
    path.write_bytes(path.read_bytes()[:3000])
    with pytest.raises(GGUFError, match="truncated"):
        read_gguf_info(path)


def test_counts_the_weights_of_its_tensors(tmp_path: Path) -> None:
    """Ollama's parameter_size comes from here: the tensors' shapes summed (one 4x64)."""
    assert read_gguf_info(write_tiny_gguf(tmp_path / "m.gguf")).parameters == 4 * 64
    truncated = tmp_path / "cut.gguf"
    whole = (tmp_path / "m.gguf").read_bytes()
    truncated.write_bytes(whole[: whole.index(b"token_embd.weight") + 4])
    assert read_gguf_info(truncated).parameters is None  # the metadata still reads


@pytest.mark.parametrize(("file_type", "name"), [
    (15, "Q4_K_M"), (1, "F16"), (0, "F32"), (7, "Q8_0"), (32, "BF16"), (None, "unknown"),
    (999, "unknown"), (1024, "unknown")])
def test_quantization_is_named_as_llama_cpp_names_it(tmp_path: Path, file_type: int | None,
                                                     name: str) -> None:
    info = read_gguf_info(write_tiny_gguf(tmp_path / "m.gguf"))  # file type 15
    assert dataclasses.replace(info, file_type=file_type).quantization == name
