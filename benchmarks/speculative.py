"""Speculative decoding and KV cache types: what they gain and what they cost.

One `bunkhouse serve` (its log in the run's logs) serves the packaged Qwen three ways, each
with 2 slots of 2,048 tokens: ``plain``, ``ngram`` (``speculative = "ngram"``) and ``draft``
(``draft =`` a copy of Qwen's own file: a wiring check of the draft path, never a speed-up,
since the draft is as slow as the target).

* Decode: greedy chat answers of up to ``spec_tokens`` tokens, streamed, on two tasks (a
  code-copy edit: "copy this code exactly" with a 12-function module; free text: an
  explanation), alternating targets and tasks, ``spec_rounds`` each: time to first token,
  decode tokens/s (tokens after the first over the time after it), and the engine's own
  drafted and accepted tokens of each answer (its ``timings``). Every answer is checked
  against plain's (greedy: the same text).
* Memory at 32K context: Qwen with one 32,768-token slot, f16 and q8_0 KV caches, each loaded
  and asked one short question: its estimate (KV part and total) and its measured peak.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import QWEN, Profile, bunkhouse, packaged, stream_chat
from bunkhouse.catalog import build_catalog
from bunkhouse.config import Settings, load_config_file
from bunkhouse.engines import ENGINES
from bunkhouse.residency.estimate import estimate

CODE = "\n".join(f"def f{i}(a, b):\n    return a * {i} + b - {i * i}\n" for i in range(12))
TASKS = {
    "code-copy": f"Copy this code exactly, nothing else:\n{CODE}",
    "free text": "Explain how a hash table works, and when to use one, in a few paragraphs.",
}
TARGETS = ("plain", "ngram", "draft")
MIB = 2**20


def _stream(url: str, model: str, prompt: str, tokens: int) -> dict[str, Any]:
    """A streamed greedy chat answer: its text, time to first token, decode tokens/s and the
    engine's drafted / accepted tokens."""
    r = stream_chat(url, {"model": model, "messages": [{"role": "user", "content": prompt}],
                          "max_tokens": tokens, "temperature": 0})
    first, last, timings = r.first or r.sent, r.last or r.sent, r.timings
    n = int(timings.get("predicted_n") or len(r.pieces))
    return {"text": r.text, "ttft_s": first - r.sent,
            "decode_tps": (n - 1) / (last - first) if n > 1 and last > first else 0.0,
            "tokens": n, "drafted": int(timings.get("draft_n") or 0),
            "accepted": int(timings.get("draft_n_accepted") or 0)}


def _memory(url: str, config: Path) -> dict[str, Any]:
    catalog = build_catalog(load_config_file(config, Settings()), engines=ENGINES)
    out = {}
    for model in ("long-f16", "long-q8_0"):
        resp = httpx.post(f"{url}/v1/chat/completions", timeout=900, json={
            "model": model, "messages": [{"role": "user",
                                          "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0})
        resp.raise_for_status()
        est = estimate(catalog.get(model))
        described = httpx.get(f"{url}/v1/models/{model}", timeout=30).json()
        out[model.removeprefix("long-")] = {
            "kv_estimate_bytes": est.kv_cache, "estimate_bytes": est.total,
            "peak_bytes": described["measured_bytes"],
            "answer": resp.json()["choices"][0]["message"]["content"]}
    return out


def measure(profile: Profile) -> dict[str, Any]:
    qwen = packaged(QWEN).path
    with tempfile.TemporaryDirectory(prefix="bh-spec-") as tmp:
        draft = Path(tmp) / "draft-copy.gguf"
        shutil.copyfile(qwen, draft)
        config = Path(tmp) / "bunkhouse.toml"
        config.write_text(
            "include_packaged = false\n[defaults]\ncontext = 4096\nparallel = 2\n"
            f'[[models]]\nid = "plain"\npath = "{qwen}"\n'
            f'[[models]]\nid = "ngram"\npath = "{qwen}"\nspeculative = "ngram"\n'
            + (f'[[models]]\nid = "draft"\npath = "{qwen}"\ndraft = "{draft}"\n'
               if profile.spec_draft else "")
            + "".join(f'[[models]]\nid = "long-{kv}"\npath = "{qwen}"\ncontext = 32768\n'
                      f'parallel = 1\ncache_type_k = "{kv}"\ncache_type_v = "{kv}"\n'
                      for kv in ("f16", "q8_0")))
        with bunkhouse("speculative", "--config", str(config), "--budget", "16GiB",
                       "--kv-cache-dir", str(Path(tmp) / "kv")) as (url, _):
            targets = TARGETS if profile.spec_draft else TARGETS[:2]
            for model in targets:  # each worker loaded, and warm, before timing
                _stream(url, model, "Hi", 2)
            runs: dict[str, dict[str, list[dict[str, Any]]]] = {
                task: {t: [] for t in targets} for task in TASKS}
            for _ in range(profile.spec_rounds):
                for task, prompt in TASKS.items():
                    for target in targets:
                        runs[task][target].append(_stream(url, target, prompt,
                                                          profile.spec_tokens))
            memory = _memory(url, config) if profile.spec_memory else {}
    return {"tokens": profile.spec_tokens, "rounds": profile.spec_rounds,
            "runs": runs, "summary": summarize(runs), "memory": memory,
            "measured_at": time.strftime("%Y-%m-%d")}


def _common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per task and target: medians, acceptance, ratios against plain, and whether every
    answer was plain's."""
    out: dict[str, Any] = {}
    for task, targets in runs.items():
        plain = targets["plain"]
        base_tps = statistics.median(r["decode_tps"] for r in plain)
        base_ttft = statistics.median(r["ttft_s"] for r in plain)
        expected = {r["text"] for r in plain}
        out[task] = {}
        for target, rows in targets.items():
            tps = statistics.median(r["decode_tps"] for r in rows)
            ttft = statistics.median(r["ttft_s"] for r in rows)
            drafted = sum(r["drafted"] for r in rows)
            out[task][target] = {
                "decode_tps": tps, "ttft_s": ttft,
                "decode_ratio": tps / base_tps if base_tps else 0.0,
                "ttft_ratio": ttft / base_ttft if base_ttft else 0.0,
                "drafted": drafted, "accepted": sum(r["accepted"] for r in rows),
                "acceptance": sum(r["accepted"] for r in rows) / drafted if drafted else None,
                "same_answers": sum(r["text"] in expected for r in rows),
                "answers": len(rows),
                # where the others left plain's answer (characters in): a near-tie, where
                # the batched verification's logits took the other token
                "diverged_at": sorted(_common_prefix(r["text"], plain[0]["text"])
                                      for r in rows if r["text"] not in expected)}
    return out
