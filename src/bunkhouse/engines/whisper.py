"""The Whisper engine adapter (faster-whisper, CTranslate2 model directories), front side.

Its worker (``bunkhouse.worker.engines.whisper``) speaks the worker API's shape: ``/health``,
``/slots`` (one slot), and ``POST /v1/audio/transcriptions`` taking the upload's bytes and
answering NDJSON lines (info, segments as they come, done). A transcription model serves no
generation, tokens or KV snapshots: those calls are refused as the wrong kind of model.

The memory estimate (:func:`estimate`) was measured with Whisper tiny.en (int8, 2 threads,
`python -m benchmarks run --only transcribe`, docs/benchmarks.md section 7): the worker holds
138 MiB once loaded (75 MB ``model.bin``) and peaks at 275 MiB on a 7.5 s file; on a
10-minute file, transcribed in windows of ``WINDOW_S`` seconds, at 507 and 460 MiB in two
runs (faster-whisper called directly on the whole file: 679 MiB). A window's spectrogram,
decoder buffers and the allocator's retained pages come to about 3 MiB per second of
window, counted in full.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bunkhouse.engines import options as opts
from bunkhouse.engines.contract import (
    Adapter,
    Capabilities,
    ConstraintCheck,
    EngineRefused,
    MemoryEstimate,
    Messages,
    ServedModel,
    SlotSnapshot,
    SlotState,
    Timings,
    TokenPiece,
    WorkerSpawn,
)
from bunkhouse.engines.worker_http import WorkerHTTP
from bunkhouse.errors import EngineUnavailable, InvalidRequest, RequestTooLarge, envelope

NAME = "whisper"
WORKER_ENGINE = "bunkhouse.worker.engines.whisper:WhisperEngine"
MIB = 1024 * 1024

RUNTIME_BYTES = 160 * MIB
"""The worker without its model: Python, CTranslate2, PyAV, their threads (measured 130 MiB
for tiny.en's process less its weights, rounded up)."""

WINDOW_S = 120  # worker/engines/whisper.py WINDOW_S: audio transcribed at once, seconds
WINDOW_BYTES_PER_S = 3 * MIB
"""A window's working set per second of audio: (507 - 138) MiB over a 120 s window, measured
on a 10-minute file (see above), rounded up."""
SAMPLE_BYTES_PER_S = 16_000 * 2  # the decoded audio: 16 kHz mono, 16-bit

ROUTE = "/v1/audio/transcriptions"


@dataclass(frozen=True, slots=True)
class WhisperOptions:
    """Whisper's own options of a model (config keys of the same names)."""

    threads: int = field(default_factory=opts.cpu_threads)  # CTranslate2's CPU threads


_OPTION_CHECKS: dict[str, opts.Check] = {"threads": opts.integer(1)}


def parse_options(raw: Mapping[str, Any], where: str) -> WhisperOptions:
    """Whisper's options as written; ConfigError naming an unknown key or a wrong value."""
    return WhisperOptions(**opts.checked(raw, _OPTION_CHECKS, where))


def wrong_kind(model_id: str) -> InvalidRequest:
    return InvalidRequest(f"model {model_id!r} is a transcription model: send audio to "
                          "POST /v1/audio/transcriptions", param="model")


class WhisperClient(WorkerHTTP):
    """The worker contract over the Whisper worker's API; generation calls are refused."""

    async def probe(self, timeout_s: float) -> bool:
        # the HTTP server's own thread answers; a transcription runs on another
        return await self.health(timeout_s)

    async def count_tokens(self, prompt: str | Messages) -> int:
        raise wrong_kind(self._model_id)

    async def tokenize(self, prompt: str | Messages | dict[str, Any]) -> list[int]:
        raise wrong_kind(self._model_id)

    async def token_pieces(self, text: str, *, add_special: bool,
                           parse_special: bool) -> list[TokenPiece]:
        raise wrong_kind(self._model_id)

    async def detokenize(self, tokens: list[int]) -> str:
        raise wrong_kind(self._model_id)

    async def apply_template(self, chat: dict[str, Any]) -> str:
        raise wrong_kind(self._model_id)

    async def generate(self, route: str, body: dict[str, Any] | bytes,
                       slot: int | None = None) -> httpx.Response:
        raise wrong_kind(self._model_id)

    async def infill(self, body: dict[str, Any] | bytes,
                     slot: int | None = None) -> httpx.Response:
        raise wrong_kind(self._model_id)

    def timings(self, event: dict[str, Any]) -> Timings | None:
        return None

    timings_mark = b""  # its transcripts carry no figures

    def timings_line(self, line: str) -> Timings | None:
        return None

    def error(self, status: int, body: bytes, route: str) -> tuple[int, dict[str, Any]]:
        return error_object(status, body)

    async def slots(self) -> list[SlotState]:
        resp = await self._get("/slots", None)
        try:
            return [SlotState(int(s["id"]), bool(s.get("is_processing"))) for s in resp.json()]
        except (ValueError, TypeError, KeyError) as e:
            raise EngineUnavailable(f"model {self._model_id!r}: /slots answered "
                                    f"{resp.text[:200]!r}") from e

    async def save_slot(self, slot_id: int, filename: str) -> SlotSnapshot:
        raise wrong_kind(self._model_id)

    async def restore_slot(self, slot_id: int, filename: str) -> SlotSnapshot:
        raise wrong_kind(self._model_id)

    async def adapter_fields(self, adapters: tuple[Adapter, ...],
                             chosen: Adapter | None) -> dict[str, Any]:
        raise wrong_kind(self._model_id)

    async def prime_slot(self, slot_id: int, fields: dict[str, Any], token: int) -> None:
        raise wrong_kind(self._model_id)

    async def transcribe(self, audio: AsyncIterator[bytes], size: int,
                         options: dict[str, Any]) -> httpx.Response:
        """Send ``size`` bytes of an upload; the open NDJSON answer (the caller reads and
        closes it). A refusal of the file is EngineRefused (not audio) or RequestTooLarge
        (too long), naming ``file``; a worker that cannot be reached, EngineUnavailable."""
        resp = await self._send(self._http.build_request(
            "POST", ROUTE, params={"options": json.dumps(options)}, content=audio,
            headers={"content-length": str(size), "content-type": "application/octet-stream"}))
        if resp.status_code != 200:
            try:
                body = await resp.aread()
            except httpx.TransportError as e:
                raise self._unreachable(e) from e
            finally:
                await resp.aclose()
            status, err = error_object(resp.status_code, body)
            if status == 413:
                raise RequestTooLarge(err["error"]["message"], param=err["error"]["param"])
            if status < 500:
                raise EngineRefused(err["error"]["message"], param=err["error"]["param"])
            raise EngineUnavailable(f"model {self._model_id!r}: {err['error']['message']}")
        return resp


def error_object(status: int, body: bytes) -> tuple[int, dict[str, Any]]:
    """The worker's error answer as (status, OpenAI error envelope)."""
    message, param = body.decode("utf-8", errors="replace")[:2000], None
    try:
        err: Any = json.loads(body)["error"]
        message, param = str(err.get("message", message)), err.get("param")
    except (ValueError, AttributeError, TypeError, KeyError):
        pass
    if 400 <= status < 500:
        return status, envelope(message, "invalid_request_error", "invalid_request",
                                param if isinstance(param, str) else None)
    return status, envelope(message, "server_error", "engine_error")


def estimate(model: ServedModel) -> MemoryEstimate:
    """The worker's worst case: its runtime, the weights (the directory's files as stored;
    int8 on CPU never takes more), a window's working set and, for larger models, encoder
    and decoder buffers of half the weights; the window's samples (the upload itself is
    spooled to disk)."""
    return MemoryEstimate(
        weights=model.size_bytes, kv_cache=0, prompt_cache=0, runtime=RUNTIME_BYTES,
        compute=WINDOW_S * WINDOW_BYTES_PER_S + model.size_bytes // 2,
        outputs=2 * WINDOW_S * SAMPLE_BYTES_PER_S)


class Whisper:
    """The Whisper engine adapter (engines/contract.py ``EngineAdapter``)."""

    name = NAME
    worker_engine = WORKER_ENGINE
    build = "faster-whisper"

    known_options = frozenset(_OPTION_CHECKS)

    def options(self, raw: Mapping[str, Any], where: str) -> WhisperOptions:
        return parse_options(raw, where)

    ready_line: str | None = None

    def command(self, model: ServedModel, spawn: WorkerSpawn) -> list[str] | None:
        return None

    def worker_args(self, model: ServedModel) -> list[str]:
        own = parse_options(dict(model.options.engine_keys), "the model's whisper options")
        return ["--parallel", "1", *opts.worker_args(own)]

    def estimate(self, model: ServedModel) -> MemoryEstimate:
        return estimate(model)

    def client(self, transport: httpx.AsyncBaseTransport, model_id: str) -> WhisperClient:
        return WhisperClient(transport, model_id)

    def capabilities(self, model: ServedModel) -> Capabilities:
        return Capabilities(generates=False, embeds=False, infills=False, transcribes=True,
                            saves_kv=False)

    def pinnable(self, route: str, body: dict[str, Any]) -> bool:
        return False

    def shown_options(self, model: ServedModel) -> dict[str, Any]:
        return {}

    def draft_name(self, model: ServedModel) -> str | None:
        return None

    def refused(self, model: ServedModel) -> str | None:
        return None

    def adapters_refused(self, model: ServedModel) -> str | None:
        return "a transcription model takes no LoRA adapters"

    def check_request(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        return body

    probe_module: str | None = None

    def constraint_checks(self, path: str, body: dict[str, Any]) -> list[ConstraintCheck]:
        return []

    def forwarded_fields(self) -> frozenset[str]:
        return frozenset()

    def embedding_limit(self, model: ServedModel) -> int:
        return 0

    def kv_cache_bytes(self, model: ServedModel, tokens: int) -> int:
        return 0

    def slot_tokens(self, tokens: int) -> int:
        return tokens  # its one slot holds audio, not tokens

    def snapshot_layout(self, model: ServedModel) -> dict[str, Any] | None:
        return None

    def restore_hint(self, model: ServedModel) -> str:
        return ""

    def saved_tokens(self, path: Path) -> list[int]:
        raise ValueError("a transcription model saves no slots")
