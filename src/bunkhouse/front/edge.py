"""What the front can know is wrong with a request, refused before any engine sees it.

After the schema (api/schemas.py) has checked types, ranges and enums, :func:`prepare` applies
what depends on the model and on field aliases, and builds the body the worker gets:

- ``max_tokens`` and ``max_completion_tokens`` are one limit (OpenAI renamed it); both given
  and different is a 400; the worker and every check see ``max_tokens``.
- Content parts the model cannot take (every model served today takes text only) are a 400
  naming the part, instead of an engine error.
- Chat on a model without a chat template is a 400 that says how to give it one.
- The model's request defaults and filters (its ``params``, ``fixed_params`` and
  ``strip_params``, config.RequestParams) are applied first, so every check sees the result.
- Only OpenAI's fields and the engine adapter's extension fields are forwarded; anything else
  unknown is dropped, so a typo never reaches the engine as a raw parse error.
- ``model`` is the model's id, not the alias or ``:latest`` spelling the client sent, so that
  every answer names the model one way.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request

from bunkhouse.api.fields import shown
from bunkhouse.api.schemas import INT32_MAX, MAX_TOOLS_BYTES, known_fields
from bunkhouse.catalog import CatalogModel
from bunkhouse.engines import ENGINES, engine_for
from bunkhouse.errors import InvalidRequest

log = logging.getLogger(__name__)

_TEXT_PARTS = frozenset({"text"})

SKIPPED_TOOLS_HEADER = "x-bunkhouse-skipped-tools"
"""The answer's header naming the request's tools the model cannot run, which were left out
(api/fields.py): ``web_search, custom:apply_patch``."""

MAX_SKIPPED_NAMED = 16
"""Skipped tools the header names; past them it says how many more."""


def note_skipped_tools(request: Request, skipped: list[str]) -> None:
    """Note ``skipped`` (tool labels, api/fields.tool_label) for the answer's
    :data:`SKIPPED_TOOLS_HEADER` (front/app.py sets it) and the log."""
    if not skipped:
        return
    named = ", ".join(skipped[:MAX_SKIPPED_NAMED])
    more = len(skipped) - MAX_SKIPPED_NAMED
    request.state.skipped_tools = named + (f", and {more} more" if more > 0 else "")
    log.info("%s: skipped %d tool(s) the model cannot run: %s", request.url.path[:200],
             len(skipped), request.state.skipped_tools)


def prepare(path: str, schema: type[BaseModel], model: CatalogModel,
            data: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """The body to send to ``model``'s worker, or InvalidRequest (400) naming the field. It
    names the model by its id (``name``: the id of the adapter of ``model`` asked for),
    whatever alias the client used (or none): an answer that echoes ``model`` echoes the
    id, on every route."""
    check_generates(model)
    body = {**model.request.apply(_merge_token_limits(data)), "model": name or model.id}
    _check_choices(model, body)
    if path == "/v1/chat/completions":
        _check_template(model)
        for i, message in enumerate(body.get("messages") or []):
            _check_message(model, i, message)
        if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        _check_tools_size(body.get("tools"))
    if path == "/v1/embeddings":
        _check_embeddings(model, body)
    _check_token_ids(model, body)
    engine = engine_for(model)
    body = engine.check_request(path, body)
    allowed = _forwarded_fields(schema, engine.name)
    return {k: v for k, v in body.items() if k in allowed}


def check_generates(model: CatalogModel) -> None:
    """InvalidRequest (400, ``model``) for a model that does not generate text (a
    transcription model)."""
    if not engine_for(model).capabilities(model).generates:
        raise InvalidRequest(f"model {model.id!r} is a transcription model: send audio to "
                             "POST /v1/audio/transcriptions", param="model")


@functools.cache
def _forwarded_fields(schema: type[BaseModel], engine: str) -> frozenset[str]:
    return known_fields(schema) | ENGINES[engine].forwarded_fields()


def known_only(schema: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the fields no engine reads, dropped as soon as it is parsed so that
    an unknown field's value (up to the body's size, parsed) is not held for the request's
    life."""
    kept = _any_engine_fields(schema)
    if all(k in kept for k in data):
        return data
    return {k: v for k, v in data.items() if k in kept}


@functools.cache
def _any_engine_fields(schema: type[BaseModel]) -> frozenset[str]:
    return frozenset().union(*(_forwarded_fields(schema, name) for name in ENGINES))


def _check_token_ids(model: CatalogModel, body: dict[str, Any]) -> None:
    """``logit_bias``'s token ids (OpenAI's map or llama.cpp's pairs) must be tokens of the
    model: a larger id would reach the engine wrapped to 32 bits, another token."""
    bias = body.get("logit_bias")
    ids = (list(bias) if isinstance(bias, dict) else
           [p[0] for p in bias if isinstance(p, list) and p and isinstance(p[0], int)]
           if isinstance(bias, list) else [])
    vocab = model.info.vocab_size or INT32_MAX + 1
    for token in ids:
        if isinstance(token, bool) or not 0 <= int(token) < vocab:
            raise InvalidRequest(f"logit_bias: {shown(token)} is not a token id of model "
                                 f"{model.id!r} (0 to {vocab - 1})", param="logit_bias")


def _check_tools_size(tools: Any) -> None:
    if tools and len(json.dumps(tools, ensure_ascii=False).encode()) > MAX_TOOLS_BYTES:
        raise InvalidRequest(f"tools take more than {MAX_TOOLS_BYTES // 1024} KiB of JSON; "
                             "send fewer or shorter tool definitions", param="tools")


def _check_embeddings(model: CatalogModel, body: dict[str, Any]) -> None:
    """The model must serve embeddings; ``dimensions``, if given, must be its width (no
    model served here can shorten its vectors)."""
    if not engine_for(model).embedding_limit(model):
        raise InvalidRequest(
            f"model {model.id!r} does not serve embeddings; turn them on with embeddings = "
            "true in the config file: in its [[models]] entry, or under [defaults] for every "
            "model (packaged ones included); a model registered at runtime takes "
            '"embeddings": true. It raises the model\'s memory estimate '
            "(docs/memory-estimate.md).", param="model")
    dimensions, width = body.get("dimensions"), model.info.embedding_length
    if dimensions is not None and width and dimensions != width:
        raise InvalidRequest(f"model {model.id!r} makes {width}-dimensional embeddings and "
                             f"cannot shorten them; dimensions must be {width} or left out",
                             param="dimensions")


def _check_choices(model: CatalogModel, body: dict[str, Any]) -> None:
    n = body.get("n")
    if isinstance(n, int) and n > model.options.parallel:
        raise InvalidRequest(f"model {model.id!r} generates at most {model.options.parallel} "
                             f"choices at once (its slots); n is {n}", param="n")


def _check_message(model: CatalogModel, i: int, message: dict[str, Any]) -> None:
    """Content is required but for assistant messages, and must be text (see module doc)."""
    content = message.get("content")
    if content is None and message.get("role") != "assistant":
        raise InvalidRequest(f"a {message.get('role')} message needs content",
                             param=f"messages.{i}.content")
    for j, part in enumerate(content if isinstance(content, list) else []):
        if part.get("type") not in _TEXT_PARTS:
            raise InvalidRequest(
                f"model {model.id!r} takes text only: content part type "
                f"{part.get('type')!r} is not supported; send the content as text parts",
                param=f"messages.{i}.content.{j}.type")
        if not isinstance(part.get("text"), str):
            raise InvalidRequest("a text content part needs a string field 'text'",
                                 param=f"messages.{i}.content.{j}.text")


def _merge_token_limits(data: dict[str, Any]) -> dict[str, Any]:
    if "max_completion_tokens" not in data:
        return data
    body = dict(data)
    newer = body.pop("max_completion_tokens")
    older = body.get("max_tokens")
    if older is not None and newer is not None and older != newer:
        raise InvalidRequest(
            f"max_tokens ({older}) and max_completion_tokens ({newer}) disagree; they are "
            "the same limit: send one of them", param="max_completion_tokens")
    if newer is not None:
        body["max_tokens"] = newer
    return body


def _check_template(model: CatalogModel) -> None:
    if not model.has_chat_template:
        raise InvalidRequest(
            f"model {model.id!r} has no chat template (its GGUF carries none), so it cannot "
            "answer chat messages; use /v1/completions with a prompt, or give it one with "
            'chat_template = "NAME" (a template llama.cpp knows, e.g. "gemma" or "chatml") '
            'or chat_template = "path/to/template.jinja" in its [[models]] entry of the '
            "config file", param="messages")
