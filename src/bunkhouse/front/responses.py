"""OpenAI's Responses API routes: ``POST /v1/responses`` (translated to a chat completion
request by api/responses.py and served by the one generation path, ``Pipeline.generate``), and
the stored responses (front/response_store.py): ``GET`` and ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from bunkhouse.api import responses
from bunkhouse.api.fields import function_tool, read_object, rename_error, shown, skipped_tools
from bunkhouse.api.schemas import ChatCompletionRequest, validate
from bunkhouse.errors import BunkhouseError, InvalidRequest, NotFound
from bunkhouse.front.edge import note_skipped_tools
from bunkhouse.front.pipeline import Pipeline
from bunkhouse.front.protocols import ResponsesShape
from bunkhouse.front.response_store import ResponseStore

MAX_PAGE = 100  # input items in one listing page (OpenAI's limit)


class ResponseNotFound(NotFound):
    code = "response_not_found"


class PreviousResponseNotFound(NotFound):
    code = "previous_response_not_found"


class ResponsesRoutes:
    """The Responses API over ``front``; ``store`` None: nothing is stored (a
    ``previous_response_id`` is then never found)."""

    def __init__(self, front: Pipeline, store: ResponseStore | None) -> None:
        self.front = front
        self.store = store

    async def create(self, request: Request) -> Response:
        front = self.front
        body = await front.bodies.read(request)
        given = await front.bodies.cpu(len(body), read_object, body, responses.FREE_FORM)
        items = await front.bodies.cpu(len(body), responses.check_request, given)
        note_skipped_tools(request, skipped_tools(given, function_tool))
        owner = front.keys.owner(request)
        history: list[dict[str, Any]] = []
        history_bytes = 0
        previous = given.get("previous_response_id")
        if previous:
            found = (await self.store.conversation(previous, owner)
                     if self.store else None)
            if found is None:
                raise PreviousResponseNotFound(
                    f"previous response {shown(previous)} not found (never stored, deleted, or "
                    "past the server's retention)", param="previous_response_id")
            history = found
            history_bytes = len(await front.bodies.cpu(len(body), _encoded, history))
        data = await front.bodies.cpu(len(body), responses.to_chat, given, items, history)
        try:
            parsed = await front.bodies.cpu(len(body), validate, ChatCompletionRequest, data)
        except BunkhouseError as e:
            rename_error(e, responses.CHAT_FIELDS)
            raise
        store = self.store if given.get("store", True) is not False else None
        if store is not None:
            # an answer asked to be stored, that cannot be, is a 503; one that can never fit
            # the store's bytes (it holds the request and the conversation again) a 400
            store.check(len(body) + history_bytes)
        given = {**given, "store": store is not None}  # as the response will say

        made: list[ResponsesShape] = []

        def shape(model_id: str) -> ResponsesShape:
            on_done = (functools.partial(_keep, store, owner or "", items, history)
                       if store is not None else None)
            made.append(ResponsesShape(responses.Echo(given, model_id), on_done))
            return made[-1]

        try:
            answer = await front.generate(request, "/v1/chat/completions",
                                          ChatCompletionRequest, parsed, data, len(body),
                                          shape, cap=True)
        except BunkhouseError as e:  # refused as a chat request: named as this API names it
            rename_error(e, responses.CHAT_FIELDS)
            raise
        # a stream its client leaves is kept as far as it went (ResponsesShape.sent)
        return _Sent(answer, made[0].sent) if parsed.stream and made else answer

    async def retrieve(self, request: Request) -> Response:
        found = await self._stored(request, "response")
        return JSONResponse(found)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        owner = self.front.keys.owner(request)
        if self.store is None or not await self.store.delete(response_id, owner):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        items = await self._stored(request, "items")
        query = request.query_params
        raw = query.get("limit", "20")
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_PAGE:
            raise InvalidRequest(f"limit must be an integer from 1 to {MAX_PAGE}",
                                 param="limit")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest("order must be \"asc\" or \"desc\"", param="order")
        return JSONResponse(responses.input_items_page(items, limit=int(raw), order=order,
                                                       after=query.get("after")))

    async def _stored(self, request: Request, what: str) -> Any:
        response_id = request.path_params["response_id"]
        found = None
        owner = self.front.keys.owner(request)
        if self.store is not None:
            found = await (self.store.response(response_id, owner) if what == "response"
                           else self.store.items(response_id, owner))
        if found is None:
            raise _not_found(response_id)
        return found


class _Sent(Response):
    """``inner`` sent as it is, then ``then()`` however its sending ended (the whole answer
    sent, the client gone, the task cancelled)."""

    def __init__(self, inner: Response, then: Callable[[], None]) -> None:
        self.inner = inner
        self.then = then
        self.status_code = inner.status_code
        self.raw_headers = inner.raw_headers  # one list: a header set here is the inner's
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            self.then()


def _encoded(value: Any) -> bytes:
    return json.dumps(value).encode()


def _not_found(response_id: str) -> NotFound:
    return ResponseNotFound(f"response {shown(response_id)} not found (never stored, deleted, "
                            "or past the server's retention)")


def _keep(store: ResponseStore, owner: str, items: list[dict[str, Any]],
          history: list[dict[str, Any]], response: dict[str, Any]) -> None:
    """Store ``response``, however it ended (completed, incomplete, failed: OpenAI keeps
    each, with its status and its ``error``)."""
    store.put(owner, response, items, responses.conversation(history, items, response))
