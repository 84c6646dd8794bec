"""Runtime model control: register, delete, load, unload, pin and unpin models.

Every endpoint here needs an admin key (front/auth.py); registering a model by path also
needs ``--allow-runtime-load`` and a path that resolves (symlinks and ``..`` followed) inside
one of the allowed roots. Changes live in memory: the config file stays the source of truth.

    POST   /v1/models                 {"id", "path", context?, parallel?, queue?, ttl?, pinned?,
                                       embeddings?, engine?, the llama.cpp options}
           200 model object once ready; 409 id taken; 403 disabled or outside the roots;
           400 not a loadable local model (with the engine's reason)
           {"id", "path", "adapter_of", scale?}: a LoRA adapter of a served model, 200 its
           model object at once (its base re-mounted with it when next used or now, if
           resident); 400 naming adapter_of, path or scale for one that cannot be
    DELETE /v1/models/{id}            204 freed; 202 still draining; 404; 409 pinned by config;
                                      an adapter: 204 gone, 409 held by a request or configured
    POST   /v1/models/{id}/load       200 model object once ready, with "changed" (false:
                                      it was ready already)
    POST   /v1/models/{id}/unload     204 freed; 202 still draining; 200 model object with
                                      "changed": false when it held nothing (absent, failed)
    POST   /v1/models/{id}/pin        200 model object, with "changed" (false: it was so)
    POST   /v1/models/{id}/unpin      200 model object, with "changed" (false: it was so)
    POST   /admin/pause               {"max_s"?}: 200 once the requests in flight finished
    POST   /admin/resume              200 {"resumed": bool}
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bunkhouse.api.schemas import parse_json_object, read_body, validate
from bunkhouse.catalog import Catalog, CatalogModel
from bunkhouse.catalog.catalog import (
    effective_options,
    files_size,
    make_adapter,
    model_files,
    settle,
)
from bunkhouse.config import DEFAULT_ENGINE, EngineOptions, check_model_id, check_scale
from bunkhouse.defaults import DRAIN_GRACE_S
from bunkhouse.engines import ENGINES, LLAMA_SERVER
from bunkhouse.errors import (
    ConfigError,
    Conflict,
    Forbidden,
    GGUFError,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    WorkerLoadFailed,
)
from bunkhouse.front.reload import Reloader
from bunkhouse.gguf.meta import read_gguf_info
from bunkhouse.kvcache.keeper import SnapshotKeeper
from bunkhouse.residency.manager import ResidencyManager

log = logging.getLogger(__name__)


PAUSE_MAX_S = 300
"""How long an operator's pause holds when nobody resumes it, seconds, by default."""
PAUSE_LIMIT_S = 3600
"""The longest pause ``max_s`` may ask for, seconds."""


@dataclass(frozen=True, slots=True)
class AdminOptions:
    allow_runtime_load: bool = False
    roots: tuple[Path, ...] = ()  # where runtime-registered model files may live
    defaults: EngineOptions = field(default_factory=EngineOptions)
    drain_grace_s: float = DRAIN_GRACE_S
    default_engine: str = DEFAULT_ENGINE  # of a registration that names none ([defaults])


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: StrictStr
    path: StrictStr
    context: StrictInt | None = Field(default=None, ge=1)
    parallel: StrictInt | None = Field(default=None, ge=1)
    queue: StrictInt | None = Field(default=None, ge=0)
    ttl: float | None = Field(default=None, ge=0)
    pinned: StrictBool = False
    embeddings: StrictBool | None = None  # None: on for embedding models only
    adapter_of: StrictStr | None = None  # a LoRA adapter of this base model
    scale: StrictFloat | StrictInt | None = None  # an adapter's scale (config.check_scale)
    # "llama.cpp" or "llama-server" (None: [defaults]'s); llama-server's args are the config
    # file's only: a flag passed to a binary can name a file it writes
    engine: StrictStr | None = None
    # the llama.cpp engine's options of the config file's keys (checked by its adapter)
    speculative: StrictStr | None = None
    draft: StrictStr | None = None
    draft_max: StrictInt | None = None
    draft_min: StrictInt | None = None
    mtp: StrictBool | None = None
    cache_type_k: StrictStr | None = None
    cache_type_v: StrictStr | None = None
    flash_attn: StrictBool | StrictStr | None = None

    @property
    def model_fields_given(self) -> list[str]:
        """The fields of a model (not an adapter) given in this request."""
        return [name for name in ("context", "parallel", "queue", "ttl", "embeddings",
                                  "engine", *ENGINE_FIELDS)
                if getattr(self, name) is not None] + (["pinned"] if self.pinned else [])

    @property
    def engine_keys(self) -> tuple[tuple[str, Any], ...]:
        return tuple((k, getattr(self, k)) for k in ENGINE_FIELDS if getattr(self, k) is not None)


ENGINE_FIELDS = tuple(name for name in RegisterRequest.model_fields
                      if name in ENGINES[DEFAULT_ENGINE].known_options)
"""The default engine's own options that a registration may set (its adapter checks them)."""

GGUF_ENGINES = frozenset({DEFAULT_ENGINE, LLAMA_SERVER.name})
"""The engines a registration may name (a GGUF model's)."""


def _named_field(message: str) -> str | None:
    """The request field an option's error names first (``draft: ...``, ``cache_type_v =
    ...``), if it is one."""
    first = re.match(r"\s*(\w+)", message)
    return first.group(1) if first and first.group(1) in ENGINE_FIELDS else None


def inside_roots(path: str, roots: tuple[Path, ...]) -> Path | None:
    """The real path of ``path`` if it lies inside one of ``roots`` (after resolving)."""
    real = Path(os.path.realpath(os.path.expanduser(path)))
    for root in roots:
        real_root = os.path.realpath(root)
        if os.path.commonpath([real_root, real]) == real_root:
            return real
    return None


class Admin:
    def __init__(self, catalog: Catalog, residency: ResidencyManager, options: AdminOptions,
                 describe: Callable[[CatalogModel], dict[str, Any]],
                 keeper: SnapshotKeeper | None = None,
                 reloader: Reloader | None = None) -> None:
        self.catalog = catalog
        self.residency = residency
        self.options = options
        self.describe = describe
        self.keeper = keeper
        self.reloader = reloader

    async def reload(self, request: Request) -> Response:
        """Re-read the configuration file and the model folders (front/reload.py)."""
        if self.reloader is None:
            raise Conflict("this server cannot reload its configuration")
        return JSONResponse(await self.reloader.reload("an operator asked"))

    async def set_default(self, request: Request) -> Response:
        """``{"model": ID}``: requests that name no model go to it from now on (until a
        restart). Answers its model object with ``changed`` (false: it was the default)."""
        data = parse_json_object(await read_body(request, 64 * 1024))
        name = data.get("model")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("needs a string field 'model': the model to make the "
                                 "default", param="model")
        before = self.catalog.default_id
        model = self.catalog.set_default(name)
        if model.id != before:
            log.info("default model switched to %s by an operator", model.id)
        return JSONResponse({**self.describe(model), "changed": model.id != before})

    async def pause(self, request: Request) -> Response:
        """``{"max_s": N}`` (optional, seconds, default :data:`PAUSE_MAX_S`): hold every
        model paused until ``POST /admin/resume`` or ``max_s`` seconds. Answers once the
        requests in flight have finished (or the pause ended meanwhile: ``paused`` false);
        a client that leaves before that leaves the pause held. ``extended``: a pause was
        held already, and only its end moved."""
        body = await read_body(request, 64 * 1024)
        data = parse_json_object(body) if body.strip() else {}
        max_s = data.get("max_s", PAUSE_MAX_S)
        if isinstance(max_s, bool) or not isinstance(max_s, int | float) \
                or not 1 <= max_s <= PAUSE_LIMIT_S:
            raise InvalidRequest(f"max_s must be a number of seconds from 1 to "
                                 f"{PAUSE_LIMIT_S}", param="max_s")
        already = bool(self.residency.pause_status()["paused"])
        ends = await self.residency.operator_pause(float(max_s))
        log.info("every model paused by an operator (for %.0f s at most)%s", max_s,
                 "; it was paused already: its end moved" if already else "")
        held = await self.residency.paused_quiet()
        return JSONResponse({"paused": held, "in_flight": self.residency.in_flight(),
                             "resumes_at": ends if held else None, "extended": already})

    async def resume(self, request: Request) -> Response:
        """End the pause: every waiting request goes on. ``resumed`` false when no pause was
        held."""
        resumed = await self.residency.operator_resume()
        if resumed:
            log.info("every model resumed by an operator")
        return JSONResponse({"paused": False, "resumed": resumed})

    def _snapshots(self) -> SnapshotKeeper:
        if self.keeper is None:
            raise Conflict("KV snapshots are off on this server: --kv-cache-max 0, or its "
                           "--kv-cache-dir could not be used (its log says why at start)")
        return self.keeper

    async def cache_flush(self, request: Request) -> Response:
        """Save every ready model's unsaved idle slots now."""
        keeper = self._snapshots()
        flushed = {}
        for model, engine, gate in self.residency.ready_workers():
            report = await keeper.flush(model, engine, gate, "flushed by an operator")
            flushed[model.id] = report.as_dict()
        return JSONResponse({"flushed": flushed, "kv_cache": keeper.report(detail=True)})

    async def cache_purge(self, request: Request) -> Response:
        """Remove every snapshot, or one model's (``/admin/cache/{model_id}``)."""
        keeper = self._snapshots()
        model_id = request.path_params.get("model_id")
        if model_id is not None and model_id not in self.catalog \
                and not keeper.model_stats(model_id)[0]:
            raise NotFound(f"no model {model_id[:200]!r} and no snapshots of it",
                           param="model")
        removed = await asyncio.to_thread(keeper.purge, model_id)
        log.info("KV snapshots purged by an operator: %d of %s", removed,
                 model_id or "every model")
        return JSONResponse({"removed": removed, "kv_cache": keeper.report(detail=True)})

    async def register(self, request: Request) -> Response:
        if not self.options.allow_runtime_load:
            raise Forbidden("runtime model loading is off; start the server with "
                            "--allow-runtime-load")
        data = parse_json_object(await read_body(request, 64 * 1024))
        if not isinstance(data.get("id"), str) or not isinstance(data.get("path"), str):
            raise InvalidRequest("needs string fields 'id' and 'path'")
        body = validate(RegisterRequest, data)
        try:
            check_model_id(body.id, "id")
        except ConfigError as e:
            raise InvalidRequest(e.message, param="id") from e
        if self.catalog.taken(body.id) or self.catalog.resolve(body.id) is not None:
            raise Conflict(f"model id {body.id!r} is already in use (as Ollama reads names, "
                           "NAME and NAME:latest are one)", param="id")
        if body.adapter_of is not None:
            return await self._register_adapter(body)
        if body.scale is not None:
            raise InvalidRequest("scale is an adapter's: give adapter_of too", param="scale")
        model = await self._model(body)
        await self.residency.register(model)  # 409 if the id was taken meanwhile
        try:
            await self.residency.load(model.id)
        except BaseException as e:
            # catalog entry, residency record and slot gate go together
            await asyncio.shield(self.residency.delete(model.id, "its load failed", 0.0))
            if isinstance(e, WorkerLoadFailed):
                raise InvalidRequest(f"{body.path} is not a loadable model: "  # admins only
                                     f"{e.full_message()}", param="path") from e
            raise
        log.info("model %s: registered at runtime from %s", model.id, model.path)
        return JSONResponse(self.describe(model))

    async def _register_adapter(self, body: RegisterRequest) -> Response:
        """A LoRA adapter of a served base model (``adapter_of``): checked, added to the
        catalog and mounted on its base (a resident base is re-mounted once its requests
        end, its conversations' KV state kept). 400 naming the field for what cannot be."""
        given = body.model_fields_given
        if given:
            raise InvalidRequest(f"{given[0]}: an adapter is served with its base's settings; "
                                 "give only id, path, adapter_of and scale", param=given[0])
        assert body.adapter_of is not None
        try:
            scale = check_scale(1.0 if body.scale is None else body.scale, "scale")
        except ConfigError as e:
            raise InvalidRequest(e.message, param="scale") from e
        try:
            base = self.catalog.get(body.adapter_of)
        except ModelNotFound as e:
            raise InvalidRequest(f"adapter_of: {e.message}", param="adapter_of") from e
        real = self._checked_path(body.path)
        try:
            adapter = await asyncio.to_thread(make_adapter, body.id, real, base, scale,
                                              "runtime")
        except ConfigError as e:
            param = e.message.split(":", 1)[0]
            raise InvalidRequest(e.message, param=param if param in ("adapter_of", "path")
                                 else None) from e
        await self.residency.mount(base.id, added=adapter)  # 409 if the id was taken
        log.info("adapter %s of %s: registered at runtime from %s", adapter.id, base.id, real)
        return JSONResponse(self.describe(adapter))

    def _checked_path(self, path: str) -> Path:
        """A runtime model's path as its real path, inside the allowed roots and a file;
        InvalidRequest or Forbidden naming ``path``."""
        if "\0" in path:
            raise InvalidRequest("path contains a NUL byte", param="path")
        try:
            real = inside_roots(path, self.options.roots)
        except (OSError, ValueError) as e:
            raise InvalidRequest(f"path cannot be resolved: {e}", param="path") from e
        if real is None:
            log.warning("refused a runtime model path outside the allowed roots: %r",
                        path[:300])
            raise Forbidden("path is outside the allowed model roots", param="path")
        try:
            if real.is_dir():
                raise InvalidRequest(
                    "path is a directory: models registered at run time are GGUF files; "
                    "serve an MLX model directory from the config file or a model root "
                    "(then POST /admin/reload)", param="path")
            if not real.is_file():
                raise InvalidRequest("path is not a file", param="path")
        except OSError as e:
            raise InvalidRequest(f"path cannot be read: {e.strerror}", param="path") from e
        return real

    async def _model(self, body: RegisterRequest) -> CatalogModel:
        real = self._checked_path(body.path)
        try:
            # A large or hostile header takes a while to scan: off the event loop.
            info = await asyncio.to_thread(read_gguf_info, real)
            if info.general_type == "adapter":
                raise InvalidRequest("path is a LoRA adapter, not a model: register it with "
                                     "adapter_of, the base model's id", param="path")
            st = real.stat()
            files = model_files(real, info.split_count)
            outside = [f for f in files if inside_roots(str(f), self.options.roots) != f]
            if outside:  # a part that is a link, or leads out of the roots
                log.warning("refused a runtime model whose parts lead elsewhere: %s", outside)
                raise Forbidden("a part of the split model is outside the allowed model "
                                "roots, or a link", param="path")
            size = files_size(files)
        except OSError as e:  # a name too long, no permission, gone meanwhile
            raise InvalidRequest(f"path cannot be read: {e.strerror}", param="path") from e
        except GGUFError as e:
            raise InvalidRequest(f"not a GGUF model: {e.message}", param="path") from e
        overrides = {k: v for k, v in (("context", body.context), ("parallel", body.parallel),
                                       ("queue", body.queue), ("embeddings", body.embeddings))
                     if v is not None}
        if body.context is not None:
            overrides["context_auto"] = False
        where = f"model {body.id!r}"
        engine = self.options.default_engine if body.engine is None else body.engine
        if engine not in GGUF_ENGINES:
            raise InvalidRequest(f"engine must be one of {sorted(GGUF_ENGINES)}, not "
                                 f"{engine!r}", param="engine")
        try:
            options = effective_options(self.options.defaults, overrides, info, where,
                                        engine=engine, own=body.engine_keys)
        except ConfigError as e:
            message = e.message.removeprefix(f"{where}: ")
            raise InvalidRequest(message, param=_named_field(message)) from e
        model = CatalogModel(body.id, real, "runtime", info, options, size,
                             modified=int(st.st_mtime), pinned=body.pinned, ttl_s=body.ttl,
                             engine=engine)
        model = await asyncio.to_thread(settle, model, self._served, Path.cwd(),
                                        self._draft_path)
        if model.refused:
            raise InvalidRequest(model.refused, param=_named_field(model.refused))
        return model

    def _served(self, name: str) -> CatalogModel | None:
        found = self.catalog.resolve(name)
        return self.catalog.get(found) if found is not None else None

    def _draft_path(self, path: Path) -> Path:
        """A runtime model's draft given by path: inside the allowed roots, as its own."""
        real = inside_roots(str(path), self.options.roots)
        if real is None:
            log.warning("refused a runtime draft model outside the allowed roots: %r",
                        str(path)[:300])
            raise Forbidden("draft is outside the allowed model roots", param="draft")
        return real

    def _known(self, request: Request) -> CatalogModel:
        model = self.catalog.get(request.path_params["model_id"])
        request.state.model = model.id  # for the access log and /metrics
        return model

    async def delete(self, request: Request) -> Response:
        model = self._known(request)
        if model.adapter_of is not None:
            return await self._delete_adapter(model)
        if self.residency.status(model.id).pinned and model.source != "runtime":
            raise Conflict(f"model {model.id!r} is pinned; unpin it first "
                           f"(POST /v1/models/{model.id}/unpin)")
        reason, grace = "deleted by an operator", self.options.drain_grace_s
        freed: bool | None  # None: it held nothing (a configured model stays, absent)
        if model.source == "runtime":  # gone from the catalog: its id is free once absent
            freed = await self.residency.delete(model.id, reason, grace)
        else:  # a configured model stays listed: unloaded
            freed = await self.residency.unload(model.id, reason, grace)
        return Response(status_code=202 if freed is False else 204)

    async def _delete_adapter(self, adapter: CatalogModel) -> Response:
        """204 once a runtime adapter left the catalog (its base re-mounted without it);
        409 while a request holds it, or for one the config file names."""
        if adapter.source != "runtime":
            raise Conflict(f"adapter {adapter.id!r} is configured in the config file; remove "
                           "its [[models]] entry there and reload (POST /admin/reload)")
        assert adapter.adapter_of is not None
        await self.residency.mount(adapter.adapter_of, removed=adapter.id)
        log.info("adapter %s of %s: deleted by an operator", adapter.id, adapter.adapter_of)
        return Response(status_code=204)

    async def action(self, request: Request) -> Response:
        """load, unload, pin or unpin: the model object with ``changed`` (false: it was so
        already), or for an unload that stopped a worker 204 (freed) or 202 (draining)."""
        named = self._known(request)
        action = request.path_params["action"]
        if named.adapter_of is not None and action in ("pin", "unpin"):
            raise InvalidRequest(f"{named.id!r} is an adapter of {named.adapter_of!r}: "
                                 f"{action} its base model", param="model")
        model = self.catalog.served(named)[0]  # an adapter loads with its base
        if action == "load":
            before = self.residency.status(model.id)
            await self.residency.load(model.id, reset=True)
            changed = before.state != "ready" or before.pid != \
                self.residency.status(model.id).pid
        elif action == "unload":
            freed = await self.residency.unload(model.id, "unloaded by an operator",
                                                self.options.drain_grace_s)
            if freed is not None:
                return Response(status_code=204 if freed else 202)
            changed = False  # it held nothing
        elif action in ("pin", "unpin"):
            changed = await self.residency.set_pinned(model.id, action == "pin")
        else:
            raise NotFound(f"no action {action!r}; use load, unload, pin or unpin")
        return JSONResponse({**self.describe(named), "changed": changed})
