"""The one request pipeline: every request to a model takes these stages, in this order,
whatever its protocol (the route modules translate in front of it and answer after it).

1. **Resolve**: the model the body names (catalog), the body checked and made the one sent to
   its engine (front/edge.py ``prepare``), the tool-call reader and the protocol's shape.
2. **Refuse before load**: a prompt certainly too long for a slot, more prompts than slots,
   a constraint already found too costly or a client whose constraints stall workers too
   often is refused before its model is loaded (front/admission.py ``refuse_before_load``,
   front/constraints.py ``refuse_known``), so it waits for no load and evicts nothing.
3. **Place and lease**: a place in the model's line (residency/slots.py; a full line is a
   429 at once, whether the model is loading, waiting for memory or busy), then the model
   ready and held (residency; it may load, evicting others).
4. **Constraint**: a grammar, schema or sampler lists measured apart from the shared worker
   (front/constraints.py).
5. **Tokens and fit**: the prompt tokenized when KV snapshots need it, then checked to fit
   one slot with its ``max_tokens`` (lowered to the room left when that is a ceiling).
6. **Slot**: one of the model's slots, its place in line kept until one is free.
7. **Compute turn**: on a CPU host one model computes at a time on each node
   (front/admission.py ``ComputeGate``, one per node: ``ComputeGates``).
8. **Restore**: the slot's KV state from the snapshot sharing most of the prompt
   (kvcache/keeper.py), and the request pinned to that slot.
9. **Generate**: sent through the engine contract and relayed (front/proxy.py), in the
   caller's protocol.
10. **Release**: compute turn, slot and lease given back once the answer ends, however it
    ends (the client gone, the worker dead, the front stopping).

A streamed request that waits in 3-7 gets its headers at once and pings meanwhile
(front/waiting.py); a client that leaves while it waits gives its place up. A transcription
takes stages 3, 6, 7 and 10 (front/audio.py); a one-off call to a worker (tokens, a
template) takes 3 and 10 (:meth:`Pipeline.worker`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from bunkhouse.api.tool_calls import ToolCallReader, check_tool_choice
from bunkhouse.catalog import Catalog, CatalogModel
from bunkhouse.engines import engine_for
from bunkhouse.engines.contract import Adapter, EngineClient, Messages, Timings
from bunkhouse.errors import (
    BunkhouseError,
    ClientGone,
    EngineUnavailable,
    InvalidRequest,
    ShuttingDown,
)
from bunkhouse.front.admission import (
    Admitted,
    ComputeGates,
    Held,
    check_fits,
    drop_admission,
    model_pair_table,
    refuse_before_load,
)
from bunkhouse.front.auth import Keys
from bunkhouse.front.bodies import BodyReader
from bunkhouse.front.constraints import ConstraintGate
from bunkhouse.front.edge import prepare
from bunkhouse.front.protocols import ChatShape, ToolCallShape
from bunkhouse.front.proxy import Shape, client_gone, forward, stream_broke
from bunkhouse.front.relay import StreamShaper
from bunkhouse.front.waiting import WaitingOptions, WaitingStream
from bunkhouse.kvcache.keeper import SnapshotKeeper
from bunkhouse.residency.manager import Lease, ResidencyManager
from bunkhouse.residency.slots import Place, Slot, SlotGate
from bunkhouse.supervisor.handle import file_version

log = logging.getLogger(__name__)

T = TypeVar("T")

Shaper = Callable[[str], Shape]
"""A protocol's shape of a chat answer, made for the model id it names."""


class Pipeline:
    """The stages of a request to a model (see the module docstring), over one catalog and
    one residency manager."""

    def __init__(self, catalog: Catalog, residency: ResidencyManager, compute: ComputeGates,
                 bodies: BodyReader, keys: Keys | None = None,
                 keeper: SnapshotKeeper | None = None, strict_context: bool = False,
                 waiting: WaitingOptions | None = None,
                 constraints: ConstraintGate | None = None) -> None:
        self.catalog = catalog
        self.residency = residency
        self.compute = compute
        self.bodies = bodies
        self.keys = keys or Keys()
        self.keeper = keeper
        self.strict_context = strict_context
        self.waiting = waiting or WaitingOptions()
        self.constraints = constraints or ConstraintGate()  # what a grammar costs, measured

    # -- a generation, every stage --------------------------------------------------------

    async def generate(self, request: Request, route: str, schema: type[BaseModel],
                       parsed: Any, data: dict[str, Any], size: int,
                       shape: Shaper | None = None, cap: bool = False,
                       count_prompt: bool = False) -> Response:
        """Serve one generation (``route``: an OpenAI generation route or ``/infill``;
        ``parsed``: ``data`` as ``schema`` validated it, ``size`` its body's bytes) and
        answer it, in ``shape(model_id)``'s protocol if given. ``cap``: the request's
        ``max_tokens`` is a ceiling, lowered to what the slot holds after the prompt
        (Anthropic's and the Responses API's meaning), not a need refused when it does not
        fit (OpenAI chat completions' with ``--strict-context``; without it every request's
        ``max_tokens`` is a ceiling, as local servers treat it). ``count_prompt``: the
        prompt's tokens are counted before it is sent, for a protocol whose stream says
        them first (Anthropic's ``message_start``)."""
        cap = cap or not self.strict_context
        named = self.catalog.get(parsed.model)
        request.state.model = named.id  # for the access log and /metrics: an adapter's own
        model, adapter = self.catalog.served(named)  # an adapter runs on its base's worker
        data = await self.bodies.cpu(size, prepare, route, schema, model, data, named.id)
        reader = None
        if route == "/v1/chat/completions":  # after prepare: it checks the tools as given
            data, reader = _tool_reader(data)
        await refuse_before_load(model, route, data, functools.partial(model_pair_table, model),
                                 cap=cap)
        self.constraints.refuse_known(model, route, data, self.keys.client_of(request))
        request.state.stream = bool(parsed.stream)
        shaped = _shape(named.id, shape, reader)
        serve = functools.partial(self._serve, request, model, route, bool(parsed.stream),
                                  shaped)
        admit = self.admit(request, model, route, data, cap, count_prompt, adapter)
        if not parsed.stream:  # a client that leaves while it waits gives its place up
            return await serve(await self.unless_gone(request, admit))
        task = asyncio.ensure_future(admit)
        try:
            await asyncio.wait({task}, timeout=self.waiting.headers_after_s)
        except asyncio.CancelledError:
            await drop_admission(task)
            raise
        if task.done():  # admitted, or refused, at once: the usual status and headers
            return await serve(task.result())
        # it waits for a load or a slot: headers now, then pings until it is admitted
        return WaitingStream(
            task, serve, shaped, self.waiting, functools.partial(self._waiting_for, model.id)
            if route == "/v1/chat/completions" and shape is None else None, named.id)

    def _waiting_for(self, model_id: str) -> str | None:
        """What a waiting request waits for, as a client may be told it (--send-loading-state)."""
        state = self.residency.status(model_id).state
        if state == "loading":
            return f"loading model {model_id}"
        if state in ("absent", "draining"):
            return f"waiting for memory to load model {model_id}"
        return None

    # -- stages 3 to 7: admission ---------------------------------------------------------

    async def admit(self, request: Request, model: CatalogModel, route: str,
                    data: dict[str, Any] | None = None, cap: bool = True,
                    count_prompt: bool = False, adapter: CatalogModel | None = None
                    ) -> Admitted:
        """Everything a request waits for before its engine sees it: the lease (loading the
        model if need be; with ``adapter``, an adapter of ``model``, a lease on that too),
        for a generation (``data``) the adapters' fields, its constraint, tokens and fit (and
        its prompt's count if ``count_prompt``), then a slot and a compute turn. ClientGone
        if the client left meanwhile. On an error or a cancel, what was taken is given
        back."""
        queued = time.monotonic()
        place = self._join(model)  # a full line refuses now, whatever the model is doing
        try:
            lease = await self.residency.acquire(model, adapter.id if adapter else None)
        except BaseException:
            if place is not None:
                place.leave()
            raise
        request.state.load_s = time.monotonic() - queued  # its model's load, if it waited
        held = Held(lease)
        if place is not None:
            held.push(place.leave)  # until it takes a slot (again is harmless)
        with self._releasing(lease, held, model.id):
            admitted = Admitted(held, lease.worker.engine, data or {})
            if data is not None and (lease.adapters or adapter is not None):
                await _choose_adapter(admitted, adapter)
            if data is not None:
                admitted = await self._tokens_and_fit(request, model, route, admitted, cap)
                if count_prompt:
                    admitted.prompt_tokens = await _prompt_count(admitted)
            slots = lease.slots
            slot = await slots.enter(admitted.tokens, place, admitted.setting)
            admitted.slot = slot
            held.push(functools.partial(self._leave, model, admitted.engine, slots, slot))
            gate = self.compute.of(lease.worker.placement.node)  # its node's cores
            await gate.enter(model.id)
            held.push(lambda: gate.leave(model.id))
            request.state.queue_s = time.monotonic() - queued  # load, slot and compute turn
            if await request.is_disconnected():  # gone while it waited: never started
                raise ClientGone("the client disconnected while its request waited")
        return admitted

    def _join(self, model: CatalogModel) -> Place | None:
        """The request's place in its model's line (residency/slots.py), before its lease;
        QueueFull (429) at once when the line is full. None for a model residency does not
        track (its lease answers why)."""
        try:
            gate = self.residency.slots(model.id)
        except KeyError:
            return None
        return gate.join()

    async def _tokens_and_fit(self, request: Request, model: CatalogModel, route: str,
                              admitted: Admitted, cap: bool) -> Admitted:
        """Stages 4 and 5: the constraint measured (front/constraints.py), the prompt's
        tokens when KV snapshots restore by them, and the fit in one slot."""
        data, engine = admitted.data, admitted.engine
        admitted.constrained = await self.constraints.check(model, route, data,
                                                            self.keys.client_of(request))
        keeper = self.keeper if self.keeper and self.keeper.active(model) else None
        admitted.keeper = keeper
        admitted.pinned = keeper is not None and engine_for(model).pinnable(route, data)
        if keeper is not None and admitted.pinned:
            admitted.tokens = await keeper.prompt_tokens(model, engine, route, data)
        room = await check_fits(model, route, data, _counter(engine, admitted.tokens), cap=cap)
        if room is not None:
            admitted.data = {**data, "max_tokens": room}
        return admitted

    def _leave(self, model: CatalogModel, engine: EngineClient, slots: SlotGate,
               slot: Slot) -> None:
        slots.leave(slot)
        if self.keeper is not None:
            self.keeper.slot_idle(model, engine, slots, slot)

    async def unless_gone(self, request: Request, work: Awaitable[T]) -> T:
        """``work``'s result, or ClientGone (a 499 nobody reads) once the client left: the
        work is cancelled, so its place in line is given up at once, a load nobody waits for
        any more evicts nothing, and what an admission already took is given back."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await drop_admission(task)
            raise
        finally:
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
        if task.done():
            return task.result()
        log.info("%s: client disconnected while waiting; its place given up",
                 request.url.path[:200])
        await drop_admission(task)
        raise ClientGone("the client disconnected while its request waited or ran")

    def check_still_served(self, lease: Lease) -> None:
        """After waiting for a slot and a compute turn: the front may have begun stopping, or
        the worker died meanwhile; then the request never starts (ShuttingDown, or
        EngineUnavailable to retry)."""
        if self.residency.closing:
            raise ShuttingDown(lease.model_id)
        if not lease.worker.alive:
            raise EngineUnavailable(f"model {lease.model_id!r}: its worker exited while this "
                                    "request waited; retry")

    # -- stages 8 to 10: restore, generate, release ---------------------------------------

    async def _serve(self, request: Request, model: CatalogModel, route: str, stream: bool,
                     shaped: Shape | None, admitted: Admitted,
                     shaper: StreamShaper | None = None) -> Response:
        """Send the admitted request to its worker and relay the answer. ``shaper``: the
        stream's shaper when its first bytes were sent already (a waiting stream)."""
        lease, held, data = admitted.lease, admitted.held, admitted.data
        blamed = functools.cache(functools.partial(  # once: a stall counts once
            self._blamed, lease, model, route, data, self.keys.client_of(request)))
        with self._releasing(lease, held, model.id, blamed):  # forward may have closed it
            self.check_still_served(lease)
            check, slot = await self._restore(model, admitted)
            if admitted.constrained:  # a stall until its answer ends is this request's
                lease.constrained(True)
                held.push(functools.partial(lease.constrained, False))
            response = await forward(admitted.engine, route, data, stream=stream,
                                     request=request, model_id=model.id, slot=slot,
                                     on_done=held.close, on_broken=self._broken(lease, blamed),
                                     on_timings=functools.partial(_noted, request, check),
                                     shape=shaped, started=shaper,
                                     prompt_tokens=admitted.prompt_tokens,
                                     name=request.state.model)
        lease.report(True)  # it answered: whatever it said, it is alive
        return response

    async def _restore(self, model: CatalogModel, admitted: Admitted
                       ) -> tuple[Callable[[Timings], None] | None, int | None]:
        """Stage 8: the slot's KV state restored from a snapshot if one shares more of the
        prompt; the check of the restore by the engine's figures, and the slot the request
        is pinned to (None: the engine chooses)."""
        keeper, slot = admitted.keeper, admitted.slot
        if admitted.adapter_fields is not None and slot is not None and not admitted.pinned:
            admitted.lease.slots.unknown()  # the engine chooses its slot: any may change
            slot.held, slot.setting = None, None
            return None, None
        if keeper is None or slot is None:
            return None, None
        check = None
        prime = None
        if admitted.adapter_fields is not None and slot.id >= 0:
            prime = functools.partial(admitted.engine.prime_slot, slot.id,
                                      admitted.adapter_fields)
        restore = await keeper.prepare(model, admitted.engine, slot, admitted.tokens,
                                       admitted.setting, prime)
        if restore is not None:
            check = functools.partial(keeper.check, model, restore)
        return check, slot.id if admitted.pinned and slot.id >= 0 else None

    def _blamed(self, lease: Lease, model: CatalogModel, route: str, data: dict[str, Any],
                client: str) -> BunkhouseError | None:
        """The error of a request whose worker stalled until it was replaced while it ran
        (residency/step.py ``_probed``): a 400 naming its constraint's field, kept as the
        constraint's verdict so that it is refused at once next time; None for any other
        request."""
        if not lease.blamed():
            return None
        param = self.constraints.blame(model, route, data, client)
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

    # -- stages 3 and 10 alone: a one-off call to a worker --------------------------------

    @contextlib.asynccontextmanager
    async def worker(self, model: CatalogModel) -> AsyncIterator[EngineClient]:
        """The engine of ``model``'s worker (its base's, for an adapter) for one call
        (tokens, a template), under a lease taken for it (loading the model if need be) and
        given back after."""
        lease = await self.residency.acquire(self.catalog.served(model)[0])
        try:
            yield lease.worker.engine
            lease.report(True)  # it answered
        finally:
            lease.release()


async def _choose_adapter(admitted: Admitted, adapter: CatalogModel | None) -> None:
    """The request runs with exactly ``adapter`` (None: the base alone) on a worker that
    mounts adapters: every adapter's scale set in its body, and its adapter setting noted
    for its slot and its KV snapshots (a LoRA's file and scale; "" the base)."""
    chosen = adapter.adapter if adapter is not None else None
    fields = await admitted.engine.adapter_fields(admitted.lease.adapters, chosen)
    admitted.data = {**admitted.data, **fields}
    admitted.adapter_fields = fields
    versions = admitted.lease.worker.adapter_versions
    admitted.setting = "" if chosen is None else _setting(chosen, versions)


def _setting(adapter: Adapter, versions: Mapping[str, str]) -> str:
    """What KV state computed under ``adapter`` depends on: its file as the worker mounted it
    (``versions``: path, size, modification time when it started; a file replaced under the
    same name is another adapter, from the next worker on) and its scale."""
    version = versions.get(str(adapter.path)) or file_version(adapter.path)
    return f"{adapter.path}|{version}|{adapter.scale}"


def _tool_reader(data: dict[str, Any]) -> tuple[dict[str, Any], ToolCallReader | None]:
    """The chat request to send and the reader of the tool calls in its answer's text
    (api/tool_calls.py). Raises InvalidRequest for a tool_choice that cannot be met."""
    check_tool_choice(data)
    return ToolCallReader.for_request(data)


def _shape(model_id: str, shape: Shaper | None, reader: ToolCallReader | None) -> Shape | None:
    """The protocol's shape, with the tool-call reader in front of it if there is one."""
    inner = shape(model_id) if shape else None
    if reader is None:
        return inner
    return ToolCallShape(reader, inner or ChatShape())


async def _prompt_count(admitted: Admitted) -> int:
    """The tokens of the admitted chat request's prompt as its engine prefills them (its
    template, tools and all): counted when snapshots needed them, else now."""
    if admitted.tokens is not None:
        return len(admitted.tokens)
    return len(await admitted.engine.tokenize(admitted.data))


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


def _noted(request: Request, then: Callable[[Timings], None] | None,
           timings: Timings) -> None:
    """The engine's figures of an answer: its tokens noted for the access log and /metrics,
    then ``then`` (the KV restore's check) if any."""
    request.state.tokens = (timings.prompt_tokens + timings.cached_tokens,
                            timings.generated_tokens)
    request.state.timings = timings
    if then is not None:
        then(timings)
