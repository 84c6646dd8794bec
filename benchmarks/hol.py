"""Head-of-line blocking across models: a short request to one model while another streams a
long generation.

On one `bunkhouse serve` with both packaged models loaded, Qwen streams ``hol_tokens`` tokens
(``ignore_eos``) while short requests to Gemma (8 tokens) are sent every
``HOL_EVERY_S`` seconds, each from its own thread (so none waits for another). Measured per
short request: its time to first token; for the mix: all tokens (Qwen's and Gemma's) over the
wall time, and Qwen's own decode rate. Run with the compute gate's time slice
(``--compute-turn 0.5``, the default) and without it (``--compute-turn 0``: a turn lasts until
its model's requests end, the serialized gate), the two taking turns in order between runs.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import httpx

from benchmarks.common import GEMMA, NO_KEEPALIVE, QWEN, Profile, bunkhouse

HOL_EVERY_S = 1.5
SHORT_TOKENS = 8
CONFIGS = {"time slice": "0.5", "serialized": "0"}


def stream_completion(url: str, model: str, tokens: int, prompt: str,
                      cache_prompt: bool = True) -> dict[str, Any]:
    """A greedy completion of ``tokens`` tokens, streamed: when it was sent, when its first
    and last token came (perf_counter), and its tokens. ``cache_prompt`` false: the engine
    prefills the prompt again."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True,
            "stream": True, "temperature": 0, **({} if cache_prompt else {"cache_prompt": False})}
    sent = time.perf_counter()
    first = last = None
    n = 0
    with httpx.Client(limits=NO_KEEPALIVE) as client, client.stream(
            "POST", f"{url}/v1/completions", json=body, timeout=900) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {") and '"text":' in line \
                    and json.loads(line[6:])["choices"][0]["text"]:  # not the last, empty one
                n += 1
                last = time.perf_counter()
                first = first or last
    if first is None or last is None:
        raise RuntimeError(f"{model}: no tokens")
    return {"sent": sent, "first": first, "last": last, "tokens": n}


def _run(url: str, tokens: int) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    long: dict[str, Any] = {}

    def run_long() -> None:
        long.update(stream_completion(url, QWEN, tokens, "Once upon a time"))

    def run_short(i: int) -> None:
        results.append(stream_completion(url, GEMMA, SHORT_TOKENS, f"[{i}] Hello"))

    start = time.perf_counter()
    lt = threading.Thread(target=run_long)
    lt.start()
    shorts = []
    time.sleep(2.0)
    i = 0
    while lt.is_alive():
        t = threading.Thread(target=run_short, args=(i,))
        t.start()
        shorts.append(t)
        i += 1
        time.sleep(HOL_EVERY_S)
    lt.join()
    for t in shorts:
        t.join()
    end = max([long["last"], *(r["last"] for r in results)])
    answered_during = [r for r in results if r["sent"] < long["last"]]
    return {
        "ttft_s": [r["first"] - r["sent"] for r in answered_during],
        "long_tokens": long["tokens"],
        "long_decode_tps": (long["tokens"] - 1) / (long["last"] - long["first"]),
        "mix_tps": (long["tokens"] + sum(r["tokens"] for r in results)) / (end - start),
        "short_requests": len(results),
    }


def measure(profile: Profile) -> dict[str, Any]:
    """Per configuration, per run: the run's figures (see _run)."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    names = list(CONFIGS)
    for r in range(profile.hol_runs):
        for name in names if r % 2 == 0 else names[::-1]:
            with bunkhouse(f"hol-{name.replace(' ', '-')}", "--preload", QWEN, "--preload",
                           GEMMA, "--compute-turn", CONFIGS[name]) as (url, _):
                stream_completion(url, QWEN, 4, "Hello")  # warm-up, not counted
                stream_completion(url, GEMMA, 4, "Hello")
                runs[name].append(_run(url, profile.hol_tokens))
            print(f"hol: {name} run {r + 1}/{profile.hol_runs}", file=sys.stderr)
    return {"long_model": QWEN, "short_model": GEMMA, "long_tokens": profile.hol_tokens,
            "short_tokens": SHORT_TOKENS, "every_s": HOL_EVERY_S, "runs": runs}
