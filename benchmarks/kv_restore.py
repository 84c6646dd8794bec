"""A conversation's follow-up after its model was evicted: KV snapshots against re-prefilling.

The workload, the same for every target, per conversation length L (about 1K, 4K and 8K
tokens of Qwen): a fresh server with room for one model; a greedy chat turn of L tokens to
Qwen; a short completion from Gemma (Qwen is evicted to make room); then the follow-up
question to Qwen, streamed. Measured: the follow-up's time to first token (it includes
loading Qwen again on both targets) and the tokens the engine prefilled for it (its
``timings.prompt_n``).

* ``bunkhouse``: `bunkhouse serve --budget 900MiB` with KV snapshots on (a private
  snapshot directory per run): Qwen's slot is saved when it is evicted and restored before
  the follow-up;
* ``router``: llama.cpp's router, `llama-server --models-dir DIR --models-max 1` with the same
  engine options, when a binary is given: its eviction drops the KV cache, so the follow-up
  prefills the whole conversation again.

Also the cost on bunkhouse's side: the eviction's flush (seconds, bytes, bytes per token),
and the Gemma request's time to first token (it waits for Qwen's drain, flush included).
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import GEMMA, QWEN, Profile, bunkhouse, packaged, stream_chat
from benchmarks.swap import router

BUDGET = "900MiB"
CONTEXT = 16384  # one slot: an 8K conversation and its follow-up fit
PARALLEL = 1
ANSWER_TOKENS = 16


def conversation(tokens: int) -> list[dict[str, Any]]:
    """A first turn of about ``tokens`` Qwen tokens (a module of small functions: about 18
    tokens each)."""
    functions = max(1, tokens // 18)
    module = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(functions))
    return [{"role": "system", "content": "You are a careful code reviewer."},
            {"role": "user", "content": f"Here is a module:\n{module}\nWhich function "
                                        f"returns x * {functions // 2} + {functions // 2 % 7}?"}]


def chat(url: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed greedy chat turn: its text, time to first token and the engine's timings."""
    r = stream_chat(url, {"model": QWEN, "messages": messages, "max_tokens": ANSWER_TOKENS,
                          "temperature": 0})
    return {"text": r.text, "ttft_s": None if r.first is None else r.first - r.sent,
            "prompt_n": r.timings.get("prompt_n"), "cache_n": r.timings.get("cache_n")}


def gemma(url: str) -> float:
    """Seconds until Gemma's first token (the eviction of Qwen comes first)."""
    sent = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", timeout=600, json={
            "model": GEMMA, "prompt": "Hello", "max_tokens": 2, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - sent
    raise RuntimeError(f"{url}: Gemma sent no token")


def scenario(url: str, tokens: int) -> dict[str, Any]:
    messages = conversation(tokens)
    first = chat(url, messages)
    gemma_ttft = gemma(url)
    follow_up = [*messages, {"role": "assistant", "content": first["text"]},
                 {"role": "user", "content": "And which function returns x * 3 + 3?"}]
    second = chat(url, follow_up)
    return {"tokens": tokens, "first_prompt_n": first["prompt_n"],
            "first_ttft_s": first["ttft_s"], "gemma_ttft_s": gemma_ttft,
            "follow_up_ttft_s": second["ttft_s"], "follow_up_prompt_n": second["prompt_n"],
            "follow_up_cache_n": second["cache_n"], "follow_up_text": second["text"]}


@contextmanager
def _config() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="bh-kv-") as tmp:
        path = Path(tmp) / "bunkhouse.toml"
        path.write_text(f"[defaults]\ncontext = {CONTEXT}\nparallel = {PARALLEL}\n")
        yield path


def run_bunkhouse(tokens: int) -> dict[str, Any]:
    with _config() as config, tempfile.TemporaryDirectory(prefix="bh-kv-store-") as kv, \
            bunkhouse("kv-bunkhouse", "--config", str(config), "--budget", BUDGET,
                      "--kv-cache-dir", kv) as (url, _):
        result = scenario(url, tokens)
        qwen = httpx.get(f"{url}/v1/models/{QWEN}").json()["kv_cache"]
        result["restored"] = qwen["restored"]
        result["missed"] = qwen["missed"]
        saves = [f for f in qwen["recent_flushes"] if f["saved"]]
        result["flushes"] = saves
        if saves:  # the first turn's slot: saved when idle, or when Qwen was evicted
            first = saves[0]
            result["flush_s"] = first["seconds"]
            result["flush_bytes"] = first["saved_bytes"]
            result["bytes_per_token"] = first["saved_bytes"] / first["saved_tokens"]
        return result


def run_router(binary: str, tokens: int) -> dict[str, Any]:
    # no prompt cache, as a worker's (llama.cpp's option's default)
    options = dataclasses.replace(packaged(QWEN).options, context=CONTEXT, parallel=PARALLEL)
    with router(binary, "kv-router", options) as (url, _):
        return scenario(url, tokens)


def measure(profile: Profile, llama_server: str | None) -> dict[str, Any]:
    result: dict[str, Any] = {"budget": BUDGET, "context": CONTEXT, "parallel": PARALLEL,
                              "answer_tokens": ANSWER_TOKENS, "lengths": {}}
    for tokens in profile.kv_lengths:
        row: dict[str, Any] = {}
        targets = ["bunkhouse", "router"] if llama_server else ["bunkhouse"]
        for target in targets:
            if target == "bunkhouse":
                row[target] = run_bunkhouse(tokens)
            else:
                assert llama_server
                row[target] = run_router(llama_server, tokens)
            print(f"kv: {tokens} tokens, {target}: follow-up TTFT "
                  f"{row[target]['follow_up_ttft_s']:.2f} s", file=sys.stderr)
        if "router" in row:
            b, r = row["bunkhouse"], row["router"]
            row["ttft_ratio"] = b["follow_up_ttft_s"] / r["follow_up_ttft_s"]
            row["same_answer"] = b["follow_up_text"] == r["follow_up_text"]
        result["lengths"][str(tokens)] = row
    return result
