"""Request bodies: read within their bounds, parsed off the event loop when large.

Every route that takes a body reads it here: the body size limit, the bytes all requests
hold while they are read (one client's share of them bounded: bunkhouse/shares.py), and the
parsing of a large body on a thread, two at a time (each takes a few times its size while
pydantic checks it: sixteen 15 MiB bodies at once took the front past 1 GB).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from starlette.requests import Request

from bunkhouse import defaults
from bunkhouse.api.schemas import read_body
from bunkhouse.front.auth import Keys
from bunkhouse.shares import Shares

R = TypeVar("R")


class BodyReader:
    """Reads and parses request bodies (see the module docstring)."""

    def __init__(self, keys: Keys, max_body_bytes: int = defaults.MAX_BODY_BYTES) -> None:
        self.keys = keys
        self.max_body_bytes = max_body_bytes
        self._parsing = asyncio.Semaphore(2)
        self._bodies = Shares(defaults.BODIES_IN_FLIGHT_BYTES, "request body bytes being read")

    async def read(self, request: Request) -> bytes:
        """The request's body, within the body size limit and the bytes in flight (the
        client's share of them included): RequestTooLarge (413) past the limit, ServerBusy
        (503) past the bytes in flight."""
        return await read_body(request, self.max_body_bytes, self._bodies,
                               self.keys.client_of(request))

    async def cpu(self, size: int, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)``: inline for an input of ``size`` bytes under
        ``defaults.LARGE_INPUT_BYTES``; for a larger one on a thread, two at a time."""
        if size < defaults.LARGE_INPUT_BYTES:
            return fn(*args)
        async with self._parsing:
            return await asyncio.to_thread(fn, *args)
