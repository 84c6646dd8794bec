"""Ollama's API on the same port (Ollama's docs/api.md): ``/api/chat`` and ``/api/generate``
translated by api/ollama.py and served by the one generation path (``Front.generate``);
``/api/version``, ``/api/tags``, ``/api/ps``, ``/api/show`` from the catalog and residency;
``pull``, ``push``, ``create``, ``copy`` and ``delete`` answer 501 saying what bunkhouse does
instead. Errors come as Ollama's ``{"error": "..."}`` (front/protocols.py)."""

from __future__ import annotations

import datetime as dt
import hashlib
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bunkhouse import __version__
from bunkhouse.api import ollama
from bunkhouse.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_json_object,
    validate,
)
from bunkhouse.catalog import CatalogModel
from bunkhouse.errors import BunkhouseError, InvalidRequest, ModelNotFound
from bunkhouse.front.protocols import OllamaShape

if TYPE_CHECKING:
    from bunkhouse.front.app import Front


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


def _details(model: CatalogModel) -> dict[str, Any]:
    arch = model.info.architecture
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
            "parameter_size": "", "quantization_level": ""}


class OllamaRoutes:
    def __init__(self, front: Front) -> None:
        self.front = front

    def _model(self, name: Any) -> CatalogModel:
        """The catalog model an Ollama name means (``name:latest`` is ``name``)."""
        if not isinstance(name, str) or not name:
            raise InvalidRequest("model is required: a model name", param="model")
        try:
            return self.front.catalog.get(name)
        except ModelNotFound:
            if name.endswith(":latest"):
                return self.front.catalog.get(name.removesuffix(":latest"))
            raise

    async def _load_only(self, model: CatalogModel, name: str, chat: bool) -> Response:
        """An empty request loads the model (Ollama's way to preload)."""
        (await self.front.residency.acquire(model)).release()
        done: dict[str, Any] = {"model": name, "created_at": ollama.now(), "done": True,
                                "done_reason": "load"}
        done.update({"message": {"role": "assistant", "content": ""}} if chat
                    else {"response": ""})
        return JSONResponse(done)

    async def _begin(self, request: Request) -> tuple[bytes, dict[str, Any], CatalogModel,
                                                      str]:
        """The body, parsed, the model it names and the name as given."""
        body = await self.front.read(request)
        given = await self.front.cpu(len(body), parse_json_object, body)
        return body, given, self._model(given.get("model")), str(given.get("model"))

    async def chat(self, request: Request) -> Response:
        front = self.front
        body, given, model, name = await self._begin(request)
        if not given.get("messages"):
            return await self._load_only(model, name, chat=True)
        data = await front.cpu(len(body), ollama.chat_request, given)
        data["model"] = model.id
        parsed = await front.cpu(len(body), validate, ChatCompletionRequest, data)
        return await front.generate(request, "/v1/chat/completions", ChatCompletionRequest,
                                    parsed, data, len(body),
                                    lambda _: OllamaShape(name, chat=True))

    async def generate(self, request: Request) -> Response:
        front = self.front
        body, given, model, name = await self._begin(request)
        if not given.get("prompt") and not given.get("suffix"):
            return await self._load_only(model, name, chat=False)
        path, data = await front.cpu(len(body), ollama.generate_request, given,
                                     model.has_chat_template)
        data["model"] = model.id
        schema = ChatCompletionRequest if path == "/v1/chat/completions" else CompletionRequest
        parsed = await front.cpu(len(body), validate, schema, data)
        return await front.generate(request, path, schema, parsed, data, len(body),
                                    lambda _: OllamaShape(name, chat=False))

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def tags(self, request: Request) -> Response:
        return JSONResponse({"models": [
            {"name": m.id, "model": m.id, "modified_at": _time(m.modified),
             "size": m.size_bytes, "digest": _digest(m), "details": _details(m)}
            for m in self.front.catalog]})

    async def ps(self, request: Request) -> Response:
        running = []
        residency = self.front.residency
        for m in self.front.catalog:
            status = residency.status(m.id)
            if status.state not in ("ready", "loading"):
                continue
            ttl = m.ttl_s  # the global ttl is not the catalog's to know: shown as none
            expires = (status.last_used + ttl if ttl and status.last_used
                       else 4102444800.0)  # no idle unload: far away (2100)
            running.append({"name": m.id, "model": m.id, "size":
                            status.measured_bytes or status.estimated_bytes,
                            "digest": _digest(m), "details": _details(m),
                            "expires_at": _time(expires), "size_vram": 0,
                            "context_length": m.options.context // max(m.options.parallel, 1)})
        return JSONResponse({"models": running})

    async def show(self, request: Request) -> Response:
        front = self.front
        body = await front.read(request)
        given = await front.cpu(len(body), parse_json_object, body)
        model = self._model(given.get("model") or given.get("name"))
        arch = model.info.architecture
        capabilities = ["completion"] + (["tools"] if model.has_chat_template else []) + (
            ["embedding"] if model.embeddings else [])
        return JSONResponse({
            "modelfile": "", "parameters": "", "template": "", "details": _details(model),
            "model_info": {"general.architecture": arch,
                           f"{arch}.context_length": model.info.context_length},
            "capabilities": capabilities, "modified_at": _time(model.modified)})

    async def not_served(self, request: Request) -> Response:
        raise NotServed(ollama.not_served(request.url.path.rsplit("/", 1)[-1]))
