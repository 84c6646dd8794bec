"""The llama.cpp adapter's parameters, as xllamacpp (the native engine) reads them."""

from __future__ import annotations

from pathlib import Path

import xllamacpp

from bunkhouse.engines import options as opts
from bunkhouse.engines.llamacpp import LlamaCppOptions
from bunkhouse.worker.engine import WorkerConfig
from bunkhouse.worker.engines.llamacpp import build_params


def test_an_embedders_pooling_reaches_llama_cpp(tmp_path: Path) -> None:
    """``--pooling model`` leaves the choice to the model file; ``mean`` is passed on."""
    pooling = xllamacpp.llama_pooling_type
    for kind, expected in (("model", pooling.LLAMA_POOLING_TYPE_UNSPECIFIED),
                           ("mean", pooling.LLAMA_POOLING_TYPE_MEAN)):
        config = WorkerConfig("e", Path("/m/e.gguf"), tmp_path / "w.sock", 512, 1,
                              embeddings=True, pooling=kind)
        assert build_params(config).pooling_type == expected


def test_the_llamacpp_worker_sets_its_options_on_the_engine(tmp_path: Path) -> None:
    own = LlamaCppOptions(cache_ram_mib=64, threads=3, swa_full=True)
    config = WorkerConfig("m", tmp_path / "m.gguf", tmp_path / "w.sock", 512, 1,
                          engine_options=opts.worker_args(own)[1])
    params = build_params(config)
    assert (params.cache_ram_mib, params.swa_full) == (64, True)
    assert params.cpuparams.n_threads == params.cpuparams_batch.n_threads == 3
