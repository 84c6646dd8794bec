"""uvicorn's server with bunkhouse's start line and stop."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

log = logging.getLogger("bunkhouse")


class Server(uvicorn.Server):
    """uvicorn's server with bunkhouse's stop (SIGINT/SIGTERM):

    - it stops accepting and gives running requests ``grace_s`` to finish; then it stops every
      worker, which ends each stream still running with an SSE error event (no stream is
      left truncated, and nothing is cancelled under a request);
    - every worker is stopped even on a forced exit (a second ^C), when uvicorn skips the
      app's shutdown;
    - a requested stop exits 0: uvicorn re-raises the captured signal after its shutdown,
      which makes the exit status look like a crash to supervisors (systemd, tests).
    """

    def __init__(self, config: uvicorn.Config, stop_workers: Callable[[], Awaitable[None]],
                 grace_s: float, serving: str,
                 on_stop: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._on_stop = on_stop  # called as the stop begins
        self._stop_workers = stop_workers
        self._grace_s = grace_s
        self._serving = serving

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # bound: only now is "serving" true (a port in use exits before)
            log.info("%s", self._serving)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        cut: list[asyncio.Future[None]] = []
        if self._on_stop is not None:
            self._on_stop()
        timer = loop.call_later(self._grace_s,
                                lambda: cut.append(asyncio.ensure_future(self._cut())))
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
            await self._stop_workers()
            if self.force_exit:  # uvicorn skipped the app's shutdown: let it end cleanly
                await self.lifespan.shutdown()

    async def _cut(self) -> None:
        log.info("stop grace of %.0f s passed; stopping workers, which ends running streams",
                 self._grace_s)
        await self._stop_workers()
