"""What several e2e modules use: a streamed request read line by line, its usage, and the
config of two Gemmas and a Qwen under a budget that holds the two Gemmas or the Qwen."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx

from bunkhouse.catalog import Catalog
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
