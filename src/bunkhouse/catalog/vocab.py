"""A lower bound on a text's token count, from a GGUF's vocabulary alone (no weights, no engine).

Why: a request whose prompt can never fit its model's slot must be refused before the model
is loaded (a load may evict other models). The exact count needs the model's tokenizer, which
lives in the worker; this bound needs only the vocabulary strings in the GGUF header.

How: any tokenization of a text is a split of its bytes into vocabulary tokens. If a pair of
adjacent bytes occurs inside no vocabulary token, every tokenization must cut between them.
So a text has at least ``1 + (number of such forced cuts)`` tokens, whatever the merges,
pre-tokenizer or special-token parsing do (special tokens are vocabulary tokens too). For
byte-level BPE vocabularies (``gpt2``: Qwen, Llama 3, ...) no token holds a space after a
non-space byte, so the bound is close to the word count: about three quarters of the real
count on English text. Only vocabularies stored as raw text are understood (``gpt2``, whose
tokens map bytes to printable characters, and ``llama``, SentencePiece with ``▁`` for a
space and ``<0xNN>`` byte tokens); for others there is no bound and the worker counts.

Reading a 150k-262k token vocabulary takes about a second on 2 cores: it is done off the
event loop, once per model file, and only for prompts long enough that they might not fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from bunkhouse.gguf.meta import read_fields

_TOKENS_KEY = "tokenizer.ggml.tokens"
_MODEL_KEY = "tokenizer.ggml.model"
_SPM_SPACE = "\u2581"


@dataclass(frozen=True, slots=True)
class PairTable:
    """Which byte pairs occur inside some vocabulary token: ``allowed[a * 256 + b]``."""

    allowed: np.ndarray  # 65,536 booleans

    def min_tokens(self, text: str) -> int:
        """At least this many tokens encode ``text`` (0 for an empty text)."""
        data = text.strip().encode()
        if not data:
            return 0
        codes = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
        pairs = codes[:-1] * 256 + codes[1:]
        return 1 + int(np.count_nonzero(~self.allowed[pairs]))


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes-to-printable-characters map (as in its encoder.py)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _token_bytes(token: str, model: str, decoder: dict[str, int]) -> bytes:
    if model == "gpt2":
        try:
            return bytes(decoder[c] for c in token)
        except KeyError:  # a special token written as plain text
            return token.encode()
    if token.startswith("<0x") and token.endswith(">") and len(token) == 6:
        return bytes([int(token[3:5], 16)])
    return token.replace(_SPM_SPACE, " ").encode()


@lru_cache(maxsize=8)  # a few models; runtime registrations must not grow it
def pair_table(path: Path, mtime_ns: int) -> PairTable | None:
    """The pair table of the GGUF at ``path`` (cached per file version), or None when its
    vocabulary is of a kind this bound does not understand. Raises GGUFError."""
    fields, _ = read_fields(path, strings=frozenset({_TOKENS_KEY, _MODEL_KEY}))
    model, tokens = fields.get(_MODEL_KEY), fields.get(_TOKENS_KEY)
    if model not in ("gpt2", "llama") or not isinstance(tokens, list) or not tokens:
        return None
    decoder = _gpt2_byte_decoder()
    allowed = np.zeros(65536, dtype=bool)
    pieces = [_token_bytes(token, model, decoder) for token in tokens]
    codes = np.frombuffer(b"".join(pieces), dtype=np.uint8).astype(np.uint16)
    if len(codes) < 2:
        return PairTable(allowed)
    inside = np.ones(len(codes) - 1, dtype=bool)  # pair i is bytes i and i + 1
    starts = np.cumsum([len(p) for p in pieces])[:-1]  # where each next token begins
    inside[starts[(starts > 0) & (starts < len(codes))] - 1] = False
    allowed[(codes[:-1] * 256 + codes[1:])[inside]] = True
    return PairTable(allowed)
