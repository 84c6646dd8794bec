"""Whisper models for transcription: CTranslate2 model directories, as faster-whisper loads
them (``model.bin``, ``config.json``, ``tokenizer.json``, often ``vocabulary.txt``).

A directory is checked when it is catalogued, without loading it: the files faster-whisper
needs are there and regular (without ``tokenizer.json`` faster-whisper would fetch one from
the Hugging Face hub, which a local server must never do). What serving needs to know of it
fits the catalog's :class:`GGUFInfo` with the architecture ``whisper`` and nothing else.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

from bunkhouse.errors import GGUFError
from bunkhouse.gguf.meta import GGUFInfo

ENGINE = "whisper"
ENGINES = frozenset({ENGINE})
"""The engines (config ``engine`` key) that serve transcription models."""

OPTIONS = {"parallel": 1, "context": 256}
"""A transcription model's options, whatever is configured: one transcription at a time; its
one slot holds no tokens (any context the options' checks accept)."""

OPENAI_NAME = "whisper-1"
"""The model name OpenAI's clients send for a transcription."""

REQUIRED = ("model.bin", "config.json", "tokenizer.json")
MAX_FILES = 64
"""Files a model directory may hold (real ones hold four or five)."""


def model_files(path: Path) -> list[Path]:
    """The regular files of the model directory ``path``, in name order (what the memory
    estimate counts as weights, and what a worker's start checks again). Raises GGUFError
    (the catalog's "not a usable model file" error) naming what is missing."""
    try:
        entries = sorted(path.iterdir())
    except OSError as e:
        raise GGUFError(f"{path}: cannot list the Whisper model directory: {e.strerror}") from e
    files = []
    for entry in entries[: MAX_FILES + 1]:
        try:
            if stat.S_ISREG(entry.lstat().st_mode):
                files.append(entry)
        except OSError:
            continue
    if len(entries) > MAX_FILES:
        raise GGUFError(f"{path}: more than {MAX_FILES} entries; not a Whisper model directory")
    missing = [name for name in REQUIRED if path / name not in files]
    if missing:
        raise GGUFError(f"{path}: not a CTranslate2 Whisper model directory (missing "
                        f"{', '.join(missing)}); convert a model with ct2-transformers-"
                        "converter, with --copy_files tokenizer.json")
    return files


def info(path: Path) -> GGUFInfo:
    """The catalog's facts about the Whisper model at ``path``: its architecture and its
    directory's name. Raises GGUFError when config.json is not a JSON object."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise GGUFError(f"{path}/config.json: not readable JSON ({e})") from e
    if not isinstance(config, dict):
        raise GGUFError(f"{path}/config.json: not a JSON object")
    return GGUFInfo(architecture="whisper", name=path.name, context_length=None, block_count=None,
                    embedding_length=None, head_count=None, head_count_kv=None,
                    key_length=None, value_length=None, sliding_window=None,
                    chat_template=None, file_type=None, tensor_count=0)
