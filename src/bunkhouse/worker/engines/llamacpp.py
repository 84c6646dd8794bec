"""The llama.cpp engine: xllamacpp's embedded llama-server, listening on the worker's socket."""

from __future__ import annotations

import logging
from typing import Any

import xllamacpp

from bunkhouse.worker.engine import EngineLoadError, WorkerConfig

log = logging.getLogger(__name__)


def build_params(config: WorkerConfig) -> Any:
    """Engine parameters, every memory-relevant one set explicitly.

    xllamacpp's defaults (the model's full trained context, one slot, an 8 GiB RAM prompt
    cache) would wreck a memory budget.
    """
    params = xllamacpp.CommonParams()
    params.model.path = str(config.model_path)
    params.model_alias = {config.model_id}
    params.hostnames = [str(config.socket)]  # a path ending in .sock: a Unix socket
    params.n_ctx = config.context  # total context, shared by the slots
    params.n_parallel = config.parallel
    params.cont_batching = True
    # With embeddings on, llama.cpp lowers n_batch to n_ubatch anyway (and warns): say so.
    params.n_batch = 512
    params.n_ubatch = 512  # residency.estimate assumes this micro-batch (SWA cache size)
    params.kv_unified = False  # each slot owns context / parallel tokens: predictable KV need
    params.cache_ram_mib = config.cache_ram_mib
    params.cpuparams.n_threads = config.threads
    params.cpuparams_batch.n_threads = config.threads
    params.embedding = True  # /v1/embeddings next to generation
    params.pooling_type = xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_MEAN
    params.endpoint_metrics = True
    params.endpoint_slots = True
    params.n_threads_http = max(2, config.parallel + 1)
    return params


class LlamaCppEngine:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self._server: Any = None

    def start(self) -> None:
        if not self.config.model_path.is_file():
            raise EngineLoadError(f"model file not found: {self.config.model_path}")
        try:
            self._server = xllamacpp.Server(build_params(self.config))
        except Exception as e:
            raise EngineLoadError(f"llama.cpp failed to load {self.config.model_path}: {e}") from e

    def stop(self) -> None:
        self._server = None
