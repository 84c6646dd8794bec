"""The front's ASGI app: its routes, each a thin translation in front of the one request
pipeline (front/pipeline.py), its lifespan, and every error rendered once."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bunkhouse import __version__, defaults
from bunkhouse.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    InfillRequest,
)
from bunkhouse.catalog import Catalog
from bunkhouse.config import default_data_dir
from bunkhouse.errors import BunkhouseError, MethodNotAllowed, NotFound, log_line
from bunkhouse.front.access import AccessLog
from bunkhouse.front.admin import Admin, AdminOptions
from bunkhouse.front.admission import ComputeGates
from bunkhouse.front.anthropic import AnthropicRoutes
from bunkhouse.front.audio import Transcriptions
from bunkhouse.front.auth import Keys, Level, access
from bunkhouse.front.bodies import BodyReader
from bunkhouse.front.console import Console
from bunkhouse.front.constraints import ConstraintGate
from bunkhouse.front.cors import Cors
from bunkhouse.front.edge import SKIPPED_TOOLS_HEADER
from bunkhouse.front.extras import Extras
from bunkhouse.front.metrics import DraftTally, Metrics
from bunkhouse.front.models import ModelViews
from bunkhouse.front.ollama import OllamaRoutes
from bunkhouse.front.openai import OpenAIRoutes
from bunkhouse.front.openapi import openapi
from bunkhouse.front.pipeline import Pipeline
from bunkhouse.front.protocols import error_envelope
from bunkhouse.front.pull_routes import PullRoutes
from bunkhouse.front.pulls import Pulls
from bunkhouse.front.reload import Reloader
from bunkhouse.front.response_store import ResponseStore, ResponseStoreError
from bunkhouse.front.responses import ResponsesRoutes
from bunkhouse.front.site import SiteGuard, SitePolicy
from bunkhouse.front.waiting import WaitingOptions
from bunkhouse.front.watch import EventStream
from bunkhouse.kvcache.keeper import SnapshotKeeper
from bunkhouse.residency.manager import ResidencyManager

if TYPE_CHECKING:
    from bunkhouse.cluster.front import Cluster

log = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True)
class FrontOptions:
    """How the front serves (the composition root fills it from the settings).

    ``site``: the Host and cross-site rules (front/site.py); the default serves loopback
    names only, as when bound to 127.0.0.1. ``cors_origins``: origins browsers may call from
    besides loopback ones (front/cors.py). ``events_heartbeat_s``: seconds of silence on
    ``GET /admin/events`` before a comment line is sent. ``waiting``: how a streamed request
    that waits is answered meanwhile (front/waiting.py). ``max_audio_bytes``: the largest
    audio upload (front/audio.py). ``strict_context``: an OpenAI chat request's
    ``max_tokens`` is a need, refused when it does not fit, not a ceiling."""

    max_body_bytes: int = defaults.MAX_BODY_BYTES
    admin: AdminOptions = dataclasses.field(default_factory=AdminOptions)
    site: SitePolicy = dataclasses.field(default_factory=SitePolicy)
    strict_context: bool = False
    cors_origins: Sequence[str] = ()
    events_heartbeat_s: float = 15.0
    waiting: WaitingOptions = dataclasses.field(default_factory=WaitingOptions)
    max_audio_bytes: int = defaults.MAX_AUDIO_BYTES


@dataclasses.dataclass
class Parts:
    """What the app is made of beyond the catalog and residency: each optional part is
    off when None. ``responses``: where Responses API answers are stored (opened at startup).
    ``reloader``: how the configuration is re-read, on ``POST /admin/reload`` and on SIGHUP.
    ``constraints``: what measures requests' constraints (front/constraints.py; default: a
    probe process per model). ``cluster``: the Ray cluster whose nodes run the workers
    (started before the preloads, closed after residency). ``pulls``: the downloads from
    the Hugging Face hub (cancelled first when the app stops). ``on_shutdown``: called last
    when the app stops."""

    preload: Sequence[str] = ()
    compute: ComputeGates | None = None
    keys: Keys | None = None
    keeper: SnapshotKeeper | None = None
    responses: ResponseStore | None = None
    reloader: Reloader | None = None
    constraints: ConstraintGate | None = None
    cluster: Cluster | None = None
    pulls: Pulls | None = None
    on_shutdown: Callable[[], None] | None = None


def build_app(catalog: Catalog, residency: ResidencyManager, parts: Parts | None = None,
              options: FrontOptions | None = None) -> Starlette:
    """The front's ASGI app over ``catalog`` and ``residency``."""
    parts = parts or Parts()
    options = options or FrontOptions()
    pulls = PullRoutes(parts.pulls or Pulls(default_data_dir(), residency.events))
    keys = parts.keys or Keys()
    pipeline = Pipeline(catalog, residency, parts.compute or ComputeGates(),
                        BodyReader(keys, options.max_body_bytes), keys, parts.keeper,
                        options.strict_context, options.waiting, parts.constraints)
    drafts = DraftTally()
    views = ModelViews(catalog, residency, keys, parts.keeper, drafts)
    metrics = Metrics(residency, pipeline.compute, parts.keeper, drafts)
    routes = [*_generation_routes(pipeline, options), *_model_routes(pipeline, views, parts,
                                                                      options, pulls),
              *_ollama_routes(pipeline, pulls),
              *_service_routes(pipeline, views, metrics, options)]
    guarded = [Route(path, _guarded(keys, method, path, handler), methods=[method])
               for method, path, handler in routes]
    return Starlette(routes=guarded, exception_handlers=_error_handlers(keys),
                     lifespan=functools.partial(_lifespan, pipeline, parts),
                     middleware=[Middleware(AccessLog, observe=metrics.observe),
                                 Middleware(Cors, origins=options.cors_origins),
                                 Middleware(SiteGuard, policy=options.site)])


Handler = Callable[[Request], Awaitable[Response]]
RouteSpec = tuple[str, str, Handler]


def _guarded(keys: Keys, method: str, path: str, handler: Handler) -> Handler:
    """``handler`` behind the key its route needs (front/auth.py), its request noted for
    the access log and /metrics."""
    guarded = keys.guard(access(method, path), handler)

    async def noted(request: Request) -> Response:
        request.state.route = path  # a bounded label for /metrics
        request.state.received_ns = time.monotonic_ns()
        response = await guarded(request)
        response.headers.update(_skipped_header(request))
        return response

    return noted


def _skipped_header(request: Request) -> dict[str, str]:
    """The tools the model cannot run that the request's were left without (api/fields.py),
    for its answer, an error's too (a ``tool_choice`` naming one of them)."""
    skipped = getattr(request.state, "skipped_tools", None)
    return {SKIPPED_TOOLS_HEADER: skipped} if skipped else {}


def _generation_routes(pipeline: Pipeline, options: FrontOptions) -> list[RouteSpec]:
    openai = OpenAIRoutes(pipeline)
    anthropic = AnthropicRoutes(pipeline)
    extras = Extras(pipeline)
    audio = Transcriptions(pipeline, options.max_audio_bytes)
    return [
        ("POST", "/v1/chat/completions",
         openai.generation("/v1/chat/completions", ChatCompletionRequest)),
        ("POST", "/v1/completions", openai.generation("/v1/completions", CompletionRequest)),
        ("POST", "/v1/embeddings", openai.generation("/v1/embeddings", EmbeddingRequest)),
        ("POST", "/infill", openai.generation("/infill", InfillRequest)),
        ("POST", "/tokenize", extras.tokenize),
        ("POST", "/detokenize", extras.detokenize),
        ("POST", "/apply-template", extras.apply_template),
        ("POST", "/v1/messages", anthropic.messages),
        ("POST", "/v1/messages/count_tokens", anthropic.count_tokens),
        ("POST", "/v1/audio/transcriptions", audio.create),
    ]


def _model_routes(pipeline: Pipeline, views: ModelViews, parts: Parts,
                  options: FrontOptions, pulls: PullRoutes) -> list[RouteSpec]:
    stored = ResponsesRoutes(pipeline, parts.responses)
    admin = Admin(pipeline.catalog, pipeline.residency, options.admin,
                  functools.partial(views.model_object, detail=True), parts.keeper,
                  parts.reloader)
    return [
        ("POST", "/v1/responses", stored.create),
        ("GET", "/v1/responses/{response_id}", stored.retrieve),
        ("DELETE", "/v1/responses/{response_id}", stored.delete),
        ("GET", "/v1/responses/{response_id}/input_items", stored.input_items),
        ("GET", "/v1/models", views.list_models),
        ("POST", "/v1/models", admin.register),
        ("POST", "/v1/models/{model_id:path}/{action}", admin.action),
        ("GET", "/v1/models/{model_id:path}", views.get_model),
        ("DELETE", "/v1/models/{model_id:path}", admin.delete),
        ("POST", "/admin/cache/flush", admin.cache_flush),
        ("DELETE", "/admin/cache", admin.cache_purge),
        ("POST", "/admin/reload", admin.reload),
        ("POST", "/admin/default", admin.set_default),
        ("POST", "/admin/pause", admin.pause),
        ("POST", "/admin/resume", admin.resume),
        ("DELETE", "/admin/cache/{model_id:path}", admin.cache_purge),
        ("POST", "/admin/pull", pulls.start),
        ("GET", "/admin/pull", pulls.list),
        ("DELETE", "/admin/pull/{pull_id}", pulls.cancel),
    ]


def _ollama_routes(pipeline: Pipeline, pulls: PullRoutes) -> list[RouteSpec]:
    olla = OllamaRoutes(pipeline)
    return [
        ("POST", "/api/chat", olla.chat),
        ("POST", "/api/generate", olla.generate),
        ("POST", "/api/embed", olla.embed),
        ("POST", "/api/embeddings", olla.embed),
        ("GET", "/api/version", olla.version),
        ("GET", "/api/tags", olla.tags),
        ("GET", "/api/ps", olla.ps),
        ("POST", "/api/show", olla.show),
        ("POST", "/api/pull", pulls.ollama),
        *(("POST", f"/api/{name}", olla.not_served) for name in ("push", "create", "copy")),
        ("DELETE", "/api/delete", olla.not_served),
    ]


def _service_routes(pipeline: Pipeline, views: ModelViews, metrics: Metrics,
                    options: FrontOptions) -> list[RouteSpec]:
    keys = pipeline.keys
    watch = EventStream(pipeline.residency.events, keys.client_of, options.events_heartbeat_s,
                        views.is_admin)
    console = Console()
    return [
        ("GET", "/health", views.health),
        ("GET", "/stats", views.stats),
        ("GET", "/metrics", metrics.scrape),
        ("GET", "/admin/events", watch.follow),
        ("GET", "/", console.page),
        ("GET", "/console/{name}", console.asset),
        ("GET", "/openapi.json", _openapi),
    ]


async def _openapi(request: Request) -> Response:
    return JSONResponse(openapi(__version__))


@contextlib.asynccontextmanager
async def _lifespan(pipeline: Pipeline, parts: Parts, app: Starlette) -> AsyncIterator[None]:
    """Open residency and the response store, preload, keep a spare worker; on the way out
    stop SIGHUP reloads, the idle saves, the probe, every worker and every event stream."""
    residency, catalog = pipeline.residency, pipeline.catalog
    pulls = parts.pulls
    residency.open()
    hangups = _on_hangup(parts.reloader)
    if parts.responses is not None:
        await _open_responses(parts.responses)
    if parts.cluster is not None:
        await parts.cluster.start(residency)
    try:
        for model_id in parts.preload:
            try:
                await residency.load(catalog.served(catalog.get(model_id))[0].id)
            except BunkhouseError as e:  # serve the others; requests get the error
                log.error("could not preload model %s: %s", model_id, e.message)
        residency.keep_spare_for(catalog.default_id)  # even the first load finds one
        yield
    finally:
        if pulls is not None:
            await pulls.close()  # first: a stop waits for no download
        if parts.reloader is not None:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        await asyncio.gather(*hangups, return_exceptions=True)
        if parts.keeper is not None:
            await parts.keeper.close()  # idle saves stop; each drain saves what is unsaved
        pipeline.constraints.close()
        await residency.close()
        if parts.cluster is not None:
            await parts.cluster.close()  # the agent, and what Ray ran for it, end
        residency.events.close()  # every event stream ends
        if parts.keeper is not None:
            parts.keeper.log_shutdown([m.id for m in catalog])
        if parts.responses is not None:
            await parts.responses.close()
        if parts.on_shutdown is not None:
            parts.on_shutdown()


def _on_hangup(reloader: Reloader | None) -> set[asyncio.Task[Any]]:
    """Reload on SIGHUP; the reloads under way (awaited at shutdown)."""
    hangups: set[asyncio.Task[Any]] = set()
    if reloader is None:
        return hangups

    def hangup() -> None:
        task = asyncio.create_task(reloader.reload("SIGHUP"))
        hangups.add(task)
        task.add_done_callback(hangups.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # logged

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, hangup)
    return hangups


async def _open_responses(responses: ResponseStore) -> None:
    try:
        count = await responses.open()
        log.info("stored responses in %s (%d kept)", responses.path, count)
    except ResponseStoreError as e:
        log.warning("responses not stored: %s", e.detail or e.message)


ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


def _error_handlers(keys: Keys) -> dict[Any, ErrorHandler]:
    """Every error rendered once, here: the detail of an error (a worker's output, server
    paths) only to an admin-key caller, and always to the log."""

    async def bunkhouse_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, BunkhouseError)
        line = log_line(exc)  # once: a fault logged where it happened, a short line here
        if line is not None:
            log.log(line[0], "%s %s: %s", request.method, request.url.path[:200], line[1],
                    extra={"output": line[2]})
        detail = keys.level_of(request) is Level.ADMIN
        return JSONResponse(error_envelope(request.url.path, exc, detail),
                            status_code=exc.status,
                            headers={**exc.headers(), **_skipped_header(request)})

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
