"""A benchmark engine that is never the bottleneck: it streams OpenAI-shaped chunks, as
llama.cpp's server writes them, at whatever rate it is asked, so that the front's own cost per
relayed token can be measured at GPU rates on a CPU host (benchmarks/relay.py).

A test and benchmark engine, never a default: the worker loads it by import path
(``--worker-engine tests.bench_engine:BenchEngine``). One asyncio loop (uvloop's where it is
installed) serves every connection on the worker's socket; a stream's chunks are encoded once
when the request arrives, and a decode step writes one token to every stream at once, as a GPU
build of llama.cpp decodes a batch of slots together.

- ``BUNKHOUSE_BENCH='{"rate": 2000}'``: tokens a second per stream (a step every ``1/rate`` s);
  ``0`` (the default) writes each stream as fast as its socket takes it.
- An answer is ``max_tokens`` tokens ``"t0 "``, ``"t1 "`` ... (``finish_reason`` ``length``),
  unless the prompt's last text scripts it:

  - ``say: TEXT``: the answer is TEXT, a token per word with its leading space
    (``finish_reason`` ``stop`` if it ends before ``max_tokens``);
  - ``[error after N]`` before that: after N tokens the stream carries llama.cpp's error event
    (``{"error": {"code": 500, ...}}``) and ends;
  - ``[cut after N]``: after N tokens the connection is closed mid-stream, as a crashed worker's.

It keeps the rest of the worker contract as the fault engine does (health, slots, tokenize,
detokenize, apply-template, slot save and restore), enough for ``bunkhouse serve``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from collections.abc import Callable
from typing import Any, cast

from bunkhouse.worker.engine import WorkerConfig

ENGINE = "tests.bench_engine:BenchEngine"  # its import path, as --worker-engine takes it

CREATED = 1_700_000_000
"""Every answer's ``created``: fixed, so that two runs' streams compare byte for byte."""

_DIRECTIVE = re.compile(r"\[(error|cut) after (\d+)\]\s*")


def _dump(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _event(value: Any) -> bytes:
    return b"data: " + _dump(value) + b"\n\n"


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Script:
    """One answer: its tokens and how it ends, from the request's body."""

    def __init__(self, body: dict[str, Any]) -> None:
        limit = body.get("max_tokens") or body.get("n_predict") or 16
        self.limit = int(limit) if isinstance(limit, int) and limit > 0 else 16
        text = _last_text(body)
        self.fault: tuple[str, int] | None = None
        match = _DIRECTIVE.match(text)
        if match:
            self.fault = (match.group(1), int(match.group(2)))
            text = text[match.end():]
        if text.startswith("say:"):
            words = re.findall(r"\s*\S+", text[4:].strip())
            self.tokens = words[:self.limit]
            self.finish = "stop" if len(words) < self.limit else "length"
        else:
            self.tokens = [f"t{i} " for i in range(self.limit)]
            self.finish = "length"
        self.prompt_tokens = max(1, len(json.dumps(body.get("messages")
                                                   or body.get("prompt") or "").split()))


def _last_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        content = messages[-1].get("content")
        if isinstance(content, list):  # parts: the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return content if isinstance(content, str) else ""
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def stream_events(model: str, route: str, body: dict[str, Any], script: Script) -> list[bytes]:
    """The answer's SSE events as llama.cpp's server writes them (compact JSON, one event per
    token), the last one ``[DONE]``; a scripted error's event ends it instead."""
    chat = route == "/v1/chat/completions"
    head = {"created": CREATED, "id": "chatcmpl-bench" if chat else "cmpl-bench",
            "model": model, "system_fingerprint": "b0-bench",
            "object": "chat.completion.chunk" if chat else "text_completion"}

    def choice(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if not chat:
            return {"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}
        delta: dict[str, Any] = {}
        if role:
            delta = {"role": "assistant", "content": None}
        elif text is not None:
            delta = {"content": text}
        return {"finish_reason": finish, "index": 0, "delta": delta}

    events = [_event({"choices": [choice(None, None, role=True)], **head})] if chat else []
    for i, token in enumerate(script.tokens):
        if script.fault is not None and script.fault[0] == "error" and i == script.fault[1]:
            events.append(_event({"error": {"code": 500, "message": "bench engine: scripted "
                                            "error", "type": "server_error"}}))
            return events
        events.append(_event({"choices": [choice(token, None)], **head}))
    n = len(script.tokens)
    timings = {"cache_n": 0, "prompt_n": script.prompt_tokens, "prompt_ms": 1.0,
               "predicted_n": n, "predicted_ms": max(1.0, n * 0.5)}
    events.append(_event({"choices": [choice(None if chat else "", script.finish)], **head,
                          "timings": timings}))
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        usage = {"completion_tokens": n, "prompt_tokens": script.prompt_tokens,
                 "total_tokens": n + script.prompt_tokens}
        events.append(_event({"choices": [], **head, "usage": usage, "timings": timings}))
    events.append(b"data: [DONE]\n\n")
    return events


class _Stream:
    """One streamed answer being written, a token's bytes per decode step."""

    def __init__(self, transport: asyncio.Transport, chunks: list[bytes], cut: int | None,
                 done: Callable[[_Stream], None]) -> None:
        self.transport = transport
        self.chunks = chunks
        self.next = 0
        self.cut = cut  # close the connection before this chunk
        self.done = done

    def step(self) -> None:
        """Write the next chunk (the last one ends the answer)."""
        if self.transport.is_closing():
            self.done(self)
            return
        if self.cut is not None and self.next >= self.cut:
            self.transport.abort()
            self.done(self)
            return
        chunk = self.chunks[self.next]
        self.next += 1
        if self.next == len(self.chunks):
            self.transport.write(chunk + b"0\r\n\r\n")
            self.transport.close()
            self.done(self)
        else:
            self.transport.write(chunk)


class _Connection(asyncio.Protocol):
    def __init__(self, engine: BenchEngine) -> None:
        self.engine = engine
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self.resumed: asyncio.Event | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.resumed is not None:
            self.resumed.set()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return
        lines = self.buffer[:head_end].decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip()
                   for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        if len(self.buffer) < head_end + 4 + length:
            return
        raw = self.buffer[head_end + 4:head_end + 4 + length]
        self.buffer = b""
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            self.answer_json(400, {"error": {"message": "invalid JSON",
                                       "type": "invalid_request_error"}})
            return
        self.engine.answer(self, method, target, body if isinstance(body, dict) else {})

    def answer_json(self, status: int, value: Any) -> None:
        data = _dump(value)
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, len(data), data))
        self.transport.close()


class BenchEngine:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        settings = json.loads(os.environ.get("BUNKHOUSE_BENCH", "{}"))
        self.rate = float(settings.get("rate", 0))
        self.slot_tokens = [0] * config.parallel
        self._streams: list[_Stream] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._ticker: asyncio.Task[None] | None = None

    def start(self) -> None:
        try:
            import uvloop
            loop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        self._loop = loop
        ready = threading.Event()

        async def serve() -> None:
            self._server = await loop.create_unix_server(
                lambda: _Connection(self), str(self.config.socket), backlog=1024)
            if self.rate > 0:
                self._ticker = loop.create_task(self._tick())
            ready.set()

        threading.Thread(target=loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(serve(), loop).result(30)
        ready.wait(30)

    def stop(self) -> None:
        if self._loop is not None and self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)

    async def _tick(self) -> None:
        """Every step, a token to every stream (a GPU decodes its slots as one batch); a
        stream whose client is not reading skips the step, as a slow reader holds its slot."""
        loop = asyncio.get_running_loop()
        interval = 1 / self.rate
        due = loop.time()
        while True:
            for stream in list(self._streams):
                if not stream.transport.get_write_buffer_size():
                    stream.step()
            due += interval
            delay = due - loop.time()
            if delay < -1:  # far behind (the machine is busy): no burst to catch up
                due = loop.time()
            await asyncio.sleep(max(0.0, delay))

    def answer(self, conn: _Connection, method: str, target: str, body: dict[str, Any]) -> None:
        path, _, query = target.partition("?")
        if method == "GET" and path == "/health":
            conn.answer_json(200, {"status": "ok"})
        elif method == "GET" and path == "/slots":
            conn.answer_json(200, [{"id": i, "is_processing": False, "n_prompt_tokens": n}
                             for i, n in enumerate(self.slot_tokens)])
        elif path == "/tokenize":
            words = str(body.get("content", "")).split()
            pieces = body.get("with_pieces")
            conn.answer_json(200, {"tokens": [{"id": i, "piece": (" " if i else "") + w}
                                        for i, w in enumerate(words)] if pieces
                             else list(range(len(words)))})
        elif path == "/detokenize":
            conn.answer_json(200, {"content": " ".join(f"t{i}" for i in body.get("tokens", []))})
        elif path == "/apply-template":
            conn.answer_json(200, {"prompt": "".join(f"<{m.get('role')}>{m.get('content')}\n"
                                               for m in body.get("messages", []))})
        elif path.startswith("/slots/"):
            self._slot_action(conn, path, query, body)
        elif path in ("/v1/chat/completions", "/v1/completions", "/completion"):
            self._generate(conn, path, body)
        else:
            conn.answer_json(404, {"error": {"message": f"not found: {path}",
                                       "type": "not_found_error"}})

    def _generate(self, conn: _Connection, path: str, body: dict[str, Any]) -> None:
        slot = body.get("id_slot", 0)
        if not isinstance(slot, int) or not 0 <= slot < len(self.slot_tokens):
            slot = 0
        script = Script(body)
        self.slot_tokens[slot] = script.prompt_tokens
        route = "/v1/completions" if path == "/completion" else path
        events = stream_events(self.config.model_id, route, body, script)
        if not body.get("stream"):
            conn.answer_json(200, _whole(self.config.model_id, route, script))
            return
        assert conn.transport is not None
        conn.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
        chunks = [_chunked(e) for e in events]
        cut = None
        if script.fault is not None and script.fault[0] == "cut":
            cut = script.fault[1] + 1  # the role chunk, then N tokens
        stream = _Stream(conn.transport, chunks, cut, self._streams.remove)
        self._streams.append(stream)
        if self.rate <= 0:
            asyncio.get_running_loop().create_task(self._unpaced(conn, stream))

    async def _unpaced(self, conn: _Connection, stream: _Stream) -> None:
        """As fast as the socket takes it: write until its buffer fills, then wait."""
        conn.resumed = asyncio.Event()
        while stream in self._streams:
            if conn.paused:
                conn.resumed.clear()
                await conn.resumed.wait()
                continue
            stream.step()
            await asyncio.sleep(0)

    def _slot_action(self, conn: _Connection, path: str, query: str,
                     body: dict[str, Any]) -> None:
        """``POST /slots/ID?action=save|restore`` with ``{"filename"}``, as llama.cpp's."""
        slot, action = int(path.rsplit("/", 1)[1]), query.removeprefix("action=")
        folder = self.config.snapshot_dir
        if folder is None:
            conn.answer_json(501, {"error": {"message": "slot save path not set",
                                       "type": "not_supported_error"}})
            return
        file = folder / str(body.get("filename", ""))
        if action == "save":
            data = _dump({"tokens": self.slot_tokens[slot]})
            file.write_bytes(data)
            conn.answer_json(200, {"id_slot": slot, "filename": file.name,
                             "n_saved": self.slot_tokens[slot], "n_written": len(data)})
        elif action == "restore" and file.is_file():
            self.slot_tokens[slot] = json.loads(file.read_bytes())["tokens"]
            conn.answer_json(200, {"id_slot": slot, "filename": file.name,
                             "n_restored": self.slot_tokens[slot], "n_read": 1})
        else:
            conn.answer_json(400, {"error": {"message": f"cannot {action} {file.name}",
                                       "type": "invalid_request_error"}})


def _whole(model: str, route: str, script: Script) -> dict[str, Any]:
    text = "".join(script.tokens)
    n = len(script.tokens)
    usage = {"completion_tokens": n, "prompt_tokens": script.prompt_tokens,
             "total_tokens": n + script.prompt_tokens}
    if route == "/v1/chat/completions":
        return {"choices": [{"finish_reason": script.finish, "index": 0,
                             "message": {"role": "assistant", "content": text}}],
                "created": CREATED, "id": "chatcmpl-bench", "model": model,
                "object": "chat.completion", "usage": usage}
    return {"choices": [{"text": text, "index": 0, "logprobs": None,
                         "finish_reason": script.finish}],
            "created": CREATED, "id": "cmpl-bench", "model": model,
            "object": "text_completion", "usage": usage}


def main(argv: list[str]) -> None:
    """``python -m tests.bench_engine SOCKET MODEL``: the engine's own server alone on SOCKET
    (the benchmark's limit), until SIGTERM."""
    import signal
    from pathlib import Path

    socket, model = Path(argv[0]), Path(argv[1])
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    engine = BenchEngine(WorkerConfig(model_id=model.stem, model_path=model, socket=socket,
                                      context=65536, parallel=16))
    engine.start()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    engine.stop()


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
