"""Ollama's API in terms of OpenAI chat completions and completions: pure functions, no I/O.

The front serves ``POST /api/chat`` and ``POST /api/generate`` by translating the request
(:func:`chat_request`, :func:`generate_request`), sending it down the one generation path
every protocol shares, and translating the answer back into Ollama's objects: whole
(:func:`answer`) or, by default, streamed as newline-delimited JSON (:class:`OllamaStream`).

Source: Ollama's docs/api.md ("Generate a chat completion", "Generate a completion": a
stream of JSON objects, one a line, each with ``done: false``, then a last one with
``done: true``, ``done_reason`` and the counts and durations in nanoseconds; ``options``
``num_predict``, ``temperature``, ``top_p``, ``top_k``, ``stop``, ``seed``, ``num_ctx``;
``format`` "json" or a JSON schema; errors as ``{"error": "message"}``).

Errors: the request translators raise :class:`bunkhouse.errors.InvalidRequest` naming the
field.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bunkhouse.api.fields import Paths, Renames, function_tool, need, shown
from bunkhouse.api.schemas import INT32_MAX

_OPTIONS = {"temperature": (float, 0, 2), "top_p": (float, 0, 1), "top_k": (int, 0, INT32_MAX),
            "seed": (int, -(1 << 63), (1 << 63) - 1), "repeat_penalty": (float, 0, 10),
            "presence_penalty": (float, -2, 2), "frequency_penalty": (float, -2, 2),
            "min_p": (float, 0, 1)}
"""Ollama options passed on under the same name: (type, lowest, highest)."""

_ENGINE_OPTIONS = {"typical_p": "typical_p", "repeat_last_n": "repeat_last_n",
                   "mirostat": "mirostat", "mirostat_tau": "mirostat_tau",
                   "mirostat_eta": "mirostat_eta", "num_keep": "n_keep"}
"""Ollama sampling options llama.cpp's server takes too (Ollama's name: the engine's), passed
on for its adapter to check against the engine's own ranges (a refusal names the Ollama
option: :data:`CHAT_FIELDS`). Ollama's load options (``num_batch``, ``num_gpu``,
``num_thread``, ``use_mmap``, ...) are the server's to set and are not read."""

CHAT_FIELDS: Renames = (
    (r"^response_format.*", "format"),
    (r"^max_tokens$", "options.num_predict"),
    (r"^(temperature|top_p|top_k|min_p|seed|stop|repeat_penalty|presence_penalty"
     r"|frequency_penalty|typical_p|repeat_last_n|mirostat|mirostat_tau|mirostat_eta)$",
     r"options.\1"),
    (r"^n_keep$", "options.num_keep"),
)
"""The chat completion fields a refusal may name, as this API names them (api/fields.py)."""

FREE_FORM: Paths = (("tools", "*", "function", "parameters"), ("format",),
                    ("messages", "*", "tool_calls", "*", "function", "arguments"))
"""Where a request's null is a value, not an omitted field (api/fields.omit_nulls; Ollama
reads a null as the field's zero value, as Go does)."""


VERSION = "0.10.0"
"""The Ollama release whose API the routes answer (``/api/version``): its newest fields
served here are ``/api/ps``' ``context_length`` (0.10.0) and tool messages' ``tool_name``
(0.9.6). Clients that check the version refuse bunkhouse's own (docs/architecture.md)."""


def tagged(model_id: str) -> str:
    """A model id as Ollama lists and answers a name: ``name:tag``, with ``:latest`` when
    the id has no tag (no colon in its last ``/`` segment), as Ollama always shows one."""
    return model_id if ":" in model_id.rsplit("/", 1)[-1] else f"{model_id}:latest"


def parameter_size(count: int | None) -> str:
    """A weight count as Ollama's ``details.parameter_size`` writes it (its
    format.HumanNumber): 494032768 is "494.03M", 7000000000 "7B", 8030000000 "8.0B"; ""
    when unknown."""
    if count is None:
        return ""
    for unit, scale, decimals in (("B", 10**9, 1), ("M", 10**6, 2), ("K", 10**3, 0)):
        if count >= scale:
            number = count / scale
            if unit == "K" or number != int(number):
                return f"{number:.{decimals}f}{unit}"
            return f"{number:.0f}{unit}"
    return str(count)


_PARAMETER_NAMES = {"max_tokens": "num_predict"}
"""Request fields a model's params may set whose Ollama option has another name (the rest,
``temperature``, ``top_p``, ``stop``, ..., have the same)."""


def parameters(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """A model's request params (chat completion fields) as Ollama's options, one pair a
    value (``stop`` one per string), in the order given."""
    out: list[tuple[str, Any]] = []
    for name, value in pairs:
        option = _PARAMETER_NAMES.get(name, name)
        out += [(option, v) for v in (value if isinstance(value, list) else [value])]
    return out


def parameters_text(options: list[tuple[str, Any]]) -> str:
    """``/api/show``'s ``parameters``: a line an option, its name padded to 30 then its
    value (a string quoted), as Ollama writes them."""
    return "\n".join(f"{name:<30} {json.dumps(value)}" for name, value in options)


def modelfile(name: str, source: str, template: str, options: list[tuple[str, Any]],
              adapter: Path | None = None) -> str:
    """``/api/show``'s ``modelfile``: the model ``name`` as a Modelfile, ``FROM`` its file
    (``source``), its LoRA ``ADAPTER`` if it is one, its ``TEMPLATE`` (a Jinja template from
    the GGUF here, not a Go one) and a ``PARAMETER`` an option."""
    lines = ["# Modelfile generated by bunkhouse for " + name, f"FROM {source}"]
    if adapter is not None:
        lines.append(f"ADAPTER {adapter}")
    if template:
        lines.append(f'TEMPLATE """{template}"""')
    lines += [f"PARAMETER {option} {json.dumps(value)}" for option, value in options]
    return "\n".join(lines) + "\n"


def now() -> str:
    """A timestamp as Ollama writes ``created_at`` (RFC 3339, UTC)."""
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


def _bound(value: float) -> str:
    """A bound as a message prints it: an integer in full, a fraction as written."""
    return str(int(value)) if value == int(value) else f"{value:g}"


def _options(body: dict[str, Any], out: dict[str, Any]) -> None:
    given = body.get("options")
    if given is None:
        return
    need(isinstance(given, dict), "options must be an object", "options")
    for name, (kind, lo, hi) in _OPTIONS.items():
        value = given.get(name)
        if value is None:
            continue
        ok = isinstance(value, int | float) and not isinstance(value, bool) and lo <= value <= hi
        need(ok and (kind is float or isinstance(value, int)),
             f"options.{name} must be a{'n integer' if kind is int else ' number'} from "
             f"{_bound(lo)} to {_bound(hi)}", f"options.{name}")
        out[name] = value
    for name, engine_name in _ENGINE_OPTIONS.items():
        if given.get(name) is not None:
            out[engine_name] = given[name]
    predict = given.get("num_predict")
    if predict is not None:
        need(isinstance(predict, int) and not isinstance(predict, bool) and predict >= -2,
             "options.num_predict must be an integer (-1: until the context is full)",
             "options.num_predict")
        if predict > 0:
            out["max_tokens"] = predict
    stop = given.get("stop")
    if stop is not None:
        need(isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop),
             "options.stop must be an array of at most 4 strings", "options.stop")
        if stop:
            out["stop"] = stop
    ctx = given.get("num_ctx")  # the model's slot size is the server's to set
    need(ctx is None or (isinstance(ctx, int) and not isinstance(ctx, bool)
                         and 0 < ctx <= INT32_MAX),
         f"options.num_ctx must be an integer from 1 to {INT32_MAX}", "options.num_ctx")


def _format(body: dict[str, Any], out: dict[str, Any]) -> None:
    fmt = body.get("format")
    if fmt in (None, ""):
        return
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
        return
    need(isinstance(fmt, dict), "format must be \"json\" or a JSON schema object", "format")
    out["response_format"] = {"type": "json_schema",
                              "json_schema": {"name": "format", "schema": fmt}}


def _common(body: dict[str, Any], out: dict[str, Any]) -> None:
    model = body.get("model")
    need(isinstance(model, str) and bool(model), "model is required: a model name", "model")
    out["model"] = model
    stream = body.get("stream", True)  # Ollama streams unless told not to
    need(isinstance(stream, bool), "stream must be a boolean", "stream")
    if stream:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    _options(body, out)
    _format(body, out)


def _message(i: int, message: Any) -> dict[str, Any]:
    at = f"messages.{i}"
    need(isinstance(message, dict), f"{at} must be an object", at)
    role = message.get("role")
    need(role in ("system", "user", "assistant", "tool"),
         f"{at}.role must be system, user, assistant or tool", f"{at}.role")
    content = message.get("content", "")
    need(isinstance(content, str), f"{at}.content must be a string", f"{at}.content")
    need(not message.get("images"), f"{at}.images: images are not served here (the "
         "packaged models read text only)", f"{at}.images")
    out: dict[str, Any] = {"role": role, "content": content}
    calls = message.get("tool_calls")
    if calls is not None and role == "assistant":
        need(isinstance(calls, list), f"{at}.tool_calls must be an array", f"{at}.tool_calls")
        out["tool_calls"] = []
        for j, call in enumerate(calls):
            fn: Any = call.get("function") if isinstance(call, dict) else None
            need(isinstance(fn, dict) and isinstance(fn.get("name"), str)
                 and isinstance(fn.get("arguments", {}), dict),
                 f"{at}.tool_calls.{j} needs a function with a name and object arguments",
                 f"{at}.tool_calls.{j}")
            out["tool_calls"].append({"id": f"call_{i}_{j}", "type": "function", "function": {
                "name": fn["name"], "arguments": json.dumps(fn.get("arguments", {}))}})
        out["content"] = content or None
    if role == "tool":
        out["tool_call_id"] = _answered(message)
    return out


def _answered(message: dict[str, Any]) -> str:
    """A tool message's call id: Ollama's messages name the tool, not the call."""
    name = message.get("tool_name") or message.get("name")
    return f"tool:{name}" if isinstance(name, str) else "tool"


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """``POST /api/chat`` as a chat completion request. Raises InvalidRequest naming the
    field."""
    messages: Any = body.get("messages")
    need(isinstance(messages, list), "messages must be an array", "messages")
    chat = [_message(i, m) for i, m in enumerate(messages)]
    # Ollama's tool messages name a tool, not a call: give each call the id its answer uses
    for m in chat:
        for call in m.get("tool_calls") or []:
            call["id"] = f"tool:{call['function']['name']}"
    out: dict[str, Any] = {"messages": chat}
    _common(body, out)
    tools = body.get("tools")
    if tools is not None:
        need(isinstance(tools, list), "tools must be an array", "tools")
        served = [t for t in tools if function_tool(t)]  # the rest: skipped (api/fields.py)
        if served:
            out["tools"] = served
    return out


def generate_request(body: dict[str, Any], templated: bool) -> tuple[str, dict[str, Any]]:
    """``POST /api/generate`` as (route, request): a chat completion (``system`` and
    ``prompt``) for a model with a chat template, else a completion of the prompt as it is
    (also when ``raw`` is true); with a ``suffix``, llama.cpp's ``/infill`` (api/infill.py).
    Raises InvalidRequest naming the field."""
    prompt = body.get("prompt", "")
    need(isinstance(prompt, str), "prompt must be a string", "prompt")
    system = body.get("system")
    need(system is None or isinstance(system, str), "system must be a string", "system")
    raw = body.get("raw", False)
    need(isinstance(raw, bool), "raw must be a boolean", "raw")
    need(not body.get("images"), "images are not served here", "images")
    suffix = body.get("suffix")
    need(suffix is None or isinstance(suffix, str), "suffix must be a string", "suffix")
    out: dict[str, Any] = {}
    if suffix:  # fill-in-the-middle: the prompt is the text before the middle
        out.update(input_prefix=prompt, input_suffix=suffix)
        _common(body, out)
        return "/infill", out
    if templated and not raw:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}]
        out["messages"] = messages
        _common(body, out)
        return "/v1/chat/completions", out
    out["prompt"] = prompt
    _common(body, out)
    return "/v1/completions", out


def _text(event: dict[str, Any]) -> tuple[str, str, list[dict[str, Any]], str | None]:
    """(text, thinking, tool call deltas, finish reason) of a chat or completion chunk."""
    choices = event.get("choices") or []
    if not choices:
        return "", "", [], None
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return (delta.get("content") or "", delta.get("reasoning_content") or "",
                delta.get("tool_calls") or [], choice.get("finish_reason"))
    message = choice.get("message")
    if isinstance(message, dict):
        return (message.get("content") or "", message.get("reasoning_content") or "",
                message.get("tool_calls") or [], choice.get("finish_reason"))
    return choice.get("text") or "", "", [], choice.get("finish_reason")


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Timing:
    """A request's own times, as Ollama reports them."""

    received_ns: int  # time.monotonic_ns() when it came
    load_ns: Callable[[], int]  # how long it waited for its model's load (0: it was ready)


class OllamaStream:
    """Chat or completion chunks in, Ollama's objects out: one per chunk with text
    (``message`` for chat, ``response`` for generate), then the last one with ``done``."""

    def __init__(self, model: str, chat: bool, timing: Timing | None = None) -> None:
        """``timing``: when the request came (monotonic ns) and how long its model took to
        load for it (ns, read at the end), for ``total_duration`` and ``load_duration``."""
        self.model = model
        self.chat = chat
        self.started = timing.received_ns if timing else time.monotonic_ns()
        self._timing = timing
        self._finish: str | None = None
        self._usage: dict[str, Any] = {}
        self._calls: dict[int, dict[str, Any]] = {}
        self._timings: dict[str, Any] = {}

    def _object(self, text: str, thinking: str = "") -> dict[str, Any]:
        base: dict[str, Any] = {"model": self.model, "created_at": now()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            base["message"] = message
        else:
            base["response"] = text
            if thinking:
                base["thinking"] = thinking
        return base

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        if isinstance(event.get("usage"), dict):
            self._usage = event["usage"]
        if isinstance(event.get("timings"), dict):
            self._timings = event["timings"]
        text, thinking, calls, finish = _text(event)
        for call in calls:
            slot = self._calls.setdefault(int(call.get("index", len(self._calls))),
                                          {"name": "", "arguments": ""})
            fn = call.get("function") or {}
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
        if finish:
            self._finish = finish
        if not text and not thinking:
            return []
        return [{**self._object(text, thinking), "done": False}]

    def end(self) -> list[dict[str, Any]]:
        last = self._object("")
        if self._calls and self.chat:
            last["message"]["tool_calls"] = [
                {"function": {"name": c["name"], "arguments": _arguments(c["arguments"])}}
                for _, c in sorted(self._calls.items())]
        prompt_ms = float(self._timings.get("prompt_ms") or 0)
        predicted_ms = float(self._timings.get("predicted_ms") or 0)
        last.update({
            "done": True,
            "done_reason": "length" if self._finish == "length" else "stop",
            # a whole answer is shaped after the fact: at least the engine's own time
            "total_duration": max(time.monotonic_ns() - self.started,
                                  int((prompt_ms + predicted_ms) * 1e6)),
            "load_duration": self._timing.load_ns() if self._timing else 0,
            "prompt_eval_count": int(self._usage.get("prompt_tokens") or 0),
            "prompt_eval_duration": int(prompt_ms * 1e6),
            "eval_count": int(self._usage.get("completion_tokens") or 0),
            "eval_duration": int(predicted_ms * 1e6),
        })
        return [last]


def answer(result: dict[str, Any], model: str, chat: bool,
           timing: Timing | None = None) -> dict[str, Any]:
    """A whole chat completion or completion as Ollama's one object (``stream: false``)."""
    stream = OllamaStream(model, chat, timing)
    text, thinking, calls, finish = _text(result)
    stream.feed({"usage": result.get("usage"), "timings": result.get("timings"),
                 "choices": [{"delta": {"tool_calls": [{**c, "index": i}
                                                       for i, c in enumerate(calls)]},
                              "finish_reason": finish}]})
    last = stream.end()[0]
    if chat:
        last["message"]["content"] = text
        if thinking:
            last["message"]["thinking"] = thinking
    else:
        last["response"] = text
    return last


_DURATION_RE = re.compile(r"(-?)((?:\d+(?:\.\d*)?(?:ns|us|µs|ms|s|m|h))+)")
MAX_KEEP_ALIVE_S = 10 * 365 * 86400.0
"""A keep_alive past ten years is forever (a negative one, in Ollama's terms)."""
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive(body: dict[str, Any]) -> float | None:
    """``keep_alive`` in seconds: how long the model stays loaded after this request (0:
    unloaded as soon as it is idle; ``math.inf`` for a negative value: never unloaded for
    idleness); None when not given. A number is seconds; a string a Go duration ("5m",
    "1h30m", "-1") as Ollama reads it (docs/faq.md). Raises InvalidRequest."""
    value = body.get("keep_alive")
    if value is None:
        return None
    seconds: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and len(value) <= 64:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            m = _DURATION_RE.fullmatch(text)
            if m:
                parts = re.findall(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)", m.group(2))
                seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
                seconds = -seconds if m.group(1) else seconds
    need(seconds is not None and math.isfinite(seconds),
         'keep_alive must be a duration such as "5m", "1h" or "0", or a number of seconds '
         "(negative: keep it loaded)", "keep_alive")
    assert seconds is not None
    return math.inf if seconds < 0 or seconds > MAX_KEEP_ALIVE_S else seconds


def embed_request(body: dict[str, Any], legacy: bool) -> dict[str, Any]:
    """``POST /api/embed`` (``input``: a text or texts) or the older ``/api/embeddings``
    (``legacy``: ``prompt``, one text) as an OpenAI embeddings request. Raises
    InvalidRequest naming the field."""
    model = body.get("model")
    need(isinstance(model, str) and bool(model), "model is required: a model name", "model")
    field = "prompt" if legacy else "input"
    given = body.get(field)
    texts = [given] if isinstance(given, str) else given
    need(isinstance(texts, list) and bool(texts) and all(isinstance(t, str) for t in texts)
         and (not legacy or isinstance(given, str)),
         f"{field} must be a text{'' if legacy else ' or a non-empty array of texts'}", field)
    truncate = body.get("truncate", True)
    need(isinstance(truncate, bool), "truncate must be a boolean", "truncate")
    dims = body.get("dimensions")
    need(dims is None, "dimensions: this server returns each model's own size", "dimensions")
    return {"model": model, "input": texts, "encoding_format": "float"}


def embed_answer(result: dict[str, Any], model: str, legacy: bool) -> dict[str, Any]:
    """An OpenAI embeddings answer as ``/api/embed``'s (or ``/api/embeddings``')."""
    vectors = [item.get("embedding") for item in sorted(
        result.get("data") or [], key=lambda d: d.get("index", 0))]
    if legacy:
        return {"embedding": vectors[0] if vectors else []}
    usage = result.get("usage") or {}
    return {"model": model, "embeddings": vectors,
            "prompt_eval_count": int(usage.get("prompt_tokens") or 0)}


def line(obj: dict[str, Any]) -> bytes:
    """One object of a newline-delimited JSON stream."""
    return json.dumps(obj).encode() + b"\n"


def error(message: str) -> dict[str, Any]:
    """Ollama's error object."""
    return {"error": message}


def not_served(route: str) -> str:
    """Why ``route`` (push, create, copy, delete) is not served, and what to do."""
    what = {"push": "bunkhouse uploads nothing",
            "create": "bunkhouse has no Modelfiles: describe a model in the TOML config file "
                      "(docs/configuration.md)",
            "copy": "name a model twice with aliases in the TOML config file",
            "delete": "bunkhouse never deletes model files: remove the file, or unload the "
                      "model with POST /v1/models/{id}/unload"}
    return f"/api/{shown(route)[1:-1]} is not served: {what.get(route, 'not supported')}"
