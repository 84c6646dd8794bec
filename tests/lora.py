"""Random LoRA adapters for the packaged Qwen, written at test time with the ``gguf`` package's
writer (fixed seeds): rank-8 ``attn_q`` and ``attn_v`` of every layer, as llama.cpp reads a
LoRA GGUF (``general.type = "adapter"``, ``adapter.type = "lora"``, ``adapter.lora.alpha``;
``blk.N.attn_q.weight.lora_a`` of numpy shape (rank, n_embd), ``lora_b`` of (n_out, rank)).

``python -m tests.lora OUT_DIR`` writes ``lora-a.gguf`` and ``lora-b.gguf`` there."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from bunkhouse.gguf.meta import GGUFInfo, read_gguf_info

RANK = 8
ALPHA = 16.0
SEEDS = {"lora-a.gguf": 1, "lora-b.gguf": 2}
SPREAD = 0.03  # the weights' standard deviation: enough to change a greedy answer


def write_lora(base: Path, out: Path, seed: int, rank: int = RANK,
               arch: str | None = None, broken: bool = False) -> Path:
    """A random LoRA for the model at ``base`` (its architecture and widths from its GGUF;
    ``arch``: another architecture to write instead, for a refusal's test; ``broken``: its
    B matrices of another rank than its A, which only the engine's load finds wrong)."""
    import gguf

    info = read_gguf_info(base)
    n_embd, n_q, n_v = _widths(info)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), arch or info.architecture)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", ALPHA)
    for layer in range(info.block_count or 0):
        for name, n_out in (("attn_q", n_q), ("attn_v", n_v)):
            a = rng.normal(0, SPREAD, (rank, n_embd)).astype(np.float32)
            b = rng.normal(0, SPREAD, (n_out, rank + broken)).astype(np.float32)
            writer.add_tensor(f"blk.{layer}.{name}.weight.lora_a", a)
            writer.add_tensor(f"blk.{layer}.{name}.weight.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _widths(info: GGUFInfo) -> tuple[int, int, int]:
    n_embd, heads = info.embedding_length, info.head_count
    if not n_embd or not heads or not info.block_count:
        raise ValueError(f"{info.architecture}: no widths in its GGUF to write a LoRA for")
    kv_heads = info.head_count_kv or heads
    head_dim = n_embd // heads
    return n_embd, heads * head_dim, kv_heads * head_dim


def write_pair(base: Path, out_dir: Path) -> dict[str, Path]:
    """Adapters A and B (different seeds) for ``base`` in ``out_dir``, by file name."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return {name: write_lora(base, out_dir / name, seed) for name, seed in SEEDS.items()}


if __name__ == "__main__":
    from bunkhouse.catalog import build_catalog
    from bunkhouse.config import Settings
    from bunkhouse.engines import ENGINES
    from tests.models import QWEN

    qwen = build_catalog(Settings(), engines=ENGINES).get(QWEN)
    for path in write_pair(qwen.path, Path(sys.argv[1])).values():
        print(path)
