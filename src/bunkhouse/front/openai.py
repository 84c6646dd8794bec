"""OpenAI's generation routes: ``/v1/chat/completions``, ``/v1/completions`` (a ``suffix``
makes it fill-in-the-middle), ``/v1/embeddings``, and llama.cpp's ``/infill``; each parsed
here and served by the one pipeline (front/pipeline.py)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from bunkhouse.api import infill
from bunkhouse.api.fields import (
    CHAT_FREE_FORM,
    function_tool,
    read_object,
    skipped_tools,
    without_tools,
)
from bunkhouse.api.schemas import InfillRequest, validate
from bunkhouse.front.edge import known_only, note_skipped_tools
from bunkhouse.front.pipeline import Pipeline
from bunkhouse.front.protocols import InfillShape


class OpenAIRoutes:
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def generation(self, route: str, schema: type[BaseModel]
                   ) -> Callable[[Request], Awaitable[Response]]:
        """The handler of ``route``, whose body ``schema`` validates."""
        pipeline, bodies = self.pipeline, self.pipeline.bodies

        def parse(body: bytes) -> tuple[Any, dict[str, Any], list[str]]:
            data = known_only(schema, read_object(body, CHAT_FREE_FORM))
            skipped = skipped_tools(data, function_tool)
            data = without_tools(data, function_tool)
            return validate(schema, data), data, skipped

        async def handler(request: Request) -> Response:
            body = await bodies.read(request)
            parsed, data, skipped = await bodies.cpu(len(body), parse, body)
            note_skipped_tools(request, skipped)
            if route == "/v1/completions" and data.get("suffix"):  # fill-in-the-middle
                shape = functools.partial(InfillShape, request=data)
                return await pipeline.generate(request, "/infill", InfillRequest, parsed,
                                               infill.from_completion(data), len(body),
                                               shape)
            return await pipeline.generate(request, route, schema, parsed, data, len(body))

        return handler
