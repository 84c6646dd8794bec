"""The front's OpenAPI description (`GET /openapi.json`) of every route the app serves (a
test holds it to the app's route table), built from the edge's own schemas."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from bunkhouse.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    InfillRequest,
    TokenizeRequest,
)
from bunkhouse.front.admin import RegisterRequest

_REF = "#/components/schemas/{model}"
_ERROR = {"description": "an OpenAI-style error envelope",
          "content": {"application/json": {"schema": {"$ref": _REF.format(model="Error")}}}}
_ERRORS = {str(code): _ERROR for code in (400, 401, 403, 404, 409, 413, 429, 502, 503)}
_JSON_OBJECT = {"application/json": {"schema": {"type": "object"}}}
_MODEL_ID = [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]


def _body(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=_REF)
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
    return {"required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(
                model=model.__name__)}}}}


def _op(summary: str, ok: str, body: dict[str, Any] | None = None,
        params: list[dict[str, Any]] | None = None, media: tuple[str, ...] = (),
        errors: tuple[int, ...] = ()) -> dict[str, Any]:
    """An operation answering ``ok`` with a JSON object (or text of the ``media`` types);
    ``errors``: statuses it may answer besides the common ones."""
    content = {m: {"schema": {"type": "string"}} for m in media} or _JSON_OBJECT
    op: dict[str, Any] = {"summary": summary,
                          "responses": {ok: {"description": "success",
                                             "content": content}, **_ERRORS,
                                        **{str(e): _ERROR for e in errors}}}
    if body:
        op["requestBody"] = body
    if params:
        op["parameters"] = params
    return op


def _messages_body(max_tokens: bool) -> dict[str, Any]:
    """Anthropic's Messages request, as its API reference describes the fields served."""
    block = {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}}}
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": block}]}
    props: dict[str, Any] = {
        "model": {"type": "string"},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"enum": ["user", "assistant"]}, "content": content}}},
        "system": content, "stream": {"type": "boolean"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "stop_sequences": {"type": "array", "items": {"type": "string"}},
        "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {"type": "object"}, "metadata": {"type": "object"},
    }
    required = ["messages"]
    if max_tokens:
        props["max_tokens"] = {"type": "integer", "minimum": 1}
        required.append("max_tokens")
    schema = {"type": "object", "required": required, "properties": props}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


_RESPONSE_ID = [{"name": "response_id", "in": "path", "required": True,
                 "schema": {"type": "string"}}]


def _responses_body() -> dict[str, Any]:
    """OpenAI's Responses request, as its API reference describes the fields served."""
    item = {"type": "object", "properties": {"type": {"enum": [
        "message", "function_call", "function_call_output", "reasoning"]}}}
    props: dict[str, Any] = {
        "model": {"type": "string"},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1,
                                                 "items": item}]},
        "instructions": {"type": "string"}, "previous_response_id": {"type": "string"},
        "store": {"type": "boolean"}, "stream": {"type": "boolean"},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"]}},
        "tool_choice": {"anyOf": [{"enum": ["auto", "none", "required"]},
                                  {"type": "object"}]},
        "parallel_tool_calls": {"type": "boolean"}, "text": {"type": "object"},
        "metadata": {"type": "object"}, "reasoning": {"type": "object"},
    }
    schema = {"type": "object", "required": ["input"], "properties": props}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _ollama_body(chat: bool) -> dict[str, Any]:
    """Ollama's chat or generate request, as its docs/api.md describes the fields served."""
    props: dict[str, Any] = {
        "model": {"type": "string"}, "stream": {"type": "boolean"},
        "format": {"anyOf": [{"const": "json"}, {"type": "object"}]},
        "options": {"type": "object", "properties": {
            "num_predict": {"type": "integer"}, "temperature": {"type": "number"},
            "top_p": {"type": "number"}, "top_k": {"type": "integer"},
            "seed": {"type": "integer"}, "num_ctx": {"type": "integer"},
            "stop": {"type": "array", "items": {"type": "string"}}}},
        "keep_alive": {"anyOf": [{"type": "string"}, {"type": "number"}]},
    }
    if chat:
        props["messages"] = {"type": "array", "items": {
            "type": "object", "required": ["role"],
            "properties": {"role": {"enum": ["system", "user", "assistant", "tool"]},
                           "content": {"type": "string"}}}}
        props["tools"] = {"type": "array", "items": {"type": "object"}}
    else:
        props.update(prompt={"type": "string"}, system={"type": "string"},
                     raw={"type": "boolean"})
    schema = {"type": "object", "required": ["model"], "properties": props}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _transcription_body() -> dict[str, Any]:
    """OpenAI's transcription form, as its API reference describes the fields served."""
    props: dict[str, Any] = {
        "file": {"type": "string", "contentMediaType": "application/octet-stream"},
        "model": {"type": "string"}, "language": {"type": "string"},
        "prompt": {"type": "string"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "response_format": {"enum": ["json", "text", "srt", "verbose_json", "vtt"]},
        "timestamp_granularities[]": {"type": "array",
                                      "items": {"enum": ["segment", "word"]}},
        "stream": {"type": "boolean"}}
    return {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["file"], "properties": props}}}}


def _object_body(props: dict[str, Any], required: list[str] | None = None,
                 needed: bool = True) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    return {"required": needed, "content": {"application/json": {"schema": schema}}}


def _ollama_embed_body(legacy: bool) -> dict[str, Any]:
    """Ollama's ``/api/embed`` (``input``: a text or texts) or ``/api/embeddings``
    (``prompt``: one text), as its docs/api.md describes the fields served."""
    text = {"type": "string"}
    field = ("prompt", text) if legacy else (
        "input", {"anyOf": [text, {"type": "array", "minItems": 1, "items": text}]})
    return _object_body({"model": text, field[0]: field[1], "truncate": {"type": "boolean"},
                         "keep_alive": {"anyOf": [text, {"type": "number"}]}},
                        ["model", field[0]])


def _not_served(name: str, method: str) -> dict[str, Any]:
    """One of Ollama's routes that change its model store: answered 501, saying why."""
    op = _op(f"Ollama's {name}: not served (bunkhouse changes no model files); 501 with "
             "the reason", "501")
    op["responses"]["501"] = {"description": "not served: the reason, as Ollama's errors",
                              "content": _JSON_OBJECT}
    if method == "post":
        op["requestBody"] = _object_body({}, needed=False)
    return op


_EVENTS_AFTER = [
    {"name": "after", "in": "query", "required": False,
     "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"}},
    {"name": "Last-Event-ID", "in": "header", "required": False,
     "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"}}]


def _pause_body() -> dict[str, Any]:
    return {"required": False, "content": {"application/json": {"schema": {
        "type": "object", "properties": {
            "max_s": {"type": "number", "minimum": 1, "maximum": 3600}}}}}}


def openapi(version: str) -> dict[str, Any]:
    schemas: dict[str, Any] = {"Error": {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type", "code"]}}}}
    paths = {**_openai_paths(schemas), **_other_protocol_paths(), **_llamacpp_paths(schemas),
             **_ollama_paths(), **_admin_paths(), **_server_paths()}
    return {"openapi": "3.1.0", "info": {"title": "bunkhouse", "version": version},
            "paths": paths, "components": {"schemas": schemas}}


def _openai_paths(schemas: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's routes whose bodies are the edge's pydantic models, and model control."""
    chat, comp, emb, reg = (_body(m, schemas) for m in (
        ChatCompletionRequest, CompletionRequest, EmbeddingRequest, RegisterRequest))
    return {
        "/v1/chat/completions": {"post": _op("chat completion (SSE with stream)", "200", chat)},
        "/v1/completions": {"post": _op("text completion (SSE with stream)", "200", comp)},
        "/v1/embeddings": {"post": _op("embeddings", "200", emb)},
        "/v1/models": {"get": _op("every local model and its state", "200"),
                       "post": _op("register and load a model by path (admin)", "200", reg)},
        "/v1/models/{model_id}": {
            "get": _op("one model", "200", params=_MODEL_ID),
            "delete": _draining(_op("drain and unload; runtime models leave the catalog "
                                    "(admin)", "204", params=_MODEL_ID))},
        "/v1/models/{model_id}/{action}": {"post": _draining(_op(
            "load, unload (204 once freed, 202 while requests drain), pin or unpin a "
            "catalog model (admin)", "200", params=[*_MODEL_ID, {
                "name": "action", "in": "path", "required": True,
                "schema": {"enum": ["load", "unload", "pin", "unpin"]}}]))},
    }


def _draining(op: dict[str, Any]) -> dict[str, Any]:
    """``op`` with an unload's answers: 204 once freed, 202 while requests still drain."""
    op["responses"]["204"] = {"description": "unloaded: the model is absent"}
    op["responses"]["202"] = {"description": "draining: freed when its requests end"}
    return op


def _other_protocol_paths() -> dict[str, Any]:
    """Anthropic's Messages, OpenAI's Responses and transcription, Ollama's chat and
    generate: request bodies described here, as each API's reference does."""
    return {
        "/v1/messages": {"post": _op("Anthropic Messages (SSE with stream); errors in "
                                     "Anthropic's envelope", "200", _messages_body(True))},
        "/v1/messages/count_tokens": {"post": _op("Anthropic: the prompt's tokens", "200",
                                                  _messages_body(False))},
        "/v1/responses": {"post": _op("OpenAI Responses (SSE with stream); stored unless "
                                      "store is false", "200", _responses_body())},
        "/v1/responses/{response_id}": {
            "get": _op("a stored response", "200", params=_RESPONSE_ID),
            "delete": _op("delete a stored response", "200", params=_RESPONSE_ID)},
        "/v1/responses/{response_id}/input_items": {"get": _op(
            "a stored response's input items (limit, order, after)", "200",
            params=_RESPONSE_ID)},
        "/v1/audio/transcriptions": {"post": _op(
            "OpenAI transcription of an audio file by a Whisper model (SSE with stream)",
            "200", _transcription_body())},
        "/api/chat": {"post": _op("Ollama chat (newline-delimited JSON unless stream is "
                                  "false); errors as {\"error\": ...}", "200",
                                  _ollama_body(True))},
        "/api/generate": {"post": _op("Ollama generate: through the chat template, or raw",
                                      "200", _ollama_body(False))},
    }


def _llamacpp_paths(schemas: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's own routes: fill-in-the-middle, tokens and templates."""

    chat, fim, tok, detok = (_body(m, schemas) for m in (
        ChatCompletionRequest, InfillRequest, TokenizeRequest, DetokenizeRequest))
    return {
        "/infill": {"post": _op("llama.cpp fill-in-the-middle: input_prefix, input_suffix, "
                                "input_extra, prompt (SSE with stream)", "200", fim)},
        "/tokenize": {"post": _op("llama.cpp: a text's tokens under the model", "200", tok)},
        "/detokenize": {"post": _op("llama.cpp: the text of token ids", "200", detok)},
        "/apply-template": {"post": _op("llama.cpp: the prompt chat messages become", "200",
                                        chat)},
    }


def _ollama_paths() -> dict[str, Any]:
    """Ollama's routes besides chat and generate, the ones it serves and the ones it
    refuses."""
    return {
        "/api/embed": {"post": _op("Ollama embeddings of input (a text or texts)", "200",
                                   _ollama_embed_body(False))},
        "/api/embeddings": {"post": _op("Ollama's older embeddings of one prompt", "200",
                                        _ollama_embed_body(True))},
        "/api/show": {"post": _op("Ollama: a model's details and capabilities", "200",
                                  _object_body({"model": {"type": "string"},
                                                "name": {"type": "string"},
                                                "verbose": {"type": "boolean"}}))},
        "/api/pull": {"post": _op("Ollama: pull a model from the Hugging Face hub, "
                                  "hf.co/ORG/REPO:QUANT (admin); NDJSON statuses", "200",
                                  _object_body({"model": {"type": "string"},
                                                "name": {"type": "string"},
                                                "stream": {"type": "boolean"}}),
                                  media=("application/x-ndjson",), errors=(507,))},
        **{f"/api/{name}": {"post": _not_served(name, "post")}
           for name in ("push", "create", "copy")},
        "/api/delete": {"delete": _not_served("delete", "delete")},
        "/api/tags": {"get": _op("Ollama: every model and alias, as name:tag", "200")},
        "/api/ps": {"get": _op("Ollama: the loaded models", "200")},
        "/api/version": {"get": _op("Ollama: the Ollama release these routes match "
                                    "(bunkhouse's own version beside it)", "200")},
    }


def _admin_paths() -> dict[str, Any]:
    """The operator's routes under /admin (an admin key)."""
    return {
        "/admin/cache/flush": {"post": _op("save every ready model's idle KV slots (admin)",
                                           "200")},
        "/admin/reload": {"post": _op("re-read the config file and model folders (admin); "
                                      "the ids added, removed and changed", "200")},
        "/admin/default": {"post": _op("switch the default model: {\"model\": ID} (admin)",
                                       "200", _object_body({"model": {"type": "string"}},
                                                           ["model"]))},
        "/admin/pause": {"post": _op("hold every model paused once the requests in flight "
                                     "finished, for max_s seconds at most (admin)", "200",
                                     _pause_body())},
        "/admin/resume": {"post": _op("end a pause: waiting requests go on (admin)", "200")},
        "/admin/cache": {"delete": _op("remove every KV snapshot (admin)", "200")},
        "/admin/cache/{model_id}": {"delete": _op("remove a model's KV snapshots (admin)",
                                                  "200", params=_MODEL_ID)},
        "/admin/pull": {
            "post": _op("pull a model from the Hugging Face hub: {\"model\": "
                        "\"ORG/REPO[:QUANT|:FILE]\", \"stream\"} (admin); its steps as "
                        "Server-Sent Events", "200",
                        _object_body({"model": {"type": "string"},
                                      "stream": {"type": "boolean"}}, ["model"]),
                        media=("text/event-stream",), errors=(507,)),
            "get": _op("the pulls of this run, with their progress (admin)", "200")},
        "/admin/pull/{pull_id}": {"delete": _op(
            "cancel a pull (admin)", "200",
            params=[{"name": "pull_id", "in": "path", "required": True,
                     "schema": {"type": "string"}}])},
    }


def _server_paths() -> dict[str, Any]:
    """The server's own: health, figures, events, this description and the web console."""
    return {
        "/health": {"get": _op("liveness and every model's state", "200")},
        "/stats": {"get": _op("memory budget, models and recent events", "200")},
        "/metrics": {"get": _op("residency in Prometheus' text format", "200",
                                media=("text/plain",))},
        "/admin/events": {"get": _op(
            "residency's events as Server-Sent Events, live, from after the sequence number "
            "given (after, or Last-Event-ID on reconnecting)", "200", params=_EVENTS_AFTER,
            media=("text/event-stream",))},
        "/openapi.json": {"get": _op("this description of every route", "200")},
        "/": {"get": _op("the web console's page", "200", media=("text/html",))},
        "/console/{name}": {"get": _op("one of the web console's files (script, style)",
                                       "200", params=[{"name": "name", "in": "path",
                                                       "required": True,
                                                       "schema": {"type": "string"}}],
                                       media=("text/javascript", "text/css"))},
    }
