"""The benchmark harness runs end to end: every section against real servers and models, on
the tiny profile (a few tokens, one round), and writes the page, the plots and the results.

It measures nothing worth reading and asserts no figure: benchmarks are never assertions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_harness_runs_every_section_and_writes_the_docs(tmp_path: Path) -> None:
    env = {**os.environ, "BUNKHOUSE_BENCH_LOGS": str(tmp_path / "logs")}
    env.pop("BUNKHOUSE_LLAMA_SERVER", None)  # the router needs a binary CI does not build
    harness = subprocess.Popen(
        [sys.executable, "-m", "benchmarks", "run", "--profile", "tiny",
         "--out", str(tmp_path / "docs"), "--llama-server", ""],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)  # its own group: the servers it started go with it
    try:
        _, stderr = harness.communicate(timeout=840)
    except subprocess.TimeoutExpired:
        os.killpg(harness.pid, signal.SIGKILL)  # not only the harness: no server outlives it
        harness.communicate()
        raise
    assert harness.returncode == 0, stderr[-4000:]

    results = json.loads((tmp_path / "docs" / "benchmarks" / "results.json").read_text())
    assert results["errors"] == {}
    assert set(results["sections"]) == {"overhead", "throughput", "hol", "swap", "kv",
                                        "reliability", "transcribe", "adapters",
                                        "speculative", "llama_server", "ray", "relay",
                                        "mlx"}
    remount = results["sections"]["adapters"]["remount"]  # the conversation kept its KV state
    assert remount["follow_up_prompt_n"] < remount["follow_up_cache_n"], remount
    assert results["sections"]["hol"]["runs"]["time slice"][0]["long_tokens"] == 40
    phases = results["sections"]["swap"]["engine_phases"][0]["xllamacpp"]
    assert all(p["total"] > 0 for p in phases.values())
    assert set(results["sections"]["overhead"]["marginal"]) == {"1", "4"}
    kv = results["sections"]["kv"]["lengths"]["300"]["bunkhouse"]
    assert kv["restored"] == 1 and kv["follow_up_prompt_n"] < kv["first_prompt_n"]
    heard = results["sections"]["transcribe"]["texts"]["bunkhouse"].lower()
    assert "fox" in heard and "lazy" in heard
    relay = results["sections"]["relay"]["runs"]  # every stream had all its tokens
    assert set(relay) == {"chat", "messages", "responses"} and set(relay["chat"]) == {
        "1", "4", "16"} and set(relay["chat"]["16"]) == {"engine", "after"}
    flood = results["sections"]["reliability"]["flood"][0]
    assert sum(flood["statuses"].values()) == flood["requests"]

    page = (tmp_path / "docs" / "benchmarks.md").read_text()
    for heading in ("## Goals", "## 1. Front overhead", "## 2. Aggregate throughput",
                    "## 3. Swapping models", "## 4. Memory", "## 5. Reliability",
                    "## 6. A conversation's follow-up after eviction",
                    "## 7. Transcription", "## 8. Head-of-line blocking across models",
                    "## 9. Where a cold load's time goes", "## 10. LoRA adapters",
                    "## 11. Speculative decoding", "## 12. The llama-server engine",
                    "## 13. A worker on a Ray node", "## 14. The relay at GPU rates",
                    "## 15. The MLX engine"):
        assert heading in page
    assert "xllamacpp disabled the router" in page  # the reason the wheel cannot be the peer
    for png in ("throughput.png", "swap-timeline.png"):
        assert (tmp_path / "docs" / "benchmarks" / png).read_bytes()[:4] == b"\x89PNG"
