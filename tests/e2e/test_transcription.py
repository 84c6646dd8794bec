"""Transcription end to end: `bunkhouse serve` with the packaged Whisper tiny.en in its own
worker, the real `openai` SDK, a WAV file of speech (tests/fixtures/speech.wav: espeak-ng,
16 kHz mono, 7.5 s, "The quick brown fox jumps over the lazy dog. Bunkhouse serves every
local model behind one endpoint."), every response format, hostile uploads, the memory
budget shared with a chat model, and the operator's pause."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import psutil
import pytest

from tests.e2e.server import Server, serve
from tests.e2e.shared import stream_usage
from tests.helpers import silent_flac, wait_for
from tests.models import QWEN, WHISPER

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).parent.parent / "fixtures" / "speech.wav"
DURATION_S = 7.55
ADMIN = {"authorization": "Bearer admin-secret"}
SPOKEN = {"quick", "fox", "lazy", "dog", "serves", "every", "local", "model"}
MAX_AUDIO = 1_000_000  # --max-audio below: the fixture (242 KB) fits, 2 MB does not


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def _heard(text: str) -> None:
    """Most of the spoken words came back (tiny.en hears "round fox", "bunk house")."""
    found = SPOKEN & _words(text)
    assert len(found) >= len(SPOKEN) - 2, (text, SPOKEN - found)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("transcribe"), "--admin-key", "admin-secret",
               "--max-audio", str(MAX_AUDIO), "--admission-wait", "60",
               "--log-level", "debug") as running:  # debug: the workers' own lines
        yield running


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=300)


def _transcribe(server: Server, **options: Any) -> Any:
    """One transcription of the fixture through the openai SDK (its client closed after)."""
    with _client(server) as client, FIXTURE.open("rb") as f:
        return client.audio.transcriptions.create(file=f, **options)


def test_the_openai_sdk_transcribes_speech_in_every_format(
        server: Server, request: pytest.FixtureRequest) -> None:
    listed = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert listed[WHISPER]["kind"] == "transcription"
    assert listed[WHISPER]["context"] is None and listed[WHISPER]["parallel"] == 1
    assert "whisper-1" in listed[WHISPER]["aliases"]
    assert listed[QWEN]["kind"] == "chat"
    client = _client(server)
    request.addfinalizer(client.close)

    with FIXTURE.open("rb") as f:
        plain = client.audio.transcriptions.create(model="whisper-1", file=f)
    _heard(plain.text)
    assert server.model(WHISPER)["state"] == "ready"

    with FIXTURE.open("rb") as f:
        srt = client.audio.transcriptions.create(model=WHISPER, file=f, response_format="srt")
    cues = re.findall(r"(\d+)\n(\d\d:\d\d:\d\d,\d{3}) --> (\d\d:\d\d:\d\d,\d{3})\n(.+)\n\n",
                      str(srt))
    assert cues and [int(c[0]) for c in cues] == list(range(1, len(cues) + 1)), srt
    assert "".join(str(srt).split("\n\n")[len(cues):]).strip() == "", srt
    _heard(" ".join(c[3] for c in cues))

    with FIXTURE.open("rb") as f:
        vtt = str(client.audio.transcriptions.create(model=WHISPER, file=f,
                                                     response_format="vtt"))
    assert vtt.startswith("WEBVTT\n\n"), vtt
    vtt_cues = re.findall(r"(\d\d:\d\d:\d\d\.\d{3}) --> (\d\d:\d\d:\d\d\.\d{3})\n(.+)\n",
                          vtt)
    assert len(vtt_cues) == len(cues), vtt

    with FIXTURE.open("rb") as f:
        verbose = client.audio.transcriptions.create(
            model=WHISPER, file=f, response_format="verbose_json",
            timestamp_granularities=["segment", "word"], language="en", temperature=0)
    assert abs(verbose.duration - DURATION_S) < 0.1, verbose.duration
    assert verbose.language == "en"
    segments = verbose.segments or []
    assert segments
    for s in segments:
        assert 0 <= s.start < s.end <= verbose.duration + 0.05, s
    words = verbose.words or []
    assert len(words) >= 10
    assert all(0 <= w.start <= w.end <= verbose.duration + 0.05 for w in words)
    _heard(" ".join(w.word for w in words))

    with FIXTURE.open("rb") as f:
        text = client.audio.transcriptions.create(model=WHISPER, file=f,
                                                  response_format="text")
    _heard(str(text))

    with FIXTURE.open("rb") as f:
        events = list(client.audio.transcriptions.create(model=WHISPER, file=f, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "transcript.text.done" and kinds[:-1], kinds
    assert set(kinds[:-1]) == {"transcript.text.delta"}, kinds
    deltas = "".join(e.delta for e in events[:-1])  # type: ignore[union-attr]
    assert deltas.strip() == events[-1].text  # type: ignore[union-attr]
    _heard(deltas)


def _encoded(fmt: str, codec: str, rate: int) -> bytes:
    """The fixture re-encoded with PyAV (faster-whisper's decoder, installed with it)."""
    import io

    import av

    out = io.BytesIO()
    with av.open(str(FIXTURE)) as source, av.open(out, "w", format=fmt) as target:
        stream = target.add_stream(codec, rate=rate, layout="mono")
        resample = av.AudioResampler(format=stream.codec_context.format or "s16",
                                     layout="mono", rate=rate)
        for frame in source.decode(audio=0):
            for part in resample.resample(frame):
                for packet in stream.encode(part):
                    target.mux(packet)
        for packet in stream.encode(None):
            target.mux(packet)
    return out.getvalue()


@pytest.mark.parametrize(("name", "fmt", "codec", "rate"), [
    ("speech.mp3", "mp3", "libmp3lame", 16000), ("speech.flac", "flac", "flac", 16000),
    ("speech.ogg", "ogg", "libopus", 48000), ("speech.m4a", "ipod", "aac", 16000),
    ("speech.webm", "webm", "libopus", 48000)])
def test_every_common_audio_format_is_transcribed(server: Server, name: str, fmt: str,
                                                  codec: str, rate: int) -> None:
    resp = httpx.post(f"{server.url}/v1/audio/transcriptions", timeout=300,
                      files={"file": (name, _encoded(fmt, codec, rate))})
    assert resp.status_code == 200, resp.text
    _heard(resp.json()["text"])


def test_a_client_that_leaves_stops_its_transcription(server: Server, tmp_path: Path) -> None:
    import wave

    with wave.open(str(FIXTURE)) as src:
        params, frames = src.getparams(), src.readframes(src.getnframes())
    long = tmp_path / "long.wav"
    with wave.open(str(long), "wb") as dst:  # about 60 s: well under --max-audio's 1 MB
        dst.setparams(params)
        for _ in range(4):
            dst.writeframes(frames)
    stopped = "transcription stopped: the front went away"
    before = server.log.read_text(errors="replace").count(stopped)
    for stream in (False, True):
        data = {"stream": "true"} if stream else {}
        # the client gives up, mid-transcription
        with pytest.raises(httpx.ReadTimeout), httpx.stream(
                "POST", f"{server.url}/v1/audio/transcriptions", data=data,
                files={"file": ("long.wav", long.read_bytes())},
                timeout=httpx.Timeout(60, read=0.5)) as resp:
            for _ in resp.iter_lines():
                pass
        before += 1
        wait_for(lambda n=before: server.log.read_text(errors="replace").count(stopped) >= n,
                 120, "the worker to stop the abandoned transcription")
    ok = httpx.post(f"{server.url}/v1/audio/transcriptions", timeout=300,
                    files={"file": ("a.wav", FIXTURE.read_bytes())})
    assert ok.status_code == 200
    _heard(ok.json()["text"])
    model = server.model(WHISPER)
    assert model["leases"] == 0 and model["running"] == 0


def _compute_waits(server: Server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=60).text
    return next(s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "bunkhouse_compute_gate_waits_total")


def test_a_transcription_takes_its_compute_turn_after_a_running_generation(
        server: Server) -> None:
    assert _chat(server).status_code == 200  # Qwen ready
    done: list[str] = []

    def long_stream() -> None:
        body = {"model": QWEN, "max_tokens": 150, "stream": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Count from one to one hundred."}]}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                          timeout=300) as resp:
            for _ in resp.iter_lines():
                pass
        done.append("generation")

    waits = _compute_waits(server)
    runner = threading.Thread(target=long_stream)
    runner.start()
    wait_for(lambda: server.model(QWEN)["running"] >= 1, 120, "the generation to run")
    resp = httpx.post(f"{server.url}/v1/audio/transcriptions", timeout=300,
                      files={"file": ("a.wav", FIXTURE.read_bytes())})
    done.append("transcription")
    runner.join(300)
    assert resp.status_code == 200
    assert _compute_waits(server) >= waits + 1  # it waited for the generation's turn
    assert done[0] == "generation" or server.model(QWEN)["running"] == 0, done


def _raw_upload(server: Server, head: bytes, body: Iterator[bytes]) -> tuple[bytes, int]:
    """Send ``head`` then ``body``'s chunks on a raw socket until the server answers;
    returns (the answer's first bytes, the body bytes sent by then)."""
    url = urlsplit(server.url)
    sent = 0
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(head)
        sock.setblocking(False)
        answer = b""
        for chunk in body:
            with contextlib.suppress(BlockingIOError):
                answer = sock.recv(4096)
            if answer:
                break
            try:
                sock.sendall(chunk)
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                time.sleep(0.01)
                continue
            sent += len(chunk)
            time.sleep(0.002)
        sock.setblocking(True)
        if not answer:
            answer = sock.recv(4096)
    return answer, sent


def _multipart_head(server: Server, boundary: str, length: str | None) -> bytes:
    netloc = urlsplit(server.url).netloc
    size = f"content-length: {length}\r\n" if length else "transfer-encoding: chunked\r\n"
    return (f"POST /v1/audio/transcriptions HTTP/1.1\r\nhost: {netloc}\r\n"
            f"content-type: multipart/form-data; boundary={boundary}\r\n{size}\r\n").encode()


def test_bad_uploads_get_4xx_without_touching_the_worker(server: Server,
                                                         tmp_path: Path) -> None:
    url = f"{server.url}/v1/audio/transcriptions"
    # the worker is up (and its pid noted) before the hostile uploads
    ok = httpx.post(url, files={"file": ("a.wav", FIXTURE.read_bytes())}, timeout=300)
    assert ok.status_code == 200, ok.text
    pid = server.model(WHISPER)["pid"]
    assert pid

    text = httpx.post(url, files={"file": ("notes.wav", b"these are my notes\n" * 50)},
                      data={"model": "whisper-1"}, timeout=60)
    assert text.status_code == 400 and text.json()["error"]["param"] == "file", text.text
    # looks like a WAV (its first bytes), is not one: the worker's decoder refuses it
    fake = b"RIFF\x24\x00\x00\x00WAVEgarbage" + bytes(range(256)) * 40
    forged = httpx.post(url, files={"file": ("x.wav", fake)}, timeout=120)
    assert forged.status_code == 400 and forged.json()["error"]["param"] == "file", \
        forged.text
    empty = httpx.post(url, files={"file": ("empty.wav", b"")}, timeout=60)
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]
    none = httpx.post(url, data={"model": "whisper-1"}, timeout=60)
    assert none.status_code == 400 and none.json()["error"]["param"] == "file", none.text
    not_form = httpx.post(url, json={"file": "x"}, timeout=60)
    assert not_form.status_code == 400
    as_text = httpx.post(url, files={"file": (None, "RIFF" * 10)}, timeout=60)  # a text part
    assert as_text.status_code == 400 and "file part" in as_text.json()["error"]["message"]
    file_as_model = httpx.post(url, timeout=60, files={
        "file": ("a.wav", FIXTURE.read_bytes()), "model": ("m.wav", b"RIFF")})
    assert file_as_model.status_code == 400
    assert file_as_model.json()["error"]["param"] == "model"
    many = httpx.post(url, files={"file": ("a.wav", FIXTURE.read_bytes())}, timeout=60,
                      data={f"x{i}": "1" for i in range(20)})
    assert many.status_code == 400 and "fields" in many.json()["error"]["message"]
    bad_format = httpx.post(url, files={"file": ("a.wav", FIXTURE.read_bytes())},
                            data={"response_format": "mp3"}, timeout=60)
    assert bad_format.json()["error"]["param"] == "response_format"
    german = httpx.post(url, files={"file": ("a.wav", FIXTURE.read_bytes())},
                        data={"language": "de"}, timeout=120)  # tiny.en knows English only
    assert german.status_code == 400 and german.json()["error"]["param"] == "language", \
        german.text
    qwen_before = server.model(QWEN)
    chat_model = httpx.post(url, files={"file": ("a.wav", FIXTURE.read_bytes())},
                            data={"model": QWEN}, timeout=60)
    assert chat_model.status_code == 400 and chat_model.json()["error"]["param"] == "model"
    qwen_after = server.model(QWEN)  # refused before any load or use
    assert (qwen_after["state"], qwen_after["last_used"]) == \
        (qwen_before["state"], qwen_before["last_used"])
    as_chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "whisper-1", "messages": [{"role": "user", "content": "hi"}]})
    assert as_chat.status_code == 400 and as_chat.json()["error"]["param"] == "model"

    # 413 before it is all read: declared too large, and streamed past the bound
    boundary = "b0undary"
    part = (f"--{boundary}\r\ncontent-disposition: form-data; name=\"file\"; "
            f"filename=\"big.wav\"\r\ncontent-type: audio/wav\r\n\r\n").encode()
    chunk = b"RIFF" + b"\x00" * 65532
    total = 50_000_000
    answer, sent = _raw_upload(server, _multipart_head(server, boundary, str(total)),
                               iter([part, *([chunk] * (total // len(chunk)))]))
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < total // 10, sent

    def chunked() -> Iterator[bytes]:
        yield f"{len(part):x}\r\n".encode() + part + b"\r\n"
        for _ in range(total // len(chunk)):
            yield f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"

    answer, sent = _raw_upload(server, _multipart_head(server, boundary, None), chunked())
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 4 * MAX_AUDIO, sent

    # none of it touched the worker: same process, no crash, and it still transcribes
    assert server.model(WHISPER)["pid"] == pid
    assert psutil.pid_exists(pid)
    counts = server.stats()["event_counts"]
    assert not counts.get("crashed"), counts
    again = httpx.post(url, files={"file": ("a.wav", FIXTURE.read_bytes())}, timeout=300)
    assert again.status_code == 200
    _heard(again.json()["text"])


def test_audio_longer_than_the_bound_is_refused_naming_file(server: Server) -> None:
    """An hour of silence is a 656 KB FLAC: refused from its header, and one whose header
    says 1 s refused as it is decoded, both before any transcription (a deadline far below
    the minutes the hour took to transcribe); the worker then transcribes speech."""
    url = f"{server.url}/v1/audio/transcriptions"
    hour = silent_flac(3600)
    assert len(hour) < MAX_AUDIO  # within --max-audio: its bytes are no bound on it
    for name, data in (("hour.flac", hour), ("lying.flac", silent_flac(1800, declared_s=1))):
        refused = httpx.post(url, files={"file": (name, data)}, timeout=120)
        assert refused.status_code == 413, refused.text
        error = refused.json()["error"]
        assert error["param"] == "file" and "1,500 s" in error["message"], error
    spoken = httpx.post(url, files={"file": ("a.wav", FIXTURE.read_bytes())}, timeout=300)
    assert spoken.status_code == 200, spoken.text
    _heard(spoken.json()["text"])
    assert not server.stats()["event_counts"].get("crashed")


def _chat(server: Server, max_tokens: int = 8, stream: bool = False,
          timeout: float = 300) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=timeout, json={
        "model": QWEN, "max_tokens": max_tokens, "stream": stream,
        "messages": [{"role": "user", "content": "Count from one to one hundred."}]})


def test_the_pause_lets_in_flight_finish_and_holds_new_requests(server: Server) -> None:
    assert _chat(server).status_code == 200  # loaded
    streamed: dict[str, Any] = {}

    def long_stream() -> None:
        body = {"model": QWEN, "max_tokens": 120, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "Count from one to one hundred."}]}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                          timeout=300) as resp:
            streamed["status"] = resp.status_code
            streamed["lines"] = [line for line in resp.iter_lines() if line.startswith("data:")]

    runner = threading.Thread(target=long_stream)
    runner.start()
    wait_for(lambda: server.model(QWEN)["running"] >= 1, 120, "the long stream to run")
    paused = httpx.post(f"{server.url}/admin/pause", headers=ADMIN, json={"max_s": 120},
                        timeout=300)
    at_return = server.model(QWEN)  # the stream's engine work ended before the answer
    runner.join(300)
    assert paused.status_code == 200, paused.text
    assert paused.json()["paused"] is True and paused.json()["in_flight"] == 0
    assert at_return["leases"] == 0 and at_return["running"] == 0, at_return
    assert streamed["status"] == 200 and streamed["lines"][-1] == "data: [DONE]"
    # it ran to its end, not cut by the pause (a loaded engine may send tokens per chunk)
    assert stream_usage(streamed["lines"])["completion_tokens"] == 120, streamed["lines"][-3:]

    waiting: dict[str, Any] = {}

    def chat_meanwhile() -> None:
        waiting["response"] = _chat(server)

    sender = threading.Thread(target=chat_meanwhile)
    sender.start()
    wait_for(lambda: server.model(QWEN)["waiting"] >= 1, 60, "the chat to wait")
    sender.join(2.0)
    assert sender.is_alive() and "response" not in waiting  # held by the pause
    resumed = httpx.post(f"{server.url}/admin/resume", headers=ADMIN, timeout=60)
    assert resumed.json() == {"paused": False, "resumed": True}
    sender.join(300)
    assert waiting["response"].status_code == 200, waiting["response"].text
    kinds = [e["kind"] for e in server.stats()["events"] if e["model"] == "*"]
    assert "paused" in kinds and "resumed" in kinds

    # without the admin key: refused; a pause nobody resumes ends by itself
    assert httpx.post(f"{server.url}/admin/pause", timeout=60).status_code in (401, 403)
    held = httpx.post(f"{server.url}/admin/pause", headers=ADMIN, json={"max_s": 100},
                      timeout=60)
    assert held.json()["paused"] is True
    shown = server.stats()["pause"]
    assert shown["paused"] is True and shown["resumes_at"] == held.json()["resumes_at"]
    gauges = httpx.get(f"{server.url}/metrics", timeout=60).text
    assert "bunkhouse_paused 1.0" in gauges
    bounded = httpx.post(f"{server.url}/admin/pause", headers=ADMIN, json={"max_s": 1},
                         timeout=60)  # renewed: its bound is now 1 s
    assert bounded.json()["paused"] is True
    renewals = [e["data"] for e in server.stats()["events"] if e["kind"] == "paused"]
    assert renewals[-1]["renewed"] is True and renewals[-1]["max_s"] == 1
    assert _chat(server).status_code == 200  # waited at most the pause's second
    assert httpx.post(f"{server.url}/admin/resume", headers=ADMIN,
                      timeout=60).json()["resumed"] is False
    bad = httpx.post(f"{server.url}/admin/pause", headers=ADMIN, json={"max_s": -1},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_s"


def test_a_paused_request_gets_503_with_retry_after_past_the_admission_wait(
        tmp_path: Path) -> None:
    with serve(tmp_path, "--admin-key", "admin-secret", "--admission-wait", "1") as server:
        assert httpx.post(f"{server.url}/admin/pause", headers=ADMIN,
                          timeout=60).json()["paused"] is True
        refused = _chat(server)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "paused"
        assert 200 <= int(refused.headers["retry-after"]) <= 300  # when the pause ends
        assert "--admission-wait" in refused.json()["error"]["message"]
        assert "ERROR" not in server.log.read_text()  # an operator's pause is no error
        assert server.model(QWEN)["state"] == "absent"  # nothing loads while paused
        httpx.post(f"{server.url}/admin/resume", headers=ADMIN, timeout=60)
        assert _chat(server).status_code == 200


def test_chat_and_transcription_take_turns_in_a_budget_for_one(tmp_path: Path) -> None:
    # the budget fits Qwen (its estimate) or Whisper, never both
    with serve(tmp_path / "sizes", "--context", "2048") as probe:
        listed = {m["id"]: m for m in httpx.get(f"{probe.url}/v1/models").json()["data"]}
    qwen, whisper = listed[QWEN]["estimated_bytes"], listed[WHISPER]["estimated_bytes"]
    budget = max(qwen, whisper) + 64 * 2**20
    assert budget < qwen + whisper
    with serve(tmp_path / "budget", "--context", "2048", "--budget", str(budget)) as server:
        peak = {"measured": 0}
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                total = 0
                for w in server.workers():
                    with contextlib.suppress(psutil.Error):
                        total += w.memory_info().rss
                peak["measured"] = max(peak["measured"], total)
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            assert _chat(server).status_code == 200
            text = _transcribe(server, model="whisper-1")
            _heard(text.text)
            assert server.model(QWEN)["state"] == "absent"
            assert _chat(server).status_code == 200
            assert server.model(WHISPER)["state"] == "absent"
        finally:
            stop.set()
            watcher.join()
        stats = server.stats()
        evicted = [(e["model"], e["data"].get("cause")) for e in stats["events"]
                   if e["kind"] == "draining"]
        assert evicted == [(QWEN, "room"), (WHISPER, "room")], evicted
        assert stats["peak_used_bytes"] <= budget
        assert 0 < peak["measured"] <= budget, (peak, budget)


def test_a_configured_whisper_directory_is_served_end_to_end(tmp_path: Path) -> None:
    import shutil

    from bunkhouse.catalog.packaged import WHISPER_TINY_EN, directory_path

    packaged = directory_path(WHISPER_TINY_EN)
    assert packaged is not None
    own = tmp_path / "models" / "my-whisper"
    shutil.copytree(packaged, own)  # a user's own CTranslate2 directory
    config = tmp_path / "bunkhouse.toml"
    config.write_text(f'[[models]]\nid = "dictation"\npath = "{own}"\nengine = "whisper"\n'
                      "threads = 1\nttl = 600\n")
    with serve(tmp_path / "run", "--no-packaged", "--config", str(config)) as server:
        listed = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert list(listed) == ["dictation"]
        assert listed["dictation"]["kind"] == "transcription"
        assert listed["dictation"]["aliases"] == ["whisper-1"]
        text = _transcribe(server, model="whisper-1")
        _heard(text.text)
        assert server.model("dictation")["state"] == "ready"
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}]})  # no default chat model
        assert chat.status_code in (400, 404), chat.text
