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
from typing import Any

from bunkhouse.errors import InvalidRequest

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

# The types of the extension fields whose misuse llama.cpp answers with a parse error.
_EXTENSION_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("ignore_eos", "cache_prompt", "return_tokens", "post_sampling_probs",
                     "timings_per_token", "return_progress", "parse_tool_calls",
                     "add_generation_prompt", "enable_thinking", "thinking_forced_open"),
                    (bool,)),
    **dict.fromkeys(("n_predict", "n_probs", "n_keep", "n_indent", "n_cmpl", "id_slot",
                     "top_k", "min_keep", "repeat_last_n", "dry_allowed_length",
                     "dry_penalty_last_n", "mirostat", "t_max_predict_ms"), (int,)),
    **dict.fromkeys(("min_p", "typical_p", "top_n_sigma", "repeat_penalty",
                     "dry_multiplier", "dry_base", "xtc_probability", "xtc_threshold",
                     "mirostat_tau", "mirostat_eta", "dynatemp_range", "dynatemp_exponent"),
                    (int, float)),
    **dict.fromkeys(("grammar", "input_prefix", "input_suffix", "reasoning_format"), (str,)),
    **dict.fromkeys(("json_schema", "chat_template_kwargs"), (dict,)),
    **dict.fromkeys(("samplers", "dry_sequence_breakers", "response_fields", "lora",
                     "input_extra"), (list, str)),
}


def check_extensions(body: dict[str, Any]) -> None:
    """Raise InvalidRequest naming an extension field given with the wrong JSON type."""
    for name, types in _EXTENSION_TYPES.items():
        value = body.get(name)
        if value is None:
            continue
        wrong = isinstance(value, bool) and bool not in types
        if wrong or not isinstance(value, types):
            kinds = " or ".join(_JSON_NAMES[t] for t in types)
            raise InvalidRequest(f"{name} must be {kinds}", param=name)


_JSON_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               dict: "an object", list: "an array"}


def refused_field(message: str, path: str) -> str | None:
    """The request field an engine refusal is about: the one it names (``Field 'n': ...``),
    or the one its text points to (a grammar, a JSON schema, token ids); else None."""
    m = _FIELD.search(message)
    if m:
        return m.group(1)
    for pattern, field in _FIELD_HINTS:
        if pattern.search(message):
            return field.get(path, field[""])
    return None


_FIELD = re.compile(r"Field '([A-Za-z_][A-Za-z0-9_.]*)'")
_FIELD_HINTS: list[tuple[re.Pattern[str], dict[str, str]]] = [
    (re.compile(r"grammar", re.IGNORECASE), {"": "grammar"}),
    (re.compile(r"json.?schema|\$ref", re.IGNORECASE), {"": "response_format"}),
    (re.compile(r"invalid tokens?", re.IGNORECASE),
     {"": "prompt", "/v1/embeddings": "input", "/v1/chat/completions": "messages"}),
]

EMBEDDING_BATCH = 512  # worker: n_batch = n_ubatch = 512 (what runs with embeddings on)

# Error texts of llama.cpp's server that mean "your request is wrong", whatever its status.
_REFUSALS = re.compile(
    r"json\.exception|is not supported|input is too large|increase the physical batch size"
    r"|failed to parse|unsupported|out of range|invalid token"
    r"|exceeds the available context size|invalid|must be|cannot be|required|empty",
    re.IGNORECASE)


def refusal(status: int, message: str) -> bool:
    """Whether an engine's error answer refuses the request's input (so: a 4xx, not the
    engine's failure)."""
    return 400 <= status < 500 or (status == 500 and bool(_REFUSALS.search(message)))
