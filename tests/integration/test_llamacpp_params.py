"""The llama.cpp adapter's parameters, as xllamacpp (the native engine) reads them."""

from __future__ import annotations

from pathlib import Path

import xllamacpp

from bunkhouse.worker.engine import WorkerConfig
from bunkhouse.worker.engines.llamacpp import build_params


def test_an_embedders_pooling_reaches_llama_cpp(tmp_path: Path) -> None:
    """``--pooling model`` leaves the choice to the model file; ``mean`` is passed on."""
    pooling = xllamacpp.llama_pooling_type
    for kind, expected in (("model", pooling.LLAMA_POOLING_TYPE_UNSPECIFIED),
                           ("mean", pooling.LLAMA_POOLING_TYPE_MEAN)):
        config = WorkerConfig("e", Path("/m/e.gguf"), tmp_path / "w.sock", 512, 1, 0, 1,
                              embeddings=True, pooling=kind)
        assert build_params(config).pooling_type == expected
