"""Anthropic's Messages API: ``POST /v1/messages`` translated to a chat completion request
(api/anthropic.py), served by the one pipeline (front/pipeline.py) and answered in
Anthropic's shape; ``POST /v1/messages/count_tokens`` counted by the model's worker."""

from __future__ import annotations

import functools
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bunkhouse.api import anthropic
from bunkhouse.api.fields import rename_error, skipped_tools
from bunkhouse.api.schemas import ChatCompletionRequest, parse_json_object, validate
from bunkhouse.api.tool_calls import check_tool_choice
from bunkhouse.errors import BunkhouseError
from bunkhouse.front.admission import model_pair_table, refuse_before_load, trained_limit
from bunkhouse.front.edge import note_skipped_tools, prepare
from bunkhouse.front.pipeline import Pipeline
from bunkhouse.front.protocols import AnthropicShape

CHAT = "/v1/chat/completions"


class AnthropicRoutes:
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    async def messages(self, request: Request) -> Response:
        """``POST /v1/messages``: the request's ``max_tokens`` is a ceiling (Anthropic's
        meaning), lowered to what the slot holds after the prompt."""
        bodies = self.pipeline.bodies

        def parse(body: bytes) -> tuple[dict[str, Any], list[str]]:
            given = parse_json_object(body)
            return anthropic.to_chat(given), skipped_tools(given, anthropic.served)

        body = await bodies.read(request)
        data, skipped = await bodies.cpu(len(body), parse, body)
        note_skipped_tools(request, skipped)
        stops = list(data.get("stop") or [])
        try:  # refused as a chat request: the field named as this API names it
            parsed = await bodies.cpu(len(body), validate, ChatCompletionRequest, data)
            return await self.pipeline.generate(
                request, CHAT, ChatCompletionRequest, parsed, data, len(body),
                lambda model_id: AnthropicShape(model_id, stops), cap=True,
                count_prompt=bool(parsed.stream))
        except BunkhouseError as e:
            rename_error(e, anthropic.CHAT_FIELDS)
            raise

    async def count_tokens(self, request: Request) -> Response:
        """``POST /v1/messages/count_tokens``: the prompt's tokens, as the model's worker
        templates and tokenizes it (the model is loaded if it is not); a prompt longer than
        the model's trained context is a 400 without being tokenized."""
        bodies = self.pipeline.bodies
        body = await bodies.read(request)

        def parse(raw: bytes) -> tuple[dict[str, Any], list[str]]:
            given = parse_json_object(raw)
            return (anthropic.to_chat({**given, "max_tokens": 1, "stream": False}),
                    skipped_tools(given, anthropic.served))

        data, skipped = await bodies.cpu(len(body), parse, body)
        note_skipped_tools(request, skipped)  # left out of the count, as of an answer
        try:  # refused as a chat request: the field named as this API names it
            parsed = await bodies.cpu(len(body), validate, ChatCompletionRequest, data)
            check_tool_choice(data)
            catalog = self.pipeline.catalog
            model = catalog.served(catalog.get(parsed.model))[0]  # an adapter counts as its base
            data = await bodies.cpu(len(body), prepare, CHAT, ChatCompletionRequest, model, data)
            # counted even past one slot (agents count to decide when to compact), but not
            # past what the model was trained for: megabytes of text took the worker gigabytes
            await refuse_before_load(model, CHAT, data,
                                     functools.partial(model_pair_table, model), cap=True,
                                     limit=trained_limit(model))
        except BunkhouseError as e:
            rename_error(e, anthropic.CHAT_FIELDS)
            raise
        async with self.pipeline.worker(model) as engine:
            tokens = await engine.tokenize(data)
        return JSONResponse({"input_tokens": len(tokens)})
