"""Admission: who may run now, who waits, who is turned away.

- :class:`SlotGate` (residency/slots.py), one per model, owned by its residency entry: as
  many requests run as the worker has slots; at most ``queue`` more wait; past that, 429
  ``queue_full``.
- :class:`ComputeGate`, one per host: on a CPU host two workers decoding at once
  oversubscribe the cores and both collapse (DESIGN.md "Compute contention"), so one model
  computes at a time. The model holding the gate keeps admitting its own requests (they batch
  in its slots) until another model asks and its turn is at least ``batch_window_s`` old;
  then its new requests wait, its running ones finish, and the gate passes to the waiting
  model in arrival order, with all of its waiting requests. The window lets requests that
  arrive together batch together instead of being split across turns.
- :func:`refuse_before_load`: a request whose prompt is *certainly* too long for one slot
  (a lower bound on its tokens from the model's vocabulary, catalog/vocab.py), or that has
  more prompts than the model has slots, gets 400 before its model is loaded, so it never
  waits for a load or evicts other models.
- :func:`check_fits`: a request whose prompt plus ``max_tokens`` can never fit one slot gets
  400 before any generation (exact, counted by the worker when a byte bound cannot decide).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from bunkhouse.api.schemas import text_bytes
from bunkhouse.catalog import CatalogModel
from bunkhouse.catalog.vocab import PairTable, pair_table
from bunkhouse.defaults import LARGE_INPUT_BYTES
from bunkhouse.engines import ENGINES, engine_for
from bunkhouse.engines.contract import EngineClient, Messages
from bunkhouse.errors import ContextLengthExceeded, GGUFError, InvalidRequest

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from bunkhouse.kvcache.keeper import SnapshotKeeper
    from bunkhouse.residency.manager import Lease
    from bunkhouse.residency.slots import Slot


class _Turn:
    """One model's place in the compute gate's line: released to all its waiters at once."""

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future = future
        self.waiting = 0  # requests of the model awaiting this turn, cancelled ones not counted


class Held:
    """What a request holds (its lease, then its slot and compute turn), released once, in
    reverse order."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self._releases: list[Callable[[], None]] = [lease.release]

    def push(self, release: Callable[[], None]) -> None:
        self._releases.append(release)

    def close(self) -> None:
        while self._releases:
            self._releases.pop()()


@dataclasses.dataclass
class Admitted:
    """A request let in (front/pipeline.py): what it holds and what its sending needs."""

    held: Held
    engine: EngineClient
    data: dict[str, Any]  # the body to send, its max_tokens lowered to the room left
    tokens: list[int] | None = None  # its prompt's tokens, when KV snapshots needed them
    prompt_tokens: int | None = None  # their count, when its protocol shows it first
    slot: Slot | None = None
    keeper: SnapshotKeeper | None = None  # KV snapshots, when on for its model
    pinned: bool = False  # it runs in ``slot``, chosen by the front
    # on a worker with adapters: the fields that choose its adapter, and that setting
    # (residency/slots.py Slot.setting); None: the worker mounts none
    adapter_fields: dict[str, Any] | None = None
    setting: str = ""
    constrained: bool = False  # it carries a constraint (front/constraints.py)

    @property
    def lease(self) -> Lease:
        return self.held.lease

    def close(self) -> None:
        """Give back everything it holds (again is harmless)."""
        self.held.close()


async def drop_admission(task: asyncio.Future[Any]) -> None:
    """Cancel an admission nobody will use (its client left), giving back what it holds
    (an :class:`Admitted` or a :class:`Held`) if it was admitted before the cancel landed."""
    task.cancel()
    results = await asyncio.gather(task, return_exceptions=True)
    if isinstance(results[0], Admitted | Held):
        results[0].close()


class ComputeGate:
    """One model computes at a time; the others wait their turn (FIFO by model).

    With ``turn_s`` set (and ``suspend``/``resume`` given), a turn is also a time slice: once
    the owner has held the gate for ``turn_s`` while another model waits, its worker is
    suspended (``suspend(model_id)``: SIGSTOP, its generations frozen mid-token with their KV
    cache in place) and the gate passes on; the suspended model joins the end of the line and
    ``resume(model_id)`` (SIGCONT) continues it when its turn comes back. So a short request
    to one model waits at most about ``turn_s`` behind another model's long generation, and
    still no two models compute at once. A suspended model whose every request ended (its
    clients left) is resumed at once, so a worker is never left stopped with nothing to do.

    A waiter cancelled at any moment (before or after its turn came) leaves the gate as if it
    had never asked: a turn whose every waiter is gone is dropped, or passed on at once if it
    had already come, so the gate is never left with an owner that nobody will hand over.
    """

    def __init__(self, enabled: bool = True, batch_window_s: float = 0.25,
                 turn_s: float = 0.0, suspend: Callable[[str], None] | None = None,
                 resume: Callable[[str], None] | None = None) -> None:
        self.enabled = enabled
        self.batch_window_s = batch_window_s
        self.turn_s = turn_s if suspend is not None and resume is not None else 0.0
        self._suspend = suspend or (lambda _model_id: None)
        self._resume = resume or (lambda _model_id: None)
        self.owner: str | None = None
        self._active: dict[str, int] = {}  # requests inside the gate, by model
        self.suspended: set[str] = set()  # models whose worker is stopped (each has requests)
        self._turn_started = 0.0
        self._turns: collections.OrderedDict[str, _Turn] = collections.OrderedDict()
        self._timer: asyncio.TimerHandle | None = None
        self.waits = 0  # requests that waited for another model's turn to end
        self.wait_s = 0.0  # the seconds they waited, all together
        self.preemptions = 0  # turns ended by their time slice, a model suspended

    @property
    def active(self) -> int:
        """Requests inside the gate (computing, or suspended with their model)."""
        return sum(self._active.values())

    async def enter(self, model_id: str) -> None:
        if not self.enabled:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self.owner is None:
            self.owner, self._turn_started = model_id, now
        if self.owner == model_id and (
                not self._turns or now - self._turn_started < self.batch_window_s):
            self._active[model_id] = self._active.get(model_id, 0) + 1
            return
        turn = self._turns.get(model_id)
        if turn is None:
            turn = self._turns[model_id] = _Turn(loop.create_future())
        turn.waiting += 1
        self.waits += 1
        self._arm()
        try:
            await asyncio.shield(turn.future)
        except asyncio.CancelledError:
            turn.waiting -= 1
            self._abandoned(model_id, turn)
            raise
        finally:
            self.wait_s += loop.time() - now
        turn.waiting -= 1
        self._active[model_id] = self._active.get(model_id, 0) + 1

    def _abandoned(self, model_id: str, turn: _Turn) -> None:
        if turn.waiting:
            return
        if not turn.future.done():  # still in line: nobody wants it any more
            if self._turns.get(model_id) is turn and model_id not in self.suspended:
                del self._turns[model_id]
        elif self.owner == model_id and not self._active.get(model_id):  # nobody took it
            self._pass_on()

    def leave(self, model_id: str) -> None:
        if not self.enabled:
            return
        left = self._active[model_id] - 1
        if left:
            self._active[model_id] = left
            return
        del self._active[model_id]
        if model_id in self.suspended:  # its clients left while it was stopped
            self.suspended.discard(model_id)
            self._resume(model_id)
            turn = self._turns.get(model_id)
            if turn is not None and not turn.waiting:
                del self._turns[model_id]
        elif model_id == self.owner:
            self._pass_on()

    def _arm(self) -> None:
        """Time the owner's slice, now that someone waits."""
        if not self.turn_s or self._timer is not None or self.owner is None:
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(self._turn_started + self.turn_s, self._slice_over)

    def _slice_over(self) -> None:
        self._timer = None
        owner = self.owner
        if owner is None or not self._turns:
            return
        if not self._active.get(owner):  # its turn came, nobody has entered yet
            self._turn_started = asyncio.get_running_loop().time()
            self._arm()
            return
        self.preemptions += 1
        self._suspend(owner)
        self.suspended.add(owner)
        if owner not in self._turns:
            self._turns[owner] = _Turn(asyncio.get_running_loop().create_future())
        self._pass_on()

    def _pass_on(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._turns:
            self.owner = None
            return
        model_id, turn = self._turns.popitem(last=False)
        self.owner, self._turn_started = model_id, asyncio.get_running_loop().time()
        if model_id in self.suspended:
            self.suspended.discard(model_id)
            self._resume(model_id)
        if not turn.future.done():
            turn.future.set_result(None)  # every request of that model that waited goes in
        if self._turns:
            self._arm()



# The templated prompt of a chat is never longer, in bytes, than its message texts plus this
# much per message and overall (role markers, default system prompt). Above the bound the
# prompt is templated and tokenized by the worker, exactly.
_PER_MESSAGE_BYTES = 256
_TEMPLATE_BYTES = 1024


class ComputeGates:
    """A :class:`ComputeGate` per node: the models on one node take turns on its cores, as
    on one machine; models on different nodes (a cluster's, ``--ray``) compute at once.
    Made on a node's first request, each with the same options."""

    def __init__(self, enabled: bool = True, batch_window_s: float = 0.25,
                 turn_s: float = 0.0, suspend: Callable[[str], None] | None = None,
                 resume: Callable[[str], None] | None = None) -> None:
        self.enabled = enabled
        self._make = functools.partial(ComputeGate, enabled, batch_window_s, turn_s, suspend,
                                       resume)
        self._gates: dict[str, ComputeGate] = {}

    def of(self, node: str) -> ComputeGate:
        """The gate of ``node`` (residency's node id: ``local`` without a cluster)."""
        gate = self._gates.get(node)
        if gate is None:
            gate = self._gates[node] = self._make()
        return gate

    @property
    def waits(self) -> int:
        return sum(g.waits for g in self._gates.values())

    @property
    def wait_s(self) -> float:
        return sum(g.wait_s for g in self._gates.values())

    @property
    def preemptions(self) -> int:
        return sum(g.preemptions for g in self._gates.values())

    @property
    def suspended(self) -> set[str]:
        return set().union(*(g.suspended for g in self._gates.values()))


def slot_context(model: CatalogModel) -> int:
    return model.options.context // model.options.parallel


CountTokens = Callable[[str | Messages], Awaitable[int]]


class _Chat:
    """A chat request's messages, counted as one prompt once templated."""

    def __init__(self, messages: Messages) -> None:
        self.messages = messages


async def check_fits(model: CatalogModel, path: str, body: dict[str, Any],
                     count_tokens: CountTokens, *, cap: bool = False) -> int | None:
    """Raise ContextLengthExceeded if the request's prompt plus max_tokens cannot fit a slot.

    ``count_tokens`` is the worker's (engines/contract.py): a raw prompt's tokens, or chat
    messages' once templated; it is only asked when a cheap byte bound cannot prove that the
    request fits. ``cap``: ``max_tokens`` is a ceiling, not a need (Anthropic's Messages and
    OpenAI's Responses): only the prompt must fit, and the ``max_tokens`` to send instead is
    returned when the slot holds fewer; else None (send it as it is).
    """
    if path == "/v1/embeddings":
        await _check_inputs(model, body, count_tokens)
        return None
    limit = slot_context(model)
    asked = body.get("max_tokens") or 0  # missing: the rest of the slot's context
    max_tokens = 0 if cap else asked
    if path == "/v1/chat/completions":
        messages = body.get("messages", [])
        bound = (text_bytes(messages) + _PER_MESSAGE_BYTES * len(messages) + _TEMPLATE_BYTES
                 + text_bytes(body.get("tools")) * 2)
        if bound + asked < limit:
            return None
        prompts: list[Any] = [_Chat(messages)]
    else:
        prompts = _prompts(body.get("prompt", ""))
    for prompt in prompts:
        if isinstance(prompt, _Chat):
            tokens = await count_tokens(prompt.messages)
        elif isinstance(prompt, list):  # already tokens
            tokens = len(prompt)
        elif len(prompt.encode()) + 2 + max_tokens < limit:  # a token is at least one byte
            continue
        else:
            tokens = await count_tokens(prompt)
        need = tokens + max(max_tokens, 1)
        if need > limit:
            raise _too_long(model, path, tokens, max_tokens, need, limit)
        if cap and asked and tokens + asked > limit:
            return limit - tokens
    # a short prompt was not counted: a ceiling past the slot is the slot (the rest of it
    # is generated until it is full), never a number past what the engine holds
    return limit if cap and asked > limit else None


Count = Callable[[str], Awaitable[int]]


async def _check_inputs(model: CatalogModel, body: dict[str, Any], count: Count,
                        at_least: bool = False) -> None:
    """Raise ContextLengthExceeded naming the limit if an embeddings input is too long.
    ``count(text)`` counts its tokens (exactly, or a lower bound: ``at_least``); it is only
    asked for inputs whose bytes leave the question open."""
    limit = engine_for(model).embedding_limit(model)
    raw = body.get("input")
    single = isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int))
    inputs: list[Any] = [raw] if single else list(raw or [])
    for i, item in enumerate(inputs):
        if isinstance(item, list):
            tokens = len(item)
        elif len(item.encode()) + 2 <= limit:  # a token is at least one byte; 2 specials
            continue
        else:
            tokens = await count(item)
        if tokens > limit:
            which = "the input" if single else f"input {i}"
            raise ContextLengthExceeded(
                f"model {model.id!r}: {which} is {'at least ' if at_least else ''}{tokens} "
                f"tokens; this model embeds at most {limit} tokens per input (its slot has "
                f"{slot_context(model)} tokens; its engine embeds an input in one batch). "
                "Split the text into shorter inputs.",
                param="input")


def _prompt_texts(path: str, body: dict[str, Any]) -> list[list[str] | int]:
    """Per prompt of the request: its texts, or its length when it is given as token ids."""
    if path == "/v1/chat/completions":
        texts: list[str] = []
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts += [p["text"] for p in content
                          if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return [texts]
    return [[p] if isinstance(p, str) else len(p) if isinstance(p, list) else []
            for p in _prompts(body.get("prompt", ""))]


def _prompts(raw: Any) -> list[Any]:
    """A completion's prompts: a text or a token list is one prompt; a list of them, several."""
    return raw if isinstance(raw, list) and raw and not isinstance(raw[0], int) else [raw]


async def refuse_before_load(model: CatalogModel, path: str, body: dict[str, Any],
                             table: Callable[[], Awaitable[PairTable | None]], *,
                             cap: bool = False, limit: int | None = None) -> None:
    """Raise ContextLengthExceeded, before the model is loaded, if a prompt's lower bound on
    tokens (catalog/vocab.py) plus max_tokens cannot fit one slot. ``table()`` gives the
    model's pair table (None: no bound); it is only asked for prompts long enough.
    ``cap``: max_tokens is a ceiling (see :func:`check_fits`): only the prompt must fit.
    ``limit``: tokens to fit in instead of one slot's."""
    if path == "/v1/embeddings":
        async def bound(text: str) -> int:
            pairs = await table()
            return 0 if pairs is None else await _min_tokens(pairs, [text])

        await _check_inputs(model, body, bound, at_least=True)
        return
    _check_prompt_count(model, path, body)
    _check_logprobs(model, body)
    limit = limit or slot_context(model)
    given = body.get("max_tokens")
    max_tokens = given if isinstance(given, int) and not cap else 0
    for prompt in _prompt_texts(path, body):
        if isinstance(prompt, int):
            tokens = prompt
        else:
            if sum(len(t.encode()) for t in prompt) + max(max_tokens, 1) <= limit:
                continue  # a token is at least one byte: it may fit
            pairs = await table()
            if pairs is None:
                return
            tokens = await _min_tokens(pairs, prompt)
        need = tokens + max(max_tokens, 1)
        if need > limit:
            raise _too_long(model, path, tokens, max_tokens, need, limit, at_least=True)


LOGPROB_FIELDS = ("logprobs", "top_logprobs", "n_probs")
"""The fields of a worker-bound request that ask for log-probabilities (OpenAI's chat and
completions, llama.cpp's own)."""


def _check_logprobs(model: CatalogModel, body: dict[str, Any]) -> None:
    """InvalidRequest naming the field for log-probabilities asked of a model whose engine
    cannot give one for every token (speculative decoding: tokens accepted from a draft come
    without), rather than an answer whose log-probabilities silently miss tokens."""
    asked = next((f for f in LOGPROB_FIELDS if body.get(f) not in (None, False, 0)), None)
    if asked is None or ENGINES[model.engine].capabilities(model).logprobs:
        return
    raise InvalidRequest(
        f"{asked}: model {model.id!r} runs speculative decoding, and its engine gives no "
        "log-probabilities for the tokens it accepts from a draft; ask for log-probabilities "
        "from a model without speculative decoding (the same file under another id)",
        param=asked)


def _check_prompt_count(model: CatalogModel, path: str, body: dict[str, Any]) -> None:
    """InvalidRequest (400, ``prompt``) for a completion with more prompts than the model
    has slots (each prompt takes one in the engine): known from the body, before any load."""
    if path == "/v1/chat/completions":
        return
    count = len(_prompts(body.get("prompt", "")))
    if count > model.options.parallel:
        raise InvalidRequest(
            f"model {model.id!r}: {count} prompts in one request; send at most "
            f"{model.options.parallel} (its slots) and the rest in further requests",
            param="prompt")


def trained_limit(model: CatalogModel) -> int:
    """Tokens a text may have where it need not fit a slot (counting, tokenizing): what the
    model was trained for, or its configured context if larger. Megabytes of text past it
    took the worker gigabytes."""
    return max(model.info.context_length or 0, model.options.context)


async def check_text_length(model: CatalogModel, text: str, param: str) -> None:
    """InvalidRequest (400, ``param``) for a text of more than :func:`trained_limit` tokens
    by its lower bound (catalog/vocab.py), found without the engine."""
    limit = trained_limit(model)
    if len(text.encode()) <= limit:
        return  # a token is at least one byte
    pairs = await model_pair_table(model)
    tokens = 0 if pairs is None else await _min_tokens(pairs, [text])
    if tokens > limit:
        raise InvalidRequest(
            f"{param} is at least {tokens} tokens, more than model {model.id!r} takes "
            f"({limit}, its trained context); send it in parts", param=param)


async def model_pair_table(model: CatalogModel) -> PairTable | None:
    """The model's vocabulary pair table, read off the event loop once per file version."""
    try:
        mtime_ns = model.path.stat().st_mtime_ns
        return await asyncio.to_thread(pair_table, model.path, mtime_ns)
    except (OSError, GGUFError) as e:
        log.warning("model %s: no token bound from its vocabulary: %s", model.id, e)
        return None


async def _min_tokens(pairs: PairTable, texts: list[str]) -> int:
    """The bound for ``texts`` together; a long text's on a thread (about 10 ms of CPU a
    MiB), so that the event loop never waits on it."""
    if sum(len(t) for t in texts) < LARGE_INPUT_BYTES:
        return sum(pairs.min_tokens(t) for t in texts)
    return await asyncio.to_thread(lambda: sum(pairs.min_tokens(t) for t in texts))


def _too_long(model: CatalogModel, path: str, tokens: int, max_tokens: int, need: int,
              limit: int, *, at_least: bool = False) -> ContextLengthExceeded:
    o = model.options
    engine = engine_for(model)
    kv_need = engine.kv_cache_bytes(model, need)
    kv_slot = engine.kv_cache_bytes(model, limit)
    prompt = "messages" if path == "/v1/chat/completions" else "prompt"
    asked = f"and max_tokens is {max_tokens}" if max_tokens else "with room for one more"
    return ContextLengthExceeded(
        f"model {model.id!r}: the prompt is {'at least ' if at_least else ''}{tokens} tokens "
        f"{asked}: {need} tokens ({kv_need // 1024} KiB of KV cache) "
        f"do not fit one slot of {limit} tokens ({kv_slot // 1024} KiB; context {o.context} "
        f"shared by {o.parallel} slots). Shorten the prompt, "
        f"{'lower max_tokens, ' if max_tokens else ''}or serve the model with a larger "
        "context or fewer slots.",
        param=prompt if tokens >= limit else "max_tokens")
