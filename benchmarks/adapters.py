"""LoRA adapters: what mounting them costs a model, and what a re-mount costs a conversation.

One `bunkhouse serve` (its log in the run's logs) serves the packaged Qwen twice: ``plain``,
its file with no adapter, and the packaged id with two random rank-8 adapters mounted
(tests/lora.py: attn_q and attn_v of every layer, as a small fine-tune has them), a budget
for both.

* Mounting: greedy completions of ``adapter_tokens`` tokens (``ignore_eos``), streamed, on
  ``plain``, on the base with its adapters mounted (its requests run them at scale 0) and on
  adapter A, alternating, ``adapter_rounds`` each: time to first token and decode tokens/s
  (tokens after the first over the time after it).
* A re-mount with a conversation kept: a chat turn on A (about 600 tokens; 300 in the tiny
  profile, above the 256 a snapshot needs), then adapter C
  registered at run time (``POST /v1/models``): the seconds from the registration to C's
  first token (the base drains, its slot is saved, and it loads again with three adapters),
  then A's follow-up: its time to first token and the prompt tokens the engine prefilled.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from tests.lora import write_pair

from benchmarks.common import QWEN, Profile, bunkhouse, packaged
from benchmarks.hol import stream_completion

ADMIN = "bench-admin"
PROMPT = "def quicksort(items):\n"
QUESTION = {"role": "user", "content": "And which one returns x - 11?"}


def conversation(functions: int) -> list[dict[str, Any]]:
    """A first turn of about 14 Qwen tokens a function, 60 more."""
    module = "".join(f"def g{i}(x):\n    return x - {i}\n" for i in range(functions))
    return [{"role": "system", "content": "You review Python code."},
            {"role": "user", "content": f"{module}\nWhich function returns x - 17?"}]


def _completion(url: str, model: str, tokens: int) -> dict[str, float]:
    """A streamed greedy completion: its time to first token and decode tokens/s."""
    r = stream_completion(url, model, tokens, PROMPT, cache_prompt=False)
    n, first, last = r["tokens"], r["first"], r["last"]
    decode = (n - 1) / (last - first) if n > 1 and last > first else 0.0
    return {"ttft_s": first - r["sent"], "decode_tps": decode}


def _chat(url: str, model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    sent = time.perf_counter()
    resp = httpx.post(f"{url}/v1/chat/completions", timeout=900, json={
        "model": model, "messages": messages, "max_tokens": 16, "temperature": 0})
    resp.raise_for_status()
    data = resp.json()
    return {"text": data["choices"][0]["message"]["content"], "s": time.perf_counter() - sent,
            "prompt_n": data["timings"]["prompt_n"], "cache_n": data["timings"]["cache_n"]}


def _first_token_s(url: str, model: str) -> float:
    """Seconds until ``model``'s first streamed token."""
    sent = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=900, json={
            "model": model, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2, "stream": True}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                return time.perf_counter() - sent
    raise RuntimeError(f"{model}: no token")


def _remount(url: str, loras: Path, functions: int) -> dict[str, Any]:
    messages = conversation(functions)
    first = _chat(url, "a", messages)
    shutil.copy(loras / "lora-b.gguf", loras / "lora-c.gguf")
    started = time.perf_counter()
    resp = httpx.post(f"{url}/v1/models", timeout=600, headers={
        "authorization": f"Bearer {ADMIN}"}, json={
        "id": "c", "path": str(loras / "lora-c.gguf"), "adapter_of": QWEN})
    resp.raise_for_status()
    registered = time.perf_counter() - started
    c_first = _first_token_s(url, "c")
    follow = _chat(url, "a", [*messages, {"role": "assistant", "content": first["text"]},
                              QUESTION])
    return {"conversation_tokens": first["prompt_n"] + first["cache_n"],
            "register_s": registered, "remount_to_first_token_s": registered + c_first,
            "follow_up_s": follow["s"], "follow_up_prompt_n": follow["prompt_n"],
            "follow_up_cache_n": follow["cache_n"]}


def measure(profile: Profile) -> dict[str, Any]:
    qwen = packaged(QWEN).path
    with tempfile.TemporaryDirectory(prefix="bh-lora-") as tmp:
        loras = Path(tmp) / "loras"
        write_pair(qwen, loras)
        config = Path(tmp) / "bunkhouse.toml"
        config.write_text(
            "[defaults]\ncontext = 4096\nparallel = 2\n"
            f'[[models]]\nid = "plain"\npath = "{qwen}"\n'
            + "".join(f'[[models]]\nid = "{name}"\nadapter_of = "{QWEN}"\n'
                      f'path = "{loras / f"lora-{name}.gguf"}"\n' for name in ("a", "b")))
        with bunkhouse("adapters", "--config", str(config), "--kv-cache-dir",
                       str(Path(tmp) / "kv"), "--admin-key", ADMIN, "--allow-runtime-load",
                       "--allowed-root", str(loras)) as (url, _):
            targets = {"plain": "plain", "mounted": QWEN, "adapter": "a"}
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
            for model in targets.values():  # each worker loaded, and warm, before timing
                _completion(url, model, 2)
            for _ in range(profile.adapter_rounds):
                for name, model in targets.items():
                    runs[name].append(_completion(url, model, profile.adapter_tokens))
            remount = _remount(url, loras, profile.adapter_functions)
    medians = {name: {k: statistics.median(r[k] for r in rows) for k in ("ttft_s", "decode_tps")}
               for name, rows in runs.items()}
    return {"tokens": profile.adapter_tokens, "rounds": profile.adapter_rounds, "runs": runs,
            "medians": medians, "remount": remount}
