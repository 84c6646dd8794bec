"""MLX models: directories as mlx-lm loads them (``config.json``, a tokenizer,
``model*.safetensors``), served by the ``mlx`` engine.

A directory is checked when it is catalogued, without loading it (the front imports no MLX):
the files mlx-lm reads are there, ``config.json`` is a JSON object. What serving needs to know
of it (the KV cache's shape for the memory estimate, the trained context, the chat template)
is read from ``config.json`` and ``tokenizer_config.json`` into the catalog's
:class:`GGUFInfo`.

Found in three places: a config entry with ``engine = "mlx"`` and a directory ``path``; a
directory under a model root (``--models-dir``) holding ``config.json`` and
``model*.safetensors``, with its path relative to the root as id; a Hugging Face hub cache
repo whose snapshot is one (``org/repo``, as mlx-community publishes them).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bunkhouse.errors import GGUFError
from bunkhouse.gguf.meta import GGUFInfo

ENGINE = "mlx"

MAX_FILES = 256
"""Entries a model directory may hold (a large model's shards and its tokenizer's files)."""
MAX_JSON_BYTES = 32 * 1024 * 1024  # config.json, tokenizer_config.json (templates are long)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def looks_like(path: Path) -> bool:
    """Whether the directory ``path`` holds an MLX model (``config.json`` and
    ``model*.safetensors``), by names alone."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return "config.json" in names and any(
        n.startswith("model") and n.endswith(".safetensors") for n in names)


def model_files(path: Path) -> list[Path]:
    """The files of the model directory ``path`` (links followed: a hub cache snapshot's are
    links to its blobs), in name order: what the memory estimate counts as weights and what a
    worker's start checks again. Raises GGUFError (the catalog's "not a usable model" error)
    naming what is missing."""
    try:
        entries = sorted(path.iterdir())
    except OSError as e:
        raise GGUFError(f"{path}: cannot list the MLX model directory: {e.strerror}") from e
    if len(entries) > MAX_FILES:
        raise GGUFError(f"{path}: more than {MAX_FILES} entries; not an MLX model directory")
    files = []
    for entry in entries:
        try:
            if stat.S_ISREG(entry.stat().st_mode):
                files.append(entry)
        except OSError:
            continue
    names = {f.name for f in files}
    missing = [n for n in ("config.json",) if n not in names]
    if not any(n.startswith("model") and n.endswith(".safetensors") for n in names):
        missing.append("model*.safetensors")
    if not names & set(TOKENIZER_FILES):
        missing.append("a tokenizer (tokenizer.json)")
    if missing:
        raise GGUFError(f"{path}: not an MLX model directory (missing {', '.join(missing)}); "
                        "convert a model with `mlx_lm.convert`, or download one from "
                        "mlx-community")
    return files


def _json(path: Path, required: bool) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        if required:
            raise GGUFError(f"{path}: missing") from None
        return {}
    except OSError as e:
        raise GGUFError(f"{path}: not readable ({e.strerror})") from e
    if len(raw) > MAX_JSON_BYTES:
        raise GGUFError(f"{path}: larger than {MAX_JSON_BYTES} bytes")
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise GGUFError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise GGUFError(f"{path}: not a JSON object")
    return value


def _int(config: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = config.get(name)
        if type(value) is int and value > 0:
            return value
    return None


def info(path: Path) -> GGUFInfo:
    """The catalog's facts about the MLX model at ``path``, from its ``config.json`` (a
    multimodal model's ``text_config`` where it has one) and ``tokenizer_config.json``.
    Raises GGUFError when config.json is not a JSON object."""
    config = _json(path / "config.json", required=True)
    text = config.get("text_config")
    text = {**config, **text} if isinstance(text, dict) else config
    heads = _int(text, "num_attention_heads", "n_heads")
    hidden = _int(text, "hidden_size", "dim", "d_model")
    head_dim = _int(text, "head_dim") or (hidden // heads if hidden and heads else None)
    template = _json(path / "tokenizer_config.json", required=False).get("chat_template")
    if not isinstance(template, str):
        jinja = path / "chat_template.jinja"
        try:
            template = jinja.read_text(encoding="utf-8")[:MAX_JSON_BYTES] if jinja.is_file() \
                else None
        except (OSError, UnicodeDecodeError):
            template = None
    window = _int(text, "sliding_window")
    model_type = text.get("model_type")
    return GGUFInfo(
        architecture=model_type if isinstance(model_type, str) else "unknown",
        name=path.name, context_length=_int(text, "max_position_embeddings"),
        block_count=_int(text, "num_hidden_layers", "n_layers"), embedding_length=hidden,
        head_count=heads, head_count_kv=_int(text, "num_key_value_heads") or heads,
        key_length=head_dim, value_length=head_dim,
        sliding_window=window if text.get("use_sliding_window", True) else None,
        chat_template=template, file_type=None, tensor_count=0,
        vocab_size=_int(text, "vocab_size"),
        feed_forward_length=_int(text, "intermediate_size"))


def model_dirs(root: Path) -> Iterator[tuple[str, Path]]:
    """(id, path) of each MLX model directory under ``root`` (its path relative to the root),
    in a stable order; a model directory's own subdirectories are not searched."""
    for dirpath, dirnames, _ in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        here = Path(dirpath)
        if here != root and looks_like(here):
            dirnames[:] = []
            rel = here.relative_to(root).as_posix()
            if rel.isprintable():
                yield rel, here
