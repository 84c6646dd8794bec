"""Request schemas at the HTTP edge: just enough to reject what the engine cannot answer.

Fields bunkhouse does not know are ignored here and passed on to the engine untouched, as
OpenAI clients expect. Types are strict: ``"stream": "yes"`` is a 400, not a guess.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.requests import Request

from bunkhouse.errors import InvalidRequest, RequestTooLarge


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    model: StrictStr | None = None
    stream: StrictBool = False
    max_tokens: StrictInt | None = Field(default=None, ge=0)


T = TypeVar("T", bound=BaseModel)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class EmbeddingRequest(_Request):
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or InvalidRequest saying what is wrong with it."""
    if not body:
        raise InvalidRequest("request body is empty; send a JSON object")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    if _depth(data) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"request body nests deeper than {MAX_JSON_DEPTH} levels")
    return data


MAX_JSON_DEPTH = 64


def _depth(value: Any) -> int:
    """How deep containers nest in ``value`` (iterative: no recursion limit to hit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:
                children = item.values() if isinstance(item, dict) else item
                stack.extend((c, depth + 1) for c in children)
    return deepest


def validate(schema: type[T], data: dict[str, Any]) -> T:
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = _param(data, first["loc"], missing=first["type"] == "missing")
        raise InvalidRequest(
            f"{param}: {first['msg']}" if param else first["msg"], param=param
        ) from e


def _param(data: Any, loc: tuple[int | str, ...], *, missing: bool) -> str | None:
    """The path of the offending field, without pydantic's union-branch tags (``prompt.str``)."""
    path: list[str] = []
    for i, key in enumerate(loc):
        present = (isinstance(data, dict) and key in data) or (
            isinstance(data, list) and isinstance(key, int) and key < len(data)
        )
        if not present and not (missing and i == len(loc) - 1):
            break
        path.append(str(key))
        data = data[key] if present else None
    return ".".join(path) or None


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or RequestTooLarge (413) as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
