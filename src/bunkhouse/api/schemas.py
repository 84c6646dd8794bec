"""Request schemas at the HTTP edge: just enough to reject what the engine cannot answer.

Fields bunkhouse does not know are ignored here and passed on to the engine untouched, as
OpenAI clients expect. Types are strict: ``"stream": "yes"`` is a 400, not a guess.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

import annotated_types
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)
from starlette.requests import ClientDisconnect, Request

from bunkhouse.errors import ClientGone, InvalidRequest, RequestTooLarge
from bunkhouse.shares import Shares


def text_bytes(value: Any) -> int:
    """UTF-8 bytes of every string in a JSON value (nested lists and objects included)."""
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, list):
        return sum(text_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(text_bytes(v) for v in value.values())
    return 0


def _number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be a number")
    return value


def Number(lo: float, hi: float) -> Any:
    """A JSON number (not a string, not a boolean) within ``[lo, hi]``."""
    return Annotated[float, BeforeValidator(_number), Field(ge=lo, le=hi)]


INT32_MAX = (1 << 31) - 1
"""The largest token id an engine takes (a C ``int``): a larger one would wrap to another."""

INT64 = (-(1 << 63), (1 << 63) - 1)
"""OpenAI's integers (a ``seed``)."""

MAX_EMBEDDING_INPUTS = 2048  # inputs in one embeddings request (OpenAI's documented limit)
MAX_LOGIT_BIAS = 1024  # logit_bias entries (each is work per sampled token)

Stop = StrictStr | Annotated[list[StrictStr], Field(max_length=4)] | None  # OpenAI: up to 4


class _Request(BaseModel):
    """Fields every generation route shares (OpenAI API reference); others are ignored here
    and filtered at forwarding (front/edge.py)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model: Annotated[StrictStr, Field(max_length=256)] | None = None  # ids: at most 128
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)  # OpenAI: >= 1 (0 made 1)
    temperature: Number(0, 2) | None = None  # type: ignore[valid-type]
    top_p: Number(0, 1) | None = None  # type: ignore[valid-type]
    n: StrictInt | None = Field(default=None, ge=1, le=128)
    stop: Stop = None
    presence_penalty: Number(-2, 2) | None = None  # type: ignore[valid-type]
    frequency_penalty: Number(-2, 2) | None = None  # type: ignore[valid-type]
    seed: StrictInt | None = Field(default=None, ge=INT64[0], le=INT64[1])  # engines fold it
    # OpenAI's map of token id to bias, or llama.cpp's list of [token or text, bias] pairs.
    logit_bias: (Annotated[dict[Annotated[str, Field(pattern=r"^\d{1,10}$")],
                                Number(-100, 100)],  # type: ignore[valid-type]
                           Field(max_length=MAX_LOGIT_BIAS)]
                 | Annotated[list[Any], Field(max_length=MAX_LOGIT_BIAS)] | None) = None
    user: StrictStr | None = None


T = TypeVar("T", bound=BaseModel)

PART_TYPES = ("text", "image_url", "input_audio", "file", "refusal")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    type: Literal["text", "image_url", "input_audio", "file", "refusal"]
    text: StrictStr | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    name: StrictStr
    arguments: StrictStr | None = None


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    id: StrictStr | None = None
    type: Literal["function"]
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    name: StrictStr | None = None


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    name: Annotated[StrictStr, Field(min_length=1)]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    type: Literal["function"]
    function: FunctionSpec


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    include_usage: StrictBool | None = None


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None


TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]


class CompletionRequest(_Request):
    prompt: (StrictStr | Annotated[list[StrictStr], Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
    echo: StrictBool | None = None
    best_of: StrictInt | None = Field(default=None, ge=1, le=20)
    suffix: StrictStr | None = None


class ExtraChunk(BaseModel):
    """A chunk of another file, context for fill-in-the-middle."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    filename: StrictStr = ""
    text: StrictStr


class InfillRequest(_Request):
    """llama.cpp's ``POST /infill`` (tools/server/README.md): the text before and after the
    cursor, the start of the middle (``prompt``), other files' chunks for context."""

    input_prefix: StrictStr = ""
    input_suffix: StrictStr = ""
    input_extra: Annotated[list[ExtraChunk], Field(max_length=1024)] | None = None
    prompt: StrictStr = ""


NonEmptyText = Annotated[StrictStr, Field(min_length=1)]
Tokens = Annotated[list[TokenId], Field(min_length=1)]


# -- an audio upload's multipart form (front/audio.py) --

FORM_OVERHEAD_BYTES = 64 * 1024
"""A form's bytes besides the file: boundaries, part headers, the option fields."""

MAX_FIELD_BYTES = 16 * 1024
"""The largest option field (a prompt: OpenAI takes 224 tokens of it)."""

MAX_FIELDS = 16
"""Text fields in a form (OpenAI defines 9)."""

MAX_FILES = 4
"""File parts a form may carry: one is served; the others are refused by name (all of them
count against ``--max-audio``)."""


MAX_TOOLS_BYTES = 256 * 1024
"""A chat request's tools as JSON: its template renders them into every prompt."""


MAX_DETOKENIZE = 1 << 20
"""Token ids in one ``/detokenize`` request (a million: far past any context)."""


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (llama.cpp's server route, routed by ``model``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Annotated[StrictStr, Field(max_length=256)] | None = None
    content: StrictStr
    add_special: StrictBool = False
    parse_special: StrictBool = True
    with_pieces: StrictBool = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (llama.cpp's server route, routed by ``model``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Annotated[StrictStr, Field(max_length=256)] | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE)]


class EmbeddingRequest(_Request):
    input: (NonEmptyText
            | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
            | Tokens
            | Annotated[list[Tokens], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)])
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: StrictInt | None = Field(default=None, ge=1)


# A union's first error names one branch (``input.str``); these say what is accepted instead.
_UNION_MESSAGES = {
    "input": "must be a non-empty string, a non-empty list of non-empty strings, a "
             "non-empty list of token ids (>= 0), or a list of such lists; at most "
             f"{MAX_EMBEDDING_INPUTS} inputs",
    "prompt": "must be a string, a non-empty list of strings, a non-empty list of token ids "
              "(>= 0), or a list of such lists",
    "stop": "must be a string or a list of at most 4 strings",
    "logit_bias": "must map token ids to biases from -100 to 100 (or be llama.cpp's list of "
                  f"[token, bias] pairs), at most {MAX_LOGIT_BIAS} of them",
    "content": "must be a string, null, or a list of content parts, each an object whose "
               "type is one of " + ", ".join(PART_TYPES),
}


def known_fields(schema: type[BaseModel]) -> frozenset[str]:
    """The OpenAI fields a request schema knows (the rest are extensions or ignored)."""
    return frozenset(schema.model_fields)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or InvalidRequest saying what is wrong with it."""
    if not body:
        raise InvalidRequest("request body is empty; send a JSON object")
    values = json_values(body)
    if values > MAX_JSON_VALUES:
        raise InvalidRequest(f"request body holds about {values:,} JSON values (at most "
                             f"{MAX_JSON_VALUES:,}); send fewer items")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {str(e)[:200]}") from e
    except ValueError as e:  # Python refuses to read an integer of 4,300+ digits
        raise InvalidRequest("request body holds an integer of thousands of digits; no field "
                             "takes one") from e
    except RecursionError as e:
        raise InvalidRequest(f"request body nests deeper than {MAX_JSON_DEPTH} levels") from e
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    depth, bad_text = _walk(data)
    if depth > MAX_JSON_DEPTH:
        raise InvalidRequest(f"request body nests deeper than {MAX_JSON_DEPTH} levels")
    if bad_text:
        param = _surrogate_path(data)
        raise InvalidRequest(f"{param or 'the body'}: a string holds a lone UTF-16 surrogate "
                             "(JSON's \\ud800 ...), which is not valid text", param=param)
    return data


MAX_JSON_DEPTH = 64

MAX_JSON_VALUES = 2_000_000
"""Values (objects, arrays, strings, numbers, literals) in one body. Parsed, each takes up
to 72 bytes in Python: ``[{},{},...]`` read 16 MiB into 400 MB. Twice ``/detokenize``'s
million token ids, the most any field takes."""

_EMPTY = re.compile(rb"[\[{]\s*[\]}]")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_values(body: bytes) -> int:
    """How many values the JSON text ``body`` holds (object keys not counted), without
    parsing it: each takes at least two bytes (``1,``), so a short body is not read; else
    its strings are taken out, and each non-empty object or array holds one value more than
    the commas in it."""
    if len(body) < 2 * MAX_JSON_VALUES:
        return len(body) // 2 + 1
    bare = _STRING.sub(b'""', body)
    empty = len(_EMPTY.findall(bare))
    return bare.count(b",") + bare.count(b"[") + bare.count(b"{") - empty + 1


def _walk(value: Any) -> tuple[int, bool]:
    """How deep containers nest in ``value``, and whether a string in it holds a lone UTF-16
    surrogate (it cannot be encoded for the engine). One pass, iterative: no recursion limit
    to hit."""
    deepest, bad_text, stack = 0, False, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            bad_text = bad_text or (not item.isascii() and not _encodable(item))
        elif isinstance(item, dict | list):
            if isinstance(item, dict):
                bad_text = bad_text or not all(k.isascii() or _encodable(k) for k in item)
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:
                children = item.values() if isinstance(item, dict) else item
                stack.extend((c, depth + 1) for c in children)
    return deepest, bad_text


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _surrogate_path(value: Any) -> str | None:
    """Where the first string that cannot be encoded is (only asked once one was found)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str) and not _encodable(item):
            return where or None
        if isinstance(item, dict):
            if not all(_encodable(k) for k in item):
                return where or None  # a key: name the object that holds it
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{where}.{i}") for i, v in enumerate(item))
    return None


def validate(schema: type[T], data: dict[str, Any]) -> T:
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = _param(data, first["loc"], missing=first["type"] == "missing")
        message = first["msg"]
        key = "content" if param and param.endswith(".content") else param
        bounded = _integer_bounds(schema, key) if len(first["loc"]) == 1 else None
        if key in _UNION_MESSAGES and first["type"] != "missing":
            message = _UNION_MESSAGES[key]
        elif bounded and first["type"] != "missing":
            message = bounded  # one message whatever is wrong with the integer
        elif first["type"] == "value_error":
            message = str(first["ctx"]["error"]) if "ctx" in first else message
        message = message[:300]
        raise InvalidRequest(f"{param}: {message}" if param else message, param=param) from e


def _integer_bounds(schema: type[BaseModel], key: str | None) -> str | None:
    """What the top-level integer field ``key`` of ``schema`` must be (``must be an integer
    from 1 to 128``), from its bounds; None for another field."""
    field = schema.model_fields.get(key or "")
    if field is None or "int" not in str(field.annotation):
        return None
    lo = next((m.ge for m in field.metadata if isinstance(m, annotated_types.Ge)), None)
    hi = next((m.le for m in field.metadata if isinstance(m, annotated_types.Le)), None)
    if lo is None:
        return None
    return f"must be an integer from {lo}" + (f" to {hi}" if hi is not None else "")


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


async def read_body(request: Request, limit: int, budget: Shares | None = None,
                    client: str = "") -> bytes:
    """The request body, or RequestTooLarge (413) as soon as it passes ``limit`` bytes, or
    ServerBusy (503) when ``budget`` has no room for it, or ``client`` has held its share of
    it, while it is read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestTooLarge(f"request body is over the limit of {limit} bytes")
            if budget is not None:
                budget.take(client, len(chunk))
            chunks.append(chunk)
    except ClientDisconnect as e:  # gone mid-body (or cut for sending it too slowly)
        raise ClientGone("the client disconnected before its request body was read") from e
    finally:
        if budget is not None:
            budget.give(client, sum(len(c) for c in chunks))
    return b"".join(chunks)
