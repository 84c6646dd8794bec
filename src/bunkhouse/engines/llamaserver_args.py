"""A model's ``args``: llama-server flags bunkhouse does not model, passed to the binary.

A llama-swap user's command line for a model, less the model path and the port, works as
``args``, with one rule: a flag that changes the worker's memory or a setting bunkhouse owns
is never passed blind. Each is either read into the model's options (the same options every
llama.cpp model has: ``-t`` is ``threads``, ``-ctk`` is ``cache_type_k``, ``-ngl`` is
``n_gpu_layers`` ...), so that the memory estimate counts it and ``bunkhouse models`` shows
it, or refused with the reason and the key to use instead (``-c``: ``context``; ``--port``:
the binary listens on a private Unix socket). Any other flag passes through as written, if
the binary lists it in its ``--help`` (checked before a load, engines/llamaserver.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from bunkhouse.errors import ConfigError

_MEMORY = "changes the worker's memory, which bunkhouse's estimate must count"

# flag -> why bunkhouse sets it itself, and what to write instead
OWNED: dict[str, str] = {
    **dict.fromkeys(("-m", "--model", "-mu", "--model-url", "-hf", "-hfr", "--hf-repo",
                     "-hff", "--hf-file", "-dr", "--docker-repo"),
                    "bunkhouse opens the model's file itself: give its path as the entry's "
                    "path"),
    **dict.fromkeys(("-c", "--ctx-size"), "set context = N (the total of the slots) instead"),
    **dict.fromkeys(("-np", "--parallel"), "set parallel = N instead"),
    **dict.fromkeys(("--host", "--port", "--reuse-port", "--path", "--api-prefix",
                     "--api-key", "--api-key-file"),
                    "the binary listens on a private Unix socket behind bunkhouse's front, "
                    "which has the port and the keys (bunkhouse serve --port, --api-key)"),
    **dict.fromkeys(("--slot-save-path", "--metrics", "--slots", "--no-slots"),
                    "bunkhouse sets it to save KV snapshots and read the slots "
                    "(--kv-cache-dir)"),
    **dict.fromkeys(("-a", "--alias"), "a model's names are its id and its aliases key"),
    **dict.fromkeys(("--lora", "--lora-scaled", "--lora-init-without-apply"),
                    "serve an adapter as a [[models]] entry with adapter_of = this model's id"),
    **dict.fromkeys(("--embedding", "--embeddings", "--pooling"),
                    "set embeddings = true instead"),
    **dict.fromkeys(("--chat-template", "--chat-template-file"),
                    "set chat_template = NAME-OR-FILE instead"),
    **dict.fromkeys(("-md", "--model-draft", "--spec-draft-model"),
                    "set draft = ID-OR-PATH instead"),
    **dict.fromkeys(("--spec-type",), 'set speculative = "ngram", draft or mtp = true instead'),
    **dict.fromkeys(("--spec-draft-n-max", "--spec-ngram-mod-n-max", "--draft", "--draft-n",
                     "--draft-max"), "set draft_max = N instead"),
    **dict.fromkeys(("--spec-draft-n-min", "--spec-ngram-mod-n-min", "--draft-min",
                     "--draft-n-min"), "set draft_min = N instead"),
    **dict.fromkeys(("-ctkd", "-ctvd", "--cache-type-k-draft", "--cache-type-v-draft",
                     "--spec-draft-type-k", "--spec-draft-type-v"),
                    "a draft's KV cache takes cache_type_k and cache_type_v"),
    **dict.fromkeys(("-b", "--batch-size", "-ub", "--ubatch-size"),
                    f"{_MEMORY} (bunkhouse runs batches of 512 tokens)"),
    **dict.fromkeys(("-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified",
                     "--kv-unified-per-slot"),
                    f"{_MEMORY} (each slot owns its KV cache: context / parallel tokens)"),
    **dict.fromkeys(("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", "-cms",
                     "--checkpoint-min-step"), f"{_MEMORY} (context checkpoints)"),
    **dict.fromkeys(("-mm", "--mmproj", "-mmu", "--mmproj-url"),
                    f"{_MEMORY}; multimodal projectors are not served yet"),
    **dict.fromkeys(("-tb", "--threads-batch"), "threads = N sets both -t and -tb"),
    **dict.fromkeys(("--models-dir", "--models-preset", "--models-max", "--models-autoload",
                     "--no-models-autoload"),
                    "router mode: bunkhouse is the router; give each model an entry"),
    **dict.fromkeys(("-lcs", "--lookup-cache-static", "-lcd", "--lookup-cache-dynamic",
                     "--ssl-key-file", "--ssl-cert-file", "--log-prompts-dir", "--media-path",
                     "--control-vector", "--control-vector-scaled", "--grammar-file",
                     "--webui-config-file", "--ui-config-file", "--mcp-servers-config",
                     "--tools"),
                    "it points the binary at a file of its own, which bunkhouse does not check"),
    **dict.fromkeys(("--rerank", "--reranking"),
                    "the front serves no rerank route; the model would only rerank"),
    **dict.fromkeys(("--log-disable", "--log-file"),
                    "bunkhouse reads the binary's output (its readiness, its errors)"),
    **dict.fromkeys(("-h", "--help", "--usage", "--version", "--list-devices",
                     "--completion-bash"), "it makes the binary exit at once"),
}

# flag -> the option it sets, and how many values it takes (fa: one, optional)
READ: dict[str, str] = {
    **dict.fromkeys(("-t", "--threads"), "threads"),
    **dict.fromkeys(("-ctk", "--cache-type-k"), "cache_type_k"),
    **dict.fromkeys(("-ctv", "--cache-type-v"), "cache_type_v"),
    **dict.fromkeys(("-fa", "--flash-attn"), "flash_attn"),
    **dict.fromkeys(("--swa-full",), "swa_full"),
    **dict.fromkeys(("-cram", "--cache-ram"), "cache_ram_mib"),
    **dict.fromkeys(("-ngl", "--gpu-layers", "--n-gpu-layers"), "n_gpu_layers"),
}

_FLASH = {"on": True, "off": False, "auto": "auto", "enabled": True, "disabled": False}
_IS_FLAG = re.compile(r"^--?[A-Za-z]")
_GPU_LAYERS = ("auto", "all")


@dataclass(frozen=True, slots=True)
class ReadArgs:
    """``args`` taken apart: the options its flags set (config keys, typed as the config
    file types them) and the flags passed through as written."""

    options: dict[str, Any]
    passed: tuple[str, ...]


def check_args(value: Any, key: str, where: str) -> tuple[str, ...]:
    """A list of strings (the binary's command-line words), each without NUL."""
    if not isinstance(value, list) or not all(isinstance(a, str) and "\0" not in a
                                              for a in value):
        raise ConfigError(f"{where}: {key} must be an array of strings, the llama-server "
                          'flags to pass, such as ["--jinja", "--no-context-shift"]')
    return tuple(value)


def check_gpu_layers(value: Any, key: str, where: str) -> int | str:
    """Layers offloaded to the GPU: a count, "auto" or "all" (llama-server's ``-ngl``)."""
    if isinstance(value, str) and value.lower() in _GPU_LAYERS:
        return value.lower()
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ConfigError(f'{where}: {key} must be a whole number of layers, "auto" or "all", '
                      f"not {value!r}")


def flags_of(args: tuple[str, ...]) -> list[str]:
    """The flags among ``args`` (``--name=value`` counts as ``--name``), in order."""
    return [a.split("=", 1)[0] for a in args if _IS_FLAG.match(a)]


def read_args(args: tuple[str, ...], where: str) -> ReadArgs:
    """The options ``args`` set and the flags it passes through; ConfigError naming a flag
    bunkhouse owns (with the key to use instead) or a value it cannot read."""
    options: dict[str, Any] = {}
    passed: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        i += 1
        if not _IS_FLAG.match(word):
            if not passed or not _IS_FLAG.match(passed[-1]):
                raise ConfigError(f"{where}: args: {word!r} is not a flag (args are "
                                  'flags, each followed by its value: ["--temp", "0.2"])')
            passed.append(word)  # the value of the flag before it
            continue
        name, eq, inline = word.partition("=")
        if name in OWNED:
            raise ConfigError(f"{where}: args: {name} is not passed to llama-server: "
                              f"{OWNED[name]}")
        if name.endswith("-default"):  # --embd-gemma-default, --fim-qwen-1.5b-default ...
            raise ConfigError(f"{where}: args: {name} is not passed to llama-server: a "
                              "preset sets the model, its context and slots itself (and may "
                              "download weights); give the model's path, context and "
                              "parallel instead")
        key = READ.get(name)
        if key is None:
            passed.append(word)
            continue
        if key in options:
            raise ConfigError(f"{where}: args: {name} sets {key}, which an earlier flag set "
                              "already; keep one")
        if key == "swa_full":
            options[key] = True
            continue
        value = inline if eq else None
        if value is None and i < len(args) and (key != "flash_attn"
                                                or args[i].lower() in _FLASH):
            value, i = args[i], i + 1
        options[key] = _typed(key, name, value, where)
    return ReadArgs(options, tuple(passed))


def _typed(key: str, flag: str, value: str | None, where: str) -> Any:
    if key == "flash_attn":
        return _FLASH[value.lower()] if value is not None and value.lower() in _FLASH else True
    if value is None:
        raise ConfigError(f"{where}: args: {flag} needs a value")
    if key in ("cache_type_k", "cache_type_v"):
        return value
    if key == "n_gpu_layers" and value.lower() in _GPU_LAYERS:
        return value.lower()
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{where}: args: {flag} needs a whole number, not {value!r}") from None
