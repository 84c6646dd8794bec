"""Transcription: bunkhouse's Whisper worker against faster-whisper called directly.

The workload, the same for both: tests/fixtures/speech.wav (7.5 s of espeak-ng speech, 16 kHz
mono) transcribed ROUNDS times, alternating target each round, after one warm-up each (the
first request to bunkhouse also loads its worker: reported apart as its cold time). Then,
unless the profile skips it, a long file (the fixture repeated to about LONG seconds, a WAV
within the 25 MB upload bound) once on each, for memory: faster-whisper builds its whole
input's spectrogram at once, bunkhouse's worker transcribes in 120 s windows.

* ``direct``: benchmarks/whisper_direct.py, one process holding the model (CPU, int8, the
  same threads), timed from the call to the last segment (decoding included);
* ``bunkhouse``: `bunkhouse serve` with the packaged whisper-tiny.en, timed by the client
  from the upload's first byte to the answer's last (HTTP, multipart, the front, the worker).

Memory: the direct process's peak resident set (``ru_maxrss``) against the bunkhouse worker's
measured peak (``measured_bytes``, sampled every second by the front) and its estimate.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import LOG_DIR, Profile, bunkhouse, packaged

WHISPER = "whisper-tiny.en"
FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "speech.wav"


def long_wav(seconds: float, out: Path) -> Path:
    """The fixture repeated to about ``seconds`` seconds, as one WAV."""
    with wave.open(str(FIXTURE)) as src:
        params, frames = src.getparams(), src.readframes(src.getnframes())
        times = max(1, round(seconds / (src.getnframes() / src.getframerate())))
    with wave.open(str(out), "wb") as dst:
        dst.setparams(params)
        for _ in range(times):
            dst.writeframes(frames)
    return out


class Direct:
    """The whisper_direct process: a line in, a JSON line out."""

    def __init__(self, model_dir: Path, name: str) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self._log = (LOG_DIR / f"{name}.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.whisper_direct", str(model_dir),
             "--threads", str(os.cpu_count() or 1)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.loaded = self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"whisper_direct exited with {self.proc.wait()}; see {LOG_DIR}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def transcribe(self, path: Path) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self._log.close()


def through_bunkhouse(url: str, path: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    with path.open("rb") as f:
        resp = httpx.post(f"{url}/v1/audio/transcriptions", files={"file": (path.name, f)},
                          data={"model": "whisper-1"}, timeout=1800)
    seconds = time.perf_counter() - t0
    if resp.status_code != 200:
        raise RuntimeError(f"bunkhouse: HTTP {resp.status_code}: {resp.text[:300]}")
    return {"seconds": seconds, "text": resp.json()["text"]}


def _worker(url: str) -> dict[str, Any]:
    model: dict[str, Any] = httpx.get(f"{url}/v1/models/{WHISPER}", timeout=60).json()
    return model


def measure(profile: Profile) -> dict[str, Any]:
    model_dir = packaged(WHISPER).path
    rounds = profile.transcribe_rounds
    out: dict[str, Any] = {"rounds": rounds, "fixture_s": _duration(FIXTURE),
                           "threads": os.cpu_count() or 1}
    direct = Direct(model_dir, "transcribe-direct")
    try:
        with bunkhouse("transcribe-bunkhouse", "--no-source", "hf_cache", "--no-source",
                       "ollama", "--no-source", "lmstudio") as (url, _):
            t0 = time.perf_counter()
            cold = through_bunkhouse(url, FIXTURE)
            out["bunkhouse_cold_s"] = time.perf_counter() - t0
            out["direct_load_s"] = direct.loaded["load_s"]
            direct.transcribe(FIXTURE)  # warm-up, as bunkhouse's cold request was
            runs: dict[str, list[float]] = {"direct": [], "bunkhouse": []}
            last: dict[str, dict[str, Any]] = {"bunkhouse": cold}
            for i in range(rounds):
                order = ("direct", "bunkhouse") if i % 2 == 0 else ("bunkhouse", "direct")
                for target in order:
                    last[target] = direct.transcribe(FIXTURE) if target == "direct" else \
                        through_bunkhouse(url, FIXTURE)
                    runs[target].append(last[target]["seconds"])
            out["runs"] = runs
            out["texts"] = {target: answer["text"] for target, answer in last.items()}
            worker = _worker(url)
            out["bunkhouse_peak_bytes"] = worker["measured_bytes"]
            out["bunkhouse_estimate_bytes"] = worker["estimated_bytes"]
            out["direct_peak_bytes"] = last["direct"]["peak_bytes"]
            if profile.transcribe_long_s:
                out["long"] = _long(url, model_dir, profile.transcribe_long_s)
    finally:
        direct.close()
    ratio = statistics.median(out["runs"]["bunkhouse"]) / statistics.median(
        out["runs"]["direct"])
    out["ratio"] = ratio
    print(f"transcribe: ratio {ratio:.3f}", file=sys.stderr, flush=True)
    return out


def _long(url: str, model_dir: Path, seconds: float) -> dict[str, Any]:
    """One long file on each target, each in a process that transcribed nothing longer."""
    with tempfile.TemporaryDirectory(prefix="bunkhouse-bench-") as tmp:
        path = long_wav(seconds, Path(tmp) / "long.wav")
        fresh = Direct(model_dir, "transcribe-direct-long")
        try:
            direct = fresh.transcribe(path)
        finally:
            fresh.close()
        before = _worker(url)["measured_bytes"]
        theirs = through_bunkhouse(url, path)
        time.sleep(2.5)  # the front samples the worker's peak every second
        worker = _worker(url)
        return {"audio_s": _duration(path), "bytes": path.stat().st_size,
                "direct_s": direct["seconds"], "direct_peak_bytes": direct["peak_bytes"],
                "bunkhouse_s": theirs["seconds"], "bunkhouse_peak_before_bytes": before,
                "bunkhouse_peak_bytes": worker["measured_bytes"],
                "bunkhouse_estimate_bytes": worker["estimated_bytes"]}


def _duration(path: Path) -> float:
    with wave.open(str(path)) as w:
        return float(w.getnframes() / w.getframerate())
