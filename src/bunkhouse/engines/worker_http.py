"""The HTTP plumbing every engine client shares: one ``httpx.AsyncClient`` on its worker's
transport, and transport failures turned into the contract's ``EngineUnavailable``."""

from __future__ import annotations

import httpx

from bunkhouse.defaults import CONNECT_TIMEOUT_S
from bunkhouse.errors import EngineUnavailable


class WorkerHTTP:
    """Base of the engine clients (engines/llamacpp.py, engines/whisper.py)."""

    def __init__(self, transport: httpx.AsyncBaseTransport, model_id: str = "") -> None:
        self._model_id = model_id
        self._http = httpx.AsyncClient(transport=transport, base_url="http://worker",
                                       timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S))

    def _unreachable(self, e: Exception) -> EngineUnavailable:
        return EngineUnavailable(f"model {self._model_id!r}: worker unreachable",
                                 detail=repr(e))

    def _check_open(self) -> None:
        """EngineUnavailable once the client is closed (its worker is gone), rather than
        httpx's RuntimeError for a task that still held it."""
        if self._http.is_closed:
            raise EngineUnavailable(f"model {self._model_id!r}: its worker is gone")

    async def _get(self, path: str, timeout_s: float | None) -> httpx.Response:
        self._check_open()
        try:
            return await self._http.get(path, timeout=timeout_s)
        except httpx.TransportError as e:
            raise self._unreachable(e) from e

    async def _send(self, request: httpx.Request) -> httpx.Response:
        """Send ``request``; the open, streamed response (the caller reads and closes it)."""
        self._check_open()
        try:
            return await self._http.send(request, stream=True)
        except httpx.TransportError as e:
            raise self._unreachable(e) from e

    async def health(self, timeout_s: float) -> bool:
        try:
            return (await self._get("/health", timeout_s)).status_code == 200
        except EngineUnavailable:
            return False

    async def aclose(self) -> None:
        await self._http.aclose()
