"""llama.cpp's server routes users script against, routed by ``model`` like every other:
``/tokenize``, ``/detokenize`` and ``/apply-template`` (tools/server/README.md). They hold a
lease on the model (it is loaded if it is not, and is not evicted meanwhile) but no slot and
no compute turn: the engine answers them on its HTTP threads without decoding. ``/infill``
generates, so it takes the one generation path (``Front.generate``), not this module.

Each request is checked here before the engine sees it (types, token ids inside the model's
vocabulary, chat on a model with a template, a text to tokenize and token ids to detokenize no
longer than the model's trained context: 15.6 MB to ``/tokenize`` grew a worker by 840 MiB
past its memory estimate); the engine's answer is relayed as it is.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bunkhouse.api.schemas import ChatCompletionRequest, TokenId, parse_json_object, validate
from bunkhouse.catalog import CatalogModel
from bunkhouse.engines.llamacpp import TEMPLATED_FIELDS
from bunkhouse.errors import InvalidRequest
from bunkhouse.front.admission import check_text_length, trained_limit
from bunkhouse.front.edge import check_generates, prepare

if TYPE_CHECKING:
    from bunkhouse.front.app import Front

S = TypeVar("S", bound=BaseModel)

MAX_DETOKENIZE = 1 << 20
"""Token ids in one ``/detokenize`` request (a million: far past any context)."""


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Annotated[StrictStr, Field(max_length=256)] | None = None
    content: StrictStr
    add_special: StrictBool = False
    parse_special: StrictBool = True
    with_pieces: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Annotated[StrictStr, Field(max_length=256)] | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE)]


class Extras:
    def __init__(self, front: Front) -> None:
        self.front = front

    async def _parse(self, request: Request, schema: type[S]
                     ) -> tuple[dict[str, Any], S, CatalogModel]:
        """The body as given, as ``schema`` checks it, and the model it names."""
        front = self.front
        body = await front.read(request)
        data = await front.cpu(len(body), parse_json_object, body)
        parsed = await front.cpu(len(body), validate, schema, data)
        model = front.catalog.get(getattr(parsed, "model", None))
        check_generates(model)
        return data, parsed, model

    async def tokenize(self, request: Request) -> Response:
        _, parsed, model = await self._parse(request, TokenizeRequest)
        await check_text_length(model, parsed.content, "content")
        return await self._relay(model.id, "/tokenize", parsed.model_dump(exclude={"model"}))

    async def detokenize(self, request: Request) -> Response:
        _, parsed, model = await self._parse(request, DetokenizeRequest)
        limit = trained_limit(model)
        if len(parsed.tokens) > limit:  # its text would be that long
            raise InvalidRequest(f"tokens: {len(parsed.tokens)} token ids, more than model "
                                 f"{model.id!r} takes ({limit}, its trained context); send "
                                 "them in parts", param="tokens")
        vocab = model.info.vocab_size
        if vocab:  # an id past the vocabulary is not the engine's to meet
            for i, token in enumerate(parsed.tokens):
                if token >= vocab:
                    raise InvalidRequest(f"tokens.{i}: {token} is not a token of model "
                                         f"{model.id!r} (its vocabulary has {vocab})",
                                         param=f"tokens.{i}")
        return await self._relay(model.id, "/detokenize", {"tokens": parsed.tokens})

    async def apply_template(self, request: Request) -> Response:
        """The prompt a chat request becomes under the model's chat template."""
        data, _, model = await self._parse(request, ChatCompletionRequest)
        checked = prepare("/v1/chat/completions", ChatCompletionRequest, model, data)
        chat = {k: v for k, v in checked.items() if k in TEMPLATED_FIELDS}
        return await self._relay(model.id, "/apply-template", chat)

    async def _relay(self, model_id: str, route: str, body: dict[str, Any]) -> Response:
        residency = self.front.residency
        lease = await residency.acquire(self.front.catalog.get(model_id))
        try:
            engine = lease.worker.engine
            resp = await engine.generate(route, json.dumps(body).encode())
            try:
                raw = await resp.aread()
            finally:
                await resp.aclose()
            if resp.status_code >= 400:
                status, content = engine.error(resp.status_code, raw, route)
                return JSONResponse(content, status_code=status)
            lease.report(True)
            return Response(raw, media_type="application/json")
        finally:
            lease.release()
