"""The contract between a worker process and the engine it hosts.

An engine is named by an import path (``package.module:Class``) on the worker's command line,
so tests can supply engines with injected faults without a test branch in product code. The
engine serves the worker HTTP API itself on ``config.socket`` (llama.cpp's server already
speaks it: ``/health``, ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
``/slots``, ``/metrics``), so no Python sits in the per-token path.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    model_id: str
    model_path: Path
    socket: Path
    context: int
    parallel: int
    chat_template: str | None = None  # a template name the engine knows, or a file's path
    embeddings: bool = False  # serve /v1/embeddings (llama.cpp: larger output buffers)
    snapshot_dir: Path | None = None  # where slot KV state is saved and restored from
    # how embeddings pool: "model", as the GGUF says (an embedding model: CLS, last or
    # mean, as it was trained), or "mean" over the tokens (a generation model: none stated)
    pooling: str = "mean"
    # the engine's own options: a JSON object its front-side adapter wrote, which the engine
    # decodes with that adapter's parser (bunkhouse.engines.options)
    engine_options: str = "{}"
    adapters: tuple[Path, ...] = ()  # LoRA adapters mounted with the model, every one at 0
    draft: Path | None = None  # a draft model for speculative decoding (the options say how)


class Engine(Protocol):
    def __init__(self, config: WorkerConfig) -> None: ...

    def start(self) -> None:
        """Load the model and start serving on ``config.socket``; return once it answers."""

    def stop(self) -> None:
        """Stop serving and free the model."""


class EngineLoadError(Exception):
    """The engine could not load its model; the message says why."""


def load_engine_class(import_path: str) -> type[Engine]:
    module_name, _, attr = import_path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"engine must be 'module:Class', not {import_path!r}")
    cls: type[Engine] = getattr(importlib.import_module(module_name), attr)
    return cls
