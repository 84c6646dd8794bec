"""The MLX engine: mlx-lm's generation in the worker, behind the worker API on its socket.

The worker API is the one bunkhouse's llama.cpp workers answer (engines/mlx.py is the front
side, which reads it with the llama.cpp client), so that the front, residency and the KV
store need nothing of MLX:

- ``GET /health``: 200 once the model is loaded (answered by the HTTP thread).
- ``GET /slots``: each slot's ``id``, ``is_processing`` and ``n_prompt_tokens`` (the tokens
  its KV cache holds), answered by the generation thread, so that a hung engine fails the
  liveness probe.
- ``POST /v1/chat/completions`` and ``/v1/completions``: OpenAI chat and text completions,
  streamed (SSE, a chunk per token) or whole, each answer's figures in a ``timings`` object
  (``prompt_n`` tokens prefilled, ``cache_n`` reused from the slot's KV cache, ``predicted_n``
  generated, and their milliseconds), ``id_slot`` choosing the slot.
- ``POST /tokenize``, ``/detokenize``, ``/apply-template``: the model's tokenizer and chat
  template.
- ``POST /slots/{id}?action=save|restore`` with ``{"filename"}``: a slot's KV cache saved to
  (restored from) the snapshot directory as mlx-lm's prompt-cache file (safetensors), whose
  metadata holds the token ids it covers (``0.tokens``: mlx-lm keeps the caller's metadata as
  the first item of its flattened tree).
- ``/infill`` and ``/v1/embeddings``: 501 (an MLX model here generates only).

Requests run with continuous batching (mlx-lm's ``BatchGenerator``): one generation thread
owns the generator and the slots; the HTTP thread (uvicorn, its own event loop) sends it
commands and receives each request's tokens. A slot keeps the KV cache of its last answer, so
a request whose prompt extends it (a conversation's next turn, or a restored snapshot)
prefills only the new tokens. A client that leaves removes its request from the batch at the
next step; the slot keeps the KV state computed so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bunkhouse.worker.engine import EngineLoadError, WorkerConfig

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'bunkhouse[mlx]' (mlx and mlx-lm; on Linux mlx[cpu])"
DEFAULT_MAX_TOKENS = 2048  # a request that sets no limit: at most this, and the slot's room
DEFAULT_TEMPERATURE = 0.8  # llama.cpp's server default: the same request samples alike
READY_TIMEOUT_S = 30.0  # the HTTP server's start on the socket
IDLE_WAIT_S = 0.5  # the generation thread's wait for a command while nothing runs
STATE_TOKENS_KEY = "tokens"  # the prompt-cache file's metadata key of the covered token ids


class Refused(Exception):
    """A request's input refused: a 400 naming ``param`` (llama.cpp's ``Field 'x':`` form,
    which the front's error reading turns into the field)."""

    def __init__(self, param: str | None, message: str, status: int = 400) -> None:
        super().__init__(f"Field '{param}': {message}" if param else message)
        self.param = param
        self.status = status


# -- the generation thread ------------------------------------------------------------------


@dataclass(eq=False)
class Job:
    """One generation: its prompt's token ids and how to sample, and where its events go
    (``emit`` is called on the generation thread: ``("token", id)``, ``("done", reason,
    timings)`` or ``("error", message)``)."""

    prompt: list[int]
    max_tokens: int
    sampler: Any
    processors: list[Any]
    stop_ids: list[int]
    emit: Callable[[tuple[Any, ...]], object]
    slot: int | None = None  # asked for (id_slot); set when it runs
    uid: int | None = None
    reused: int = 0
    inserted: float = 0.0
    first: float | None = None
    generated: int = 0


@dataclass
class Slot:
    id: int
    tokens: list[int] = field(default_factory=list)  # what ``cache`` holds
    cache: list[Any] | None = None
    job: Job | None = None
    used: float = 0.0


def _reseed() -> None:
    import mlx.core as mx

    mx.random.seed(time.time_ns() % (1 << 32))


def timings(job: Job, now: float) -> dict[str, Any]:
    """A job's figures as llama.cpp's server reports them: tokens prefilled and reused,
    tokens generated, and the milliseconds of each (``now``: its end)."""
    first = job.first or now
    return {"cache_n": job.reused, "prompt_n": len(job.prompt) - job.reused,
            "prompt_ms": (first - job.inserted) * 1000, "predicted_n": job.generated,
            "predicted_ms": (now - first) * 1000}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Scheduler:
    """The generation thread: the only owner of the model's batch generator and the slots.
    Other threads talk to it through :meth:`submit`, :meth:`cancel` and :meth:`call`."""

    def __init__(self, model: Any, slots: int, slot_tokens: int, layers: int) -> None:
        from mlx_lm.generate import BatchGenerator

        self._model = model
        self._batch: Any = BatchGenerator(model, completion_batch_size=slots,
                                          prefill_batch_size=slots)
        self.slot_tokens = slot_tokens
        self.layers = layers
        self.slots = [Slot(i) for i in range(slots)]
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._running: dict[int, Job] = {}  # by the generator's uid
        self._waiting: list[Job] = []  # for a slot
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="mlx-generation", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._commands.put(("wake",))
        self._thread.join(10)

    def submit(self, job: Job) -> None:
        self._commands.put(("submit", job))

    def cancel(self, job: Job) -> None:
        self._commands.put(("cancel", job))

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on the generation thread between two steps; its result or error."""
        done: Future[Any] = Future()
        self._commands.put(("call", fn, done))
        return done

    # the thread

    def _loop(self) -> None:
        while not self._stop:
            try:
                command = self._commands.get_nowait() if self._running else \
                    self._commands.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
                command = None
            while command is not None:
                try:
                    self._command(command)
                except Exception:  # the generation thread serves on, whatever one did
                    log.exception("mlx: a command failed")
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self._running:
                self._step()

    def _command(self, command: tuple[Any, ...]) -> None:
        kind = command[0]
        if kind == "submit":
            self._waiting.append(command[1])
            self._admit()
        elif kind == "cancel":
            self._cancel(command[1])
        elif kind == "call":
            fn, done = command[1], command[2]
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn())
                except BaseException as e:  # handed to the caller
                    done.set_exception(e)

    def _admit(self) -> None:
        """Start each waiting job whose slot is free (FIFO)."""
        for job in list(self._waiting):
            slot = self._slot_for(job)
            if slot is None:
                continue
            self._waiting.remove(job)
            try:
                self._insert(job, slot)
            except Exception as e:  # the job's error, the others run on
                log.exception("mlx: a request could not start")
                slot.job = None
                job.emit(("error", f"the engine could not start the request: {e}"))

    def _slot_for(self, job: Job) -> Slot | None:
        if job.slot is not None:
            slot = self.slots[job.slot]
            return slot if slot.job is None else None
        free = [s for s in self.slots if s.job is None]
        if not free:
            return None
        # the slot sharing the longest prefix with the prompt, else the least recently used
        return max(free, key=lambda s: (common_prefix(s.tokens, job.prompt), -s.used))

    def _insert(self, job: Job, slot: Slot) -> None:
        from mlx_lm.generate import StopSequences
        from mlx_lm.models.cache import trim_prompt_cache

        shared = min(common_prefix(slot.tokens, job.prompt), len(job.prompt) - 1)
        cache: Any = None
        if slot.cache is not None and shared > 0:
            trim_prompt_cache(slot.cache, len(slot.tokens) - shared)
            cache = slot.cache
        else:
            shared = 0
        slot.cache, slot.tokens, slot.job = None, [], job
        job.slot, job.reused, job.inserted = slot.id, shared, time.perf_counter()
        (job.uid,) = self._batch.insert(
            [job.prompt[shared:]], [job.max_tokens], caches=[cache],
            all_tokens=[job.prompt[:shared]], samplers=[job.sampler],
            logits_processors=[job.processors],
            stop_sequences=[StopSequences([[t] for t in job.stop_ids] or None)])
        self._running[job.uid] = job

    def _step(self) -> None:
        try:
            _, generated = self._batch.next()
        except Exception as e:  # every running request fails, the worker serves
            log.exception("mlx: a decode step failed")
            _reseed()  # a sampler that raised mid-trace leaves MLX's random state unusable
            for failed in list(self._running.values()):
                self._drop(failed, keep_cache=False)
                failed.emit(("error", f"the engine failed: {e}"))
            self._admit()
            return
        now = time.perf_counter()
        for r in generated:
            job = self._running.get(r.uid)
            if job is None:
                continue
            if job.first is None:
                job.first = now
            if r.finish_reason != "stop":  # a stop token is not part of the answer
                job.generated += 1
                job.emit(("token", r.token))
            if r.finish_reason is not None:
                del self._running[r.uid]
                self._release(job, r.prompt_cache, r.all_tokens)
                job.emit(("done", r.finish_reason, timings(job, now)))
        if len(self._running) < len(self.slots):
            self._admit()

    def _release(self, job: Job, cache: list[Any] | None, tokens: list[int] | None) -> None:
        assert job.slot is not None
        slot = self.slots[job.slot]
        slot.job, slot.used = None, time.monotonic()
        if cache and tokens is not None:
            held = cache[0].offset if hasattr(cache[0], "offset") else len(tokens)
            slot.cache, slot.tokens = cache, list(tokens)[:held]
            if len(slot.tokens) != held:  # not what it says it holds: drop it
                slot.cache, slot.tokens = None, []

    def _drop(self, job: Job, keep_cache: bool) -> None:
        if job.uid is None or job.uid not in self._running:
            return
        del self._running[job.uid]
        caches = self._batch.remove([job.uid], return_prompt_caches=keep_cache)
        cache, tokens = caches.get(job.uid, (None, None)) if keep_cache else (None, None)
        self._release(job, cache, tokens)

    def _cancel(self, job: Job) -> None:
        if job in self._waiting:
            self._waiting.remove(job)
            return
        self._drop(job, keep_cache=True)
        self._admit()

    # slot operations (run through call())

    def slot_states(self) -> list[dict[str, Any]]:
        return [{"id": s.id, "is_processing": s.job is not None,
                 "n_prompt_tokens": len(s.job.prompt) if s.job else len(s.tokens)}
                for s in self.slots]

    def save(self, slot_id: int, path: Path, model_id: str) -> dict[str, Any]:
        from mlx_lm.models.cache import save_prompt_cache

        slot = self._slot(slot_id)
        if slot.job is not None:
            raise Refused("id_slot", f"slot {slot_id} is running a request", 409)
        if slot.cache is None or not slot.tokens:  # an empty record, as llama.cpp saves one
            header = json.dumps({"__metadata__": {f"0.{STATE_TOKENS_KEY}": "[]"}}).encode()
            path.write_bytes(len(header).to_bytes(8, "little") + header)
            return {"id_slot": slot_id, "filename": path.name, "n_saved": 0,
                    "n_written": path.stat().st_size}
        # mlx names a file .safetensors: written under that name, then moved to the one asked
        tmp = path.with_name(f".{path.name}.{os.getpid()}.safetensors")
        try:
            save_prompt_cache(str(tmp), slot.cache, {STATE_TOKENS_KEY: json.dumps(slot.tokens),
                                                     "model": model_id})
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return {"id_slot": slot_id, "filename": path.name, "n_saved": len(slot.tokens),
                "n_written": path.stat().st_size}

    def restore(self, slot_id: int, path: Path) -> dict[str, Any]:
        from mlx_lm.models import cache as caches

        load_prompt_cache: Any = caches.load_prompt_cache

        slot = self._slot(slot_id)
        if slot.job is not None:
            raise Refused("id_slot", f"slot {slot_id} is running a request", 409)
        if not path.is_file():
            raise Refused("filename", f"cannot restore {path.name}: no such snapshot")
        link = path.with_name(f".restore-{os.getpid()}-{secrets.token_hex(4)}.safetensors")
        try:
            link.symlink_to(path.name)
            cache, meta = load_prompt_cache(str(link), return_metadata=True)
            tokens = json.loads(meta[STATE_TOKENS_KEY])
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            raise Refused("filename", f"cannot restore {path.name}: not an MLX prompt "
                          f"cache of this engine ({e})") from e
        finally:
            link.unlink(missing_ok=True)
        ok = (isinstance(tokens, list) and all(type(t) is int for t in tokens)
              and len(cache) == self.layers and tokens
              and getattr(cache[0], "offset", -1) == len(tokens)
              and len(tokens) < self.slot_tokens)
        if not ok:
            raise Refused("filename", f"cannot restore {path.name}: not a snapshot of this "
                          "model that fits its slot")
        slot.cache, slot.tokens = cache, tokens
        return {"id_slot": slot_id, "filename": path.name, "n_restored": len(tokens),
                "n_read": path.stat().st_size}

    def _slot(self, slot_id: int) -> Slot:
        if not 0 <= slot_id < len(self.slots):
            raise Refused("id_slot", f"no slot {slot_id}: the worker has {len(self.slots)}")
        return self.slots[slot_id]


# -- requests ---------------------------------------------------------------------------------


def _int(body: dict[str, Any], name: str, low: int, default: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not int or value < low:
        raise Refused(name, f"must be an integer of at least {low}")
    return value


def _float(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise Refused(name, "must be a number")
    return float(value)


UNSUPPORTED = ("grammar", "json_schema", "response_format", "lora", "logprobs",
               "top_logprobs", "n_probs", "suffix")
"""Request fields the MLX worker does not do: refused naming the field, never ignored
(``logprobs``/``response_format`` only when they ask for something)."""


@dataclass
class Request:
    """A generation request as the worker runs it."""

    chat: bool
    prompt: list[int]
    max_tokens: int
    stop: list[str]
    stream: bool
    usage: bool
    slot: int | None
    sampler: Any
    processors: list[Any]
    stop_ids: list[int]


class Model:
    """The loaded model and tokenizer, and the request rules that need them."""

    def __init__(self, config: WorkerConfig) -> None:
        try:
            import mlx.core  # noqa: F401
            import mlx_lm  # noqa: F401
        except ImportError as e:
            raise EngineLoadError(f"the MLX engine is not installed ({e.name} is missing): "
                                  f"{INSTALL_HINT}") from e
        from mlx_lm.utils import load

        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory; never the hub
        try:
            loaded: Any = load(str(config.model_path), return_config=True)
            self.model, self.tokenizer, self.config = loaded
        except Exception as e:  # whatever mlx-lm says, as the load's reason
            raise EngineLoadError(f"mlx-lm cannot load {config.model_id!r}: "
                                  f"{type(e).__name__}: {e}") from e
        self.id = config.model_id
        self.chat_template: str | None = None  # configured: a .jinja file's text
        if config.chat_template:
            try:
                self.chat_template = Path(config.chat_template).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise EngineLoadError(
                    f"chat_template {config.chat_template!r}: the MLX engine takes a .jinja "
                    f"file's path, not a template name ({e})") from e
        self.vocab = len(self.tokenizer)
        self.eos = sorted(self.tokenizer.eos_token_ids)
        self.slot_tokens = max(1, config.context // max(1, config.parallel))
        self.layers = len(self.model.layers)
        self._byte_decoder = getattr(self.tokenizer.detokenizer, "_byte_decoder", None)

    def template(self, body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Refused("messages", "must be a non-empty array of messages")
        for m in messages:
            if not isinstance(m, dict):
                raise Refused("messages", "each message must be an object")
            if isinstance(m.get("content"), list):  # text parts, joined
                m["content"] = "".join(p.get("text", "") for p in m["content"]
                                       if isinstance(p, dict) and p.get("type") == "text")
        kwargs = body.get("chat_template_kwargs")
        extra = kwargs if isinstance(kwargs, dict) else {}
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        try:
            if self.chat_template is not None:
                extra = {**extra, "chat_template": self.chat_template}
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False,
                add_generation_prompt=body.get("add_generation_prompt", True), **extra)
        except Exception as e:  # the template refused these messages
            raise Refused("messages", f"the chat template failed: {e}") from e
        return str(text)

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True
               ) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special,
                                    split_special_tokens=not parse_special)
        return list(ids)

    def pieces(self, ids: list[int]) -> list[dict[str, Any]]:
        out = []
        for i in ids:
            text = self.tokenizer.decode([i])
            piece: str | list[int] = text
            if "\ufffd" in text and self._byte_decoder is not None:
                try:
                    data = bytes(self._byte_decoder[c]
                                 for c in self.tokenizer.convert_ids_to_tokens(i))
                except (KeyError, TypeError):
                    data = b""
                if data:  # its bytes: text where they are UTF-8 alone, else the integers
                    try:
                        piece = data.decode("utf-8")
                    except UnicodeDecodeError:
                        piece = list(data)
            out.append({"id": i, "piece": piece})
        return out

    def request(self, route: str, body: dict[str, Any]) -> Request:
        """The request as the worker runs it; Refused naming the field it cannot take."""
        for name in UNSUPPORTED:
            value = body.get(name)
            if value not in (None, False, 0, {}, []) and not (
                    name == "response_format" and isinstance(value, dict)
                    and value.get("type") == "text"):
                raise Refused(name, "not supported by the MLX engine")
        n = body.get("n", 1)
        if n != 1:
            raise Refused("n", "the MLX engine answers one choice per request")
        chat = route == "/v1/chat/completions"
        prompt = self._prompt(chat, body)
        limit = None
        for name in ("max_completion_tokens", "max_tokens", "n_predict"):
            value = body.get(name)
            if name == "n_predict" and value == -1:
                continue
            limit = _int(body, name, 1) if value is not None else limit
            if limit is not None:
                break
        max_tokens = min(limit or DEFAULT_MAX_TOKENS, self.slot_tokens - len(prompt))
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise Refused("stop", "must be a string or an array of strings")
        slot = _int(body, "id_slot", -1)
        sampler, processors = self._sampling(body)
        options = body.get("stream_options")
        return Request(chat, prompt, max_tokens, [s for s in stops if s],
                       bool(body.get("stream")),
                       isinstance(options, dict) and bool(options.get("include_usage")),
                       None if slot is None or slot < 0 else slot, sampler, processors,
                       [] if body.get("ignore_eos") else self.eos)

    def _prompt(self, chat: bool, body: dict[str, Any]) -> list[int]:
        if chat:
            prompt = self.encode(self.template(body))
        else:
            raw = body.get("prompt")
            if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
                raw = raw[0]
            if isinstance(raw, str):
                prompt = self.encode(raw)
            elif isinstance(raw, list) and raw and all(type(t) is int for t in raw):
                if any(not 0 <= t < self.vocab for t in raw):
                    raise Refused("prompt", f"invalid token: ids go from 0 to {self.vocab - 1}")
                prompt = list(raw)
            else:
                raise Refused("prompt", "must be a string or an array of token ids")
        if not prompt:
            raise Refused("prompt" if not chat else "messages", "the prompt is empty")
        if len(prompt) >= self.slot_tokens:
            raise Refused("messages" if chat else "prompt",
                          f"the request ({len(prompt)} tokens) exceeds the available context "
                          f"size ({self.slot_tokens} tokens per slot)")
        return prompt

    def _sampling(self, body: dict[str, Any]) -> tuple[Any, list[Any]]:
        """The request's sampler and logits processors (mlx-lm's), every value checked here:
        mlx-lm checks some only when its compiled sampler first runs, in the batch's decode
        step, where a failure would end every request of the batch (and leave MLX's random
        state broken for the next ones)."""
        from mlx_lm.sample_utils import make_logits_processors

        temperature = _float(body, "temperature", DEFAULT_TEMPERATURE)
        top_p = _float(body, "top_p", 1.0)
        top_k = _int(body, "top_k", 0, 0) or 0
        min_p = _float(body, "min_p", 0.0)
        if temperature < 0:
            raise Refused("temperature", "must be at least 0")
        if not 0 < top_p <= 1:
            raise Refused("top_p", "must be above 0 and at most 1")
        if not 0 <= min_p <= 1:
            raise Refused("min_p", "must be from 0 to 1")
        bias = body.get("logit_bias")
        logit_bias = None
        if isinstance(bias, dict) and bias:
            try:
                logit_bias = {int(k): float(v) for k, v in bias.items()}
            except (TypeError, ValueError) as e:
                raise Refused("logit_bias", "must map token ids to numbers") from e
            if any(not 0 <= k < self.vocab for k in logit_bias):
                raise Refused("logit_bias", f"token ids go from 0 to {self.vocab - 1}")
        repeat = _float(body, "repeat_penalty", _float(body, "repetition_penalty", 1.0))
        if repeat < 0:
            raise Refused("repeat_penalty", "must be at least 0")
        presence = _float(body, "presence_penalty", 0.0)
        frequency = _float(body, "frequency_penalty", 0.0)
        processors = make_logits_processors(
            logit_bias=logit_bias, repetition_penalty=repeat if repeat != 1 else None,
            presence_penalty=presence or None, frequency_penalty=frequency or None)
        # a top_k past the vocabulary keeps every token, as llama.cpp reads it
        sampler = make_sampler(temperature, top_p if top_p < 1 else 0.0, min_p,
                               top_k if top_k < self.vocab else 0, _int(body, "seed", 0))
        return sampler, processors


def make_sampler(temp: float, top_p: float, min_p: float, top_k: int,
                 seed: int | None) -> Any:
    """mlx-lm's sampler chain (top-p, min-p, top-k, then a categorical draw at ``temp``;
    greedy at 0), drawing from a key of the request's own when it gives a ``seed``: MLX's
    global random state is shared by every request of the batch, so a seed set there would
    not make one request's answer repeatable."""
    import mlx.core as mx
    from mlx_lm import sample_utils as su

    if seed is None or temp == 0:
        return su.make_sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)
    filters: list[Callable[[Any], Any]] = []
    if 0 < top_p < 1:
        filters.append(lambda x: su.apply_top_p(x, top_p))
    if min_p:
        filters.append(lambda x: su.apply_min_p(x, min_p, 1))
    if top_k > 0:
        filters.append(lambda x: su.apply_top_k(x, top_k))
    key = [mx.random.key(seed)]

    def sample(logprobs: Any) -> Any:
        for f in filters:
            logprobs = f(logprobs)
        key[0], draw = mx.random.split(key[0])
        return mx.random.categorical(logprobs * (1 / temp), key=draw)

    return sample


class TextOut:
    """A request's text as its tokens come, exactly the tokenizer's decoding of them all
    (mlx-lm's streaming detokenizers drop the answer's leading space). Each token's text is
    the difference of two decodings from the last settled point, so that a token completing
    a UTF-8 sequence or a word's space comes out whole, as vLLM and transformers' streamers
    do. Stop strings cut it, and text that could be the start of one is held back until it
    cannot."""

    def __init__(self, model: Model, stops: list[str]) -> None:
        self._decode: Callable[[list[int]], str] = model.tokenizer.decode
        self._ids: list[int] = []
        self._prefix = 0  # the window decoded starts here...
        self._read = 0  # ...and its text up to here was sent
        self._stops = stops
        self._held = ""
        self.stopped = False

    def add(self, token: int) -> str:
        self._ids.append(token)
        return self._text(self._delta(final=False))

    def finish(self) -> str:
        text = self._text(self._delta(final=True))
        if not self.stopped:
            text, self._held = text + self._held, ""
        return text

    def _delta(self, final: bool) -> str:
        sent = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        if len(now) <= len(sent) or (now.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(sent):]

    def _text(self, new: str) -> str:
        if self.stopped:
            return ""
        text = self._held + new
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0:
                self.stopped, self._held = True, ""
                return text[:at]
        keep = max((k for s in self._stops for k in range(1, len(s))
                    if text.endswith(s[:k])), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]


# -- the HTTP side --------------------------------------------------------------------------


def _error(status: int, message: str, type_: str = "invalid_request_error") -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"code": status, "message": message, "type": type_}},
                        status_code=status)


def _event(value: Any) -> bytes:
    return b"data: " + json.dumps(value, separators=(",", ":"),
                                  ensure_ascii=False).encode() + b"\n\n"


class Api:
    """The worker API's routes over a :class:`Model` and its :class:`Scheduler`."""

    def __init__(self, model: Model, scheduler: Scheduler, snapshot_dir: Path | None) -> None:
        self.model = model
        self.scheduler = scheduler
        self.snapshot_dir = snapshot_dir

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/slots", self.slots, methods=["GET"]),
            Route("/slots/{slot:int}", self.slot_action, methods=["POST"]),
            Route("/v1/chat/completions", self.generate, methods=["POST"]),
            Route("/v1/completions", self.generate, methods=["POST"]),
            Route("/completion", self.generate, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/apply-template", self.apply_template, methods=["POST"]),
            Route("/lora-adapters", self.adapters, methods=["GET"]),
            Route("/infill", self.not_supported, methods=["POST"]),
            Route("/v1/embeddings", self.not_supported, methods=["POST"]),
        ])

    async def _body(self, request: Any) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            raise Refused(None, f"the body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise Refused(None, "the body must be a JSON object")
        return body

    async def _on_thread(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.scheduler.call(fn))

    async def health(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok"})

    async def slots(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse(await self._on_thread(self.scheduler.slot_states))

    async def adapters(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse([])

    async def not_supported(self, request: Any) -> Any:
        return _error(501, "the MLX engine does not serve this (no fill-in-the-middle or "
                      "embeddings)", "not_supported_error")

    async def slot_action(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            body = await self._body(request)
            name = body.get("filename")
            if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
                raise Refused("filename", "must be a plain file name")
            if self.snapshot_dir is None:
                return _error(501, "no snapshot directory: slots are not saved",
                              "not_supported_error")
            path = self.snapshot_dir / name
            slot, action = request.path_params["slot"], request.query_params.get("action")
            if action == "save":
                reply = await self._on_thread(lambda: self.scheduler.save(slot, path,
                                                                          self.model.id))
            elif action == "restore":
                reply = await self._on_thread(lambda: self.scheduler.restore(slot, path))
            else:
                raise Refused("action", "must be save or restore")
        except Refused as e:
            return _error(e.status, str(e))
        return JSONResponse(reply)

    async def tokenize(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            body = await self._body(request)
            content = body.get("content")
            if not isinstance(content, str):
                raise Refused("content", "must be a string")
            ids = self.model.encode(content, bool(body.get("add_special", False)),
                                    bool(body.get("parse_special", True)))
        except Refused as e:
            return _error(e.status, str(e))
        if body.get("with_pieces"):
            return JSONResponse({"tokens": self.model.pieces(ids)})
        return JSONResponse({"tokens": ids})

    async def detokenize(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            body = await self._body(request)
            ids = body.get("tokens")
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise Refused("tokens", "must be an array of token ids")
            if any(not 0 <= t < self.model.vocab for t in ids):
                raise Refused("tokens", f"invalid token: ids go from 0 to "
                              f"{self.model.vocab - 1}")
        except Refused as e:
            return _error(e.status, str(e))
        return JSONResponse({"content": self.model.tokenizer.decode(ids)})

    async def apply_template(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            body = await self._body(request)
            text = self.model.template(body)
        except Refused as e:
            return _error(e.status, str(e))
        return JSONResponse({"prompt": text})

    async def generate(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        route = "/v1/completions" if request.url.path == "/completion" else request.url.path
        try:
            body = await self._body(request)
            req = self.model.request(route, body)
        except Refused as e:
            return _error(e.status, str(e))
        except (ValueError, TypeError) as e:  # mlx-lm refused a value it checks itself
            return _error(400, f"the request cannot be run: {e}")
        if req.slot is not None and req.slot >= len(self.scheduler.slots):
            return _error(400, f"Field 'id_slot': no slot {req.slot}")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        job = Job(req.prompt, req.max_tokens, req.sampler, req.processors, req.stop_ids,
                  _emitter(loop, events), req.slot)
        answer = _Answer(self, route, req, body, job, events)
        if req.stream:
            return StreamingResponse(answer.stream(), media_type="text/event-stream")
        whole = asyncio.ensure_future(answer.whole())
        left = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({whole, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not whole.done():
                whole.cancel()
                self.scheduler.cancel(job)
        if whole.cancelled():
            return _error(499, "the client left")
        status, value = whole.result()
        return JSONResponse(value, status_code=status)


def _emitter(loop: asyncio.AbstractEventLoop, events: asyncio.Queue[tuple[Any, ...]]
             ) -> Callable[[tuple[Any, ...]], None]:
    """A job's ``emit``: its events onto the request's queue, from the generation thread (a
    loop closed meanwhile, the worker stopping, drops them)."""
    def emit(event: tuple[Any, ...]) -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(events.put_nowait, event)
    return emit


async def _disconnected(request: Any) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Answer:
    """One request's answer, built from its job's events (a chunk per token, or whole)."""

    def __init__(self, api: Api, route: str, req: Request, body: dict[str, Any], job: Job,
                 events: asyncio.Queue[tuple[Any, ...]]) -> None:
        self.api, self.req, self.job, self.events = api, req, job, events
        self.chat = route == "/v1/chat/completions"
        self.text = TextOut(api.model, req.stop)
        self.created = int(time.time())
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        self.head = {"created": self.created, "id": prefix + secrets.token_hex(12),
                     "model": str(body.get("model") or api.model.id),
                     "system_fingerprint": "mlx",
                     "object": "chat.completion.chunk" if self.chat else "text_completion"}

    def _choice(self, text: str | None, finish: str | None, role: bool = False
                ) -> dict[str, Any]:
        if not self.chat:
            return {"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}
        delta: dict[str, Any] = {"role": "assistant", "content": None} if role else \
            {"content": text} if text is not None else {}
        return {"finish_reason": finish, "index": 0, "delta": delta}

    async def _tokens(self) -> AsyncIterator[tuple[str, Any]]:
        """("text", piece) as tokens come, then ("done", (reason, timings)) or ("error",
        message). A stop string found ends the job at once."""
        while True:
            event = await self.events.get()
            if event[0] == "token":
                piece = self.text.add(event[1])
                if piece:
                    yield "text", piece
                if self.text.stopped:
                    self.api.scheduler.cancel(self.job)
                    yield "done", ("stop", timings(self.job, time.perf_counter()))
                    return
            elif event[0] == "done":
                tail = self.text.finish()
                if tail:
                    yield "text", tail
                yield "done", ("stop" if self.text.stopped else event[1], event[2])
                return
            else:
                yield "error", event[1]
                return

    def _usage(self, timings: dict[str, Any]) -> dict[str, Any]:
        prompt = len(self.job.prompt)
        return {"completion_tokens": timings["predicted_n"], "prompt_tokens": prompt,
                "total_tokens": prompt + timings["predicted_n"],
                "prompt_tokens_details": {"cached_tokens": timings["cache_n"]}}

    async def stream(self) -> AsyncIterator[bytes]:
        finished = False
        self.api.scheduler.submit(self.job)  # here: a stream never started runs no job
        try:
            if self.chat:
                yield _event({"choices": [self._choice(None, None, role=True)], **self.head})
            async for kind, value in self._tokens():
                if kind == "text":
                    yield _event({"choices": [self._choice(value, None)], **self.head})
                elif kind == "error":
                    finished = True
                    yield _event({"error": {"code": 500, "message": value,
                                            "type": "server_error"}})
                    return
                else:
                    finished = True
                    reason, timings = value
                    yield _event({"choices": [self._choice(None if self.chat else "", reason)],
                                  **self.head, "timings": timings})
                    if self.req.usage:
                        yield _event({"choices": [], **self.head,
                                      "usage": self._usage(timings), "timings": timings})
                    yield b"data: [DONE]\n\n"
        finally:
            if not finished:  # the client left: its request leaves the batch
                self.api.scheduler.cancel(self.job)

    async def whole(self) -> tuple[int, dict[str, Any]]:
        self.api.scheduler.submit(self.job)
        parts: list[str] = []
        async for kind, value in self._tokens():
            if kind == "text":
                parts.append(value)
            elif kind == "error":
                return 500, {"error": {"code": 500, "message": value, "type": "server_error"}}
            else:
                reason, timings = value
                text = "".join(parts)
                choice: dict[str, Any] = {"finish_reason": reason, "index": 0}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice.update(text=text, logprobs=None)
                obj = "chat.completion" if self.chat else "text_completion"
                return 200, {"choices": [choice], **self.head, "object": obj,
                             "usage": self._usage(timings), "timings": timings}
        return 500, {"error": {"code": 500, "message": "no answer", "type": "server_error"}}


# -- the engine -------------------------------------------------------------------------------


class MlxEngine:
    """The worker's engine (worker/engine.py): loads the model with mlx-lm, starts the
    generation thread and serves the worker API on ``config.socket`` with uvicorn."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self._scheduler: Scheduler | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        model = Model(self.config)
        import uvicorn

        scheduler = Scheduler(model.model, max(1, self.config.parallel), model.slot_tokens,
                              model.layers)
        scheduler.start()
        self._scheduler = scheduler
        api = Api(model, scheduler, self.config.snapshot_dir)
        server = uvicorn.Server(uvicorn.Config(
            api.app(), uds=str(self.config.socket), log_level="warning", lifespan="off",
            access_log=False, loop="asyncio", http="h11", timeout_graceful_shutdown=1,
            backlog=1024))
        self._server = server
        self._thread = threading.Thread(target=server.run, name="mlx-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise EngineLoadError("the MLX worker's HTTP server did not start on "
                                      f"{self.config.socket}")
            time.sleep(0.02)
        log.info("model %s: mlx-lm, %d slot(s) of %d tokens, continuous batching",
                 self.config.model_id, len(scheduler.slots), model.slot_tokens)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(5)
        if self._scheduler is not None:
            with contextlib.suppress(Exception):
                self._scheduler.stop()
