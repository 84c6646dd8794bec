"""A worker engine with injected faults, speaking the same worker API as llama.cpp's server.

The worker loads it by import path (``--engine tests.fault_engine:FaultEngine``); faults come
from the environment, per model id: ``BUNKHOUSE_FAULTS='{"m": {"crash_after_tokens": 3}}'``.

- ``load_delay_s``: seconds before it serves;
- ``load_gate``: a file path; the load goes on once the file exists (at most 120 s), so that
  a test holds a model loading for as long as it needs, without timing anything;
- ``fail_load``: a message; the load fails with it;
- ``crash_after_tokens``: the process exits (code 70) after streaming this many tokens;
- ``ignore_sigterm``: SIGTERM does nothing (only SIGKILL stops it);
- ``hang_after_requests``: after this many generations, nothing answers any more;
- ``fail_generation``: health answers, every generation is a 500.
- ``stall_on_grammar``: a generation with a ``grammar`` stops everything answering, as
  llama.cpp's loop stalls on a grammar too costly to apply.

It keeps the worker contract (engines/contract.py) as llama.cpp's server does: health, slots,
``/tokenize`` (a token per word, with pieces if asked), ``/detokenize`` and
``/apply-template``, streamed and plain generations (``/infill`` too) in the slot asked for
with their timings, and slot save/restore to files in its snapshot directory
(tests/integration/test_contract.py).
"""

from __future__ import annotations

import json
import os
import signal
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

from bunkhouse.worker.engine import EngineLoadError, WorkerConfig

ENGINE = "tests.fault_engine:FaultEngine"  # its import path, as --worker-engine takes it

_TOKEN_INTERVAL_S = 0.01


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class FaultEngine:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        all_faults = json.loads(os.environ.get("BUNKHOUSE_FAULTS", "{}"))
        self.faults: dict[str, Any] = all_faults.get(config.model_id, {})
        self.requests = 0
        self.stalled = False
        self.slot_tokens = [0] * config.parallel  # tokens each slot holds (its last prompt)
        self._server: _Server | None = None

    def start(self) -> None:
        time.sleep(float(self.faults.get("load_delay_s", 0)))
        gate = self.faults.get("load_gate")
        deadline = time.monotonic() + 120
        while gate and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.faults.get("fail_load"):
            raise EngineLoadError(f"fault engine: {self.faults['fail_load']}")
        if self.faults.get("ignore_sigterm"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        engine = self

        class Handler(_Handler):
            pass

        Handler.engine = engine
        self._server = _Server(str(self.config.socket), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()

    def hung(self) -> bool:
        limit = self.faults.get("hang_after_requests")
        return self.stalled or (limit is not None and self.requests >= int(limit))


class _Handler(BaseHTTPRequestHandler):
    engine: FaultEngine
    protocol_version = "HTTP/1.1"  # streams are chunked, as llama.cpp's are

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True
        self.wfile.write(data)

    def _hang_if_hung(self) -> None:
        if self.engine.hung():
            time.sleep(3600)

    def do_GET(self) -> None:
        self._hang_if_hung()
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/slots":
            self._json(200, [{"id": i, "is_processing": False, "n_prompt_tokens": n}
                             for i, n in enumerate(self.engine.slot_tokens)])
        else:
            self._json(404, {"error": {"message": "not found", "type": "not_found_error"}})

    def do_POST(self) -> None:
        self._hang_if_hung()
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        except ValueError as e:
            self._json(400, {"error": {"message": f"invalid JSON: {e}",
                                       "type": "invalid_request_error"}})
            return
        if self.engine.faults.get("stall_on_grammar") and body.get("grammar"):
            self.engine.stalled = True
            self._hang_if_hung()
        if self.path.startswith("/slots/"):
            self._slot_action(body)
            return
        if self.path == "/apply-template":
            text = "".join(f"<{m.get('role')}>{m.get('content')}\n" for m in body["messages"])
            self._json(200, {"prompt": text})
            return
        if self.path == "/tokenize":
            words = body["content"].split()
            tokens: list[Any] = list(range(len(words)))
            if body.get("with_pieces"):
                tokens = [{"id": i, "piece": (" " if i else "") + w} for i, w in enumerate(words)]
            self._json(200, {"tokens": tokens})
            return
        if self.path == "/detokenize":
            self._json(200, {"content": " ".join(f"t{i}" for i in body["tokens"])})
            return
        self.engine.requests += 1
        prompt = body.get("prompt") or body.get("messages") or body.get("input_prefix") or ""
        slot = body.get("id_slot", 0)
        if not isinstance(slot, int) or not 0 <= slot < len(self.engine.slot_tokens):
            self._json(400, {"error": {"message": f"invalid id_slot {slot!r}",
                                       "type": "invalid_request_error"}})
            return
        self.engine.slot_tokens[slot] = len(json.dumps(prompt).split())
        faults = self.engine.faults
        if faults.get("fail_generation"):
            self._json(500, {"error": {"message": "fault engine: generation failed",
                                       "type": "server_error"}})
            return
        tokens = int(body.get("max_tokens") or body.get("n_predict") or 16)
        model = self.engine.config.model_id
        timings = {"prompt_n": self.engine.slot_tokens[slot], "cache_n": 0,
                   "predicted_n": tokens, "prompt_ms": 1.0, "predicted_ms": 1.0}
        if not body.get("stream") and self.path == "/infill":  # llama.cpp's own shape
            text = " ".join(f"t{i}" for i in range(tokens))
            self._json(200, {"content": text, "stop": True, "timings": timings})
            return
        if not body.get("stream"):
            text = " ".join(f"t{i}" for i in range(tokens))
            self._json(200, {"object": "chat.completion", "model": model, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text},
                 "finish_reason": "length"}], "timings": timings})
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.send_header("connection", "close")
        self.end_headers()
        crash_after = faults.get("crash_after_tokens")
        for i in range(tokens):
            if crash_after is not None and i >= int(crash_after):
                os._exit(70)
            chunk = {"object": "chat.completion.chunk", "model": model,
                     "choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
            self._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
            time.sleep(float(faults.get("token_interval_s", _TOKEN_INTERVAL_S)))
        final = {"object": "chat.completion.chunk", "model": model, "timings": timings,
                 "choices": []}
        self._chunk(f"data: {json.dumps(final)}\n\n".encode())
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True

    def _slot_action(self, body: dict[str, Any]) -> None:
        """``POST /slots/ID?action=save|restore`` with ``{"filename"}``, as llama.cpp's."""
        path, _, query = self.path.partition("?")
        slot, action = int(path.rsplit("/", 1)[1]), query.removeprefix("action=")
        folder = self.engine.config.snapshot_dir
        if folder is None:
            self._json(501, {"error": {"message": "slot save path not set",
                                       "type": "not_supported_error"}})
            return
        file = folder / body["filename"]
        if action == "save":
            data = json.dumps({"tokens": self.engine.slot_tokens[slot]}).encode()
            file.write_bytes(data)
            self._json(200, {"id_slot": slot, "filename": body["filename"],
                             "n_saved": self.engine.slot_tokens[slot], "n_written": len(data)})
        elif action == "restore" and file.is_file():
            data = file.read_bytes()
            self.engine.slot_tokens[slot] = json.loads(data)["tokens"]
            self._json(200, {"id_slot": slot, "filename": body["filename"],
                             "n_restored": self.engine.slot_tokens[slot], "n_read": len(data)})
        else:
            self._json(400, {"error": {"message": f"cannot {action} {body['filename']}",
                                       "type": "invalid_request_error"}})

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()
