"""The llama.cpp estimator's parts: what each option adds (the figures are fitted and checked
against real workers in docs/memory-estimate.md and tests/e2e/test_memory_budget.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from bunkhouse.catalog import CatalogModel
from bunkhouse.config import EngineOptions
from bunkhouse.engines.llamacpp import N_UBATCH, estimate, kv_cache_bytes
from bunkhouse.gguf.meta import GGUFInfo

MIB = 2**20
# Like Gemma 3: 18 layers, every 6th full attention, the others a 512-token window.
SWA = GGUFInfo("gemma3", None, 32768, 18, 640, 4, 1, 256, 256, 512, None, None, 0,
               vocab_size=262144, feed_forward_length=2048)
FULL = dataclasses.replace(SWA, architecture="qwen2", sliding_window=None)


def _model(info: GGUFInfo, context: int = 8192, parallel: int = 4,
           embeddings: bool = False, cache_ram_mib: int = 0) -> CatalogModel:
    options = EngineOptions(context=context, parallel=parallel, embeddings=embeddings,
                            engine_keys=(("threads", 1), ("cache_ram_mib", cache_ram_mib)))
    return CatalogModel("m", Path("/m.gguf"), "config", info, options, 300 * MIB)


def test_embeddings_add_two_logit_rows_per_token_of_one_micro_batch() -> None:
    off, on = estimate(_model(SWA)), estimate(_model(SWA, embeddings=True))
    assert off.outputs == 0
    assert on.outputs == N_UBATCH * 4 * (2 * 262144 + 640)
    assert on.total - off.total == on.outputs


def test_the_prompt_cache_counts_in_full() -> None:
    assert estimate(_model(FULL, cache_ram_mib=256)).prompt_cache == 256 * MIB


def test_sliding_window_layers_hold_a_window_per_slot_stream() -> None:
    per_token_layer = 1 * (256 + 256) * 2
    # one slot: full layers hold the context, window layers window + one micro-batch
    assert kv_cache_bytes(SWA, 8192, 1) == per_token_layer * (3 * 8192 + 15 * 1024)
    # four slots, each its own stream of window + micro-batch cells
    assert kv_cache_bytes(SWA, 8192, 4) == per_token_layer * (3 * 8192 + 15 * 4 * 1024)
    # slots shorter than the window: their own length, padded to 256 cells
    assert kv_cache_bytes(SWA, 512, 4) == per_token_layer * (3 * 512 + 15 * 4 * 256)
    # no window: every layer at the full context
    assert kv_cache_bytes(FULL, 8192, 4) == per_token_layer * 18 * 8192


def test_more_slots_and_longer_slots_never_need_less() -> None:
    for info in (SWA, FULL):
        for embeddings in (False, True):
            totals = [estimate(_model(info, c, p, embeddings)).total
                      for c in (512, 2048, 8192, 32768) for p in (1, 4)]
            by_context = [estimate(_model(info, c, 1, embeddings)).total
                          for c in (512, 2048, 8192, 32768)]
            assert by_context == sorted(by_context)
            assert all(t > 300 * MIB for t in totals)


def test_a_full_sliding_window_cache_counts_every_layer_at_the_whole_context() -> None:
    per_token_layer = 1 * (256 + 256) * 2
    full = dataclasses.replace(_model(SWA), options=dataclasses.replace(
        _model(SWA).options, engine_keys=(("swa_full", True),)))
    assert estimate(full).kv_cache == per_token_layer * 18 * 8192 == kv_cache_bytes(
        SWA, 8192, 4, swa_full=True)
    assert estimate(full).kv_cache > estimate(_model(SWA)).kv_cache
    # measured with the packaged Gemma, 4 slots of 2,000 tokens each: 541 MiB peak, 549
    # estimated (docs/memory-estimate.md)
