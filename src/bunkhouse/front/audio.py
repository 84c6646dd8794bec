"""``POST /v1/audio/transcriptions``: OpenAI's transcription API, served by a Whisper worker.

The upload is a multipart form (``file`` and the options as fields). It is read as it
arrives into a temporary file (Starlette's multipart parser spools a file part past 1 MiB to
disk), bounded by ``--max-audio`` bytes (413 as soon as it is passed, or at once when the
declared length says so) and by the uploads held at once (503 ``server_busy``). Before any
model is loaded the file is checked to begin like an audio container (WAV, MP3, FLAC, Ogg,
MP4/M4A, WebM/Matroska, AIFF, AMR, AAC): a text file renamed ``.wav`` is a 400 at once. The
decoding itself runs in the worker (worker/engines/whisper.py): a file that only looks like
audio is refused there with a 400, one holding more audio than a transcription may take
(its declared duration, then what its frames hold) with a 413, both naming ``file``, and a
decoder crash takes down that worker, never the front.

A transcription is admitted like a generation: a lease on the model (loading it, evicting
least recently used models to make room), its one slot, and a compute turn (front/admission.py
``ComputeGate``: on a CPU host a transcription and a decoding model take turns). A client that
leaves while it waits gives its place up; one that leaves while it is transcribed stops the
worker at its next segment, and what it held is given back once the worker is idle.

Answers (``response_format``): ``json`` ``{"text", "usage"}``, ``text``, ``srt``, ``vtt``,
``verbose_json`` (language, duration, segments, and ``words`` when
``timestamp_granularities[]`` asks for them); ``stream=true`` answers Server-Sent Events,
``transcript.text.delta`` per segment as it is transcribed and ``transcript.text.done``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from sse_starlette import EventSourceResponse
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from bunkhouse.api.schemas import FORM_OVERHEAD_BYTES, MAX_FIELD_BYTES, MAX_FIELDS, MAX_FILES
from bunkhouse.catalog import CatalogModel
from bunkhouse.catalog.whisper import OPENAI_NAME
from bunkhouse.defaults import MAX_AUDIO_BYTES, UPLOADS_IN_FLIGHT_BYTES
from bunkhouse.engines import engine_for
from bunkhouse.errors import (
    BunkhouseError,
    ClientGone,
    EngineUnavailable,
    InvalidRequest,
    RequestTooLarge,
    ShuttingDown,
    error_body,
)
from bunkhouse.front.admission import Admitted, Held
from bunkhouse.front.pipeline import Pipeline
from bunkhouse.shares import Shares

log = logging.getLogger(__name__)

ROUTE = "/v1/audio/transcriptions"

SETTLE_S = 120.0
"""How long an abandoned transcription's lease is held at most while its worker finishes the
stretch of audio it is on (measured: up to 17 s on 2 busy cores)."""
SETTLE_POLL_S = 0.25

FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
GRANULARITIES = ("segment", "word")
_LANGUAGE = re.compile(r"[a-z]{2,3}")
_CHUNK = 1 << 20

# How audio containers begin (offset, bytes): what FFmpeg's probes recognize them by.
_SIGNATURES: tuple[tuple[int, bytes], ...] = (
    (0, b"RIFF"),  # WAV (RIFF....WAVE), also AVI
    (0, b"RF64"),  # WAV past 4 GB
    (0, b"ID3"),  # MP3 with a tag
    (0, b"fLaC"),
    (0, b"OggS"),  # Ogg: Vorbis, Opus, FLAC
    (4, b"ftyp"),  # MP4, M4A, 3GP, MOV
    (0, b"\x1a\x45\xdf\xa3"),  # Matroska, WebM
    (0, b"FORM"),  # AIFF
    (0, b"#!AMR"),
    (0, b"caff"),  # Core Audio
    (0, b".snd"),  # AU
)
_FORMAT_NAMES = "wav, mp3, m4a, mp4, flac, ogg, opus, webm, aiff, amr, aac"


def looks_like_audio(head: bytes) -> bool:
    """Whether a file beginning with ``head`` (its first 12 bytes or more) is in a container
    FFmpeg decodes audio from; an MPEG audio stream (MP3, AAC ADTS) has no header but a
    frame sync word (11 bits set)."""
    if any(head[at:at + len(sig)] == sig for at, sig in _SIGNATURES):
        return True
    return len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0


@dataclass(slots=True)
class Options:
    """A transcription request's fields, checked."""

    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    response_format: str = "json"
    granularities: tuple[str, ...] = ()
    stream: bool = False

    def worker_options(self) -> dict[str, Any]:
        return {"language": self.language, "prompt": self.prompt,
                "temperature": self.temperature, "words": "word" in self.granularities}


def parse_fields(form: FormData) -> Options:
    """The option fields of a transcription form; InvalidRequest naming the field for a
    value OpenAI's API would refuse. Fields OpenAI defines that do not apply to Whisper
    (``chunking_strategy``, ``include[]``) and unknown fields are ignored."""
    def text(name: str) -> str | None:
        values = form.getlist(name)
        if not values:
            return None
        if len(values) > 1 or not isinstance(values[0], str):
            raise InvalidRequest(f"{name} must be given once, as a text field", param=name)
        return values[0]

    options = Options(model=text("model") or None)
    if (language := text("language")) is not None and language != "":
        if not _LANGUAGE.fullmatch(language):
            raise InvalidRequest("language must be an ISO-639-1 code such as 'en'",
                                 param="language")
        options.language = language
    options.prompt = text("prompt") or None
    if (temperature := text("temperature")) is not None:
        try:
            options.temperature = float(temperature)
        except ValueError:
            options.temperature = -1.0
        if not 0.0 <= options.temperature <= 1.0:
            raise InvalidRequest("temperature must be a number from 0 to 1",
                                 param="temperature")
    if (fmt := text("response_format")) is not None:
        if fmt not in FORMATS:
            raise InvalidRequest(f"response_format must be one of {', '.join(FORMATS)}",
                                 param="response_format")
        options.response_format = fmt
    granularities = [*form.getlist("timestamp_granularities[]"),
                     *form.getlist("timestamp_granularities")]
    for value in granularities:
        if not isinstance(value, str) or value not in GRANULARITIES:
            raise InvalidRequest("timestamp_granularities[] takes 'segment' and 'word'",
                                 param="timestamp_granularities")
    if granularities and options.response_format != "verbose_json":
        raise InvalidRequest("timestamp_granularities[] needs response_format verbose_json",
                             param="timestamp_granularities")
    options.granularities = tuple(dict.fromkeys(str(g) for g in granularities))
    if (stream := text("stream")) is not None:
        if stream.lower() not in ("true", "false"):
            raise InvalidRequest("stream must be true or false", param="stream")
        options.stream = stream.lower() == "true"
    return options


@dataclass(slots=True)
class Upload:
    """A received form: its file part (on disk past 1 MiB) and its size, bytes;
    ``release`` gives its bytes back to the uploads' budget."""

    form: FormData
    release: Callable[[], None]
    file: UploadFile | None = None
    size: int = 0


async def read_upload(request: Request, limit: int, budget: Shares, client: str) -> Upload:
    """The multipart form of ``request`` with its ``file`` part, read as it arrives.
    Raises RequestTooLarge (413) past ``limit`` bytes of file (plus the form's overhead),
    ServerBusy (503) when ``budget`` has no room or ``client`` holds its share of it,
    InvalidRequest (400) for a body that is not
    a multipart form with one file in ``file``, an empty file, or one that is not audio;
    ClientGone when the client leaves while sending."""
    ctype = request.headers.get("content-type", "")
    if not ctype.lower().startswith("multipart/form-data"):
        raise InvalidRequest("send the audio as multipart/form-data, the file in the field "
                             "'file' (as OpenAI's clients and curl -F do)", param="file")
    bound = limit + FORM_OVERHEAD_BYTES
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > bound:
        raise RequestTooLarge(f"the upload is {declared} bytes; the limit is {limit} bytes of "
                              "audio (--max-audio)", param="file")
    taken = 0

    async def body() -> AsyncGenerator[bytes, None]:
        nonlocal taken
        async for chunk in request.stream():
            if taken + len(chunk) > bound:
                raise RequestTooLarge(f"the upload is over the limit of {limit} bytes of "
                                      "audio (--max-audio)", param="file")
            budget.take(client, len(chunk))
            taken += len(chunk)
            yield chunk

    parser = MultiPartParser(request.headers, body(), max_files=MAX_FILES,
                             max_fields=MAX_FIELDS, max_part_size=MAX_FIELD_BYTES)
    try:
        form = await parser.parse()
    except MultiPartException as e:
        budget.give(client, taken)
        raise _form_error(e.message) from e
    except ClientDisconnect as e:
        budget.give(client, taken)
        raise ClientGone("the client disconnected before its upload was read") from e
    except BaseException:
        budget.give(client, taken)
        raise
    upload = Upload(form, lambda: budget.give(client, taken))
    try:
        await _check_file(upload, limit)
    except BaseException:
        await close_upload(upload)
        raise
    return upload


async def _check_file(upload: Upload, limit: int) -> None:
    """The form holds one file, in ``file``, of audio within ``limit`` bytes (InvalidRequest
    or RequestTooLarge naming the field); it is noted in ``upload``."""
    form = upload.form
    for name, value in form.multi_items():
        if name != "file" and isinstance(value, UploadFile):
            raise InvalidRequest(f"{name[:64]} must be a text field, not a file; the "
                                 "audio goes in the field 'file'", param=name[:64])
    files = [v for v in form.getlist("file") if isinstance(v, UploadFile)]
    if len(form.getlist("file")) > 1:
        raise InvalidRequest("send one audio file, in the field 'file'", param="file")
    if len(files) != 1:
        raise InvalidRequest("the form needs an audio file in the field 'file', sent as "
                             "a file part (curl -F file=@talk.mp3), and the whole body "
                             "(a cut-short body loses its last part)", param="file")
    upload.file = files[0]
    upload.size = files[0].size or 0
    if upload.size > limit:
        raise RequestTooLarge(f"the file is {upload.size} bytes; the limit is {limit} "
                              "(--max-audio)", param="file")
    if upload.size == 0:
        raise InvalidRequest("the file is empty", param="file")
    head = await files[0].read(64)
    await files[0].seek(0)
    if not looks_like_audio(head):
        raise InvalidRequest(f"the file is not audio ({_FORMAT_NAMES})", param="file")


def _form_error(message: str) -> InvalidRequest:
    """A multipart parser's refusal, said for this form (Starlette names no field)."""
    if message.startswith("Too many fields"):
        return InvalidRequest(f"the form has more than {MAX_FIELDS} fields")
    if message.startswith("Too many files"):
        return InvalidRequest("send one audio file, in the field 'file'", param="file")
    if message.startswith("Part exceeded"):  # most often the audio sent as a text field
        return InvalidRequest(f"a text field is over {MAX_FIELD_BYTES // 1024} KiB; the audio "
                              "goes in the field 'file' as a file part (curl -F "
                              "file=@talk.mp3)", param="file")
    return InvalidRequest(f"the multipart body is malformed: {message}")


async def close_upload(upload: Upload) -> None:
    upload.release()
    upload.release = lambda: None
    await upload.form.close()


class Transcriptions:
    """The route: a transcription takes the pipeline's lease, slot, compute turn and
    release (front/pipeline.py)."""

    def __init__(self, pipeline: Pipeline, max_audio_bytes: int = MAX_AUDIO_BYTES) -> None:
        self.pipeline = pipeline
        self.max_audio_bytes = max_audio_bytes
        self._uploads = Shares(UPLOADS_IN_FLIGHT_BYTES, "audio upload bytes")
        self._settling: set[asyncio.Task[None]] = set()  # abandoned ones, until idle

    def model(self, name: str | None) -> CatalogModel:
        """The transcription model ``name`` means (``whisper-1`` when not given); 400 for a
        model that does not transcribe, 404 for an unknown name."""
        model = self.pipeline.catalog.get(name or OPENAI_NAME)
        if not engine_for(model).capabilities(model).transcribes:
            raise InvalidRequest(f"model {model.id!r} does not transcribe audio; use a "
                                 f"transcription model ({OPENAI_NAME!r} names the first)",
                                 param="model")
        return model

    async def create(self, request: Request) -> Response:
        upload = await read_upload(request, self.max_audio_bytes, self._uploads,
                                   self.pipeline.keys.client_of(request))
        try:
            options = parse_fields(upload.form)
            model = self.model(options.model)
            request.state.model = model.id
            request.state.stream = options.stream
            queued = time.monotonic()
            admitted = await self.pipeline.unless_gone(request, self._admit(request, model))
            request.state.queue_s = time.monotonic() - queued
        except BaseException:
            await close_upload(upload)
            raise
        lines = _Lines(admitted.held, upload, model.id, self.pipeline, self._settling)
        try:
            answer = await lines.open(options)
        except BaseException:
            await lines.close()
            raise
        if options.stream:
            return EventSourceResponse(_events(lines, answer), ping=15,
                                       headers={"cache-control": "no-cache"})
        try:
            transcript = await self.pipeline.unless_gone(request, _collect(answer))
        finally:
            await lines.close()
        return _render(transcript, options)

    async def _admit(self, request: Request, model: CatalogModel) -> Admitted:
        """The pipeline's lease, slot and compute turn, or what was taken given back."""
        admitted = await self.pipeline.admit(request, model, ROUTE)
        try:
            self.pipeline.check_still_served(admitted.lease)
        except BaseException:
            admitted.close()
            raise
        return admitted


class _Lines:
    """The worker's answer, line by line; closing it gives back the lease, slot and turn
    and the upload (once)."""

    def __init__(self, held: Held, upload: Upload, model_id: str, pipeline: Pipeline,
                 settling: set[asyncio.Task[None]]) -> None:
        self.held = held
        self.upload = upload
        self.model_id = model_id
        self.residency = pipeline.residency
        self.response: Any = None
        self.finished = False  # the worker's answer ended (done, or an error line)
        self._settling = settling
        self._closed = False

    async def open(self, options: Options) -> AsyncIterator[dict[str, Any]]:
        engine = self.held.lease.worker.engine
        try:
            self.response = await engine.transcribe(self._file(), self.upload.size,
                                                    options.worker_options())
        except EngineUnavailable:
            self._failed()
            raise
        self.held.lease.report(True)
        return self._read()

    async def _file(self) -> AsyncIterator[bytes]:
        assert self.upload.file is not None  # read_upload checked it
        while block := await self.upload.file.read(_CHUNK):
            yield block

    async def _read(self) -> AsyncIterator[dict[str, Any]]:
        try:
            async for raw in self.response.aiter_lines():
                if not raw.strip():
                    continue
                try:
                    line = json.loads(raw)
                except ValueError:
                    line = None
                if not isinstance(line, dict):
                    raise EngineUnavailable(f"model {self.model_id!r}: its worker answered "
                                            f"{raw[:200]!r}")
                if line.get("type") in ("error", "done"):
                    self.finished = True
                if line.get("type") == "error":
                    raise EngineUnavailable(f"model {self.model_id!r}: transcription failed: "
                                            f"{str(line.get('message'))[:500]}")
                yield line
                if line.get("type") == "done":
                    return
        except Exception as e:
            if isinstance(e, BunkhouseError):
                raise
            self._failed()
            raise EngineUnavailable(f"model {self.model_id!r}: its worker's answer broke off; "
                                    "retry", detail=repr(e)) from e
        self._failed()
        raise EngineUnavailable(f"model {self.model_id!r}: its worker's answer ended early; "
                                "retry")

    def _failed(self) -> None:
        if self.residency.closing:
            raise ShuttingDown(self.model_id)
        self.held.lease.report(False)

    async def close(self) -> None:
        """Close the worker's answer and give everything back. An answer cut short (the
        client left) stops the worker only at its next segment, one 30 s stretch of audio
        later (seconds of compute): until its slot is idle the lease, slot and compute
        turn stay held, so that nothing else computes beside it or queues behind it
        unseen."""
        if self._closed:
            return
        self._closed = True
        cut = self.response is not None and not self.finished
        try:
            if self.response is not None:
                await self.response.aclose()
        finally:
            if cut:
                task = asyncio.ensure_future(self._settle())
                self._settling.add(task)
                task.add_done_callback(self._settling.discard)
            else:
                self.held.close()
            await close_upload(self.upload)

    async def _settle(self) -> None:
        engine = self.held.lease.worker.engine
        deadline = time.monotonic() + SETTLE_S
        try:
            while time.monotonic() < deadline and self.held.lease.worker.alive \
                    and not self.residency.closing:
                try:
                    if not any(s.busy for s in await engine.slots()):
                        return
                except BunkhouseError:
                    return
                await asyncio.sleep(SETTLE_POLL_S)
            log.warning("model %s: its worker still transcribes %.0f s after its client left",
                        self.model_id, SETTLE_S)
        finally:
            self.held.close()


@dataclass(slots=True)
class Transcript:
    language: str | None = None
    duration: float = 0.0
    segments: list[dict[str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(s["text"] for s in self.segments).strip()


async def _collect(answer: AsyncIterator[dict[str, Any]]) -> Transcript:
    transcript = Transcript()
    async for line in answer:
        _take(transcript, line)
    return transcript


def _take(transcript: Transcript, line: dict[str, Any]) -> None:
    kind = line.get("type")
    if kind == "info":
        transcript.language = str(line.get("language") or "") or None
    elif kind == "segment":
        transcript.segments.append(line)
    elif kind == "done":
        transcript.duration = float(line.get("duration") or 0.0)


async def _events(lines: _Lines, answer: AsyncIterator[dict[str, Any]]
                  ) -> AsyncIterator[dict[str, str]]:
    """SSE events: a ``transcript.text.delta`` per segment, then ``transcript.text.done``;
    an error after the first event is an ``error`` event, as OpenAI streams say them."""
    transcript = Transcript()
    try:
        async for line in answer:
            _take(transcript, line)
            if line.get("type") == "segment" and line.get("text"):
                yield {"data": json.dumps({"type": "transcript.text.delta",
                                           "delta": line["text"]})}
        yield {"data": json.dumps({"type": "transcript.text.done", "text": transcript.text,
                                   "usage": _usage(transcript)})}
    except BunkhouseError as e:
        yield {"data": json.dumps({"type": "error", **error_body(e)})}
    finally:
        # a client that left cancels this stream's scope: the worker's answer is still
        # closed (so the worker stops) and everything held given back
        with anyio.CancelScope(shield=True):
            await lines.close()


def _usage(transcript: Transcript) -> dict[str, Any]:
    """OpenAI's usage of a Whisper transcription: the audio's seconds, rounded up."""
    return {"type": "duration", "seconds": int(-(-transcript.duration // 1))}


def _render(transcript: Transcript, options: Options) -> Response:
    fmt = options.response_format
    if fmt == "text":
        return PlainTextResponse(transcript.text + "\n")
    if fmt == "srt":
        return PlainTextResponse(srt(transcript.segments))
    if fmt == "vtt":
        return PlainTextResponse(vtt(transcript.segments), media_type="text/vtt")
    if fmt == "verbose_json":
        body: dict[str, Any] = {"task": "transcribe", "language": transcript.language,
                                "duration": transcript.duration, "text": transcript.text}
        if not options.granularities or "segment" in options.granularities:
            body["segments"] = [_segment(s) for s in transcript.segments]
        if "word" in options.granularities:
            body["words"] = [w for s in transcript.segments for w in s.get("words") or ()]
        body["usage"] = _usage(transcript)
        return JSONResponse(body)
    return JSONResponse({"text": transcript.text, "usage": _usage(transcript)})


_SEGMENT_FIELDS = ("id", "seek", "start", "end", "text", "tokens", "temperature",
                   "avg_logprob", "compression_ratio", "no_speech_prob")


def _segment(line: dict[str, Any]) -> dict[str, Any]:
    return {k: line.get(k) for k in _SEGMENT_FIELDS}


def timestamp(seconds: float, separator: str) -> str:
    """``HH:MM:SS,mmm`` (SRT: ``separator`` ``,``) or ``HH:MM:SS.mmm`` (WebVTT: ``.``)."""
    ms = max(0, round(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{ms:03d}"


def _cue_text(text: str) -> str:
    # a blank line ends a cue in both formats; "-->" inside a cue's text confuses readers
    return " ".join(text.split()).replace("-->", "->")


def srt(segments: list[dict[str, Any]]) -> str:
    """SubRip: numbered cues from 1, ``start --> end``, the text, a blank line."""
    return "".join(f"{i}\n{timestamp(s['start'], ',')} --> {timestamp(s['end'], ',')}\n"
                   f"{_cue_text(s['text'])}\n\n" for i, s in enumerate(segments, 1))


def vtt(segments: list[dict[str, Any]]) -> str:
    """WebVTT: the ``WEBVTT`` header, then ``start --> end``, the text, a blank line."""
    return "WEBVTT\n\n" + "".join(
        f"{timestamp(s['start'], '.')} --> {timestamp(s['end'], '.')}\n"
        f"{_cue_text(s['text'])}\n\n" for s in segments)
