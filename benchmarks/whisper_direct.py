"""faster-whisper called directly, the peer of bunkhouse's transcription: one model loaded as
bunkhouse's worker loads it (CPU, int8, the same threads), then one audio file path per line
on stdin, each answered on stdout with a JSON line: the seconds the transcription took (from
the call to its last segment, decoding included), its text, and the process's peak resident
memory so far (bytes). The first line it prints is its load time.

    python -m benchmarks.whisper_direct MODEL_DIR [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.whisper_direct")
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)
    started = time.perf_counter()
    from faster_whisper import WhisperModel

    model = WhisperModel(a.model, device="cpu", compute_type="int8", cpu_threads=a.threads,
                         num_workers=1)
    print(json.dumps({"load_s": time.perf_counter() - started, "peak_bytes": _peak()}),
          flush=True)
    for line in sys.stdin:
        path = line.strip()
        if not path:
            continue
        t0 = time.perf_counter()
        segments, _ = model.transcribe(path, vad_filter=False,
                                       condition_on_previous_text=True)
        text = "".join(s.text for s in segments).strip()
        print(json.dumps({"seconds": time.perf_counter() - t0, "text": text,
                          "peak_bytes": _peak()}), flush=True)
    return 0


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


if __name__ == "__main__":
    raise SystemExit(main())
