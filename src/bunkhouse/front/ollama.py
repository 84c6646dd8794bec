"""Ollama's API on the same port (Ollama's docs/api.md): ``/api/chat`` and ``/api/generate``
translated by api/ollama.py and served by the one generation path (``Pipeline.generate``);
``/api/version``, ``/api/tags``, ``/api/ps``, ``/api/show`` from the catalog and residency;
``/api/pull`` is front/pull_routes.py's; ``push``, ``create``, ``copy`` and ``delete`` answer
501 saying what bunkhouse does instead. Errors come as Ollama's ``{"error": "..."}``
(front/protocols.py)."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bunkhouse import __version__
from bunkhouse.api import ollama
from bunkhouse.api.fields import function_tool, read_object, rename_error, skipped_tools
from bunkhouse.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    InfillRequest,
    parse_json_object,
    validate,
)
from bunkhouse.catalog import CatalogModel
from bunkhouse.errors import BunkhouseError, InvalidRequest
from bunkhouse.front.edge import check_generates, note_skipped_tools
from bunkhouse.front.pipeline import Pipeline
from bunkhouse.front.protocols import InfillShape, OllamaEmbedShape, OllamaShape
from bunkhouse.front.proxy import Shape


class NotServed(BunkhouseError):
    status = 501
    type = "invalid_request_error"
    code = "not_implemented"


def _time(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat().replace("+00:00", "Z")


def _digest(model: CatalogModel) -> str:
    """A stable stand-in for Ollama's blob digest (hashing gigabytes per listing is not
    worth it): the file's path, size and time."""
    return hashlib.sha256(f"{model.path}:{model.size_bytes}:{model.modified}".encode()
                          ).hexdigest()


def _details(model: CatalogModel, base: CatalogModel | None = None) -> dict[str, Any]:
    """Ollama's ``details``, from the model file's metadata; an adapter's are its ``base``'s,
    with the base as ``parent_model`` (as Ollama shows a model made ``FROM`` another)."""
    weights = base or model
    arch = weights.info.architecture
    return {"parent_model": ollama.tagged(base.id) if base is not None else "",
            "format": "gguf", "family": arch, "families": [arch],
            "parameter_size": ollama.parameter_size(weights.info.parameters),
            "quantization_level": weights.info.quantization}


def _listed(model: CatalogModel, name: str, base: CatalogModel | None = None
            ) -> dict[str, Any]:
    """``model`` as ``/api/tags`` lists it under ``name`` (its id or an alias); ``base``:
    an adapter's base."""
    return {"name": ollama.tagged(name), "model": ollama.tagged(name),
            "modified_at": _time(model.modified), "size": model.size_bytes,
            "digest": _digest(model), "details": _details(model, base)}


class OllamaRoutes:
    def __init__(self, front: Pipeline) -> None:
        self.front = front

    def _model(self, name: Any) -> CatalogModel:
        """The catalog model an Ollama name means (``name:latest`` is ``name``)."""
        if not isinstance(name, str) or not name:
            raise InvalidRequest("model is required: a model name", param="model")
        model = self.front.catalog.get(name)
        check_generates(model)  # Ollama's API serves language models only
        return model

    async def _load_only(self, model: CatalogModel, chat: bool,
                         keep: float | None) -> Response:
        """An empty request loads the model (Ollama's way to preload), or with
        ``keep_alive: 0`` unloads it (Ollama's way to unload)."""
        residency = self.front.residency
        base = self.front.catalog.served(model)[0]  # an adapter loads with its base
        residency.keep_alive(base.id, keep)  # 0: unloaded once idle; never a pinned model
        if keep == 0:
            reason = "unload"
        else:
            await residency.load(base.id)
            reason = "load"
        done: dict[str, Any] = {"model": ollama.tagged(model.id), "created_at": ollama.now(),
                                "done": True,
                                "done_reason": reason}
        done.update({"message": {"role": "assistant", "content": ""}} if chat
                    else {"response": ""})
        return JSONResponse(done)

    async def _begin(self, request: Request) -> tuple[bytes, dict[str, Any], CatalogModel,
                                                      float | None]:
        """The body, parsed, the model it names and its keep_alive. Answers name the model
        by its id as Ollama shows it (:func:`ollama.tagged`), whatever alias the request
        used."""
        body = await self.front.bodies.read(request)
        given = await self.front.bodies.cpu(len(body), read_object, body, ollama.FREE_FORM)
        keep = ollama.keep_alive(given)
        return body, given, self._model(given.get("model")), keep

    async def chat(self, request: Request) -> Response:
        front = self.front
        body, given, model, keep = await self._begin(request)
        if not given.get("messages"):
            return await self._load_only(model, True, keep)
        data = await front.bodies.cpu(len(body), ollama.chat_request, given)
        note_skipped_tools(request, skipped_tools(given, function_tool))
        data["model"] = model.id
        return await self._serve(request, "/v1/chat/completions", ChatCompletionRequest, data,
                                 len(body), keep, lambda model_id: OllamaShape(
                                     ollama.tagged(model_id), True, _timing(request)))

    async def _serve(self, request: Request, path: str, schema: type[BaseModel],
                     data: dict[str, Any], size: int, keep: float | None,
                     shape: Callable[[str], Shape]) -> Response:
        """``data`` (Ollama's request as one of ``path``) checked, its model kept ``keep``
        seconds once idle, and answered in ``shape``; a refusal names the field as Ollama's
        API does (``format``, ``options.top_k``)."""
        try:
            parsed = await self.front.bodies.cpu(size, validate, schema, data)
            base = self.front.catalog.served(self.front.catalog.get(data["model"]))[0]
            self.front.residency.keep_alive(base.id, keep)
            return await self.front.generate(request, path, schema, parsed, data, size, shape,
                                             cap=True)
        except BunkhouseError as e:
            rename_error(e, ollama.CHAT_FIELDS)
            raise

    async def generate(self, request: Request) -> Response:
        front = self.front
        body, given, model, keep = await self._begin(request)
        if not given.get("prompt") and not given.get("suffix"):
            return await self._load_only(model, False, keep)
        path, data = await front.bodies.cpu(len(body), ollama.generate_request, given,
                                            front.catalog.served(model)[0].has_chat_template)
        data["model"] = model.id
        schema: type[BaseModel] = (ChatCompletionRequest if path == "/v1/chat/completions"
                          else InfillRequest if path == "/infill" else CompletionRequest)

        def shape(model_id: str) -> Shape:
            answer = OllamaShape(ollama.tagged(model_id), False, _timing(request))
            return InfillShape(model_id, answer) if path == "/infill" else answer

        return await self._serve(request, path, schema, data, len(body), keep, shape)

    async def embed(self, request: Request) -> Response:
        """``POST /api/embed`` and the older ``/api/embeddings``: the embeddings path."""
        front = self.front
        legacy = request.url.path == "/api/embeddings"
        body, given, model, keep = await self._begin(request)
        data = await front.bodies.cpu(len(body), ollama.embed_request, given, legacy)
        data["model"] = model.id
        parsed = await front.bodies.cpu(len(body), validate, EmbeddingRequest, data)
        front.residency.keep_alive(front.catalog.served(model)[0].id, keep)
        return await front.generate(request, "/v1/embeddings", EmbeddingRequest, parsed, data,
                                    len(body), lambda model_id: OllamaEmbedShape(
                                        ollama.tagged(model_id), legacy))

    async def version(self, request: Request) -> Response:
        """The Ollama release whose API these routes answer (docs/architecture.md), and
        bunkhouse's own version beside it (the console shows it; Ollama's clients read
        ``version`` only)."""
        return JSONResponse({"version": ollama.VERSION, "bunkhouse": __version__})

    async def tags(self, request: Request) -> Response:
        """Every model under its id, then under each alias (as ``ollama cp`` lists a copy:
        the same digest), each ``name:tag``."""
        catalog = self.front.catalog
        return JSONResponse({"models": [
            _listed(m, name, catalog.served(m)[0] if m.adapter_of else None)
            for m in catalog if not m.transcribes  # LLMs only
            for name in (m.id, *m.aliases)]})

    async def ps(self, request: Request) -> Response:
        running = []
        residency = self.front.residency
        catalog = self.front.catalog
        for m in catalog.bases():
            status = residency.status(m.id)
            if status.state not in ("ready", "loading"):
                continue
            never = 4102444800.0  # no idle unload: far away (2100)
            expires = min(residency.expires_at(m.id) or never, never)
            for shown in (m, *catalog.adapters_of(m.id)):  # loaded with its base's worker
                running.append({
                    "name": ollama.tagged(shown.id), "model": ollama.tagged(shown.id),
                    "size": status.measured_bytes or status.estimated_bytes,
                    "digest": _digest(shown),
                    "details": _details(shown, m if shown is not m else None),
                    "expires_at": _time(expires), "size_vram": 0,
                    "context_length": m.options.context // max(m.options.parallel, 1)})
        return JSONResponse({"models": running})

    async def show(self, request: Request) -> Response:
        """``POST /api/show``: the model's template (its GGUF's Jinja chat template, or the
        one configured), parameters (its request params and slot size as Ollama's options),
        a Modelfile of both, details, metadata and capabilities."""
        front = self.front
        body = await front.bodies.read(request)
        given = await front.bodies.cpu(len(body), parse_json_object, body)
        named = self._model(given.get("model") or given.get("name"))
        model = front.catalog.served(named)[0]  # an adapter shows its base's template
        template = await asyncio.to_thread(_template, model)
        options = ollama.parameters([
            ("num_ctx", model.options.context // max(model.options.parallel, 1)),
            *model.request.defaults, *model.request.fixed])
        return JSONResponse({
            "modelfile": ollama.modelfile(ollama.tagged(named.id), str(model.path), template,
                                          options, named.path if named.adapter_of else None),
            "parameters": ollama.parameters_text(options), "template": template,
            "details": _details(named, model if named.adapter_of else None),
            "model_info": _model_info(model),
            "capabilities": _capabilities(model),
            "modified_at": _time(named.modified)})

    async def not_served(self, request: Request) -> Response:
        raise NotServed(ollama.not_served(request.url.path.rsplit("/", 1)[-1]))


MAX_TEMPLATE_BYTES = 1 << 20
"""The most of a configured ``.jinja`` template ``/api/show`` reads."""


def _template(model: CatalogModel) -> str:
    """The chat template the model is served with: the configured one (a ``.jinja`` file's
    text, or the name of one llama.cpp knows), else its GGUF's; "" for none."""
    configured = model.chat_template
    if configured is None:
        return model.info.chat_template or ""
    if not configured.endswith(".jinja"):
        return configured
    try:
        with open(configured, "rb") as f:
            return f.read(MAX_TEMPLATE_BYTES).decode("utf-8", "replace")
    except OSError:
        return configured


def _model_info(model: CatalogModel) -> dict[str, Any]:
    """Ollama's ``model_info``: the GGUF metadata keys the catalog read (``general.*`` and
    ``{architecture}.*``), those the file has."""
    info, arch = model.info, model.info.architecture
    keys: dict[str, Any] = {
        "general.architecture": arch, "general.name": info.name,
        "general.file_type": info.file_type, "general.parameter_count": info.parameters,
        f"{arch}.context_length": info.context_length, f"{arch}.block_count": info.block_count,
        f"{arch}.embedding_length": info.embedding_length,
        f"{arch}.feed_forward_length": info.feed_forward_length,
        f"{arch}.attention.head_count": info.head_count,
        f"{arch}.attention.head_count_kv": info.head_count_kv,
        f"{arch}.attention.key_length": info.key_length,
        f"{arch}.attention.value_length": info.value_length,
        f"{arch}.attention.sliding_window": info.sliding_window,
        f"{arch}.vocab_size": info.vocab_size}
    return {k: v for k, v in keys.items() if v is not None}


def _capabilities(model: CatalogModel) -> list[str]:
    """Ollama's capabilities: ``completion`` (not for an embedding model), ``tools`` for a
    chat model (tools are served on every chat route), ``embedding`` where it serves
    them."""
    found = [] if model.kind == "embedding" else ["completion"]
    if model.has_chat_template:
        found.append("tools")
    return found + (["embedding"] if model.embeddings else [])


def _timing(request: Request) -> ollama.Timing:
    """The request's own times for Ollama's durations: when it came, and how long it waited
    for its model to load (noted by the generation path once it has its lease)."""
    received = getattr(request.state, "received_ns", None)
    return ollama.Timing(received if isinstance(received, int) else time.monotonic_ns(),
                         lambda: int(getattr(request.state, "load_s", 0.0) * 1e9))
