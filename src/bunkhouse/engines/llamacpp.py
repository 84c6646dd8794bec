"""What the front knows of llama.cpp's server (xllamacpp's embedded one), in one place.

- :data:`EXTENSION_FIELDS`: request fields beyond OpenAI's that llama.cpp's server reads and
  users rely on; they pass through to the worker. Other unknown fields are dropped.
- :data:`EMBEDDING_BATCH`: the micro-batch the worker runs with (``n_batch = n_ubatch``);
  llama.cpp embeds an input only in one micro-batch, so it is the longest input in tokens.
- :func:`refusal`: which of the engine's error answers are refusals of bad input (4xx), told
  apart by their text: llama.cpp answers several of them with a 500.
"""

from __future__ import annotations

import re

# llama.cpp tools/server README, "POST /completion" and "POST /v1/chat/completions" options.
EXTENSION_FIELDS = frozenset({
    "ignore_eos", "n_predict", "n_probs", "n_keep", "n_indent", "n_cmpl", "cache_prompt",
    "id_slot", "input_prefix", "input_suffix", "input_extra", "top_k", "min_p", "typical_p",
    "top_n_sigma", "min_keep", "repeat_penalty", "repeat_last_n", "dry_multiplier",
    "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
    "xtc_probability", "xtc_threshold", "mirostat", "mirostat_tau", "mirostat_eta",
    "dynatemp_range", "dynatemp_exponent", "grammar", "json_schema", "samplers",
    "t_max_predict_ms", "return_tokens", "post_sampling_probs", "timings_per_token",
    "return_progress", "response_fields", "lora", "chat_template_kwargs", "reasoning_format",
    "parse_tool_calls", "add_generation_prompt", "enable_thinking", "thinking_forced_open",
    "embd_normalize",
})

EMBEDDING_BATCH = 512  # worker: n_batch = n_ubatch = 512 (what runs with embeddings on)

# Error texts of llama.cpp's server that mean "your request is wrong", whatever its status.
_REFUSALS = re.compile(
    r"json\.exception|is not supported|input is too large|increase the physical batch size"
    r"|exceeds the available context size|invalid|must be|cannot be|required|empty",
    re.IGNORECASE)


def refusal(status: int, message: str) -> bool:
    """Whether an engine's error answer refuses the request's input (so: a 4xx, not the
    engine's failure)."""
    return 400 <= status < 500 or (status == 500 and bool(_REFUSALS.search(message)))
