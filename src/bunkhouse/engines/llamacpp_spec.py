"""llama.cpp's speculative decoding and KV cache types, as a model's options.

- Speculative decoding: one kind per model, each lossless under greedy decoding (the target
  verifies every drafted token): ``speculative = "ngram"`` (llama.cpp's ``ngram-mod``: drafts
  copied from earlier text of the same context, no second model), ``draft = ID-OR-PATH`` (a
  small model of the same vocabulary drafts: ``draft-simple``) or ``mtp = true`` (the
  model's own multi-token-prediction heads: ``draft-mtp``). ``draft_max`` / ``draft_min``
  bound the tokens drafted at once.
- KV cache types (``cache_type_k``, ``cache_type_v``): the element type of the K and V caches;
  a quantized V cache needs flash attention (llama.cpp refuses it otherwise), so
  ``flash_attn`` ("auto", the default, true or false) is turned on for one.

What is checked before a load, each refusal naming the option: a draft whose vocabulary is
not the target's (:func:`vocab_mismatch`, llama.cpp's own rule), ``mtp`` on a model without
MTP heads (:func:`has_mtp`), a cache type the engine does not take, a quantized V cache with
``flash_attn = false``, a cache type whose blocks do not divide the model's head size.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from bunkhouse.errors import ConfigError, GGUFError
from bunkhouse.gguf.meta import GGUFInfo, read_fields, read_tensor_shapes

# bytes per element and elements per block of each type llama.cpp takes for its KV cache
# (llama.cpp common/arg.cpp ``kv_cache_types``; ggml's type traits: a q8_0 block is 32
# elements in 34 bytes, a q4_0 block 32 in 18, ...)
CACHE_TYPES: dict[str, tuple[float, int]] = {
    "f32": (4.0, 1), "f16": (2.0, 1), "bf16": (2.0, 1),
    "q8_0": (34 / 32, 32), "q4_0": (18 / 32, 32), "q4_1": (20 / 32, 32),
    "iq4_nl": (18 / 32, 32), "q5_0": (22 / 32, 32), "q5_1": (24 / 32, 32),
}
UNQUANTIZED = frozenset({"f32", "f16", "bf16"})

FLASH_ATTN = ("auto", True, False)

NGRAM, DRAFT, MTP = "ngram", "draft", "mtp"
SPECULATIVE = ("none", NGRAM)
"""The values of ``speculative``: a draft model and MTP are chosen by their own keys."""

# Each kind's draft bounds when not configured: xllamacpp 2026.10's CommonParams defaults
# (``speculative.ngram_mod.n_max`` / ``n_min``, ``speculative.draft.n_max`` / ``n_min``).
DEFAULT_BOUNDS: dict[str, tuple[int, int]] = {NGRAM: (64, 48), DRAFT: (3, 0), MTP: (3, 0)}

VOCAB_CHECK_START = 5
"""Token ids below this may differ between a target and its draft (llama.cpp's
``SPEC_VOCAB_CHECK_START_TOKEN_ID``: control tokens)."""
VOCAB_MAX_DIFFERENCE = 128
"""The most the two vocabularies' sizes may differ (llama.cpp's
``SPEC_VOCAB_MAX_SIZE_DIFFERENCE``: padding rows)."""

_TOKENS = "tokenizer.ggml.tokens"
_TOKENIZER = "tokenizer.ggml.model"
_SPECIALS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
             "tokenizer.ggml.add_bos_token")


@dataclass(frozen=True, slots=True)
class Speculation:
    """A model's speculative decoding as configured: its kind (None: off) and the tokens
    drafted at once (at most ``draft_max``, at least ``draft_min``)."""

    kind: str | None
    draft_max: int = 0
    draft_min: int = 0


def speculation(speculative: str, draft: str, mtp: bool, draft_max: int | None,
                draft_min: int | None, where: str) -> Speculation:
    """The kind the options choose and its bounds; ConfigError naming the keys when two
    kinds are chosen, a bound is given without a kind, or ``draft_min`` > ``draft_max``."""
    kinds = [k for k, on in ((NGRAM, speculative == NGRAM), (DRAFT, bool(draft)),
                             (MTP, mtp)) if on]
    if len(kinds) > 1:
        keys = {NGRAM: 'speculative = "ngram"', DRAFT: "draft", MTP: "mtp = true"}
        raise ConfigError(f"{where}: {' and '.join(keys[k] for k in kinds)} are two kinds of "
                          "speculative decoding; choose one")
    if not kinds:
        given = [k for k, v in (("draft_max", draft_max), ("draft_min", draft_min))
                 if v is not None]
        if given:
            raise ConfigError(f"{where}: {given[0]} bounds speculative decoding, which is off; "
                              'set speculative = "ngram", draft or mtp = true as well')
        return Speculation(None)
    kind = kinds[0]
    top, least = DEFAULT_BOUNDS[kind]
    top = draft_max if draft_max is not None else max(top, draft_min or 0)
    least = draft_min if draft_min is not None else min(least, top)
    if least > top:
        raise ConfigError(f"{where}: draft_min ({least}) must not be above draft_max ({top})")
    return Speculation(kind, top, least)


def check_cache_type(value: Any, key: str, where: str) -> str:
    """A KV cache type the engine takes (:data:`CACHE_TYPES`), lower case."""
    if not isinstance(value, str) or value.lower() not in CACHE_TYPES:
        raise ConfigError(f"{where}: {key} must be one of {', '.join(CACHE_TYPES)}, not "
                          f"{value!r}")
    return value.lower()


def check_flash_attn(value: Any, key: str, where: str) -> str | bool:
    if value not in FLASH_ATTN or (isinstance(value, int) and not isinstance(value, bool)):
        raise ConfigError(f'{where}: {key} must be true, false or "auto", not {value!r}')
    return value  # type: ignore[no-any-return]


MAX_DRAFT = 256
"""The most tokens drafted a step taken (each costs a row of logits per slot while it is
verified; the kinds' defaults are 3 to 64, and llama.cpp's acceptance falls long before)."""


def check_speculative(value: Any, key: str, where: str) -> str:
    value = value.lower() if isinstance(value, str) else value
    if value not in SPECULATIVE:
        raise ConfigError(f'{where}: {key} must be "ngram" or "none", not {value!r} (a draft '
                          "model is set with draft = ID-OR-PATH, MTP heads with mtp = true)")
    return str(value)


def check_draft(value: Any, key: str, where: str) -> str:
    """A model id or a GGUF path ("": none)."""
    if not isinstance(value, str) or (value and not value.strip()) or "\0" in value:
        raise ConfigError(f"{where}: {key} must be a model id or a GGUF file's path")
    return value


def flash_attention(cache_type_v: str, flash_attn: str | bool, where: str) -> str | bool:
    """Flash attention as the worker runs it: on for a quantized V cache (llama.cpp needs
    it); ConfigError naming both keys when it is turned off for one."""
    if cache_type_v in UNQUANTIZED:
        return flash_attn
    if flash_attn is False:
        raise ConfigError(f"{where}: cache_type_v = {cache_type_v!r} needs flash attention "
                          "(llama.cpp quantizes the V cache only with it) and flash_attn is "
                          'false; set flash_attn = true (or "auto"), or cache_type_v = "f16"')
    return True


def head_misfit(info: GGUFInfo, cache_type_k: str, cache_type_v: str) -> str | None:
    """Why the model's heads cannot be stored in these cache types (a quantized type's block
    must divide the head size, as llama.cpp checks); None if they can."""
    for key, value, dims in (("cache_type_k", cache_type_k, info.key_length),
                             ("cache_type_v", cache_type_v, info.value_length)):
        block = CACHE_TYPES[value][1]
        if dims and dims % block:
            return (f"{key} = {value!r} stores blocks of {block} and this model's heads are "
                    f"{dims} wide; choose f16, bf16 or f32")
    return None


def kv_element_bytes(cache_type: str) -> float:
    return CACHE_TYPES[cache_type][0]


def has_mtp(path: Path, info: GGUFInfo) -> bool:
    """Whether the GGUF carries multi-token-prediction heads: ``ARCH.nextn_predict_layers``
    above 0, or its last block's ``nextn.eh_proj`` tensor (llama.cpp's
    ``common_speculative_types_from_gguf``). GGUFError for an unreadable file."""
    fields, _ = read_fields(path)
    layers = fields.get(f"{info.architecture}.nextn_predict_layers")
    if isinstance(layers, int) and layers > 0:
        return True
    last = (info.block_count or 0) - 1
    return f"blk.{last}.nextn.eh_proj.weight" in read_tensor_shapes(path)


def vocab_mismatch(target: Path, draft: Path) -> str | None:
    """How the draft's vocabulary differs from the target's, by llama.cpp's rule for a draft
    model (common/speculative.cpp ``common_speculative_are_compatible``): the same tokenizer
    kind, the same BOS and EOS tokens, sizes within :data:`VOCAB_MAX_DIFFERENCE`, and every
    token from :data:`VOCAB_CHECK_START` on spelled alike; None if they match. GGUFError
    for an unreadable file."""
    mine, theirs = _vocabulary(target), _vocabulary(draft)
    a, b = mine.get(_TOKENS), theirs.get(_TOKENS)
    if not isinstance(a, list) or not isinstance(b, list):
        return "a GGUF without a vocabulary (tokenizer.ggml.tokens)"
    kind_a, kind_b = mine.get(_TOKENIZER), theirs.get(_TOKENIZER)
    if kind_a != kind_b:
        return (f"tokenizers of different kinds ({kind_a!r} with {len(a):,} tokens, "
                f"{kind_b!r} with {len(b):,})")
    if abs(len(a) - len(b)) > VOCAB_MAX_DIFFERENCE:
        return f"{len(a):,} and {len(b):,} tokens"
    for key in _SPECIALS:
        if mine.get(key) != theirs.get(key):
            return f"{key} {mine.get(key)!r} and {theirs.get(key)!r}"
    n = min(len(a), len(b))
    if a[VOCAB_CHECK_START:n] != b[VOCAB_CHECK_START:n]:
        first = next(i for i in range(VOCAB_CHECK_START, n) if a[i] != b[i])
        return f"token {first} is {a[first]!r} in one and {b[first]!r} in the other"
    return None


def _vocabulary(path: Path) -> dict[str, Any]:
    """The tokenizer fields of the GGUF at ``path`` (read once per file version: a catalog
    build or reload checks every drafted model, often with the same target)."""
    return _read_vocabulary(path, path.stat().st_mtime_ns)


@lru_cache(maxsize=8)  # a few models; runtime registrations must not grow it
def _read_vocabulary(path: Path, mtime_ns: int) -> dict[str, Any]:
    fields, _ = read_fields(path, frozenset({_TOKENS, _TOKENIZER}))
    return {k: fields.get(k) for k in (_TOKENS, _TOKENIZER, *_SPECIALS)}


def mtp_missing(path: Path, info: GGUFInfo) -> str | None:
    """The refusal of ``mtp = true`` for a model without MTP heads; None if it has them."""
    try:
        if has_mtp(path, info):
            return None
    except GGUFError as e:
        return f"mtp: its file cannot be read: {e.message}"
    return (f"mtp = true: the model's GGUF carries no multi-token-prediction heads (no "
            f"{info.architecture}.nextn_predict_layers, no nextn tensors); use "
            'speculative = "ngram" or a draft model instead')
