"""What several e2e modules use: a streamed request read line by line, its usage, a greedy
chat answer, a model's worker process, and the
config of two Gemmas and a Qwen under a budget that holds the two Gemmas or the Qwen."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import psutil

from bunkhouse.catalog import Catalog
from tests.e2e.server import Server
from tests.models import GEMMA, QWEN


def post_stream(url: str, path: str, body: dict[str, Any],
                first: threading.Event | None = None, headers: dict[str, str] | None = None,
                done: threading.Event | None = None) -> tuple[int, list[str]]:
    """POST a streamed request; every SSE line, in order. Raises if the body is truncated.
    ``first`` is set at its first line, ``done`` at its ``[DONE]``."""
    lines: list[str] = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True},
                      headers=headers, timeout=300) as resp:
        for line in resp.iter_lines():
            if line:
                lines.append(line)
                if first is not None:
                    first.set()
                if done is not None and line == "data: [DONE]":
                    done.set()
    return resp.status_code, lines


def greedy_chat(server: Server, model: str, messages: list[dict[str, Any]],
                tokens: int = 8) -> dict[str, Any]:
    """A plain chat answer of ``model`` at temperature 0 (asserted a 200)."""
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=600, json={
        "model": model, "messages": messages, "max_tokens": tokens, "temperature": 0})
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()
    return data


def model_worker(server: Server, model: str) -> psutil.Process:
    """The worker process serving ``model`` now (it must be loaded)."""
    pid = server.model(model)["pid"]
    assert pid, server.model(model)
    return psutil.Process(pid)


def kill_mid_stream(server: Server, body: dict[str, Any]) -> tuple[int, list[str], int]:
    """Stream the chat ``body`` (its ``model`` loaded), SIGKILL that model's worker at the
    stream's first line; the stream's status and lines, and the killed worker's pid."""
    victim = model_worker(server, body["model"])
    first = threading.Event()
    result: dict[str, Any] = {}

    def stream() -> None:
        result["status"], result["lines"] = post_stream(server.url, "/v1/chat/completions",
                                                        body, first=first)

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(300)
    victim.send_signal(signal.SIGKILL)
    reader.join(300)
    return result["status"], result["lines"], victim.pid


def stream_usage(lines: list[str]) -> dict[str, Any]:
    for line in reversed(lines):
        if line.startswith("data: {") and '"usage"' in line:
            usage: dict[str, Any] | None = json.loads(line[6:]).get("usage")
            if usage:
                return usage
    raise AssertionError(f"no usage in the stream: {lines[-3:]}")


def stale_plan_config(tmp_path: Path, catalog: Catalog) -> Path:
    gemma, qwen = catalog.get(GEMMA).path, catalog.get(QWEN).path
    config = tmp_path / "bunkhouse.toml"
    config.write_text(f"""
include_packaged = false

[defaults]
context = 2048
parallel = 1

[[models]]
id = "g1"
path = "{gemma}"

[[models]]
id = "g2"
path = "{gemma}"

[[models]]
id = "q"
path = "{qwen}"
""")
    return config
