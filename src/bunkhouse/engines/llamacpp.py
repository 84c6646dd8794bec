"""The llama.cpp engine adapter (xllamacpp's embedded llama-server), front side.

Everything the front, the supervisor and residency know of llama.cpp is here, and nowhere
else (the worker side is ``bunkhouse.worker.engines.llamacpp``):

- :class:`LlamaCppClient`: the worker contract over llama.cpp's server API (``/health``,
  ``/slots``, ``/apply-template``, ``/tokenize``, the OpenAI routes, slot save and restore).
- :data:`EXTENSION_FIELDS`: request fields beyond OpenAI's that llama.cpp's server reads and
  users rely on; they pass through to the worker. Other unknown fields are dropped.
- :data:`EMBEDDING_BATCH`: the micro-batch the worker runs with (``n_batch = n_ubatch``);
  llama.cpp embeds an input only in one micro-batch, so it is the longest input in tokens.
- :func:`refusal`: which of the engine's error answers are refusals of bad input (4xx), told
  apart by their text: llama.cpp answers several of them with a 500.
- :class:`LlamaCppOptions`: llama.cpp's own options of a model (config keys of the same
  names), checked by :func:`parse_options`.
- :func:`estimate`: the worker's worst-case memory (see docs/memory-estimate.md).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import math
import re
import struct
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from bunkhouse.api.tool_calls import call_schema
from bunkhouse.engines import grammar_cost
from bunkhouse.engines import llamacpp_spec as spec
from bunkhouse.engines import options as opts
from bunkhouse.engines.contract import (
    GENERATION_ROUTES,
    Adapter,
    Capabilities,
    ConstraintCheck,
    EngineRefused,
    MemoryEstimate,
    Messages,
    ServedModel,
    SlotSnapshot,
    SlotState,
    Timings,
    TokenPiece,
    WorkerSpawn,
)
from bunkhouse.engines.worker_http import WorkerHTTP
from bunkhouse.errors import (
    EngineUnavailable,
    GGUFError,
    InvalidRequest,
    WorkerLoadFailed,
    envelope,
)
from bunkhouse.gguf.meta import GGUFInfo

log = logging.getLogger(__name__)

NAME = "llama.cpp"
WORKER_ENGINE = "bunkhouse.worker.engines.llamacpp:LlamaCppEngine"


@dataclasses.dataclass(frozen=True, slots=True)
class LlamaCppOptions:
    """llama.cpp's own options of a model: the config keys of the same names ([defaults] and
    [[models]]), each set explicitly on the engine (worker/engines/llamacpp.py). Speculative
    decoding and the KV cache types: engines/llamacpp_spec.py."""

    cache_ram_mib: int = 0  # the RAM prompt cache; off: it would grow a worker past its estimate
    threads: int = dataclasses.field(default_factory=opts.cpu_threads)  # decoding and batches
    swa_full: bool = False  # sliding-window layers keep the whole slot (KV snapshots reuse all)
    speculative: str = "none"  # "ngram": drafts from the context's own n-grams
    draft: str = ""  # a draft model: a model id or a GGUF file's path
    draft_max: int | None = None  # tokens drafted at once (None: the kind's default)
    draft_min: int | None = None
    mtp: bool = False  # the model's own multi-token-prediction heads draft
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str | bool = "auto"  # turned on for a quantized V cache

    @property
    def speculation(self) -> spec.Speculation:
        return spec.speculation(self.speculative, self.draft, self.mtp, self.draft_max,
                                self.draft_min, "options")

    @property
    def flash_attention(self) -> str | bool:
        """As the worker runs it: on for a quantized V cache."""
        return spec.flash_attention(self.cache_type_v, self.flash_attn, "options")


_OPTION_CHECKS: dict[str, opts.Check] = {
    "cache_ram_mib": opts.integer(0), "threads": opts.integer(1), "swa_full": opts.flag,
    "speculative": spec.check_speculative, "draft": spec.check_draft,
    "draft_max": opts.integer(1, spec.MAX_DRAFT), "draft_min": opts.integer(0, spec.MAX_DRAFT),
    "mtp": opts.flag,
    "cache_type_k": spec.check_cache_type, "cache_type_v": spec.check_cache_type,
    "flash_attn": spec.check_flash_attn}
KNOWN_OPTIONS = frozenset(_OPTION_CHECKS)


def parse_options(raw: Mapping[str, Any], where: str) -> LlamaCppOptions:
    """llama.cpp's options as written (``where`` names them in an error); ConfigError naming
    an unknown key, a wrong value, or keys that contradict each other (two kinds of
    speculative decoding, ``flash_attn = false`` with a quantized V cache)."""
    own = LlamaCppOptions(**opts.checked(raw, _OPTION_CHECKS, where))
    spec.speculation(own.speculative, own.draft, own.mtp, own.draft_max, own.draft_min, where)
    spec.flash_attention(own.cache_type_v, own.flash_attn, where)
    return own


def model_options(model: ServedModel) -> LlamaCppOptions:
    """``model``'s llama.cpp options (checked when it was catalogued)."""
    return parse_options(dict(model.options.engine_keys), "the model's llama.cpp options")


def server_flags(options: LlamaCppOptions) -> list[str]:
    """``options`` as llama.cpp's own ``llama-server`` takes them on its command line (the
    benchmarks run it with a worker's settings)."""
    threads = str(options.threads)
    flash = options.flash_attention
    return ["-t", threads, "-tb", threads, "--cache-ram", str(options.cache_ram_mib),
            *(["--swa-full"] if options.swa_full else []),
            "-ctk", options.cache_type_k, "-ctv", options.cache_type_v,
            "-fa", flash if isinstance(flash, str) else "on" if flash else "off"]


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
    **dict.fromkeys(("samplers", "dry_sequence_breakers", "response_fields", "input_extra"),
                    (list, str)),
    "lora": (list,),
}


def check_extensions(body: dict[str, Any]) -> None:
    """Raise InvalidRequest naming an extension field given with the wrong JSON type, or
    beyond its bound (:data:`EXTENSION_BOUNDS`; an integer field without one: the engine's
    32-bit integers, :data:`INT32`)."""
    for name, types in _EXTENSION_TYPES.items():
        value = body.get(name)
        if value is None:
            continue
        wrong = isinstance(value, bool) and bool not in types
        if types == (int,):  # one message whatever is wrong (a float, past either end)
            check_integer(name, -(1 << 64) if wrong or not isinstance(value, int) else value)
        elif wrong or not isinstance(value, types):
            kinds = " or ".join(_JSON_NAMES[t] for t in types)
            raise InvalidRequest(f"{name} must be {kinds}", param=name)
        choices = EXTENSION_CHOICES.get(name)
        if choices is not None and value not in choices:
            raise InvalidRequest(f"{name} must be one of {', '.join(sorted(choices))}",
                                 param=name)


def check_integer(name: str, value: int) -> None:
    """InvalidRequest naming the integer extension field ``name`` if ``value`` is outside
    its bound (:data:`EXTENSION_BOUNDS`, else :data:`INT32`) or a refused 0
    (:data:`NOT_ZERO`)."""
    lo, hi = EXTENSION_BOUNDS.get(name, INT32)
    instead = NOT_ZERO.get(name)
    if not lo <= value <= hi or (instead is not None and value == 0):
        allowed = f"{instead} or from 1" if instead else f"an integer from {lo}"
        raise InvalidRequest(f"{name} must be {allowed} to {hi}", param=name)


def check_lora(body: dict[str, Any]) -> None:
    """InvalidRequest naming ``lora`` when a request sets it: adapters are chosen by model id
    (an adapter is a model of its own, ``adapter_of`` its base), and the front sets the
    engine's ``lora`` itself, every adapter's scale explicitly (:meth:`LlamaCppClient.
    adapter_fields`)."""
    if body.get("lora") is not None:
        raise InvalidRequest("lora: adapters are chosen by model id, not per request: "
                             "register the LoRA as a model with adapter_of (the config file "
                             "or POST /v1/models) and send its id as model; leave lora out",
                             param="lora")


# Extension fields with a fixed set of values (llama.cpp's common_reasoning_format_from_name).
EXTENSION_CHOICES: dict[str, frozenset[str]] = {
    "reasoning_format": frozenset({"none", "auto", "deepseek", "deepseek-legacy"}),
}


INT32 = (-(1 << 31), (1 << 31) - 1)
"""The range of the engine's integer fields (C ``int``): a larger JSON integer would wrap
(``n_predict: 4294967301`` read as 5), so an extension field past it is refused."""

# The engine's own ranges (its request schema refuses a value outside them with a 500; tried
# against a worker: tests/integration/test_llamacpp_params.py), and the fields that multiply
# work or output, bounded: n_probs as OpenAI bounds top_logprobs (each token's answer carries
# that many alternatives), n_cmpl as the schema bounds n. top_k as every protocol bounds it.
EXTENSION_BOUNDS: dict[str, tuple[int, int]] = {
    "n_probs": (0, 20), "n_cmpl": (1, 128), "mirostat": (0, 2), "n_predict": (-1, INT32[1]),
    "n_keep": (-1, INT32[1]), "id_slot": (-1, INT32[1]), "n_indent": (0, INT32[1]),
    "min_keep": (0, INT32[1]), "t_max_predict_ms": (-1, INT32[1]), "top_k": (0, INT32[1]),
    "repeat_last_n": (0, INT32[1]), "dry_allowed_length": (0, INT32[1]),
    "dry_penalty_last_n": (0, INT32[1])}

NOT_ZERO = {"n_predict": "-1 (until the slot is full)"}
"""Integer fields whose 0 is refused, and what to send instead: the engine generates one
token for ``n_predict: 0`` (as for ``max_tokens: 0``, which OpenAI refuses too)."""

SEED_BITS = 32
"""llama.cpp's sampler seed is 32 bits; ``0xFFFFFFFF`` picks a random one."""


def fold_seed(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with its ``seed`` (any 64-bit integer, as OpenAI takes it) taken modulo
    2**32, the engine's seed: seeds equal modulo 2**32 sample alike, and -1 (so
    4294967295) asks for a random seed, as in llama.cpp and Ollama (docs/configuration.md)."""
    seed = body.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or 0 <= seed < 1 << SEED_BITS:
        return body
    return {**body, "seed": seed % (1 << SEED_BITS)}


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
    (re.compile(r"reasoning format", re.IGNORECASE), {"": "reasoning_format"}),
    (re.compile(r"json.?schema|\$ref|min_value|max_value", re.IGNORECASE),
     {"": "response_format"}),
    (re.compile(r"invalid tokens?", re.IGNORECASE),
     {"": "prompt", "/v1/embeddings": "input", "/v1/chat/completions": "messages"}),
]

# Chat request fields the server's /apply-template reads (its oaicompat chat parsing).
TEMPLATED_FIELDS = frozenset({"messages", "tools", "tool_choice", "parallel_tool_calls",
                              "chat_template_kwargs", "add_generation_prompt",
                              "enable_thinking", "reasoning_format", "response_format"})

SLOT_BLOCK = 256
"""Tokens llama.cpp rounds a slot's context up to a multiple of (its KV cache's padding)."""

EMBEDDING_BATCH = 512  # worker: n_batch = n_ubatch = 512 (what runs with embeddings on)
N_UBATCH = EMBEDDING_BATCH  # the micro-batch every worker runs with (set explicitly)

# Error texts of llama.cpp's server that mean "your request is wrong", whatever its status.
_REFUSALS = re.compile(
    r"json\.exception|is not supported|input is too large|increase the physical batch size"
    r"|failed to parse|unsupported|out of range|invalid token"
    r"|exceeds the available context size|invalid|must be|cannot be|required|empty|unknown",
    re.IGNORECASE)


def refusal(status: int, message: str) -> bool:
    """Whether an engine's error answer refuses the request's input (so: a 4xx, not the
    engine's failure)."""
    return 400 <= status < 500 or (status == 500 and bool(_REFUSALS.search(message)))


def error_object(status: int, body: bytes, route: str) -> tuple[int, dict[str, Any]]:
    """An error answer of the engine as (status, OpenAI error envelope): a refusal of the
    request's input is a 400 ``invalid_request`` naming its field, whatever status the engine
    gave it; anything else keeps its status, code ``engine_error``."""
    message, type_ = body.decode("utf-8", errors="replace")[:2000], "server_error"
    try:
        err: Any = json.loads(body)["error"]
        message = str(err.get("message", message))
        type_ = str(err.get("type", type_))
    except (ValueError, AttributeError, TypeError, KeyError):
        pass
    if status == 501:  # e.g. /infill on a model without fill-in-the-middle tokens
        return 400, envelope(f"the model cannot do this: {message}", "invalid_request_error",
                             "not_supported", "model")
    if refusal(status, message):
        return (400 if status >= 500 else status,
                envelope(f"the engine refused the request: {message}", "invalid_request_error",
                         "invalid_request", refused_field(message, route)))
    return status, envelope(message, type_, "engine_error")


class LlamaCppClient(WorkerHTTP):
    """The worker contract (engines/contract.py) over llama.cpp's server API."""

    _adapters: dict[str, int] | None = None  # mounted LoRA adapters: engine id by path
    _told = False  # adapters it could not mount were logged

    async def _post(self, path: str, payload: dict[str, Any],
                    timeout_s: float | None = None) -> Any:
        """POST JSON and return the parsed answer; a refusal is EngineRefused."""
        self._check_open()
        try:
            resp = await self._http.post(path, json=payload, timeout=timeout_s)
        except httpx.TransportError as e:
            raise self._unreachable(e) from e
        if resp.status_code >= 400:
            status, err = error_object(resp.status_code, resp.content, path)
            message = err["error"]["message"]
            if status < 500:
                raise EngineRefused(f"model {self._model_id!r}: {message}",
                                    param=err["error"]["param"])
            raise EngineUnavailable(f"model {self._model_id!r}: {path} failed: {message}")
        try:
            return resp.json()
        except ValueError as e:
            raise EngineUnavailable(f"model {self._model_id!r}: {path} answered "
                                    f"{resp.text[:200]!r}, not JSON") from e

    async def probe(self, timeout_s: float) -> bool:
        # /slots is served by the engine's scheduling loop; /health by the HTTP thread alone.
        try:
            return (await self._get("/slots", timeout_s)).status_code == 200
        except EngineUnavailable:
            return False

    async def count_tokens(self, prompt: str | Messages) -> int:
        return len(await self.tokenize(prompt))

    async def tokenize(self, prompt: str | Messages | dict[str, Any]) -> list[int]:
        # as the server tokenizes a prompt: special tokens added and parsed
        text = prompt if isinstance(prompt, str) else await self.apply_template(
            prompt if isinstance(prompt, dict) else {"messages": prompt})
        reply = await self._post("/tokenize", {"content": text, "add_special": True,
                                               "parse_special": True})
        tokens = reply.get("tokens") if isinstance(reply, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise EngineUnavailable(f"model {self._model_id!r}: /tokenize answered no tokens")
        return tokens

    async def token_pieces(self, text: str, *, add_special: bool,
                           parse_special: bool) -> list[TokenPiece]:
        reply = await self._post("/tokenize", {"content": text, "add_special": add_special,
                                               "parse_special": parse_special,
                                               "with_pieces": True})
        try:
            return [TokenPiece(int(t["id"]), t["piece"]) for t in reply["tokens"]]
        except (TypeError, KeyError, ValueError) as e:
            raise EngineUnavailable(f"model {self._model_id!r}: /tokenize answered no "
                                    "pieces") from e

    async def detokenize(self, tokens: list[int]) -> str:
        reply = await self._post("/detokenize", {"tokens": tokens})
        text = reply.get("content") if isinstance(reply, dict) else None
        if not isinstance(text, str):
            raise EngineUnavailable(f"model {self._model_id!r}: /detokenize answered no "
                                    "content")
        return text

    async def apply_template(self, chat: dict[str, Any]) -> str:
        templated = await self._post(
            "/apply-template", {k: v for k, v in chat.items() if k in TEMPLATED_FIELDS})
        text = templated.get("prompt") if isinstance(templated, dict) else None
        if not isinstance(text, str):
            raise EngineUnavailable(f"model {self._model_id!r}: /apply-template answered "
                                    "no prompt")
        return text

    async def adapter_fields(self, adapters: tuple[Adapter, ...],
                             chosen: Adapter | None) -> dict[str, Any]:
        if not adapters and chosen is None:
            return {}
        mounted = await self._mounted()
        missing = [a for a in adapters if str(a.path) not in mounted]
        if missing and not self._told:
            self._told = True
            log.warning("model %s: adapter(s) %s not mounted: the engine refused the file "
                        "(the worker's lines above say why); their requests fail with 503, "
                        "the base and its other adapters serve", self._model_id,
                        ", ".join(f"{a.id} ({a.path})" for a in missing))
        if chosen is not None and str(chosen.path) not in mounted:
            raise WorkerLoadFailed(
                f"adapter {chosen.id!r} of model {self._model_id!r} is not mounted: the "
                "engine refused its file when the model loaded (the server log says why); "
                "the base and its other adapters serve on. Fix or replace the file, then "
                "unload and load the model",
                param="model")
        return {"lora": [{"id": engine_id, "scale": chosen.scale
                          if chosen is not None and path == str(chosen.path) else 0.0}
                         for path, engine_id in mounted.items()]}

    async def _mounted(self) -> dict[str, int]:
        """The adapters the worker mounted, engine id by path (asked once per worker)."""
        if self._adapters is None:
            resp = await self._get("/lora-adapters", None)
            try:
                self._adapters = {str(a["path"]): int(a["id"]) for a in resp.json()}
            except (ValueError, TypeError, KeyError) as e:
                raise EngineUnavailable(f"model {self._model_id!r}: /lora-adapters answered "
                                        f"{resp.text[:200]!r}") from e
        return self._adapters

    async def prime_slot(self, slot_id: int, fields: dict[str, Any], token: int) -> None:
        await self._post("/completion", {"prompt": [token], "n_predict": 1,
                                         "id_slot": slot_id, **fields})

    async def generate(self, route: str, body: dict[str, Any] | bytes,
                       slot: int | None = None) -> httpx.Response:
        if route not in GENERATION_ROUTES:
            raise ValueError(f"not a generation route: {route}")
        return await self._generate(route, body, slot)

    async def infill(self, body: dict[str, Any] | bytes,
                     slot: int | None = None) -> httpx.Response:
        if isinstance(body, dict):  # the engine needs both, as the schema defaults them
            body = {"input_prefix": "", "input_suffix": "", **body}
        return await self._generate("/infill", body, slot)

    async def _generate(self, path: str, body: dict[str, Any] | bytes,
                        slot: int | None) -> httpx.Response:
        if slot is not None:
            if not isinstance(body, dict):
                raise ValueError("a slot is given with a parsed body only")
            body = {**body, "id_slot": slot}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await self._send(self._http.build_request(
            "POST", path, content=content, headers={"content-type": "application/json"}))

    def error(self, status: int, body: bytes, route: str) -> tuple[int, dict[str, Any]]:
        return error_object(status, body, route)

    def timings(self, event: dict[str, Any]) -> Timings | None:
        return parse_timings(event.get("timings"))

    timings_mark = b'"timings"'  # the last event's own object (llama.cpp's server)

    def timings_line(self, line: str) -> Timings | None:
        if '"timings"' not in line or not line.startswith("data:"):
            return None
        try:
            event = json.loads(line[5:])
        except ValueError:
            return None
        return self.timings(event) if isinstance(event, dict) else None

    async def transcribe(self, audio: AsyncIterator[bytes], size: int,
                         options: dict[str, Any]) -> httpx.Response:
        raise InvalidRequest(f"model {self._model_id!r} does not transcribe audio",
                             param="model")

    async def slots(self) -> list[SlotState]:
        resp = await self._get("/slots", None)
        try:
            return [SlotState(int(s["id"]), bool(s.get("is_processing")),
                              int(s.get("n_prompt_tokens") or 0)) for s in resp.json()]
        except (ValueError, TypeError, KeyError) as e:
            raise EngineUnavailable(f"model {self._model_id!r}: /slots answered "
                                    f"{resp.text[:200]!r}") from e

    async def save_slot(self, slot_id: int, filename: str) -> SlotSnapshot:
        reply = await self._post(f"/slots/{slot_id}?action=save", {"filename": filename})
        return SlotSnapshot(slot_id, filename, int(reply.get("n_saved", 0)),
                            int(reply.get("n_written", 0)))

    async def restore_slot(self, slot_id: int, filename: str) -> SlotSnapshot:
        reply = await self._post(f"/slots/{slot_id}?action=restore", {"filename": filename})
        return SlotSnapshot(slot_id, filename, int(reply.get("n_restored", 0)),
                            int(reply.get("n_read", 0)))


def parse_timings(raw: Any) -> Timings | None:
    """llama.cpp's ``timings`` object of an answer (``prompt_n`` computed, ``cache_n``
    reused, ``predicted_n`` generated, ``prompt_ms``, ``predicted_ms``; with speculative
    decoding ``draft_n`` drafted and ``draft_n_accepted``) as :class:`Timings`; None when it
    is not one."""
    if not isinstance(raw, dict):
        return None
    prompt = raw.get("prompt_n")
    if type(prompt) is not int:
        return None
    cached, generated = raw.get("cache_n"), raw.get("predicted_n")
    drafted, accepted = raw.get("draft_n"), raw.get("draft_n_accepted")
    return Timings(prompt, cached if type(cached) is int else 0,
                   generated if type(generated) is int else 0,
                   _ms(raw.get("prompt_ms")), _ms(raw.get("predicted_ms")),
                   drafted if type(drafted) is int and drafted > 0 else 0,
                   accepted if type(accepted) is int and accepted > 0 else 0)


def _ms(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
    return float(value) if ok else None


def pinnable(route: str, body: dict[str, Any]) -> bool:
    """Whether the request runs in exactly one slot the front may choose: a chat or text
    completion of one prompt and one answer, no ``id_slot`` asked for by the client."""
    if route not in ("/v1/chat/completions", "/v1/completions") or "id_slot" in body:
        return False
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)
    return body.get("n", 1) == 1 and not several


STATE_MAGIC = 0x67677371  # "ggsq": llama.cpp's sequence-state file
_STATE_VERSION = 4


def saved_tokens(path: Path) -> list[int]:
    """The token ids a slot file saved by llama.cpp's server covers (its KV cache's).

    The file starts with little-endian int32 words: the magic, the version (4), the number
    of words in the server's token record, then that record: -1, 1, the token count N, N
    token ids, 0 (observed with xllamacpp; the engine's state data follows). Raises
    ValueError for anything else, so that a file of another layout is never trusted."""
    with path.open("rb") as f:
        head = f.read(12)
        if len(head) < 12:
            raise ValueError("shorter than a slot file's header")
        magic, version, words = struct.unpack("<III", head)
        if magic != STATE_MAGIC or version != _STATE_VERSION or not 4 <= words <= 1 << 24:
            raise ValueError(f"not a slot file of state version {_STATE_VERSION}")
        record = f.read(4 * words)
    if len(record) < 4 * words:
        raise ValueError("truncated token record")
    values = struct.unpack(f"<{words}i", record)
    marker, flag, count = values[:3]
    if (marker, flag) != (-1, 1) or count != words - 4 or values[-1] != 0:
        raise ValueError("an unknown token record")
    tokens = list(values[3:-1])
    if any(t < 0 for t in tokens):
        raise ValueError("a negative token id")
    return tokens


SAMPLER_LISTS = ("samplers", "dry_sequence_breakers", "logit_bias")
"""Sampler settings given as lists, which llama.cpp turns into sampler state per request."""

SAMPLING_FIELDS = frozenset({
    *SAMPLER_LISTS, "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n"})
"""The sampler settings each check runs with: the lists and what turns them on
(``dry_sequence_breakers`` cost nothing unless ``dry_multiplier`` turns DRY on; then 300 of
them stalled a worker past its liveness probes). Settings that cost nothing to prepare
(temperature, a seed) are left out, so that a verdict holds whatever they are."""

_PROBE_PROMPT = "hi"
_PROBE_TOKENS = 2

MANY_ALTERNATIVES = 32
"""A part of a schema (an ``enum``, ``anyOf`` or ``oneOf``) or of a grammar (a rule of as
many alternatives) with this many choices is also measured on its own, as the whole
constraint: its cost would come only when generation reaches it, after a fixed prefix (a
property name, a literal) the probe's two tokens never get past."""

INNER_PARTS = 4
"""Parts measured on their own per constraint, the largest first."""


def constraint_checks(path: str, body: dict[str, Any]) -> list[ConstraintCheck]:
    """What of ``body`` llama.cpp prepares before the first token, one check each: the
    sampler lists (first, so that their cost is named as theirs), a GBNF ``grammar``, a
    ``json_schema``, a ``response_format`` with a schema (or JSON mode), and the ``tools``'
    call schema (as the grammar a tool call is held to once it starts: llama.cpp builds it
    from the same schemas; the tools themselves are not sent, their text would be a long
    prefill); then the parts of those with many alternatives on their own
    (:data:`MANY_ALTERNATIVES`). Each runs with the request's sampler settings
    (:data:`SAMPLING_FIELDS`), on the route the request takes, with a one-word prompt and
    two tokens."""
    chat = path == "/v1/chat/completions"
    parts: list[tuple[str, dict[str, Any]]] = []
    lists = [k for k in SAMPLER_LISTS if body.get(k)]
    if lists:
        parts.append((lists[0], {}))
    grammar = body.get("grammar")
    if isinstance(grammar, str):
        parts.append(("grammar", {"grammar": grammar}))
        parts += [("grammar", {"grammar": g}) for g in _inner_rules(grammar)]
    schemas: list[tuple[str, Any]] = []
    if isinstance(body.get("json_schema"), dict | bool):
        parts.append(("json_schema", {"json_schema": body["json_schema"]}))
        schemas.append(("json_schema", body["json_schema"]))
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") != "text":
        parts.append(("response_format", {"response_format": response_format}))
        inner = response_format.get("json_schema")
        schemas.append(("response_format", inner.get("schema") if isinstance(inner, dict)
                        else response_format.get("schema")))
    tools = body.get("tools")
    if chat and isinstance(tools, list) and tools and body.get("tool_choice") != "none":
        calls = call_schema(tools)
        parts.append(("tools", _as_format(calls)))
        schemas.append(("tools", calls))
    for param, schema in schemas:
        parts += [(param, _as_format(s)) for s in _inner_schemas(schema)]
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": _PROBE_PROMPT}], "max_tokens": _PROBE_TOKENS}
        if chat else {"prompt": _PROBE_PROMPT, "n_predict": _PROBE_TOKENS})
    sampling = {k: v for k, v in body.items() if k in SAMPLING_FIELDS}
    return [ConstraintCheck(param, "chat" if chat else "completion",
                            {**prompt, **sampling, **part, "stream": False,
                             "cache_prompt": True})
            for param, part in parts]


def _as_format(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "part", "schema": schema}}}


def _inner_schemas(schema: Any) -> list[Any]:
    """The largest :data:`INNER_PARTS` parts of ``schema`` with many alternatives, each
    with the root's definitions (its ``$ref`` may name them)."""
    if not isinstance(schema, dict):
        return []
    found: list[tuple[int, dict[str, Any]]] = []
    stack: list[Any] = [v for v in schema.values()]
    seen = 0
    while stack and seen < 100_000:
        node = stack.pop()
        seen += 1
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            choices = max((len(node[k]) for k in ("enum", "anyOf", "oneOf")
                           if isinstance(node.get(k), list)), default=0)
            if choices >= MANY_ALTERNATIVES:
                found.append((len(json.dumps(node)), node))
            stack.extend(node.values())
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
    found.sort(key=lambda f: -f[0])
    return [{**node, **defs} for _, node in found[:INNER_PARTS]]


_ROOT_RULE = re.compile(r"(?m)^([ \t]*)root(\s*::=)")


def _inner_rules(grammar: str) -> list[str]:
    """The grammar with each of its largest :data:`INNER_PARTS` rules of many alternatives
    as its root (the old root renamed)."""
    try:
        bodies = grammar_cost.rules(grammar)
    except (ValueError, RecursionError):
        return []
    many = sorted((name for name, text in bodies.items()
                   if name != "root" and text.count("|") + 1 >= MANY_ALTERNATIVES),
                  key=lambda name: -len(bodies[name]))
    renamed = _ROOT_RULE.sub(r"\1bunkhouse-root\2", grammar)
    return [f"{renamed}\nroot ::= {name}\n" for name in many[:INNER_PARTS]]


def _build() -> str:
    try:
        return f"xllamacpp {importlib.metadata.version('xllamacpp')}"
    except importlib.metadata.PackageNotFoundError:
        return "xllamacpp unknown"


def refused(model: ServedModel) -> str | None:
    """Why ``model`` cannot be served under its llama.cpp options (engines/llamacpp_spec.py),
    naming the option; None: it can. Reads the GGUFs' headers (a draft's vocabulary: about a
    second for a 150K-token one)."""
    own = model_options(model)
    misfit = spec.head_misfit(model.info, own.cache_type_k, own.cache_type_v)
    if misfit:
        return misfit
    slot = model.options.context // model.options.parallel
    if own.speculation.draft_max >= slot:
        return (f"draft_max = {own.speculation.draft_max} drafts more tokens a step than a "
                f"slot holds ({slot}); lower it (the kinds' defaults are 3 to 64)")
    if own.mtp:
        return spec.mtp_missing(model.path, model.info)
    if not own.draft:
        return None
    draft = model.draft
    if draft is None:
        return (f"draft: {own.draft!r} is neither a model id nor a GGUF file; name a model "
                "of `bunkhouse models` or a file's path")
    if draft.info.general_type == "adapter":
        return f"draft: {own.draft!r} is a LoRA adapter, not a model"
    try:
        differs = spec.vocab_mismatch(model.path, draft.path)
    except GGUFError as e:
        return f"draft: {own.draft!r} cannot be read: {e.message}"
    if differs:
        return (f"draft: the vocabularies differ: this model ({model.info.architecture}) and "
                f"its draft {own.draft!r} ({draft.info.architecture}) have {differs}; a "
                "draft model must share its target's vocabulary (a smaller model of the same "
                'family), or use speculative = "ngram", which needs no second model')
    return None


class LlamaCpp:
    """The llama.cpp engine adapter (engines/contract.py ``EngineAdapter``)."""

    name = NAME
    worker_engine = WORKER_ENGINE
    build = _build()

    known_options = KNOWN_OPTIONS

    def options(self, raw: Mapping[str, Any], where: str) -> LlamaCppOptions:
        return parse_options(raw, where)

    def snapshot_layout(self, model: ServedModel) -> dict[str, Any] | None:
        # the worker's settings (worker/engines/llamacpp.py build_params) a slot file holds
        # (a draft model's KV cache is its own context's, never saved: a restored slot's
        # draft catches up by itself; so the speculative kind is not part of it, but MTP
        # heads keep their KV in the model's own context)
        o, own = model.options, model_options(model)
        layout = {"cache_type_k": own.cache_type_k, "cache_type_v": own.cache_type_v,
                  "n_ubatch": N_UBATCH, "slot_context": o.context // o.parallel,
                  "kv_unified": False,
                  "swa_full": own.swa_full and _swa_layers(model.info) > 0,
                  "embeddings": model.embeddings}
        if own.mtp:
            layout["mtp"] = True
        return layout

    def restore_hint(self, model: ServedModel) -> str:
        if _swa_layers(model.info, model_options(model).swa_full):
            return "it has sliding-window attention: set swa_full = true for it"
        return ""

    def saved_tokens(self, path: Path) -> list[int]:
        return saved_tokens(path)

    ready_line: str | None = None

    def command(self, model: ServedModel, spawn: WorkerSpawn) -> list[str] | None:
        return None

    def worker_args(self, model: ServedModel) -> list[str]:
        o = model.options
        return ["--context", str(o.context), "--parallel", str(o.parallel),
                *[arg for a in model.adapters for arg in ("--adapter", str(a.path))],
                *(["--draft", str(model.draft.path)] if model.draft is not None else []),
                *(["--embeddings"] if model.embeddings else []),
                *(["--pooling", "model"] if model.info.pooling else []),
                *(["--chat-template", model.chat_template] if model.chat_template else []),
                *opts.worker_args(model_options(model))]

    def estimate(self, model: ServedModel) -> MemoryEstimate:
        return estimate(model)

    def client(self, transport: httpx.AsyncBaseTransport, model_id: str) -> LlamaCppClient:
        return LlamaCppClient(transport, model_id)

    def capabilities(self, model: ServedModel) -> Capabilities:
        return Capabilities(generates=True, embeds=self.embedding_limit(model) > 0,
                            infills=True, transcribes=False,
                            saves_kv=self.snapshot_layout(model) is not None,
                            adapters=self.adapters_refused(model) is None,
                            # tokens accepted from a draft come without log-probabilities
                            logprobs=model_options(model).speculation.kind is None)

    def pinnable(self, route: str, body: dict[str, Any]) -> bool:
        return pinnable(route, body)

    def shown_options(self, model: ServedModel) -> dict[str, Any]:
        own = model_options(model)
        s = own.speculation
        return {"speculative": s.kind, "draft": own.draft or None,
                "draft_max": s.draft_max if s.kind else None,
                "draft_min": s.draft_min if s.kind else None,
                "cache_type_k": own.cache_type_k, "cache_type_v": own.cache_type_v,
                "flash_attn": own.flash_attention, "swa_full": own.swa_full,
                "cache_ram_mib": own.cache_ram_mib, "threads": own.threads}

    def draft_name(self, model: ServedModel) -> str | None:
        return model_options(model).draft or None

    def refused(self, model: ServedModel) -> str | None:
        return refused(model)

    def adapters_refused(self, model: ServedModel) -> str | None:
        cache = model_options(model).cache_ram_mib
        if cache:
            return (f"its cache_ram_mib is {cache}: llama.cpp's RAM prompt cache finds a "
                    "prompt by its tokens alone and would hand one adapter's KV state to "
                    "another; set cache_ram_mib = 0 for it")
        return None

    def check_request(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        check_extensions(body)
        check_lora(body)
        grammar_cost.check_request(body)
        return fold_seed(body)

    probe_module: str | None = "bunkhouse.worker.engines.llamacpp_probe"

    def constraint_checks(self, path: str, body: dict[str, Any]) -> list[ConstraintCheck]:
        return constraint_checks(path, body)

    def forwarded_fields(self) -> frozenset[str]:
        return EXTENSION_FIELDS

    def embedding_limit(self, model: ServedModel) -> int:
        if not model.embeddings:
            return 0
        return min(model.options.context // model.options.parallel, EMBEDDING_BATCH)

    def kv_cache_bytes(self, model: ServedModel, tokens: int) -> int:
        own = model_options(model)
        return kv_cache_bytes(model.info, tokens, 1, types=(own.cache_type_k,
                                                             own.cache_type_v))

    def slot_tokens(self, tokens: int) -> int:
        # llama.cpp sizes each slot in whole blocks (rounding up, one block at least): a slot
        # that is not one would hold more than the front checks against
        return max(SLOT_BLOCK, tokens - tokens % SLOT_BLOCK)


# -- the memory estimate (docs/memory-estimate.md has the table and how it was measured) ---

MIB = 1024 * 1024
F16 = ("f16", "f16")  # the K and V caches' element types: llama.cpp's default
LOGIT_BYTES = 4  # f32 logits and embeddings
# Fitted to the measured peaks of the packaged models (docs/memory-estimate.md):
RUNTIME_BYTES = 130 * MIB  # interpreter, llama.cpp, threads, graph metadata
"""116 MiB fitted, plus 14 MiB: a worker whose engine library (xllamacpp's 106 MB .so) is
all in the page cache, as right after an install, maps more of it at each fault (the
kernel's fault-around), measured 13.4 MiB more resident at import in a fresh venv than in
one whose library had been partly evicted; the measured peaks below were of the latter."""
FFN_TENSORS = 6.6  # compute: a full micro-batch holds this many (512 x n_ff) f32 tensors
SLOT_VOCAB_BYTES = 18  # per slot and vocabulary entry: its sampler's candidate arrays
ATTENTION_SLOT_BYTES = 1500  # per token of one slot: attention over a whole slot...
ATTENTION_CONTEXT_BYTES = 150  # ...and per token of the context (every slot's streams)
SWA_SLOT_BYTES = 6250  # sliding-window models, per slot token past one micro-batch (to 2048)
SWA_STREAM_BYTES = 12 * 1024  # per sliding-window cell of every slot but one (batched slots)
DRAFT_CONTEXT_BYTES = 76 * MIB  # a draft model's context of its own: graph, threads, buffers
NGRAM_TABLE_BYTES = 40 * MIB  # n-gram speculation's hash table (speculation_runtime_bytes)
_SWA_LONG = 2048  # beyond this many tokens of a slot, SWA_SLOT_BYTES stops growing
_DEFAULT_FFN = 4 * 4096  # a GGUF without feed_forward_length: a large model's
_SWA_PAD = 256

# Every Nth layer uses full attention, the others a sliding window (llama.cpp's patterns).
_SWA_PATTERNS: dict[str, int] = {"gemma3": 6, "gemma2": 2, "cohere2": 4, "gemma3n": 5}


def kv_bytes_per_token_per_layer(info: GGUFInfo, types: tuple[str, str] = F16) -> float:
    """One token's K and V in one layer, at the caches' element types (``types``: K's, V's;
    a quantized type's bytes per element include its blocks' scales)."""
    heads = info.head_count_kv or info.head_count or 0
    return heads * ((info.key_length or 0) * spec.kv_element_bytes(types[0])
                    + (info.value_length or 0) * spec.kv_element_bytes(types[1]))


def _swa_layers(info: GGUFInfo, swa_full: bool = False) -> int:
    """Layers whose KV cache holds only a sliding window (none with ``swa_full``: every layer
    keeps the whole slot, as a full-attention layer does)."""
    layers = info.block_count or 0
    pattern = _SWA_PATTERNS.get(info.architecture)
    if not info.sliding_window or pattern is None or swa_full:
        return 0  # unknown pattern: count every layer at full context (over, never under)
    return layers - layers // pattern  # layer il is full when (il + 1) % pattern == 0


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _swa_stream(info: GGUFInfo, slot: int) -> int:
    """Tokens a slot's sliding-window layers attend over: its context, capped at window + one
    micro-batch."""
    return min(slot, (info.sliding_window or slot) + N_UBATCH)


def _swa_cells(info: GGUFInfo, context: int, parallel: int) -> int:
    """Cells of each sliding-window layer: every slot has its own stream (``kv_unified`` is
    off), padded to 256 (llama.cpp's llama_kv_cache_iswa)."""
    return parallel * _pad(_swa_stream(info, context // parallel), _SWA_PAD)


def kv_cache_bytes(info: GGUFInfo, context: int, parallel: int, swa_full: bool = False,
                   types: tuple[str, str] = F16) -> int:
    """The KV cache llama.cpp allocates for ``context`` tokens shared by ``parallel`` slots,
    its K and V caches of element types ``types``."""
    per_layer = kv_bytes_per_token_per_layer(info, types)
    swa = _swa_layers(info, swa_full)
    full = (info.block_count or 0) - swa
    swa_cells = _swa_cells(info, context, parallel) if swa else 0
    return math.ceil(per_layer * (full * context + swa * swa_cells))


def output_bytes(model: ServedModel) -> int:
    """The output buffers an embeddings batch grows to: llama.cpp computes logits for every
    token of it (one row of ``n_vocab`` f32 per token, in the compute buffer) and copies them
    with the embeddings to its output buffer, for up to one micro-batch of tokens."""
    if not model.embeddings:
        return 0
    rows = min(N_UBATCH, model.options.context)
    vocab = model.info.vocab_size or 0
    width = model.info.embedding_length or 0
    return rows * LOGIT_BYTES * (2 * vocab + width)


def compute_bytes(model: ServedModel) -> int:
    """Compute buffers and per-slot state a worker touches at its largest: a full
    micro-batch through the FFN, attention over a full slot, every slot sampling."""
    o = model.options
    return _compute_bytes(model.info, o.context, o.parallel, model_options(model).swa_full)


def _compute_bytes(info: GGUFInfo, context: int, parallel: int, swa_full: bool) -> int:
    ffn = info.feed_forward_length or _DEFAULT_FFN
    vocab = info.vocab_size or 0
    slot = context // parallel
    swa = swa_long = 0  # sliding-window cells the other slots attend over (unpadded)
    if _swa_layers(info, swa_full):
        swa = _swa_stream(info, slot) * (parallel - 1)
        swa_long = max(0, min(slot, _SWA_LONG) - N_UBATCH)
    return int(FFN_TENSORS * N_UBATCH * ffn * LOGIT_BYTES
               + SLOT_VOCAB_BYTES * vocab * parallel
               + ATTENTION_SLOT_BYTES * slot
               + ATTENTION_CONTEXT_BYTES * context
               + SWA_SLOT_BYTES * swa_long * parallel
               + SWA_STREAM_BYTES * swa)


def speculation_output_bytes(model: ServedModel) -> int:
    """The target's logits for every token a slot verifies at once (the one it samples and
    up to ``draft_max`` drafted): one row of ``n_vocab`` f32 each, for every slot, twice
    (computed, then copied out). Measured (docs/memory-estimate.md): the packaged Qwen with
    n-gram drafts in 2 slots peaked 11, 21 and 124 MiB above its own prompt-filled peak at
    ``draft_max`` 4, 16 and 64, against 12, 39 and 151 MiB counted here."""
    s = model_options(model).speculation
    if s.kind is None:
        return 0
    return 2 * (s.draft_max + 1) * model.options.parallel * (model.info.vocab_size or 0) \
        * LOGIT_BYTES


def speculation_runtime_bytes(model: ServedModel) -> int:
    """What speculation holds whatever it drafts: llama.cpp's n-gram table (``ngram-mod``:
    a fixed hash table, filled at start; measured: an n-gram worker was 38 MiB larger once
    ready than the same worker without, at any ``draft_max``)."""
    return NGRAM_TABLE_BYTES if model_options(model).speculation.kind == spec.NGRAM else 0


def draft_estimate(model: ServedModel) -> MemoryEstimate:
    """The draft model's part of its target's worker: its file, its KV cache at the target's
    context, slots and cache types, its compute buffers as a model of its own would have
    them, and its context's own overhead (:data:`DRAFT_CONTEXT_BYTES`: fitted to the packaged
    Qwen drafting for itself at 2,048 and 8,192 tokens in 1 and 4 slots, where it was the
    measured peak less the rest, 64 to 70 MiB; docs/memory-estimate.md)."""
    draft = model.draft
    if draft is None:
        return MemoryEstimate(0, 0, 0, 0, 0, 0)
    own = model_options(model)
    o = model.options
    return MemoryEstimate(
        weights=draft.bytes,
        kv_cache=kv_cache_bytes(draft.info, o.context, o.parallel, own.swa_full,
                                (own.cache_type_k, own.cache_type_v)),
        prompt_cache=0, runtime=DRAFT_CONTEXT_BYTES,
        compute=_compute_bytes(draft.info, o.context, o.parallel, own.swa_full),
        outputs=0)


def estimate(model: ServedModel) -> MemoryEstimate:
    """The worker's worst case under ``model``'s options, bytes by part (a draft model's
    parts added to the target's)."""
    o, own = model.options, model_options(model)
    draft = draft_estimate(model)
    return MemoryEstimate(
        weights=model.size_bytes + sum(a.bytes for a in model.adapters)  # LoRA: copied in
        + draft.weights,
        kv_cache=kv_cache_bytes(model.info, o.context, o.parallel, own.swa_full,
                                (own.cache_type_k, own.cache_type_v)) + draft.kv_cache,
        prompt_cache=own.cache_ram_mib * MIB,
        runtime=RUNTIME_BYTES + draft.runtime + speculation_runtime_bytes(model),
        compute=compute_bytes(model) + draft.compute,
        outputs=output_bytes(model) + speculation_output_bytes(model),
    )
