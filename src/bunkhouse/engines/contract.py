"""The worker contract: what the front, the supervisor and residency may ask of a worker.

Each engine has one adapter (:class:`EngineAdapter`) that knows its worker's API, its options
and its memory need; nothing outside an adapter names an engine endpoint or constant. A ready
worker is reached through an :class:`EngineClient`, made by its adapter over a transport (a
Unix socket for a local worker; another transport would place it elsewhere).

Errors: every client operation raises :class:`bunkhouse.errors.EngineUnavailable` when the
worker cannot be reached or does not answer in shape, and :class:`EngineRefused` when the
engine refuses the input (a 4xx to the caller, naming the field when it can).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from bunkhouse.errors import InvalidRequest
from bunkhouse.gguf.meta import GGUFInfo

Messages = list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """A worker's worst-case memory, bytes, by part (an engine's estimator fills them)."""

    weights: int  # the model file, memory-mapped, all of it touched
    kv_cache: int  # allocated and cleared at load: resident from the start
    prompt_cache: int  # the engine's RAM prompt cache limit, counted in full
    runtime: int  # the interpreter, the engine library, its threads
    compute: int  # compute buffers at their largest graph
    outputs: int  # output buffers at their largest batch (embeddings: one row per token)

    @property
    def total(self) -> int:
        return (self.weights + self.kv_cache + self.prompt_cache + self.runtime + self.compute
                + self.outputs)


@dataclass(frozen=True, slots=True)
class ConstraintCheck:
    """One part of a request that the engine prepares before its first token (a grammar, a
    JSON schema, the tools' schemas, sampler lists), as a request of its own to measure in a
    disposable process: a one-word prompt, two tokens, and only this part.

    ``param``: the field a refusal names; ``route``: ``"chat"`` or ``"completion"``, how the
    probe runs ``body`` (worker/engines/llamacpp_probe.py)."""

    param: str
    route: str
    body: dict[str, Any]


class EngineRefused(InvalidRequest):
    """The engine refused a request's input (a 400 ``invalid_request``, ``param`` the field
    it was about when known)."""


@dataclass(frozen=True, slots=True)
class Timings:
    """An engine's own figures of one answer: prompt tokens it computed (prefill) and reused
    from its KV cache, tokens it generated (decode), and the milliseconds each took (None:
    not reported)."""

    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    prompt_ms: float | None = None
    generated_ms: float | None = None
    drafted_tokens: int = 0  # speculative decoding: tokens drafted for the target to verify
    accepted_tokens: int = 0  # ...and those it accepted (each saved one decode step)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an engine does for a model: the front asks these, never the engine's type."""

    generates: bool  # chat and text completions
    embeds: bool  # /v1/embeddings
    infills: bool  # fill-in-the-middle (/infill, a completion's ``suffix``)
    transcribes: bool  # /v1/audio/transcriptions
    saves_kv: bool  # a slot's KV state saved to a file and restored (kvcache/)
    adapters: bool = False  # LoRA adapters mounted with the model, chosen per request
    logprobs: bool = True  # an answer carries a log-probability for each token when asked


@dataclass(frozen=True, slots=True)
class Adapter:
    """A LoRA adapter mounted with its base model's worker: the adapter's model id, its file,
    the file's bytes (its tensors, counted in the base's memory estimate) and the scale a
    request for it runs at (every other adapter of the worker runs at 0)."""

    id: str
    path: Path
    bytes: int
    scale: float = 1.0


@dataclass(frozen=True, slots=True)
class Draft:
    """A draft model for speculative decoding, run in its target's worker: the name it was
    configured by (a model id or a path), its file, the file's bytes and metadata (its
    weights, KV cache and compute buffers count in the target's memory estimate)."""

    name: str
    path: Path
    bytes: int
    info: GGUFInfo
    mtime_ns: int = 0  # the file's modification time when it was checked (a load checks it)


@dataclass(frozen=True, slots=True)
class WorkerSpawn:
    """One start of a model's worker, as an engine whose worker is its own program puts it
    on its command line: the model's id, the path it opens (``/proc/self/fd/N``: the
    descriptor the front opened and checked, inherited), the Unix socket it listens on, and
    where it saves and restores slots' KV state (None: nowhere)."""

    model_id: str
    model_path: str
    socket: Path
    snapshot_dir: Path | None = None


@dataclass(frozen=True, slots=True)
class TokenPiece:
    """One token of a tokenized text and its text (``piece``: a string, or its bytes as
    integers when they are not valid UTF-8 on their own)."""

    id: int
    piece: str | list[int]


GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
"""The OpenAI routes :meth:`EngineClient.generate` serves (its ``route``)."""


@dataclass(frozen=True, slots=True)
class SlotState:
    """One slot of a worker: its id, whether it is running a request, and how many tokens of
    context it holds (its KV cache's use; 0 when unknown)."""

    id: int
    busy: bool
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class SlotSnapshot:
    """A slot's KV state saved to (or restored from) a file: how many tokens it covers and
    its size in bytes."""

    slot_id: int
    filename: str
    tokens: int
    bytes: int


class EngineClient(Protocol):
    """One ready worker, as the front and residency see it. An operation a model's engine
    does not do (see :meth:`EngineAdapter.capabilities`) raises InvalidRequest naming
    ``model``."""

    async def health(self, timeout_s: float) -> bool:
        """Whether the worker answers at all (it may still be loading: False)."""

    async def probe(self, timeout_s: float) -> bool:
        """Liveness: whether the engine's scheduling loop answers within ``timeout_s``
        (a worker whose HTTP thread answers while its engine hangs must fail this)."""

    async def count_tokens(self, prompt: str | Messages) -> int:
        """Tokens of a raw prompt (special tokens included), or of chat ``messages`` once the
        model's chat template is applied."""

    async def tokenize(self, prompt: str | Messages | dict[str, Any]) -> list[int]:
        """The token ids the engine prefills for a raw prompt, chat ``messages``, or a whole
        chat request (the adapter templates the fields its template reads: messages, tools,
        template options)."""

    async def token_pieces(self, text: str, *, add_special: bool,
                           parse_special: bool) -> list[TokenPiece]:
        """``text``'s tokens with their text; ``add_special``: the tokens the model puts
        before a prompt (BOS); ``parse_special``: special tokens written as text are
        parsed as themselves."""

    async def detokenize(self, tokens: list[int]) -> str:
        """The text of token ids (ids past the vocabulary are the caller's to refuse)."""

    async def apply_template(self, chat: dict[str, Any]) -> str:
        """The prompt a chat request (its messages, tools, template options) becomes under
        the model's chat template."""

    async def generate(self, route: str, body: dict[str, Any] | bytes,
                       slot: int | None = None) -> httpx.Response:
        """Start an OpenAI-shaped generation (``route`` one of :data:`GENERATION_ROUTES`)
        with a JSON body (bytes: sent as they are); ``slot``: the slot it runs in (the front
        chose it: its KV state was restored there), else the engine picks. Returns the open
        upstream response, whose body the caller streams and closes. An error answer is
        returned as it is: turn it into the caller's error with :meth:`error`."""

    async def infill(self, body: dict[str, Any] | bytes,
                     slot: int | None = None) -> httpx.Response:
        """Fill in the middle: ``body`` has ``input_prefix``, ``input_suffix`` and optional
        ``prompt``, ``input_extra`` (files as context) and sampling fields; answered as a
        text completion (``content``), streamed when ``stream`` is set. As
        :meth:`generate` otherwise."""

    def error(self, status: int, body: bytes, route: str) -> tuple[int, dict[str, Any]]:
        """An error answer from :meth:`generate` as (status, OpenAI error object): a refusal
        of the input is a 400 ``invalid_request`` naming its field."""

    def timings(self, event: dict[str, Any]) -> Timings | None:
        """The engine's figures of an answer, from its whole answer or the stream event that
        carries them; None for any other."""

    timings_mark: bytes
    """Bytes every line of a streamed answer that carries the engine's figures holds (a
    relay splits its reads into lines only where they hold it); ``b""``: no line does."""

    def timings_line(self, line: str) -> Timings | None:
        """As :meth:`timings`, from one raw line of a streamed answer (None for a line that
        carries none)."""

    async def transcribe(self, audio: AsyncIterator[bytes], size: int,
                         options: dict[str, Any]) -> httpx.Response:
        """Send ``size`` bytes of an audio upload; the open NDJSON answer (the caller reads
        and closes it). A refusal of the file is EngineRefused (not audio) or
        RequestTooLarge (too long), naming ``file``."""

    async def slots(self) -> list[SlotState]:
        """Every slot's state."""

    async def save_slot(self, slot_id: int, filename: str) -> SlotSnapshot:
        """Save a slot's KV state to ``filename`` in the worker's snapshot directory."""

    async def restore_slot(self, slot_id: int, filename: str) -> SlotSnapshot:
        """Load a slot's KV state from ``filename`` in the worker's snapshot directory."""

    async def adapter_fields(self, adapters: tuple[Adapter, ...],
                             chosen: Adapter | None) -> dict[str, Any]:
        """The request fields that run a generation with exactly ``chosen`` (None: the base
        alone) at its scale and every other adapter of the worker at 0, set explicitly.
        WorkerLoadFailed (503) naming the adapter when the worker could not mount its file
        (the base and its other adapters serve on)."""

    async def prime_slot(self, slot_id: int, fields: dict[str, Any], token: int) -> None:
        """Run one token in the slot with ``fields`` (:meth:`adapter_fields`), so that the
        engine's slot runs under that adapter setting before KV state is restored into it:
        an engine that drops a slot's KV when the setting changes then drops it now, not
        after the restore."""

    async def aclose(self) -> None:
        """Close every connection to the worker: streams running end at once."""


class EngineAdapter(Protocol):
    """One engine: how its workers are started, reached and sized."""

    name: str
    """The ``engine`` key's value in the config file."""

    worker_engine: str
    """The worker-side engine class, ``module:Class`` (loaded inside the worker process);
    "" for an engine whose worker is its own program (:meth:`command`; no spare worker)."""

    def worker_args(self, model: ServedModel) -> list[str]:
        """The worker command line's engine options for ``model``."""

    def command(self, model: ServedModel, spawn: WorkerSpawn) -> list[str] | None:
        """The whole command line of a worker that is the engine's own program (no Python
        in it: the supervisor starts it with the parent-death signal armed, so that it dies
        with the front); None: the worker is ``python -m bunkhouse.worker`` running
        :attr:`worker_engine`. Raises WorkerLoadFailed when the program cannot be run."""

    ready_line: str | None
    """A line of the worker's output that says it serves (its health is checked at once);
    None: bunkhouse's own worker's (worker/main.py ``READY_LINE``)."""

    def estimate(self, model: ServedModel) -> MemoryEstimate:
        """The worker's worst case: every buffer it can grow to under ``model``'s options."""

    def client(self, transport: httpx.AsyncBaseTransport, model_id: str) -> EngineClient:
        """A client for ``model_id``'s worker, reached over ``transport``."""

    def capabilities(self, model: ServedModel) -> Capabilities:
        """What this engine does for ``model``."""

    def pinnable(self, route: str, body: dict[str, Any]) -> bool:
        """Whether a request runs in exactly one slot the front may choose (and so restore
        KV state into): one prompt, one answer, no slot asked for by the client."""

    def shown_options(self, model: ServedModel) -> dict[str, Any]:
        """The engine's own options of ``model`` as its worker runs them (defaults and
        derived values filled in: a speculative kind, its draft bounds), for the model object
        and ``bunkhouse models``."""

    def draft_name(self, model: ServedModel) -> str | None:
        """The draft model ``model``'s options name (a model id or a GGUF path), which the
        catalog resolves into its :attr:`ServedModel.draft`; None: none."""

    def refused(self, model: ServedModel) -> str | None:
        """Why ``model`` cannot be served under its options, naming the option (a draft of
        another vocabulary, a head the engine lacks); None: it can. Checked from the files'
        metadata before any load."""

    def adapters_refused(self, model: ServedModel) -> str | None:
        """Why ``model`` cannot mount LoRA adapters under its options (what to change, where
        something can); None: it can."""

    def check_request(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """Refuse (InvalidRequest naming the field) an engine option given wrongly or past
        what the engine holds (an integer past its width); return ``body`` as the engine
        takes it (a value the engine holds in fewer bits folded into them, as documented)."""

    def constraint_checks(self, path: str, body: dict[str, Any]) -> list[ConstraintCheck]:
        """The parts of the worker-bound ``body`` for ``path`` whose cost is measured before
        a shared worker meets them (front/constraints.py); empty: nothing to measure."""

    probe_module: str | None
    """The module run as ``python -m`` to measure constraints on a model (None: none)."""

    def forwarded_fields(self) -> frozenset[str]:
        """Request fields beyond OpenAI's that this engine reads (passed through)."""

    def embedding_limit(self, model: ServedModel) -> int:
        """The longest embeddings input in tokens (0: ``model`` serves no embeddings)."""

    def kv_cache_bytes(self, model: ServedModel, tokens: int) -> int:
        """The KV cache ``tokens`` tokens of one sequence take, bytes."""

    def slot_tokens(self, tokens: int) -> int:
        """The context of a slot asked to hold ``tokens`` tokens, as the engine allocates it:
        at most ``tokens`` where the engine can (an engine that allocates whole blocks gets
        whole blocks, its smallest slot at least), so that a slot holds what the front checks
        requests against."""

    @property
    def build(self) -> str:
        """The engine and its build: a slot saved by another build is never restored."""

    known_options: frozenset[str]
    """The config keys of this engine's own options (a model's ``engine_keys``)."""

    def options(self, raw: Mapping[str, Any], where: str) -> object:
        """``raw`` options of this engine (keys of :attr:`known_options`) as the adapter's own
        frozen dataclass, defaults filled in; ConfigError naming the key (``where`` first) for
        an unknown key or a wrong value."""

    def snapshot_layout(self, model: ServedModel) -> dict[str, Any] | None:
        """What a saved slot's KV state depends on beyond the model file and the build (cache
        types, a slot's context, sliding-window settings); None: this engine cannot save and
        restore slots."""

    def restore_hint(self, model: ServedModel) -> str:
        """What to change in ``model``'s options so that a restored slot's KV state is reused
        in full, for the log line of one that was not ("" : nothing)."""

    def saved_tokens(self, path: Path) -> list[int]:
        """The token ids a slot file saved by this engine covers; ValueError for a file that
        is not one."""


# -- the model an adapter serves -------------------------------------------------------------


class ServedOptions(Protocol):
    """How a model is served, as its adapter reads it (``config.EngineOptions`` is one)."""

    @property
    def context(self) -> int:
        """Total context in tokens, shared by the slots."""

    @property
    def parallel(self) -> int:
        """Slots: requests decoded at once."""

    @property
    def engine_keys(self) -> tuple[tuple[str, Any], ...]:
        """The engine's own options as configured (its adapter's :meth:`EngineAdapter.options`
        checked them when the model was catalogued)."""


class ServedModel(Protocol):
    """A model as an engine adapter sees it (the catalog's ``CatalogModel`` is one): what it
    reads to start, size and describe a worker, wherever the model was found."""

    @property
    def engine(self) -> str:
        """The name of the adapter that serves it (:attr:`EngineAdapter.name`)."""

    @property
    def info(self) -> GGUFInfo:
        """The model file's metadata."""

    @property
    def options(self) -> ServedOptions:
        """How it is served: its slots and its engine's own options."""

    @property
    def embeddings(self) -> bool:
        """Whether it serves embeddings."""

    @property
    def chat_template(self) -> str | None:
        """A configured chat template: a name the engine knows, or a file's path."""

    @property
    def size_bytes(self) -> int:
        """Its files' bytes together."""

    @property
    def adapters(self) -> tuple[Adapter, ...]:
        """The LoRA adapters mounted with it (each also served as a model id of its own)."""

    @property
    def draft(self) -> Draft | None:
        """The draft model its options name, resolved by the catalog (None: none, or not
        found: :meth:`EngineAdapter.refused` says so)."""

    @property
    def path(self) -> Path:
        """Its (first) file."""
