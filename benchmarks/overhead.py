"""What the front costs: the same streamed chat requests, alternating, in one run, against

* ``engine``: the engine's own HTTP server (xllamacpp's embedded llama-server, same GGUF,
  context, slots, threads and prompt cache) on loopback TCP with a per-process API key;
* ``bunkhouse``: ``bunkhouse serve``, i.e. client -> front (TCP) -> worker (Unix socket).

Each request streams a fixed number of tokens (``ignore_eos``); time to first token (TTFT) is
taken at the first content chunk, decode tokens/s over the chunks after it. A round sends C
requests at once (C = 1, then 4) to each target in turn, the order alternating between rounds
so that drift in the machine's speed cancels out; a round's figure is the median of its
requests. Prompts differ per round and target so that no target is served from a cache.

Then the same question through each of the front's protocols (OpenAI chat completions,
Anthropic Messages, OpenAI Responses), one at a time, taking turns: what a translated
protocol costs against chat completions on the same server.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psutil

from benchmarks.common import NO_KEEPALIVE, QWEN, Profile, bunkhouse, engine_server

CONCURRENCY = (1, 4)


def _chat_text(event: dict[str, Any]) -> bool:
    choices = event.get("choices") or []
    return bool(choices and choices[0].get("delta", {}).get("content"))


PROTOCOLS: dict[str, tuple[str, Callable[[str, int], dict[str, Any]],
                           Callable[[dict[str, Any]], bool]]] = {
    # route, request body for (prompt, tokens), "this event carries answer text"
    "chat": ("/v1/chat/completions",
             lambda prompt, tokens: {"messages": [{"role": "user", "content": prompt}],
                                     "max_tokens": tokens}, _chat_text),
    "messages": ("/v1/messages",
                 lambda prompt, tokens: {"messages": [{"role": "user", "content": prompt}],
                                         "max_tokens": tokens},
                 lambda e: e.get("type") == "content_block_delta"
                 and e["delta"].get("type") == "text_delta"),
    "responses": ("/v1/responses",
                  lambda prompt, tokens: {"input": prompt, "max_output_tokens": tokens},
                  lambda e: e.get("type") == "response.output_text.delta"),
}
"""The front's protocols, each asked the same streamed question."""


def stream_once(url: str, key: str, prompt: str, tokens: int,
                protocol: str = "chat") -> tuple[float, float, int]:
    """(TTFT s, decode tokens/s, content chunks) of one streamed answer in ``protocol``
    (a key of PROTOCOLS; ``ignore_eos`` on chat, which only llama.cpp's own fields take)."""
    route, make, is_text = PROTOCOLS[protocol]
    body = {"model": QWEN, **make(prompt, tokens), "temperature": 0, "stream": True}
    if protocol == "chat":
        body["ignore_eos"] = True
    headers = {"authorization": f"Bearer {key}"} if key else {}
    stamps: list[float] = []
    start = time.perf_counter()
    with httpx.Client(limits=NO_KEEPALIVE) as client, client.stream(
            "POST", f"{url}{route}", json=body, headers=headers, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if is_text(json.loads(line[6:])):
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"{url}: only {len(stamps)} content chunks")
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return stamps[0] - start, decode, len(stamps)


def measure(profile: Profile) -> dict[str, Any]:
    """Per target and concurrency, per round: [[ttft_s, decode_tps], ...] of its requests."""
    tokens = profile.overhead_tokens
    rounds: dict[str, list[list[list[float]]]] = {}
    with engine_server(QWEN, "overhead-engine") as (engine_url, key, _), \
            bunkhouse("overhead-bunkhouse", "--preload", QWEN) as (front_url, front):
        targets = [("engine", engine_url, key), ("bunkhouse", front_url, "")]
        for _, url, k in targets:  # warm-up, not counted
            stream_once(url, k, "Say hello.", 4)
        front_cpu = psutil.Process(front.pid)
        cpu_before = sum(front_cpu.cpu_times()[:2])
        front_tokens = 0
        for r in range(profile.overhead_rounds):
            for c in CONCURRENCY:
                for name, url, k in targets if r % 2 == 0 else targets[::-1]:
                    prompts = [f"[{name} {r} {c} {i}] Write a long list of fruits, one per line."
                               for i in range(c)]
                    with ThreadPoolExecutor(c) as pool:
                        done = list(pool.map(lambda p, u=url, k=k: stream_once(u, k, p, tokens),
                                             prompts))
                    rounds.setdefault(f"{name} c={c}", []).append(
                        [[ttft, tps] for ttft, tps, _ in done])
                    if name == "bunkhouse":
                        front_tokens += sum(n for _, _, n in done)
            print(f"overhead: round {r + 1}/{profile.overhead_rounds}", file=sys.stderr)
        front_cpu_s = sum(front_cpu.cpu_times()[:2]) - cpu_before
        protocols = _protocols(front_url, profile)
        marginal = _marginal(front_url, front_cpu, profile)
    return {"model": QWEN, "tokens": tokens, "concurrency": list(CONCURRENCY),
            "rounds": rounds, "front_cpu_s": front_cpu_s, "front_tokens": front_tokens,
            "protocols": protocols, "marginal": marginal}


def _marginal(url: str, front: psutil.Process, profile: Profile) -> dict[str, Any]:
    """The front's CPU per streamed token at the margin: per concurrency C, rounds of C short
    and C long generations at once, alternating; per round [front CPU s, content chunks] of
    each length. The slope between the two lengths leaves out what a request costs once
    (parsing, routing, the lease), which a plain average spreads over its tokens."""
    out: dict[str, Any] = {}
    for c in CONCURRENCY:
        rows: dict[str, list[list[float]]] = {"short": [], "long": []}
        for r in range(profile.marginal_rounds):
            for length, tokens in zip(("short", "long"), profile.marginal_tokens, strict=True):
                prompts = [f"[m {c} {r} {length} {i}] Write a long list of fruits, one per line."
                           for i in range(c)]
                before = sum(front.cpu_times()[:2])
                with ThreadPoolExecutor(c) as pool:
                    done = list(pool.map(lambda p, n=tokens: stream_once(url, "", p, n), prompts))
                rows[length].append([sum(front.cpu_times()[:2]) - before,
                                     sum(n for _, _, n in done)])
        out[str(c)] = rows
        print(f"overhead: marginal front CPU at {c} done", file=sys.stderr)
    return out


def _protocols(url: str, profile: Profile) -> dict[str, list[list[float]]]:
    """Per protocol, per round: [ttft_s, decode_tps] of one streamed answer through the
    front, the protocols taking turns in an order rotating between rounds. The answers are
    not fixed in length (``ignore_eos`` is llama.cpp's, not the other protocols'): the prompt
    asks for a long list, so that each runs to the token limit."""
    names = list(PROTOCOLS)
    out: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(profile.overhead_rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            prompt = f"[{name} {r}] Write a long list of fruits, one per line."
            ttft, tps, _ = stream_once(url, "", prompt, profile.overhead_tokens, name)
            out[name].append([ttft, tps])
        print(f"overhead: protocols round {r + 1}/{profile.overhead_rounds}", file=sys.stderr)
    return out
