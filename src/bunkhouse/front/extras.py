"""llama.cpp's server routes users script against, routed by ``model`` like every other:
``/tokenize``, ``/detokenize`` and ``/apply-template`` (tools/server/README.md). They hold a
lease on the model (it is loaded if it is not, and is not evicted meanwhile) but no slot and
no compute turn: the engine answers them on its HTTP threads without decoding. ``/infill``
generates, so it takes the one generation path (``Pipeline.generate``), not this module.

Each request is checked here before the engine sees it (types, token ids inside the model's
vocabulary, chat on a model with a template, a text to tokenize and token ids to detokenize no
longer than the model's trained context: 15.6 MB to ``/tokenize`` grew a worker by 840 MiB
past its memory estimate); the engine answers through the contract's methods.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bunkhouse.api.fields import CHAT_FREE_FORM, read_object
from bunkhouse.api.schemas import (
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    validate,
)
from bunkhouse.catalog import CatalogModel
from bunkhouse.errors import InvalidRequest
from bunkhouse.front.admission import check_text_length, trained_limit
from bunkhouse.front.edge import check_generates, prepare
from bunkhouse.front.pipeline import Pipeline

S = TypeVar("S", bound=BaseModel)


class Extras:
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    async def _parse(self, request: Request, schema: type[S]
                     ) -> tuple[dict[str, Any], S, CatalogModel]:
        """The body as given, as ``schema`` checks it, and the model it names."""
        bodies = self.pipeline.bodies
        body = await bodies.read(request)
        data = await bodies.cpu(len(body), read_object, body, CHAT_FREE_FORM)
        parsed = await bodies.cpu(len(body), validate, schema, data)
        catalog = self.pipeline.catalog
        model = catalog.served(catalog.get(getattr(parsed, "model", None)))[0]  # an adapter's
        check_generates(model)  # tokenizer and template are its base's
        return data, parsed, model

    async def tokenize(self, request: Request) -> Response:
        """``{"tokens": [id, ...]}``, or with ``with_pieces`` ``{"tokens": [{"id", "piece"},
        ...]}`` (a piece that is not valid UTF-8 on its own: its bytes as integers)."""
        _, parsed, model = await self._parse(request, TokenizeRequest)
        await check_text_length(model, parsed.content, "content")
        async with self.pipeline.worker(model) as engine:
            pieces = await engine.token_pieces(parsed.content, add_special=parsed.add_special,
                                               parse_special=parsed.parse_special)
        tokens: list[Any] = ([{"id": p.id, "piece": p.piece} for p in pieces]
                             if parsed.with_pieces else [p.id for p in pieces])
        return JSONResponse({"tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        """``{"content": text}``."""
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
        async with self.pipeline.worker(model) as engine:
            return JSONResponse({"content": await engine.detokenize(list(parsed.tokens))})

    async def apply_template(self, request: Request) -> Response:
        """``{"prompt": text}``: the prompt a chat request becomes under the model's chat
        template."""
        data, _, model = await self._parse(request, ChatCompletionRequest)
        checked = prepare("/v1/chat/completions", ChatCompletionRequest, model, data)
        async with self.pipeline.worker(model) as engine:
            return JSONResponse({"prompt": await engine.apply_template(checked)})
