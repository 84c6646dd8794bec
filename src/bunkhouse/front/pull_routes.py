"""The routes of pulls (front/pulls.py runs them), all behind an admin key:

    POST   /admin/pull          {"model": "ORG/REPO[:QUANT|:FILE]", "stream"?: true}
           stream: SSE, one ``data:`` JSON step each (bunkhouse/pull/run.py), the first
           ``{"status": "started", "pull": ID}``, the last ``success`` (with ``id``, the
           served id) or an error; a client that leaves does not stop the pull.
           stream false: the last step once it ends, 200 for success, else the error.
    GET    /admin/pull          every pull of this run: id, model, status, bytes done
    DELETE /admin/pull/{id}     cancel it: 200 its view; 404 no such pull
    POST   /api/pull            Ollama's: ``{"model" | "name", "stream"?}``, NDJSON of
                                Ollama's statuses; an error before the download begins
                                (no such repo or quant, no disk) is an HTTP error
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from bunkhouse.api.schemas import parse_json_object, read_body
from bunkhouse.errors import InvalidRequest
from bunkhouse.front.pulls import Pull, Pulls

_OLLAMA_KEYS = ("status", "digest", "total", "completed")


class PullRoutes:
    def __init__(self, pulls: Pulls) -> None:
        self.pulls = pulls

    async def _start(self, request: Request, names: tuple[str, ...]) -> tuple[Pull, bool]:
        data = parse_json_object(await read_body(request, 64 * 1024))
        given = next((data[n] for n in names if n in data), None)
        if not isinstance(given, str):
            raise InvalidRequest(f"needs a string field '{names[0]}': the model to pull, as "
                                 "ORG/REPO[:QUANT]", param=names[0])
        stream = data.get("stream", True)
        if not isinstance(stream, bool):
            raise InvalidRequest("'stream' must be true or false", param="stream")
        return self.pulls.start(given), stream

    async def start(self, request: Request) -> Response:
        pull, stream = await self._start(request, ("model",))
        if not stream:
            await pull.ended.wait()
            return _ended(pull)

        async def steps() -> AsyncIterator[ServerSentEvent]:
            yield ServerSentEvent(data=json.dumps({"status": "started", "pull": pull.id}))
            async for step in pull.follow():
                yield ServerSentEvent(data=json.dumps(step))

        return EventSourceResponse(steps(), ping=15, headers={"X-Pull-Id": pull.id})

    async def list(self, request: Request) -> Response:
        return JSONResponse({"pulls": self.pulls.list()})

    async def cancel(self, request: Request) -> Response:
        return JSONResponse(self.pulls.cancel(request.path_params["pull_id"]).view())

    async def ollama(self, request: Request) -> Response:
        """Ollama's ``/api/pull``. Its lines hold Ollama's keys only."""
        pull, stream = await self._start(request, ("model", "name"))
        steps = pull.follow()
        first: list[dict[str, Any]] = []
        async for step in steps:  # up to the plan: its errors are the request's
            if "error" in step:
                await pull.ended.wait()
                err = pull.error()
                assert err is not None
                raise err
            if step.get("status") == "plan":
                break
            first.append(step)
        if not stream:
            await pull.ended.wait()
            if (err := pull.error()) is not None:
                raise err
            return JSONResponse({"status": "success"})

        async def lines() -> AsyncIterator[bytes]:
            for step in first:
                yield _ollama_line(step)
            async for step in steps:
                if step.get("status") != "plan":
                    yield _ollama_line(step)

        return StreamingResponse(lines(), media_type="application/x-ndjson")


def _ollama_line(step: dict[str, Any]) -> bytes:
    if "error" in step:
        return json.dumps({"error": step["error"]}).encode() + b"\n"
    return json.dumps({k: step[k] for k in _OLLAMA_KEYS if k in step}).encode() + b"\n"


def _ended(pull: Pull) -> Response:
    err = pull.error()
    if err is not None:
        raise err
    return JSONResponse({**(pull.result or {}), "pull": pull.id})
