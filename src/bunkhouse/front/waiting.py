"""A streamed request that waits (for its model to load, for memory, for a slot or a compute
turn) is answered at once: status 200 and its stream's headers after
:attr:`WaitingOptions.headers_after_s` with a first ping (a proxy's or a browser's first-byte
timer sees bytes at once), then a ping every :attr:`WaitingOptions.ping_s`
while it waits, in its protocol's own form (an SSE comment; Anthropic's ``ping`` event once
its ``message_start``, which waits for the prompt's count, went), so
that proxies and clients that give up on a silent connection keep it. With
``--send-loading-state``, an OpenAI chat stream also gets what it waits for as
``reasoning_content`` deltas ("loading model ..."), as llama-swap's ``sendLoadingState``
shows it. Once admitted, the worker's answer follows on the same stream.

A request refused at once (a full queue: 429; a model too large for the budget: 503)
keeps its status: only one still waiting after ``headers_after_s`` is committed to a 200.
An error after that (no memory freed in time, a failed load, a stop) is its stream's error
event in its protocol. A client that leaves while waiting gives its place up at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from bunkhouse.errors import BunkhouseError, error_body, log_line
from bunkhouse.front import relay
from bunkhouse.front.admission import Admitted, drop_admission
from bunkhouse.front.protocols import ChatShape
from bunkhouse.front.proxy import Shape
from bunkhouse.front.relay import ReaderStalled, Relay, StreamShaper, bounded_send

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WaitingOptions:
    headers_after_s: float = 0.25
    """A streamed request still waiting after this gets its headers (seconds). Short enough
    to be "at once" to a client; long enough that a refusal made at once keeps its status."""
    ping_s: float = 10.0
    """Seconds between pings while it waits (llama.cpp's ``--sse-ping-interval`` default)."""
    send_loading_state: bool = False
    """Tell an OpenAI chat stream what it waits for, in ``reasoning_content``."""


Serve = Callable[[Admitted, "StreamShaper | None"], Awaitable[Response]]


class WaitingStream(Response):
    """The answer of a streamed request whose admission (``admission``, a task) is under way:
    headers now, pings while it runs, then what ``serve(admitted, shaper)`` answers."""

    def __init__(self, admission: asyncio.Future[Admitted], serve: Serve,
                 shape: Shape | None, options: WaitingOptions,
                 waiting_for: Callable[[], str | None] | None = None,
                 model_id: str = "") -> None:
        super().__init__(media_type=shape.media_type if shape else "text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        del self.headers["content-length"]
        self.admission = admission
        self.serve = serve
        self.shape = shape
        self.shaper = shape.stream() if shape else ChatShape().stream()
        self.options = options
        self.waiting_for = waiting_for if options.send_loading_state else None
        self.model_id = model_id
        self._told_at = -1.0  # seconds into the wait when it was last told

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._respond(scope, receive, send)
        except ReaderStalled:  # stopped reading its pings: its place is given up
            log.warning("model %s: a waiting client read nothing for %.0f s; its request "
                        "is ended", self.model_id, relay.SEND_TIMEOUT_S)

    async def _respond(self, scope: Scope, receive: Receive, unbounded: Send) -> None:
        """Every message bounded by SEND_TIMEOUT_S, a relay's by its own stall timer."""
        send = bounded_send(unbounded, relay.SEND_TIMEOUT_S)
        # the access log and /metrics time the first byte of the answer, not of the pings
        state = scope.setdefault("state", {})
        state["first_byte_at"] = None
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        # a first body with the headers: a proxy's or browser's first-byte timer stops now
        opening = self.shaper.keepalive()
        if opening:
            await send({"type": "http.response.body", "body": opening, "more_body": True})
        if not await self._wait(receive, send):
            return
        try:
            admitted = self.admission.result()
            response = await self.serve(admitted, self.shaper if self.shape else None)
        except BunkhouseError as e:
            line = log_line(e)  # once: a fault logged where it happened, a short line here
            if line is not None:
                log.log(line[0], "model %s: a streamed request failed after waiting: %s",
                        self.model_id, line[1], extra={"output": line[2]})
            await self._end(send, self.shaper.error(error_body(e)))
            return
        except Exception as e:  # rendered once, here, as the error handler would
            log.exception("a streamed request failed after waiting", exc_info=e)
            err = BunkhouseError("internal error; see the server log")
            await self._end(send, self.shaper.error(error_body(err)))
            return
        if isinstance(response, StreamingResponse | Relay):  # the worker's answer, relayed
            direct = unbounded if isinstance(response, Relay) else send

            async def body_only(message: Message) -> None:
                if message["type"] == "http.response.start":
                    return
                if state["first_byte_at"] is None and message.get("body"):
                    state["first_byte_at"] = time.monotonic()
                await direct(message)

            await response(scope, receive, body_only)
            return
        try:  # an answer in one piece: an engine's error (OpenAI's envelope)
            body = json.loads(bytes(response.body))
        except ValueError:
            body = None
        if response.status_code >= 400 and isinstance(body, dict):
            await self._end(send, self.shaper.error(body))
        else:
            await self._end(send, b"")

    async def _wait(self, receive: Receive, send: Send) -> bool:
        """Ping until admitted; False if the client left meanwhile (its place given up)."""
        gone: asyncio.Future[Any] = asyncio.ensure_future(_disconnected(receive))
        began = time.monotonic()
        try:
            while True:
                pending: set[asyncio.Future[Any]] = {self.admission, gone}
                done, _ = await asyncio.wait(pending,
                                             timeout=self.options.ping_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if gone in done:
                    await self._give_up()
                    return False
                if self.admission in done:
                    return True
                body = self.shaper.keepalive() + self._loading(time.monotonic() - began)
                if body:
                    await send({"type": "http.response.body", "body": body,
                                "more_body": True})
        except BaseException:
            await self._give_up()
            raise
        finally:
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)

    def _loading(self, waited_s: float) -> bytes:
        """What the request waits for, at most once a second whatever the ping interval."""
        what = self.waiting_for() if self.waiting_for is not None else None
        if what is None or waited_s - self._told_at < 1.0:
            return b""
        self._told_at = waited_s
        chunk: dict[str, Any] = {
            "id": "chatcmpl-waiting", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": self.model_id,
            "choices": [{"index": 0, "finish_reason": None, "delta": {
                "reasoning_content": f"{what}: {waited_s:.0f} s\n"}}]}
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    async def _give_up(self) -> None:
        """The client is gone: leave the line, or give back what was already taken."""
        await drop_admission(self.admission)

    @staticmethod
    async def _end(send: Send, body: bytes) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
