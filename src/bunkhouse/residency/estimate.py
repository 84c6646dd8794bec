"""How much memory a model's worker will take, estimated from its GGUF before it loads.

estimate = weights (the file, memory-mapped and all touched by warm-up)
         + KV cache (per token: layers x KV heads x (key + value head dims) x 2 bytes for f16,
           at the worker's total context; sliding-window layers capped at their window)
         + the engine's prompt cache limit (``cache_ram_mib``, counted in full)
         + a fixed part: compute buffers, the llama.cpp and Python runtime.

The fixed part was measured on this engine build (xllamacpp 2026.10.11549, CPU) as RSS after
load and one request minus weights and KV: 147 MiB for Qwen2.5-0.5B (context 8192 / 4 slots
and 2048 / 1 slot) and 142 MiB for Gemma 3 270M (8192 and 16384): 145 MiB is used.
Once a worker is ready its measured RSS replaces the estimate.

Not counted: an embeddings request on a generation model makes llama.cpp grow its output
buffer to ``n_vocab x 4 bytes`` per input token (up to the 512-token micro-batch): +100 MiB
for 100 tokens on Qwen, +190 MiB on Gemma (262k vocabulary). The measured size shows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from bunkhouse.catalog import CatalogModel
from bunkhouse.catalog.gguf_meta import GGUFInfo
from bunkhouse.engines.llamacpp import EMBEDDING_BATCH

MIB = 1024 * 1024
FIXED_BYTES = 145 * MIB
KV_ELEMENT_BYTES = 2  # f16 K and V caches, llama.cpp's default
N_UBATCH = EMBEDDING_BATCH  # the engine's micro-batch, set explicitly on every worker
_SWA_PAD = 256

# Every Nth layer uses full attention, the others a sliding window (llama.cpp's patterns).
_SWA_PATTERNS: dict[str, int] = {"gemma3": 6, "gemma2": 2, "cohere2": 4, "gemma3n": 5}


DEFAULT_BUDGET_SHARE = 0.5


def default_budget_bytes() -> int:
    """Half of this machine's RAM: room for the OS, the front and everything else."""
    return int(psutil.virtual_memory().total * DEFAULT_BUDGET_SHARE)


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    weights: int
    kv_cache: int
    prompt_cache: int
    fixed: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.prompt_cache + self.fixed


def kv_bytes_per_token_per_layer(info: GGUFInfo) -> int:
    heads = info.head_count_kv or info.head_count or 0
    dims = (info.key_length or 0) + (info.value_length or 0)
    return heads * dims * KV_ELEMENT_BYTES


def _swa_layers(info: GGUFInfo) -> int:
    layers = info.block_count or 0
    pattern = _SWA_PATTERNS.get(info.architecture)
    if not info.sliding_window or pattern is None:
        return 0  # unknown pattern: count every layer at full context (over, never under)
    return sum(1 for il in range(layers) if (il + 1) % pattern != 0)


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def kv_cache_bytes(info: GGUFInfo, context: int, parallel: int) -> int:
    """The KV cache llama.cpp allocates for ``context`` tokens shared by ``parallel`` slots."""
    per_layer = kv_bytes_per_token_per_layer(info)
    swa = _swa_layers(info)
    full = (info.block_count or 0) - swa
    swa_cells = context
    if swa and info.sliding_window:
        swa_cells = min(context, _pad(info.sliding_window * parallel + N_UBATCH, _SWA_PAD))
    return per_layer * (full * context + swa * swa_cells)


def estimate(model: CatalogModel) -> MemoryEstimate:
    o = model.options
    return MemoryEstimate(
        weights=model.size_bytes,
        kv_cache=kv_cache_bytes(model.info, o.context, o.parallel),
        prompt_cache=o.cache_ram_mib * MIB,
        fixed=FIXED_BYTES,
    )
