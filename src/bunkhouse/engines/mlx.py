"""The MLX engine adapter (mlx-lm, model directories as mlx-community publishes them), front
side. Never imports MLX: the worker does (``bunkhouse.worker.engines.mlx``).

The MLX worker answers the same worker API as bunkhouse's llama.cpp workers (health, slots,
tokenize, detokenize, apply-template, OpenAI chat and completions with a ``timings`` object,
slot save and restore), so its client is the llama.cpp one (:class:`LlamaCppClient`); what
differs is here: its capabilities (generation and KV snapshots; no embeddings,
fill-in-the-middle, adapters, log-probabilities or constraints), its memory estimate, its
snapshot files (mlx-lm's prompt-cache files, safetensors) and the request fields it refuses.

The memory estimate (:func:`estimate`) was checked with the SmolLM2-135M test model on mlx-cpu
(``tests/fixtures/mlx_smollm.py``, f32 activations, context 4096, 2 slots): 253 MiB resident
once loaded, a peak of 413 MiB after two 502-token prompts and 64 tokens each, against an
estimate of about 1.1 GiB for the slots' full context (its largest term, a prefill step's
activations with every head's attention scores, is counted for a full 2048-token step of
every slot at once).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from bunkhouse.engines import options as opts
from bunkhouse.engines.contract import (
    Capabilities,
    ConstraintCheck,
    MemoryEstimate,
    ServedModel,
    WorkerSpawn,
)
from bunkhouse.engines.llamacpp import LlamaCppClient, pinnable
from bunkhouse.errors import InvalidRequest

NAME = "mlx"
WORKER_ENGINE = "bunkhouse.worker.engines.mlx:MlxEngine"
MIB = 1024 * 1024

RUNTIME_BYTES = 200 * MIB
"""The worker without its model: Python, mlx, mlx-lm with transformers' tokenizer, uvicorn
(measured 160 MiB: the SmolLM2 worker's 253 MiB resident once loaded less its 94 MiB of
weights, mlx-cpu on Linux; rounded up)."""
KV_STEP = 256
"""Tokens an mlx-lm KV cache grows by (``KVCache.step``): a slot's cache is whole steps."""
PREFILL_STEP = 2048
"""Prompt tokens mlx-lm prefills at once (``BatchGenerator``'s ``prefill_step_size``)."""
LOGIT_BYTES = 4  # logits are f32
MAX_HEADER_BYTES = 64 * MIB  # a slot file's safetensors header; a config.json
UNSUPPORTED = {
    "grammar": "constrained output (a grammar)", "json_schema": "constrained output",
    "tools": "tool calls", "logprobs": "log-probabilities", "top_logprobs": "log-probabilities",
    "n_probs": "log-probabilities", "lora": "LoRA adapters", "suffix": "fill-in-the-middle",
    "echo": "echoing the prompt", "best_of": "several answers to choose from",
}
"""Request fields the MLX worker does not do, refused at the front naming the field."""
PRESENT = frozenset({"grammar", "json_schema", "lora"})
"""Of those, the ones refused whatever their value (an empty one too), as llama.cpp's are."""
LLAMA_CPP_ONLY = frozenset({
    "typical_p", "top_n_sigma", "min_keep", "repeat_last_n", "dry_multiplier", "dry_base",
    "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "xtc_probability",
    "xtc_threshold", "mirostat", "mirostat_tau", "mirostat_eta", "dynatemp_range",
    "dynatemp_exponent", "samplers", "n_keep", "n_indent", "n_cmpl", "t_max_predict_ms",
    "return_tokens", "post_sampling_probs", "input_prefix", "input_suffix", "input_extra",
    "embd_normalize"})
"""llama.cpp's own sampling and request fields, which the MLX engine does not read: refused
when set, never ignored."""
FORWARDED = frozenset({"top_k", "min_p", "repeat_penalty", "repetition_penalty", "ignore_eos",
                       "n_predict", "cache_prompt", "chat_template_kwargs"})


@functools.cache
def _build() -> str:
    """Read once, when a snapshot key first asks: not at import (every worker imports the
    adapters, and reading the installed distributions' metadata costs a llama.cpp worker
    about a MiB of its budget)."""
    try:
        return (f"mlx-lm {importlib.metadata.version('mlx-lm')} "
                f"mlx {importlib.metadata.version('mlx')}")
    except importlib.metadata.PackageNotFoundError:
        return "mlx-lm not installed"


def dtype_bytes(path: Path) -> int:
    """Bytes per element of the model's activations and KV cache, from its config.json's
    ``torch_dtype``: float32 4; float16, bfloat16 and anything unstated 2."""
    try:
        with (path / "config.json").open("rb") as f:
            config = json.loads(f.read(MAX_HEADER_BYTES))
    except (OSError, ValueError):
        return 2
    dtype = config.get("torch_dtype", config.get("dtype")) if isinstance(config, dict) else None
    return 4 if dtype == "float32" else 2


def _slot(model: ServedModel) -> int:
    return model.options.context // model.options.parallel


def kv_bytes_per_token(model: ServedModel) -> int:
    """One token's keys and values in every layer, bytes (the model's dtype)."""
    info = model.info
    layers = info.block_count or 32
    heads = info.head_count_kv or info.head_count or 32
    width = (info.key_length or 128) + (info.value_length or 128)
    return layers * heads * width * dtype_bytes(model.path)


def estimate(model: ServedModel) -> MemoryEstimate:
    """The worker's worst case: the directory's files as weights (safetensors are read
    whole), every slot's KV cache at its full context in whole :data:`KV_STEP` steps, and as
    much again for the batch's merged cache while the slots' own are held (mlx-lm's
    ``BatchGenerator`` copies each request's cache into the batch's); a prefill step's
    activations for a batch of every slot; the logits of a decode step."""
    o, info = model.options, model.info
    slot = -(-_slot(model) // KV_STEP) * KV_STEP
    kv = kv_bytes_per_token(model) * slot * o.parallel
    rows = min(PREFILL_STEP, _slot(model)) * o.parallel
    width = ((info.embedding_length or 4096) * 6 + (info.feed_forward_length or 16384) * 3
             + (info.head_count or 32) * min(PREFILL_STEP, _slot(model)))
    vocab = info.vocab_size or 150_000
    return MemoryEstimate(weights=model.size_bytes, kv_cache=kv, prompt_cache=kv,
                          runtime=RUNTIME_BYTES, compute=rows * width * dtype_bytes(model.path),
                          outputs=vocab * LOGIT_BYTES * o.parallel * 2)


STATE_TOKENS = "0.tokens"
"""The metadata key of a prompt-cache file that holds the token ids it covers (the worker
saves them as mlx-lm's ``save_prompt_cache`` metadata, the first item of its tree)."""


def saved_tokens(path: Path) -> list[int]:
    """The token ids an MLX worker's slot file covers, from its safetensors header (8 bytes of
    little-endian length, then that much JSON whose ``__metadata__`` holds
    :data:`STATE_TOKENS`). ValueError for a file that is not one."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", head)
        if not 2 <= size <= MAX_HEADER_BYTES:
            raise ValueError("not a safetensors file")
        raw = f.read(size)
    if len(raw) < size:
        raise ValueError("truncated header")
    try:
        meta = json.loads(raw)["__metadata__"]
        tokens = json.loads(meta[STATE_TOKENS])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not an MLX worker's slot file ({e})") from e
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise ValueError("its token record is not a list of token ids")
    return tokens


class MlxClient(LlamaCppClient):
    """The worker contract over the MLX worker's API (the llama.cpp worker API's shape)."""

    async def adapter_fields(self, adapters: tuple[Any, ...], chosen: Any) -> dict[str, Any]:
        if adapters or chosen is not None:
            raise InvalidRequest(f"model {self._model_id!r}: the MLX engine mounts no LoRA "
                                 "adapters", param="model")
        return {}

    async def prime_slot(self, slot_id: int, fields: dict[str, Any], token: int) -> None:
        return None  # no adapters: a slot's setting never changes


class Mlx:
    """The MLX engine adapter (engines/contract.py ``EngineAdapter``)."""

    name = NAME
    worker_engine = WORKER_ENGINE

    @property
    def build(self) -> str:
        return _build()

    known_options: frozenset[str] = frozenset()

    def options(self, raw: Mapping[str, Any], where: str) -> dict[str, Any]:
        return opts.checked(raw, {}, where)

    ready_line: str | None = None

    def command(self, model: ServedModel, spawn: WorkerSpawn) -> list[str] | None:
        return None

    def worker_args(self, model: ServedModel) -> list[str]:
        o = model.options
        return ["--context", str(o.context), "--parallel", str(o.parallel),
                *(["--chat-template", model.chat_template] if model.chat_template else [])]

    def estimate(self, model: ServedModel) -> MemoryEstimate:
        return estimate(model)

    def client(self, transport: httpx.AsyncBaseTransport, model_id: str) -> MlxClient:
        return MlxClient(transport, model_id)

    def capabilities(self, model: ServedModel) -> Capabilities:
        return Capabilities(generates=True, embeds=False, infills=False, transcribes=False,
                            saves_kv=True, adapters=False, logprobs=False)

    def pinnable(self, route: str, body: dict[str, Any]) -> bool:
        return pinnable(route, body)

    def shown_options(self, model: ServedModel) -> dict[str, Any]:
        return {}

    def draft_name(self, model: ServedModel) -> str | None:
        return None

    def refused(self, model: ServedModel) -> str | None:
        return None

    def adapters_refused(self, model: ServedModel) -> str | None:
        return "the MLX engine mounts no LoRA adapters yet"

    def check_request(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("tool_choice") == "none":  # no tool may be called: the tools go unused
            body = {k: v for k, v in body.items() if k not in ("tools", "tool_choice")}
        for name, what in UNSUPPORTED.items():
            harmless: tuple[Any, ...] = (None,) if name in PRESENT else \
                (None, 1) if name == "best_of" else (None, False, 0, [], {})
            if body.get(name) not in harmless:
                raise InvalidRequest(f"{what} ({name!r}) is not supported by the MLX engine",
                                     param=name)
        for name in sorted(LLAMA_CPP_ONLY & body.keys()):
            if body[name] is not None:
                raise InvalidRequest(f"{name!r} is a llama.cpp sampling option the MLX engine "
                                     "does not read; leave it out for an MLX model",
                                     param=name)
        fmt = body.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
            raise InvalidRequest("constrained output (response_format) is not supported by "
                                 "the MLX engine", param="response_format")
        if body.get("n", 1) != 1:
            raise InvalidRequest("the MLX engine answers one choice per request", param="n")
        return body

    probe_module: str | None = None

    def constraint_checks(self, path: str, body: dict[str, Any]) -> list[ConstraintCheck]:
        return []

    def forwarded_fields(self) -> frozenset[str]:
        return FORWARDED

    def embedding_limit(self, model: ServedModel) -> int:
        return 0

    def kv_cache_bytes(self, model: ServedModel, tokens: int) -> int:
        return kv_bytes_per_token(model) * tokens

    def slot_tokens(self, tokens: int) -> int:
        return tokens  # a cache grows step by step: it holds any number of tokens

    def snapshot_layout(self, model: ServedModel) -> dict[str, Any] | None:
        return {"slot_context": _slot(model), "kv": "mlx-lm prompt cache"}

    def restore_hint(self, model: ServedModel) -> str:
        return ""

    def saved_tokens(self, path: Path) -> list[int]:
        return saved_tokens(path)
