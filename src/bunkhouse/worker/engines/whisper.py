"""The Whisper engine: faster-whisper (CTranslate2) in the worker, behind a small HTTP API on
the worker's socket.

Audio is not streamed per token, so Python in this path costs nothing that matters; the API
has the shape of every worker's (engines/whisper.py is its front side):

- ``GET /health``: 200 once the model is loaded.
- ``GET /slots``: one slot, ``is_processing`` while a transcription runs.
- ``POST /v1/audio/transcriptions?options=JSON``: the body is the uploaded file's bytes, as
  the client sent them. The answer is NDJSON, one object per line: ``{"type": "info",
  "language", "duration"}``, then a ``{"type": "segment", ...}`` per segment as it is
  transcribed, then ``{"type": "done"}``; an error after the first line is ``{"type":
  "error", "message"}``. Input that is not audio is a 400 before any line, and audio longer
  than :data:`MAX_AUDIO_S` (or decoding to more than :data:`MAX_DECODED_SAMPLES`) a 413, with
  an OpenAI error object naming the field ``file``.

Decoding runs here, not in the front: a decoder that crashes on a hostile file takes this
worker down (the supervisor restarts it), never the endpoint. Audio is decoded with PyAV, as
faster-whisper decodes it, to 16 kHz mono, all of it before the answer begins (a few seconds
at most: an hour of FLAC decodes in under one): the container's declared duration is checked
first, then what the frames hold as they are decoded, since a header can understate it. The
samples go to a temporary file (48 MiB at most) and are transcribed in windows of
:data:`WINDOW_S` seconds: faster-whisper builds its whole
input's spectrogram at once (about 0.9 MiB per second of audio, measured with tiny.en), so the
window bounds the worker's memory whatever the file's length. Each window is conditioned on
the text of the one before.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import select
import socket
import socketserver
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any, BinaryIO
from urllib.parse import parse_qs, urlsplit

from bunkhouse.engines import options as opts
from bunkhouse.engines.whisper import parse_options
from bunkhouse.worker.engine import EngineLoadError, WorkerConfig

log = logging.getLogger(__name__)

SAMPLE_RATE = 16_000
"""Whisper's input rate, Hz (every Whisper model's feature extractor)."""

WINDOW_S = 120
"""Seconds of audio transcribed at once (a multiple of Whisper's 30 s window)."""

MAX_BODY_BYTES = 1 << 30
"""The largest body the worker reads (the front bounds uploads far lower: --max-audio)."""

MAX_AUDIO_S = 1_500.0
"""The most seconds of audio one upload may hold: OpenAI's maximum for its transcription
models (gpt-4o-transcribe refuses longer audio, "longer than 1500 seconds which is the maximum
for this model"; 25 MB of 128 kbit/s MP3, OpenAI's upload limit, is 26 minutes). Without it a
656 KB FLAC of an hour of silence held the one Whisper slot for 5 minutes on 2 cores."""

MAX_DECODED_SAMPLES = int(MAX_AUDIO_S) * 48_000 * 2
"""The most samples an upload may decode to before it is resampled, all channels counted:
:data:`MAX_AUDIO_S` of 48 kHz stereo (the rate of video and of most recorders). Decoding
costs what the file's own rate and channels make it: 25 minutes at 384 kHz in 8 channels is
32 times as much."""

COMPUTE_TYPE = "int8"
"""CTranslate2's weights on CPU: int8 (faster-whisper's advice for CPU, a quarter of float32)."""


class AudioError(Exception):
    """The upload is not audio this worker can decode; the message says why."""


class AudioTooLong(AudioError):
    """The upload holds more audio than one transcription may take (a 413)."""


def decode(upload: BinaryIO, pcm: BinaryIO, max_s: float = MAX_AUDIO_S,
           max_samples: int = MAX_DECODED_SAMPLES) -> int:
    """Decode all of ``upload`` (any container and codec FFmpeg knows) into ``pcm`` as
    16 kHz mono int16 samples; the number written. Frames FFmpeg cannot decode are skipped,
    as faster-whisper's own decoder skips them. Raises AudioTooLong when the container
    declares, or its frames turn out to hold, more than ``max_s`` seconds or ``max_samples``
    samples before resampling (all channels at the file's own rate); AudioError: no audio
    stream, nothing decodable."""
    import av

    written = 0
    try:
        with av.open(upload, mode="r", metadata_errors="ignore") as container:
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is None:
                raise AudioError("the file has no audio stream")
            _check_declared(container, stream, max_s, max_samples)
            resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
            decoded = 0
            for frame in itertools.chain(_frames(container, stream), [None]):
                if frame is not None:
                    decoded += frame.samples * max(1, frame.layout.nb_channels)
                    if decoded > max_samples:
                        raise _too_many_samples(max_samples)
                for out in resampler.resample(frame):
                    samples = out.to_ndarray().reshape(-1)
                    written += len(samples)
                    if written > max_s * SAMPLE_RATE:
                        raise _too_long(max_s)
                    pcm.write(samples.tobytes())
    except (av.error.FFmpegError, ValueError, IndexError, OSError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise AudioError(f"the file is not audio that can be decoded ({why})") from e
    if not written:
        raise AudioError("the file holds no audio that can be decoded")
    return written


def _check_declared(container: Any, stream: Any, max_s: float, max_samples: int) -> None:
    """Refuse what the container's header says is too long, before anything is decoded
    (the header may understate it: :func:`decode` counts as it goes)."""
    seconds = [container.duration / 1_000_000 if container.duration else 0.0]
    if stream.duration and stream.time_base:
        seconds.append(float(stream.duration * stream.time_base))
    declared = max(seconds)
    if declared > max_s:
        raise _too_long(max_s, declared)
    channels = stream.codec_context.channels or 1
    if declared * (stream.sample_rate or 0) * channels > max_samples:
        raise _too_many_samples(max_samples)


def _too_long(max_s: float, declared: float | None = None) -> AudioTooLong:
    length = f" ({declared:,.0f} s)" if declared is not None else ""
    return AudioTooLong(f"the audio is longer{length} than the limit of {max_s:,.0f} s "
                        "a transcription may take; split it")


def _too_many_samples(max_samples: int) -> AudioTooLong:
    return AudioTooLong(f"the audio decodes to more than {max_samples:,} samples (all "
                        "channels at its own rate); resample it to 48 kHz stereo or less, "
                        "or split it")


def windows(pcm: BinaryIO, window_s: float = WINDOW_S) -> Iterator[Any]:
    """The 16 kHz mono int16 samples :func:`decode` wrote to ``pcm``, from its start, as
    numpy arrays of ``window_s`` seconds (the last one shorter)."""
    import numpy as np

    pcm.seek(0)
    while block := pcm.read(int(window_s * SAMPLE_RATE) * 2):
        yield np.frombuffer(block, dtype=np.int16)


def _frames(container: Any, stream: Any) -> Iterator[Any]:
    import av

    for packet in container.demux(stream):
        try:
            yield from packet.decode()
        except av.error.InvalidDataError:
            continue  # a damaged frame: the rest may decode


def transcribe(model: Any, audio: Iterator[Any], options: dict[str, Any]
               ) -> Iterator[dict[str, Any]]:
    """Lines of the answer for the int16 windows of ``audio``: info first, then segments as
    they are transcribed, window by window (times from the audio's start), then done with
    the audio's duration."""
    import numpy as np

    prompt = options.get("prompt") or None
    words = bool(options.get("words"))
    temperature = options.get("temperature")
    # OpenAI: 0 (or unset) lets the model raise the temperature when decoding fails
    temperatures: Any = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0) if not temperature else float(temperature)
    seg_id = 0
    start = 0  # samples before this window
    for window in audio:
        offset = start / SAMPLE_RATE
        segments, info = model.transcribe(
            window.astype(np.float32) / 32768.0, language=options.get("language") or None,
            initial_prompt=prompt, temperature=temperatures, word_timestamps=words,
            vad_filter=False, condition_on_previous_text=True)
        if start == 0:
            yield {"type": "info", "language": info.language}
        texts = []
        for s in segments:
            texts.append(s.text)
            yield {"type": "segment", "id": seg_id, "seek": s.seek + start // 160,
                   "start": round(s.start + offset, 3), "end": round(s.end + offset, 3),
                   "text": s.text, "tokens": list(s.tokens),
                   "temperature": s.temperature, "avg_logprob": s.avg_logprob,
                   "compression_ratio": s.compression_ratio,
                   "no_speech_prob": s.no_speech_prob,
                   "words": [{"word": w.word, "start": round(w.start + offset, 3),
                              "end": round(w.end + offset, 3),
                              "probability": w.probability} for w in s.words or ()]
                   if words else None}
            seg_id += 1
        if texts:  # the next window goes on from what was said
            prompt = "".join(texts)[-800:]
        start += len(window)
    yield {"type": "done", "duration": round(start / SAMPLE_RATE, 3)}


def _peer_gone(sock: socket.socket) -> bool:
    """Whether the front closed this connection: it sends nothing after its request, so a
    readable socket is one at its end (or reset)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, path: str, engine: WhisperEngine) -> None:
        self.engine = engine
        super().__init__(path, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"  # the answer ends when the connection closes: a stream

    def address_string(self) -> str:  # a Unix socket's peer has no address
        return "front"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)

    def _json(self, status: int, value: Any) -> None:
        body = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str, param: str | None = None) -> None:
        self._json(status, {"error": {"message": message, "type": "invalid_request_error"
                                      if status < 500 else "server_error",
                                      "param": param, "code": None}})

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/health":
            self._json(200, {"status": "ok"})
        elif path == "/slots":
            self._json(200, [{"id": 0, "is_processing": self.server.engine.busy.locked()}])
        else:
            self._error(404, f"no route {path}")

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        if url.path != "/v1/audio/transcriptions":
            self._error(404, f"no route {url.path}")
            return
        try:
            options = json.loads(parse_qs(url.query).get("options", ["{}"])[0])
            length = int(self.headers.get("content-length", ""))
            if not isinstance(options, dict) or not 0 <= length <= MAX_BODY_BYTES:
                raise ValueError
        except ValueError:
            self._error(400, "options must be a JSON object and the body's length given")
            return
        engine = self.server.engine
        with engine.busy, tempfile.TemporaryFile() as upload, \
                tempfile.TemporaryFile() as pcm:
            left = length
            while left:  # spooled to disk: the worker's memory does not grow with uploads
                block = self.rfile.read(min(left, 1 << 20))
                if not block:
                    return  # the front went away
                upload.write(block)
                left -= len(block)
            upload.seek(0)
            language = options.get("language")
            supported = getattr(engine.model, "supported_languages", None) or ()
            if language and supported and language not in supported:
                only = f"only {', '.join(supported)}" if len(supported) < 5 else \
                    "the languages Whisper knows (ISO-639-1 codes)"
                self._error(400, f"language {language!r}: this model transcribes {only}",
                            "language")
                return
            try:  # all of it before the 200, so that a refusal is a 4xx
                decode(upload, pcm)
            except AudioTooLong as e:
                self._error(413, str(e), "file")
                return
            except AudioError as e:
                self._error(400, str(e), "file")
                return
            self._stream(windows(pcm), options)

    def _stream(self, audio: Iterator[Any], options: dict[str, Any]) -> None:
        """Answer 200 and the transcript's lines as they come, until the front goes away."""
        self.send_response(200)
        self.send_header("content-type", "application/x-ndjson")
        self.end_headers()
        try:
            for line in transcribe(self.server.engine.model, audio, options):
                if _peer_gone(self.connection):  # a write to a closed peer may succeed
                    log.info("transcription stopped: the front went away")
                    return
                self.wfile.write(json.dumps(line).encode() + b"\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            log.info("transcription stopped: the front went away")
        except Exception as e:  # the engine's failure: said in the stream, then ended
            log.exception("transcription failed")
            with contextlib.suppress(OSError):
                self.wfile.write(json.dumps({"type": "error",
                                             "message": str(e)[:500]}).encode() + b"\n")


class WhisperEngine:
    """A CTranslate2 Whisper model directory (``model.bin``, ``config.json``,
    ``tokenizer.json``) served on ``config.socket``; one transcription at a time."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.options = opts.decode(config.engine_options, parse_options)
        self.model: Any = None
        self.busy = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            from faster_whisper import WhisperModel
        except ImportError as e:
            raise EngineLoadError("faster-whisper is not installed: pip install -e "
                                  "'.[models]' (or pip install faster-whisper)") from e
        path = self.config.model_path
        if not (path / "model.bin").is_file():
            raise EngineLoadError(f"no CTranslate2 Whisper model at {path} (no model.bin)")
        try:
            self.model = WhisperModel(str(path), device="cpu", compute_type=COMPUTE_TYPE,
                                      cpu_threads=self.options.threads, num_workers=1)
        except Exception as e:
            raise EngineLoadError(f"faster-whisper failed to load {path}: {e}") from e
        self._server = _Server(str(self.config.socket), self)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="whisper-http")
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self.model = None
