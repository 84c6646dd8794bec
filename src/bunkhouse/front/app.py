"""The front's HTTP app: OpenAI-compatible routes, each routed by the body's ``model``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bunkhouse import __version__, defaults
from bunkhouse.api import anthropic, infill
from bunkhouse.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    InfillRequest,
    parse_json_object,
    read_body,
    validate,
)
from bunkhouse.api.tool_calls import ToolCallReader, check_tool_choice
from bunkhouse.catalog import Catalog, CatalogModel
from bunkhouse.engines.contract import EngineClient, Messages
from bunkhouse.errors import (
    BunkhouseError,
    EngineUnavailable,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    Paused,
    ShuttingDown,
)
from bunkhouse.front.access import AccessLog
from bunkhouse.front.admin import Admin, AdminOptions
from bunkhouse.front.admission import (
    ComputeGate,
    Held,
    check_fits,
    model_pair_table,
    refuse_before_load,
    trained_limit,
)
from bunkhouse.front.auth import Keys, Level, access
from bunkhouse.front.constraints import ConstraintGate
from bunkhouse.front.cors import Cors
from bunkhouse.front.edge import known_only, prepare
from bunkhouse.front.openapi import openapi
from bunkhouse.front.protocols import (
    AnthropicShape,
    ChatShape,
    InfillShape,
    ToolCallShape,
    error_envelope,
)
from bunkhouse.front.proxy import Shape, StreamShaper, client_gone, forward, stream_broke
from bunkhouse.front.reload import Reloader
from bunkhouse.front.response_store import ResponseStore, ResponseStoreError
from bunkhouse.front.site import SiteGuard, SitePolicy
from bunkhouse.front.waiting import WaitingOptions, WaitingStream
from bunkhouse.kvcache.keeper import SnapshotKeeper
from bunkhouse.residency.manager import Lease, ResidencyManager
from bunkhouse.residency.slots import Slot, SlotGate
from bunkhouse.shares import Shares

log = logging.getLogger(__name__)

R = TypeVar("R")

DEFAULT_MAX_BODY = defaults.MAX_BODY_BYTES
MAX_AUDIO_BYTES = defaults.MAX_AUDIO_BYTES

Schema = (type[ChatCompletionRequest] | type[CompletionRequest] | type[EmbeddingRequest]
          | type[InfillRequest])


class Front:
    """Route handlers over one catalog and one residency manager."""

    def __init__(self, catalog: Catalog, residency: ResidencyManager,
                 compute: ComputeGate, max_body_bytes: int = DEFAULT_MAX_BODY,
                 keys: Keys | None = None, keeper: SnapshotKeeper | None = None,
                 strict_context: bool = False, waiting: WaitingOptions | None = None,
                 constraints: ConstraintGate | None = None) -> None:
        self.catalog = catalog
        self.waiting = waiting or WaitingOptions()
        self.strict_context = strict_context
        self.keeper = keeper
        self.residency = residency
        self.compute = compute
        self.max_body_bytes = max_body_bytes
        self.keys = keys or Keys()
        self.constraints = constraints or ConstraintGate()  # what a grammar costs, measured
        # Large bodies parsed at once: each takes a few times its size while pydantic checks
        # it, so sixteen 15 MiB bodies at once took the front past 1 GB.
        self._parsing = asyncio.Semaphore(2)
        self._bodies = Shares(defaults.BODIES_IN_FLIGHT_BYTES,  # while they are read
                              "request body bytes being read")

    def generation(self, path: str, schema: Schema) -> Callable[[Request], Awaitable[Response]]:
        def parse(body: bytes) -> tuple[Any, dict[str, Any]]:
            data = known_only(schema, parse_json_object(body))
            return validate(schema, data), data

        async def handler(request: Request) -> Response:
            body = await self.read(request)
            parsed, data = await self.cpu(len(body), parse, body)
            if path == "/infill":  # the engine needs both, as the schema defaults them
                data = {"input_prefix": "", "input_suffix": "", **data}
            if path == "/v1/completions" and data.get("suffix"):  # fill-in-the-middle
                return await self.generate(request, "/infill", InfillRequest, parsed,
                                           infill.from_completion(data), len(body),
                                           InfillShape)
            return await self.generate(request, path, schema, parsed, data, len(body))

        return handler

    def messages(self) -> Callable[[Request], Awaitable[Response]]:
        """Anthropic's ``POST /v1/messages``: translated to a chat completion request
        (api/anthropic.py), served by :meth:`generate`, answered in Anthropic's shape."""
        def parse(body: bytes) -> tuple[Any, dict[str, Any]]:
            data = anthropic.to_chat(parse_json_object(body))
            return validate(ChatCompletionRequest, data), data

        async def handler(request: Request) -> Response:
            body = await self.read(request)
            parsed, data = await self.cpu(len(body), parse, body)
            stops = list(data.get("stop") or [])
            return await self.generate(request, "/v1/chat/completions", ChatCompletionRequest,
                                       parsed, data, len(body),
                                       lambda model_id: AnthropicShape(model_id, stops),
                                       cap=True)

        return handler

    async def count_message_tokens(self, request: Request) -> Response:
        """Anthropic's ``POST /v1/messages/count_tokens``: the prompt's tokens, as the
        model's worker templates and tokenizes it (the model is loaded if it is not); a
        prompt longer than the model's trained context is a 400 without being tokenized."""
        body = await self.read(request)

        def parse(raw: bytes) -> tuple[Any, dict[str, Any]]:
            given = parse_json_object(raw)
            data = anthropic.to_chat({**given, "max_tokens": 1, "stream": False})
            return validate(ChatCompletionRequest, data), data

        parsed, data = await self.cpu(len(body), parse, body)
        check_tool_choice(data)
        model = self.catalog.get(parsed.model)
        data = await self.cpu(len(body), prepare, "/v1/chat/completions",
                              ChatCompletionRequest, model, data)
        # counted even past one slot (agents count to decide when to compact), but not past
        # what the model was trained for: megabytes of text took the worker gigabytes
        await refuse_before_load(model, "/v1/chat/completions", data,
                                 functools.partial(model_pair_table, model), cap=True,
                                 limit=trained_limit(model))
        lease = await self.residency.acquire(model)
        try:
            tokens = await lease.worker.engine.tokenize(data)
        finally:
            lease.release()
        return JSONResponse({"input_tokens": len(tokens)})

    async def generate(self, request: Request, path: str, schema: Schema, parsed: Any,
                       data: dict[str, Any], size: int,
                       shape: Callable[[str], Shape] | None = None,
                       cap: bool = False) -> Response:
        """The one generation path every protocol takes: routing by ``model``, the checks
        before a load, the lease, the context check, KV snapshots, the slot and compute
        turns, the proxy; ``shape(model_id)`` answers in another protocol. ``cap``: the
        request's ``max_tokens`` is a ceiling, lowered to what the slot holds after the
        prompt (Anthropic's and the Responses API's meaning), not a need refused when it
        does not fit (OpenAI chat completions' with ``--strict-context``; without it every
        request's ``max_tokens`` is a ceiling, as local servers treat it)."""
        cap = cap or not self.strict_context
        model = self.catalog.get(parsed.model)
        request.state.model = model.id  # for the access log
        data = await self.cpu(size, prepare, path, schema, model, data)
        reader = None
        if path == "/v1/chat/completions":  # after prepare: it checks the tools as given
            data, reader = _tool_reader(data)
        await refuse_before_load(model, path, data, functools.partial(model_pair_table, model),
                                 cap=cap)
        request.state.stream = bool(parsed.stream)
        shaped = _shape(model.id, shape, reader)
        admit = self._admit(request, model, path, data, cap)
        if not parsed.stream:  # a client that leaves while it waits gives its place up
            return await self._serve(request, model, path, parsed, shaped,
                                     await _unless_gone(request, admit))
        task = asyncio.ensure_future(admit)
        try:
            await asyncio.wait({task}, timeout=self.waiting.headers_after_s)
        except asyncio.CancelledError:
            await drop_admission(task)
            raise
        if task.done():  # admitted, or refused, at once: the usual status and headers
            return await self._serve(request, model, path, parsed, shaped, task.result())
        # it waits for a load or a slot: headers now, then pings until it is admitted
        return WaitingStream(
            task, lambda admitted, shaper: self._serve(request, model, path, parsed, shaped,
                                                       admitted, shaper),
            shaped, self.waiting, functools.partial(self._waiting_for, model.id)
            if path == "/v1/chat/completions" and shape is None else None, model.id)

    def _waiting_for(self, model_id: str) -> str | None:
        """What a waiting request waits for, as a client may be told it (--send-loading-state)."""
        state = self.residency.status(model_id).state
        if state == "loading":
            return f"loading model {model_id}"
        if state in ("absent", "draining"):
            return f"waiting for memory to load model {model_id}"
        return None

    async def _admit(self, request: Request, model: CatalogModel, path: str,
                     data: dict[str, Any], cap: bool) -> _Admitted | None:
        """Everything a request waits for before the engine sees it: the lease (loading the
        model if need be), the context check, a slot and a compute turn. None: the client
        left meanwhile. On an error or a cancel, what was taken is given back."""
        queued = time.monotonic()
        lease = await self.residency.acquire(model)
        request.state.load_s = time.monotonic() - queued  # its model's load, if it waited
        held = Held(lease)
        with self._releasing(lease, held, model.id):
            # measured apart from the worker, before it meets it (front/constraints.py)
            constrained = await self.constraints.check(model, path, data,
                                                       self.keys.client_of(request))
            engine = lease.worker.engine
            keeper = self.keeper if self.keeper and self.keeper.active(model) else None
            pinned = keeper is not None and _pinnable(path, data)
            tokens = (await keeper.prompt_tokens(model, engine, path, data)
                      if keeper is not None and pinned else None)
            room = await check_fits(model, path, data, _counter(engine, tokens), cap=cap)
            if room is not None:
                data = {**data, "max_tokens": room}
            slots = lease.slots
            slot = await slots.enter(tokens)
            held.push(functools.partial(self._leave, model, engine, slots, slot))
            await self.compute.enter(model.id)
            held.push(lambda: self.compute.leave(model.id))
            request.state.queue_s = time.monotonic() - queued  # load, slot and compute turn
            if await request.is_disconnected():  # gone while it waited: never started
                held.close()
                return None
        return _Admitted(lease, held, engine, keeper, pinned, tokens, slot, data, constrained)

    async def _serve(self, request: Request, model: CatalogModel, path: str, parsed: Any,
                     shaped: Shape | None, admitted: _Admitted | None,
                     shaper: StreamShaper | None = None) -> Response:
        """Send the admitted request to its worker and relay the answer. ``shaper``: the
        stream's shaper when its first bytes were sent already (a waiting stream)."""
        if admitted is None:
            return Response(status_code=499)
        lease, held, data = admitted.lease, admitted.held, admitted.data
        blamed = functools.cache(functools.partial(  # once: a stall counts once
            self._blamed, lease, model, path, data, self.keys.client_of(request)))
        with self._releasing(lease, held, model.id, blamed):  # forward may have closed it
            self._check_still_served(lease)
            check = None
            keeper = admitted.keeper
            if keeper is not None:
                restore = await keeper.prepare(model, admitted.engine, admitted.slot,
                                               admitted.tokens)
                if restore is not None:
                    check = functools.partial(keeper.check, model, restore)
                if admitted.pinned and admitted.slot.id >= 0:
                    data = {**data, "id_slot": admitted.slot.id}
            on_timings = functools.partial(_noted, request, check)
            if admitted.constrained:  # a stall until its answer ends is this request's
                lease.constrained(True)
                held.push(functools.partial(lease.constrained, False))
            response = await forward(admitted.engine, path, data,
                                     stream=parsed.stream, request=request,
                                     model_id=model.id, on_done=held.close,
                                     on_broken=self._broken(lease, blamed),
                                     on_timings=on_timings, shape=shaped, started=shaper)
        lease.report(True)  # it answered: whatever it said, it is alive
        return response

    def _blamed(self, lease: Lease, model: CatalogModel, path: str, data: dict[str, Any],
                client: str) -> BunkhouseError | None:
        """The error of a request whose worker stalled until it was replaced while it ran
        (residency/step.py ``_probed``): a 400 naming its constraint's field, kept as the
        constraint's verdict so that it is refused at once next time; None for any other
        request."""
        if not lease.blamed():
            return None
        param = self.constraints.blame(model, path, data, client)
        return InvalidRequest("this request's constraint (a grammar, schema, tools or sampler "
                              "lists) stalled the engine while it ran, and its worker was "
                              "replaced; simplify it: fewer alternatives, enum values or "
                              "optional properties", param=param)

    @contextlib.contextmanager
    def _releasing(self, lease: Lease, held: Held, model_id: str,
                   blamed: Callable[[], BunkhouseError | None] = lambda: None
                   ) -> Iterator[None]:
        """On any error, give back what the request holds (``held.close`` is idempotent);
        a worker that could not be reached counts against its health, unless the front's
        own shutdown cut it or this request's constraint stalled it (``blamed()``)."""
        try:
            yield
        except EngineUnavailable as e:
            error = None if self.residency.closing else blamed()  # before its lease goes
            held.close()
            if self.residency.closing:  # the front's shutdown cut it, not the worker
                raise ShuttingDown(model_id) from e
            if error is not None:
                raise error from e
            lease.report(False)
            raise
        except BaseException:
            held.close()
            raise

    def _leave(self, model: CatalogModel, engine: EngineClient, slots: SlotGate,
               slot: Slot) -> None:
        slots.leave(slot)
        if self.keeper is not None:
            self.keeper.slot_idle(model, engine, slots, slot)

    async def read(self, request: Request) -> bytes:
        """The request's body, within the body size limit and the bytes in flight (the
        client's share of them included)."""
        return await read_body(request, self.max_body_bytes, self._bodies,
                               self.keys.client_of(request))

    async def cpu(self, size: int, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)``: inline for a small input; for a large one on a thread, two at a
        time."""
        if size < defaults.LARGE_INPUT_BYTES:
            return fn(*args)
        async with self._parsing:
            return await asyncio.to_thread(fn, *args)

    def _check_still_served(self, lease: Lease) -> None:
        """After waiting for a slot and a compute turn: the front may have begun stopping, or
        the worker died meanwhile; then this request never starts."""
        if self.residency.closing:
            raise ShuttingDown(lease.model_id)
        if not lease.worker.alive:
            raise EngineUnavailable(f"model {lease.model_id!r}: its worker exited while this "
                                    "request waited; retry")

    def _broken(self, lease: Lease, blamed: Callable[[], BunkhouseError | None]
                ) -> Callable[[Exception], BunkhouseError]:
        """A stream cut by the front's shutdown says so; one its own constraint stalled says
        that; one the worker cut counts against the worker's health, like a failed request."""
        def broken(error: Exception) -> BunkhouseError:
            if self.residency.closing:
                return ShuttingDown(lease.model_id)
            stalled = blamed()
            if stalled is not None:
                return stalled
            lease.report(False)
            return stream_broke(lease.model_id, error)

        return broken

    def model_object(self, model: CatalogModel, *, detail: bool = False) -> dict[str, Any]:
        """The model as ``GET /v1/models/{id}`` shows it; ``detail`` (admin-key callers only)
        adds ``last_error_detail``, the failed worker's last output."""
        status = self.residency.status(model.id)
        described = {
            "id": model.id,
            "object": "model",
            "created": model.modified,
            "owned_by": "bunkhouse",
            "state": status.state,
            "source": model.source,
            "kind": model.kind,  # chat, completion, embedding or transcription
            "architecture": model.info.architecture,
            "size_bytes": model.size_bytes,
            "aliases": list(model.aliases),
            "context": None if model.transcribes else model.options.context,
            "parallel": model.options.parallel,
            "slot_context": None if model.transcribes else
            model.options.context // model.options.parallel,
            "trained_context": model.info.context_length,
            "chat_template": model.has_chat_template,
            "engine": model.engine,
            "embeddings": model.embeddings,
            "default": model.id == self.catalog.default_id,
            "pinned": status.pinned,
            "leases": status.leases,
            "running": self.residency.slots(model.id).running,
            "queued": self.residency.slots(model.id).waiting,
            "waiting": status.waiting,  # for a lease: its load, memory, a pause
            "queue": model.options.queue,
            "last_used": status.last_used,
            "estimated_bytes": status.estimated_bytes,
            "measured_bytes": status.measured_bytes,
            "pid": status.pid,
            "last_error": status.last_error,
        }
        if model.projector is not None:  # noted; images are not served yet
            described["projector"] = model.projector.name
        if self.keeper is not None:
            described["kv_cache"] = self.keeper.model_report(model.id, detail)
        if detail:
            described["last_error_detail"] = status.last_error_detail
        return described

    def is_admin(self, request: Request) -> bool:
        return self.keys.level_of(request) is Level.ADMIN

    async def list_models(self, request: Request) -> Response:
        detail = self.is_admin(request)
        data = [self.model_object(m, detail=detail) for m in self.catalog]
        return JSONResponse({"object": "list", "data": data})

    async def get_model(self, request: Request) -> Response:
        model = self.catalog.get(request.path_params["model_id"])
        return JSONResponse(self.model_object(model, detail=self.is_admin(request)))

    async def health(self, request: Request) -> Response:
        """Liveness, open to all; each model's state only to a caller the client key (or
        its absence) admits."""
        if self.keys.level_of(request) < Level.CLIENT:
            return JSONResponse({"status": "ok"})
        states = {s.id: s.state for s in self.residency.statuses()}
        return JSONResponse({"status": "ok", "models": states})

    async def stats(self, request: Request) -> Response:
        r = self.residency
        detail = self.is_admin(request)
        budget, used = r.options.budget_bytes, r.used_bytes()
        return JSONResponse({
            "budget_bytes": budget,
            "used_bytes": used,
            "free_bytes": budget - used,
            "peak_used_bytes": r.peak_bytes,
            "models": [self.model_object(m, detail=detail) for m in self.catalog],
            "kv_cache": self.keeper.report(detail) if self.keeper else None,
            "pause": r.pause_status(),  # an operator's pause (POST /admin/pause)
            "spare_worker": r.spare_status(),  # the worker kept for the next load, if any
            "event_counts": r.events.counts,
            "events": [e.as_dict(detail) for e in r.events.recent(100)],
        })


def _tool_reader(data: dict[str, Any]) -> tuple[dict[str, Any], ToolCallReader | None]:
    """The chat request to send and the reader of the tool calls in its answer's text
    (api/tool_calls.py). Raises InvalidRequest for a tool_choice that cannot be met."""
    check_tool_choice(data)
    return ToolCallReader.for_request(data)


def _shape(model_id: str, shape: Callable[[str], Shape] | None,
           reader: ToolCallReader | None) -> Shape | None:
    """The protocol's shape, with the tool-call reader in front of it if there is one."""
    inner = shape(model_id) if shape else None
    if reader is None:
        return inner
    return ToolCallShape(reader, inner or ChatShape())


async def _openapi(request: Request) -> Response:
    return JSONResponse(openapi(__version__))


def _counter(engine: EngineClient, tokens: list[int] | None
             ) -> Callable[[str | Messages], Awaitable[int]]:
    """The worker's token count, or the count of the request's one prompt already tokenized
    (``tokens``: with its tools and template options, as the engine prefills it)."""
    if tokens is None:
        return engine.count_tokens
    known = len(tokens)

    async def count(prompt: str | Messages) -> int:
        return known

    return count


def _noted(request: Request, then: Callable[[dict[str, Any]], None] | None,
           timings: dict[str, Any]) -> None:
    """The engine's timings of an answer: its tokens noted for the access log, then
    ``then`` (the KV restore's check) if any."""
    prompt, predicted = timings.get("prompt_n"), timings.get("predicted_n")
    cached = timings.get("cache_n") or 0
    if isinstance(prompt, int) and isinstance(predicted, int):
        request.state.tokens = (prompt + (cached if isinstance(cached, int) else 0), predicted)
        request.state.timings = timings  # the engine's own figures, for /metrics
    if then is not None:
        then(timings)


def _pinnable(path: str, data: dict[str, Any]) -> bool:
    """Whether the request runs in exactly one slot the front may choose: one prompt, one
    answer, no slot asked for by the client."""
    if path not in ("/v1/chat/completions", "/v1/completions") or "id_slot" in data:
        return False
    prompt = data.get("prompt")
    several = isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)
    return data.get("n", 1) == 1 and not several


@dataclasses.dataclass
class _Admitted:
    """A request let in: what it holds and what its sending needs."""

    lease: Lease
    held: Held
    engine: EngineClient
    keeper: SnapshotKeeper | None
    pinned: bool
    tokens: list[int] | None
    slot: Slot
    data: dict[str, Any]
    constrained: bool  # it carries a constraint (front/constraints.py)


async def _unless_gone(request: Request, admission: Awaitable[_Admitted | None]
                       ) -> _Admitted | None:
    """``admission``'s result, or None (the request is over: 499) if the client left while
    it waited: its place in line is given up at once, and a load nobody waits for any more
    evicts nothing."""
    task = asyncio.ensure_future(admission)
    gone = asyncio.ensure_future(client_gone(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await drop_admission(task)
        raise
    finally:
        await _cancel(gone)
    if task.done():
        return task.result()
    log.info("%s: client disconnected while waiting; its place given up",
             request.url.path[:200])
    await drop_admission(task)
    return None


async def drop_admission(task: asyncio.Future[_Admitted | None]) -> None:
    """Cancel an admission nobody will use, giving back what it holds if it was admitted
    before the cancel could land."""
    task.cancel()
    results = await asyncio.gather(task, return_exceptions=True)
    if isinstance(results[0], _Admitted):
        results[0].held.close()


async def _cancel(task: asyncio.Future[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


Handler = Callable[[Request, Exception], Awaitable[Response]]


def _error_handlers(keys: Keys) -> dict[Any, Handler]:
    """Every error rendered once, here: the detail of an error (a worker's output, server
    paths) only to an admin-key caller, and always to the log."""

    async def bunkhouse_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, BunkhouseError)
        # a stop, and a pause an operator asked for, are no errors
        if exc.status >= 500 and not isinstance(exc, ShuttingDown | Paused):
            log.error("%s %s: %s", request.method, request.url.path[:200], exc.full_message())
        elif exc.detail:
            log.info("%s %s: %s", request.method, request.url.path[:200], exc.full_message())
        detail = keys.level_of(request) is Level.ADMIN
        return JSONResponse(error_envelope(request.url.path, exc, detail),
                            status_code=exc.status, headers=exc.headers())

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        err: BunkhouseError
        path = request.url.path[:200]
        if exc.status_code == 405:
            err = MethodNotAllowed(f"{request.method} is not allowed on {path}")
        else:
            err = NotFound(f"no route {request.method} {path}")
        return await bunkhouse_error(request, err)

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path[:200], exc_info=exc)
        return await bunkhouse_error(request, BunkhouseError("internal error; see the server log"))

    return {BunkhouseError: bunkhouse_error, HTTPException: http_error, Exception: unexpected}


def build_app(catalog: Catalog, residency: ResidencyManager, preload: Sequence[str] = (),
              on_shutdown: Callable[[], None] | None = None,
              compute: ComputeGate | None = None, keys: Keys | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY,
              admin_options: AdminOptions | None = None,
              site: SitePolicy | None = None,
              keeper: SnapshotKeeper | None = None,
              responses: ResponseStore | None = None,
              strict_context: bool = False,
              reloader: Reloader | None = None,
              cors_origins: Sequence[str] = (),
              events_heartbeat_s: float = 15.0,
              waiting: WaitingOptions | None = None,
              max_audio_bytes: int = MAX_AUDIO_BYTES,
              constraints: ConstraintGate | None = None) -> Starlette:
    """The front's ASGI app. ``site``: the Host and cross-site rules (front/site.py); the
    default serves loopback names only, as when bound to 127.0.0.1. ``responses``: where
    Responses API answers are stored (opened at startup; None: none are). ``reloader``: how
    the configuration is re-read, on ``POST /admin/reload`` and on SIGHUP (None: it is not).
    ``cors_origins``: origins browsers may call from besides loopback ones (front/cors.py).
    ``events_heartbeat_s``: seconds of silence on ``GET /admin/events`` before a comment
    line is sent. ``waiting``: how a streamed request that waits is answered meanwhile
    (front/waiting.py). ``max_audio_bytes``: the largest audio upload (front/audio.py).
    ``constraints``: what measures requests' constraints (front/constraints.py; default: a
    probe process per model).
    """
    from bunkhouse.front.audio import Transcriptions
    from bunkhouse.front.console import Console
    from bunkhouse.front.extras import Extras
    from bunkhouse.front.metrics import Metrics
    from bunkhouse.front.ollama import OllamaRoutes
    from bunkhouse.front.responses import ResponsesRoutes
    from bunkhouse.front.watch import EventStream

    keys = keys or Keys()
    front = Front(catalog, residency, compute or ComputeGate(), max_body_bytes, keys, keeper,
                  strict_context, waiting, constraints)
    stored = ResponsesRoutes(front, responses)
    olla = OllamaRoutes(front)
    extras = Extras(front)
    metrics = Metrics(residency, front.compute, keeper)
    watch = EventStream(residency.events, keys.client_of, events_heartbeat_s, front.is_admin)
    console = Console()
    audio = Transcriptions(front, max_audio_bytes)
    admin = Admin(catalog, residency, admin_options or AdminOptions(),
                  functools.partial(front.model_object, detail=True), keeper, reloader)

    def route(method: str, path: str, handler: Callable[[Request], Awaitable[Response]]
              ) -> Route:
        guarded = keys.guard(access(method, path), handler)

        async def noted(request: Request) -> Response:
            request.state.route = path  # a bounded label for /metrics
            request.state.received_ns = time.monotonic_ns()
            return await guarded(request)

        return Route(path, noted, methods=[method])

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        residency.open()
        hangups: set[asyncio.Task[Any]] = set()
        if reloader is not None:
            def hangup() -> None:
                task = asyncio.create_task(reloader.reload("SIGHUP"))
                hangups.add(task)
                task.add_done_callback(hangups.discard)
                task.add_done_callback(lambda t: t.cancelled() or t.exception())  # logged

            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, hangup)
        if responses is not None:
            try:
                count = await responses.open()
                log.info("stored responses in %s (%d kept)", responses.path, count)
            except ResponseStoreError as e:
                log.warning("responses not stored: %s", e.detail or e.message)
        try:
            for model_id in preload:
                try:
                    await residency.load(catalog.get(model_id).id)
                except BunkhouseError as e:  # serve the others; requests get the error
                    log.error("could not preload model %s: %s", model_id, e.message)
            residency.keep_spare_for(catalog.default_id)  # even the first load finds one
            yield
        finally:
            if reloader is not None:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            await asyncio.gather(*hangups, return_exceptions=True)
            if keeper is not None:
                await keeper.close()  # idle saves stop; each drain saves what is unsaved
            front.constraints.close()
            await residency.close()
            residency.events.close()  # every event stream ends
            if keeper is not None:
                keeper.log_shutdown([m.id for m in catalog])
            if responses is not None:
                await responses.close()
            if on_shutdown is not None:
                on_shutdown()

    routes = [
        route("POST", "/v1/chat/completions",
              front.generation("/v1/chat/completions", ChatCompletionRequest)),
        route("POST", "/v1/completions", front.generation("/v1/completions", CompletionRequest)),
        route("POST", "/v1/embeddings", front.generation("/v1/embeddings", EmbeddingRequest)),
        route("POST", "/infill", front.generation("/infill", InfillRequest)),
        route("POST", "/tokenize", extras.tokenize),
        route("POST", "/detokenize", extras.detokenize),
        route("POST", "/apply-template", extras.apply_template),
        route("POST", "/v1/messages", front.messages()),
        route("POST", "/v1/messages/count_tokens", front.count_message_tokens),
        route("POST", "/v1/audio/transcriptions", audio.create),
        route("POST", "/v1/responses", stored.create),
        route("GET", "/v1/responses/{response_id}", stored.retrieve),
        route("DELETE", "/v1/responses/{response_id}", stored.delete),
        route("GET", "/v1/responses/{response_id}/input_items", stored.input_items),
        route("GET", "/v1/models", front.list_models),
        route("POST", "/v1/models", admin.register),
        route("POST", "/v1/models/{model_id:path}/{action}", admin.action),
        route("GET", "/v1/models/{model_id:path}", front.get_model),
        route("DELETE", "/v1/models/{model_id:path}", admin.delete),
        route("POST", "/admin/cache/flush", admin.cache_flush),
        route("DELETE", "/admin/cache", admin.cache_purge),
        route("POST", "/admin/reload", admin.reload),
        route("POST", "/admin/default", admin.set_default),
        route("POST", "/admin/pause", admin.pause),
        route("POST", "/admin/resume", admin.resume),
        route("DELETE", "/admin/cache/{model_id:path}", admin.cache_purge),
        route("POST", "/api/chat", olla.chat),
        route("POST", "/api/generate", olla.generate),
        route("POST", "/api/embed", olla.embed),
        route("POST", "/api/embeddings", olla.embed),
        route("GET", "/api/version", olla.version),
        route("GET", "/api/tags", olla.tags),
        route("GET", "/api/ps", olla.ps),
        route("POST", "/api/show", olla.show),
        *(route("POST", f"/api/{name}", olla.not_served)
          for name in ("pull", "push", "create", "copy")),
        route("DELETE", "/api/delete", olla.not_served),
        route("GET", "/health", front.health),
        route("GET", "/stats", front.stats),
        route("GET", "/metrics", metrics.scrape),
        route("GET", "/admin/events", watch.follow),
        route("GET", "/", console.page),
        route("GET", "/console/{name}", console.asset),
        route("GET", "/openapi.json", _openapi),
    ]
    return Starlette(routes=routes, exception_handlers=_error_handlers(keys), lifespan=lifespan,
                     middleware=[Middleware(AccessLog, observe=metrics.observe),
                                 Middleware(Cors, origins=cors_origins),
                                 Middleware(SiteGuard, policy=site or SitePolicy())])
