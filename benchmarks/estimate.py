"""The memory estimate against each worker's measured peak, at every setting.

    python -m benchmarks.estimate [--models ID ...] [--contexts N ...] [--parallel N ...]
                                  [--embeddings off on] [--full-slot] [--json PATH]
                                  [--docs PATH] [--render]

For each packaged model, context, slot count and embeddings setting it starts a real worker
(the same process ``bunkhouse serve`` starts), then drives it to its largest buffers:

1. a generation whose prompt fills one micro-batch (512 tokens, or the slot's context when
   that is shorter) in every slot at once;
2. a generation whose prompts fill every slot at once, up to 8,192 prompt tokens in all (a
   32K prefill takes many minutes on 2 cores): attention over whole slots;
3. with embeddings on, an embeddings request whose inputs fill one micro-batch together
   (one 512-token input, or one input per slot filling each slot when slots are shorter);
4. with ``--full-slot``, one slot of ``--full-slot-context`` tokens, filled whole.

The measured peak is the kernel's high-water mark of the worker's resident memory
(``VmHWM`` in ``/proc/PID/status``), read after the requests. The estimate must never be below
it and at most 5% above it. Results go to docs/benchmarks/estimate.json and the table in
docs/memory-estimate.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import GEMMA, QWEN, packaged
from bunkhouse.catalog import CatalogModel
from bunkhouse.catalog.catalog import settle
from bunkhouse.engines import ENGINES, LLAMA_SERVER
from bunkhouse.engines.llamacpp import (
    ATTENTION_CONTEXT_BYTES,
    ATTENTION_SLOT_BYTES,
    FFN_TENSORS,
    MIB,
    RUNTIME_BYTES,
    SLOT_VOCAB_BYTES,
    SWA_SLOT_BYTES,
    SWA_STREAM_BYTES,
)
from bunkhouse.errors import ModelNotFound
from bunkhouse.residency.estimate import estimate
from bunkhouse.supervisor.handle import process_memory
from bunkhouse.supervisor.launcher import LocalLauncher
from bunkhouse.supervisor.process import LaunchOptions, WorkerProcess

ROOT = Path(__file__).resolve().parent.parent
CONTEXTS = (512, 2048, 8192, 32768)
PARALLEL = (1, 4)
MICRO_BATCH = 512
TOLERANCE = 0.05  # the estimate may be at most this much above the measured peak
LONG_PROMPTS = 8192  # tokens of prompt over all slots at once (a 32K prefill takes many minutes)
_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
          "seven", "wizards", "quietly", "hex", "jolly", "farmers", "near", "big", "old",
          "rivers", "and", "small", "green", "hills"]


def hwm_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM), bytes."""
    memory = process_memory(pid)
    if memory is None:
        raise RuntimeError(f"pid {pid} is gone")
    return memory.peak


async def text_of(worker: WorkerProcess, tokens: int, salt: int) -> str:
    """Text the model tokenizes to exactly ``tokens`` tokens (special tokens included)."""
    words = [_WORDS[(i * 7 + salt) % len(_WORDS)] for i in range(tokens)]
    text = " ".join(words)
    while True:
        n = await worker.engine.count_tokens(text)
        if n <= tokens:
            return text
        words = words[: len(words) - (n - tokens)]
        text = " ".join(words)


async def drive(worker: WorkerProcess, model: CatalogModel,
                full_slot: bool) -> tuple[dict[str, int], int]:
    """Drive the worker to its largest buffers; return its peak after each step and the
    longest prompt a slot was given (tokens)."""
    o = model.options
    slot = o.context // o.parallel
    pid = worker.pid
    assert pid is not None
    steps: dict[str, int] = {"ready": hwm_bytes(pid)}

    async def post(route: str, body: dict[str, Any]) -> None:
        resp = await worker.engine.generate(route, json.dumps(body).encode())
        await resp.aread()
        await resp.aclose()
        if resp.status_code != 200:
            raise RuntimeError(f"{route}: {resp.status_code} {resp.text[:300]}")

    async def generate_in_every_slot(tokens: int, salt: int) -> None:
        prompts = [await text_of(worker, tokens, salt + i) for i in range(o.parallel)]
        await asyncio.gather(*(post("/v1/completions", {
            "prompt": p, "max_tokens": 2, "temperature": 0, "cache_prompt": False})
            for p in prompts))

    longest = min(MICRO_BATCH, slot - 16)
    await generate_in_every_slot(longest, 0)
    steps["generation"] = hwm_bytes(pid)
    filled = slot - 16 if full_slot else min(slot - 16, LONG_PROMPTS // o.parallel)
    if filled > longest:  # attention over (nearly) whole slots
        longest = filled
        await generate_in_every_slot(filled, 7)
        steps["long_prompt"] = hwm_bytes(pid)
    if options_of(model).get("speculative"):  # verification batches of drafted tokens
        code = "\n".join(f"def f{i}(a, b):\n    return a * {i} + b - {i * i}\n"
                         for i in range(12))
        await asyncio.gather(*(post("/v1/completions", {
            "prompt": f"# {i}\n{code}\n# the same code again:\n{code[:40]}",
            "max_tokens": 160, "temperature": 0}) for i in range(o.parallel)))
        steps["speculation"] = hwm_bytes(pid)
    if model.embeddings:
        embed_tokens = min(MICRO_BATCH, slot)
        inputs = [await text_of(worker, embed_tokens, salt + 3)
                  for salt in range(min(o.parallel, max(1, MICRO_BATCH // embed_tokens)))]
        await post("/v1/embeddings", {"input": inputs})
        steps["embeddings"] = hwm_bytes(pid)
    end = process_memory(pid)
    steps["rss_end"] = end.resident if end else 0
    return steps, longest


def options_of(model: CatalogModel) -> dict[str, Any]:
    return ENGINES[model.engine].shown_options(model)


async def measure_one(launcher: LocalLauncher, model_id: str, context: int, parallel: int,
                      embeddings: bool, full_slot: bool,
                      own: dict[str, Any] | None = None,
                      engine: str = "llama.cpp") -> dict[str, Any]:
    model = _model(model_id, context, parallel, embeddings, own, engine)
    est = estimate(model)
    started = time.monotonic()
    worker = await launcher.start(model)
    try:
        steps, longest = await drive(worker, model, full_slot)
    finally:
        await worker.stop()
    peak = max(v for k, v in steps.items() if k != "rss_end")
    row = {
        "model": model_id, "context": context, "parallel": parallel, "embeddings": embeddings,
        "full_slot": full_slot, "options": own or {}, "prompt_tokens": longest,
        **({"engine": engine} if engine != "llama.cpp" else {}),
        "estimate_bytes": est.total,
        "estimate_parts": dataclasses.asdict(est), "peak_bytes": peak, "steps": steps,
        "ratio": est.total / peak, "seconds": round(time.monotonic() - started, 1),
    }
    print(f"{model_id:28s} ctx {context:6d} x{parallel} emb {embeddings:d}: "
          f"estimate {est.total / MIB:7.1f} MiB, "
          f"peak {peak / MIB:7.1f} MiB, ratio {row['ratio']:.3f}  "
          + " ".join(f"{k}={v / MIB:.0f}" for k, v in steps.items()), flush=True)
    return row


def _model(model_id: str, context: int, parallel: int, embeddings: bool,
           own: dict[str, Any] | None = None, engine: str = "llama.cpp") -> CatalogModel:
    """A packaged model at these settings on ``engine``, with its options ``own`` (a
    ``draft`` names a packaged model or a file)."""
    base = dataclasses.replace(packaged(model_id), engine=engine)
    options = dataclasses.replace(base.options, context=context, parallel=parallel,
                                  embeddings=embeddings,
                                  engine_keys=tuple((own or {}).items()))
    model = settle(dataclasses.replace(base, options=options), _packaged_or_none, Path.cwd())
    if model.refused:
        raise SystemExit(f"{model_id} {own}: {model.refused}")
    return model


def _packaged_or_none(name: str) -> CatalogModel | None:
    try:
        return packaged(name)
    except ModelNotFound:
        return None


def reestimate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with the current estimator's figures (the peaks as measured)."""
    for r in rows:
        est = estimate(_model(r["model"], r["context"], r["parallel"], r["embeddings"],
                              r.get("options"), r.get("engine", "llama.cpp")))
        r.update(estimate_bytes=est.total, estimate_parts=dataclasses.asdict(est),
                 ratio=est.total / r["peak_bytes"])
    return rows


async def measure(models: list[str], contexts: list[int], parallels: list[int],
                  embeddings: list[bool], full_slot: bool,
                  full_context: int = 8192, own: dict[str, Any] | None = None,
                  engine: str = "llama.cpp") -> list[dict[str, Any]]:
    launcher = LocalLauncher(LaunchOptions(ready_timeout_s=600, stop_grace_s=30),
                             tmp_dir=Path(tempfile.gettempdir()))
    rows = []
    try:
        for model_id in models:
            for emb in embeddings:
                for context in contexts:
                    for parallel in parallels:
                        rows.append(await measure_one(launcher, model_id, context, parallel,
                                                      emb, False, own, engine))
            if full_slot:
                for emb in embeddings:
                    for parallel in parallels:
                        rows.append(await measure_one(launcher, model_id, full_context,
                                                      parallel, emb, True, own, engine))
    finally:
        launcher.close()
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """docs/memory-estimate.md from the measured rows."""
    lines = [
        "# Memory estimate against measured peaks",
        "",
        "Generated by `python -m benchmarks.estimate --docs docs/memory-estimate.md` (every",
        "setting, about 30 minutes on 2 cores), then the long end, whole 32K slots:",
        "`python -m benchmarks.estimate --models gemma-3-270m --embeddings off --parallel 1 4",
        "--full-slot-only --full-slot-context 32768 --append --docs docs/memory-estimate.md`",
        "(about 10 minutes). The raw rows are in docs/benchmarks/estimate.json.",
        "",
        "Residency counts each model at its estimate: the worst case of its worker, every",
        "buffer it can grow to under the options it was started with (engines/llamacpp.py,",
        "`estimate`). A worker whose measured peak ever goes beyond it is counted at that peak",
        "instead (and logged: the estimate was wrong).",
        "",
        "    weights     the GGUF file (memory-mapped; warm-up touches all of it)",
        "    KV cache    context x layers x KV heads x (key + value dims) x 2 bytes (f16);",
        "                sliding-window layers capped at window x slots + one micro-batch",
        "    prompt      the engine's RAM prompt cache limit (cache_ram_mib), in full",
        "    runtime     the interpreter, llama.cpp and its threads: "
        f"{RUNTIME_BYTES // MIB} MiB",
        f"    compute     {FFN_TENSORS} x 512 x n_ff x 4 bytes (a full micro-batch through "
        "the FFN)",
        f"                + {SLOT_VOCAB_BYTES} bytes x n_vocab per slot (its sampler)",
        f"                + {ATTENTION_SLOT_BYTES} bytes per token of a slot and "
        f"{ATTENTION_CONTEXT_BYTES} per token of",
        "                context (attention over whole slots: the rows whose prompts fill them)",
        f"                + on sliding-window models {SWA_SLOT_BYTES} bytes per slot token "
        "past 512 (up",
        f"                to 2048), and {SWA_STREAM_BYTES // 1024} KiB per window cell of "
        "every slot but one",
        "                (slots batched together on a sliding-window model)",
        "    outputs     with embeddings on: llama.cpp computes logits for every token of an",
        "                embeddings batch, in its compute buffer, and copies them to its",
        "                output buffer: 2 x n_vocab x 4 bytes per token, for up to one",
        "                micro-batch of 512 tokens (+ the embeddings themselves)",
        "",
        "How each row is measured: a real worker (the process `bunkhouse serve` starts) is",
        "driven to its largest buffers: a generation whose prompt fills one micro-batch (512",
        "tokens, or the slot when shorter) in every slot at once; a generation whose prompts",
        "fill every slot at once (up to 8,192 prompt tokens in all: *prompt / slot*); with",
        "embeddings on, an embeddings request whose inputs fill one micro-batch together.",
        "*Full slot* rows fill whole 32K slots. The peak is the kernel's high-water mark of",
        "the worker's resident memory (`VmHWM`). The estimate must never be below it and at",
        f"most {TOLERANCE:.0%} above it. The fitted constants are our fit to these rows (two",
        "models, one engine build: xllamacpp 2026.10, CPU); another model or build should be",
        "measured again with this script.",
        "",
        "| model | context | slots | embeddings | prompt / slot | estimate MiB | peak MiB "
        "| estimate / peak |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        name = r["model"] + (" (full slot)" if r.get("full_slot") else "") + "".join(
            f", {k} {v}" for k, v in (r.get("options") or {}).items())
        slot = r["context"] // r["parallel"]
        lines.append(
            f"| {name} | {r['context']} | {r['parallel']} | {'on' if r['embeddings'] else 'off'}"
            f" | {r.get('prompt_tokens', '?')} / {slot}"
            f" | {r['estimate_bytes'] / MIB:.0f} | {r['peak_bytes'] / MIB:.0f}"
            f" | {r['estimate_bytes'] / r['peak_bytes']:.3f} |")
    filled = [r for r in rows if r.get("prompt_tokens", 0) >= r["context"] // r["parallel"] - 16]
    partial = [r for r in rows if r not in filled]
    ratios = [r["estimate_bytes"] / r["peak_bytes"] for r in filled]
    lines += ["", f"Estimate / peak where the prompts filled the slots ({len(filled)} rows): "
              f"{min(ratios):.3f} to {max(ratios):.3f}. A setting measured twice shows the "
              "run-to-run spread of the peak (a few MiB).", ""]
    if partial:
        worst = max(r["estimate_bytes"] / r["peak_bytes"] for r in partial)
        lines += [f"{len(partial)} rows have slots longer than the 8,192 prompt tokens a run "
                  "sends at once, so their peak is below the worst case the estimate counts "
                  f"(the estimate is up to {worst:.3f} times their peak); the full-slot rows "
                  "measure that end.", ""]
    done = {(r["model"], r["context"], r["parallel"], r["embeddings"]) for r in rows
            if not r.get("options")}
    missing = [f"{m} {c}x{n} embeddings {'on' if e else 'off'}"
               for m in (QWEN, GEMMA) for e in (False, True) for c in CONTEXTS
               for n in PARALLEL if (m, c, n, e) not in done]
    if missing:
        lines += ["Not measured in this run: " + "; ".join(missing) + ".", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.estimate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=[QWEN, GEMMA])
    p.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    p.add_argument("--parallel", nargs="+", type=int, default=list(PARALLEL))
    p.add_argument("--embeddings", nargs="+", choices=["off", "on"], default=["off", "on"])
    p.add_argument("--full-slot", action="store_true", help="also fill one 8192-token slot")
    p.add_argument("--full-slot-only", action="store_true", help="only fill one 8192-token slot")
    p.add_argument("--full-slot-context", type=int, default=8192, metavar="N",
                   help="the full slot's context (%(default)s)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a llama.cpp option of the model, as in the config file "
                        "(speculative=ngram, draft=ID-OR-PATH, cache_type_k=q8_0; repeatable)")
    p.add_argument("--engine", default="llama.cpp", choices=["llama.cpp", "llama-server"],
                   help="the engine the workers run (%(default)s)")
    p.add_argument("--llama-server", type=Path, default=None, metavar="PATH",
                   help="the binary of --engine llama-server (default: llama-server on PATH)")
    p.add_argument("--json", type=Path, default=ROOT / "docs/benchmarks/estimate.json")
    p.add_argument("--docs", type=Path, default=None, help="write the table here")
    p.add_argument("--append", action="store_true",
                   help="add the rows measured to those already in --json")
    p.add_argument("--render", action="store_true",
                   help="measure nothing: re-estimate the rows of --json and write --docs")
    a = p.parse_args(argv)
    LLAMA_SERVER.locate(a.llama_server)
    if a.render:
        rows = reestimate(json.loads(a.json.read_text()))
    else:
        rows = asyncio.run(measure(a.models, [] if a.full_slot_only else a.contexts, a.parallel,
                                   [e == "on" for e in a.embeddings],
                                   a.full_slot or a.full_slot_only, a.full_slot_context,
                                   dict(_option(o) for o in a.option), a.engine))
        if a.append and a.json.is_file():
            rows = json.loads(a.json.read_text()) + rows
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(rows, indent=1))
    if a.docs is not None:
        a.docs.write_text(render(rows))
    bad = [r for r in rows if not 1.0 <= r["ratio"] <= 1.0 + TOLERANCE]
    print(f"{len(rows) - len(bad)}/{len(rows)} within [1.00, {1 + TOLERANCE:.2f}]")
    return 0


def _option(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


if __name__ == "__main__":
    sys.exit(main())
