"""KV state that survives eviction, a restart of the front and a killed worker, through
`bunkhouse serve` with the packaged models: the follow-up of a long conversation prefills
only its new turn and answers token for token as when the model was never evicted. Invalid
snapshots, made from a real one, are skipped with their reasons and the answer stays right."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.server import Server, serve
from tests.helpers import wait_for
from tests.models import GEMMA, QWEN

ONE_MODEL = "900MiB"  # Qwen (about 860 MiB here) or Gemma, never both
BOTH = "2GiB"
ADMIN = "test-admin-key"

MODULE = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(85))
CHAT = [{"role": "system", "content": "You are a careful code reviewer."},
        {"role": "user", "content": f"Here is a module:\n{MODULE}\nWhich function returns "
                                    "x * 42 + 0?"}]  # about 1,550 tokens for Qwen
QUESTION = {"role": "user", "content": "And which one returns x * 43 + 1?"}


def _config(tmp_path: Path, context: int = 16384) -> str:
    path = tmp_path / f"bunkhouse-{context}.toml"
    path.write_text(f"[defaults]\ncontext = {context}\nparallel = 2\n")
    return str(path)


def _chat(server: Server, messages: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Qwen's greedy answer and the engine's timings (prompt_n: tokens it prefilled)."""
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=600, json={
        "model": QWEN, "messages": messages, "max_tokens": 24, "temperature": 0})
    assert resp.status_code == 200, resp.text
    data = resp.json()
    # OpenAI's own field counts the prompt tokens reused, a restored snapshot's included
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == data["timings"]["cache_n"]
    return data["choices"][0]["message"]["content"], data["timings"]


def _gemma(server: Server) -> None:
    resp = httpx.post(f"{server.url}/v1/completions", timeout=600, json={
        "model": GEMMA, "prompt": "Hello", "max_tokens": 4})
    assert resp.status_code == 200, resp.text


def _kv(server: Server) -> dict[str, Any]:
    data: dict[str, Any] = server.model(QWEN)["kv_cache"]
    return data


def test_a_conversation_survives_eviction_restart_and_a_killed_worker(tmp_path: Path) -> None:
    config = _config(tmp_path)
    # The reference: a budget for both, so Qwen is never evicted.
    with serve(tmp_path / "reference", "--config", config, "--budget", BOTH) as server:
        first, timings = _chat(server, CHAT)
        assert timings["prompt_n"] > 1400  # the conversation is as long as meant
        follow_up = [*CHAT, {"role": "assistant", "content": first}, QUESTION]
        _gemma(server)
        assert server.model(QWEN)["state"] == "ready"
        expected, _ = _chat(server, follow_up)

    kv = str(tmp_path / "kv")
    with serve(tmp_path / "evicted", "--config", config, "--budget", ONE_MODEL,
               "--kv-cache-dir", kv) as server:
        assert _chat(server, CHAT)[0] == first
        _gemma(server)  # Qwen is evicted to make room, and its slot saved
        assert server.model(QWEN)["state"] == "absent"
        flush = _kv(server)["last_flush"]
        assert flush["saved"] == 1 and "making room" in flush["reason"], flush
        answer, timings = _chat(server, follow_up)
        assert answer == expected
        assert timings["prompt_n"] < 100 and timings["cache_n"] > 1400, timings
        assert _kv(server)["restored"] == 1

    with serve(tmp_path / "restarted", "--config", config, "--budget", ONE_MODEL,
               "--kv-cache-dir", kv) as server:
        answer, timings = _chat(server, follow_up)  # saved by the last front's shutdown
        assert answer == expected
        assert timings["prompt_n"] < 100 and timings["cache_n"] > 1400, timings
        # once its slot is idle, it is saved in the background; then its worker is killed
        wait_for(lambda: (_kv(server)["last_flush"] or {}).get("reason") == "idle", 120,
                 "the idle slot to be saved")
        pid = server.model(QWEN)["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: server.model(QWEN)["pid"] not in (pid, None)
                 and server.model(QWEN)["state"] == "ready", 120, "Qwen to be restarted")
        answer, timings = _chat(server, follow_up)
        assert answer == expected
        assert timings["prompt_n"] < 100 and timings["cache_n"] > 1400, timings
        stats = server.stats()["kv_cache"]
        assert stats["restored"] >= 2 and not stats["skipped"] and not stats["disabled"]


SHORT = [{"role": "user", "content": "Here are some notes:\n" + "".join(
    f"Note {i}: the shelf {i} holds {i * 3} jars.\n" for i in range(40))
    + "How many jars does shelf 7 hold?"}]  # about 600 tokens


def test_invalid_snapshots_are_skipped_with_their_reasons(tmp_path: Path) -> None:
    config = _config(tmp_path)
    kv = tmp_path / "kv"
    headers = {"authorization": f"Bearer {ADMIN}"}
    with serve(tmp_path / "made", "--config", config, "--budget", ONE_MODEL,
               "--kv-cache-dir", str(kv), "--admin-key", ADMIN) as server:
        first, _ = _chat(server, SHORT)
        follow_up = [*SHORT, {"role": "assistant", "content": first},
                     {"role": "user", "content": "And shelf 8?"}]
        flushed = httpx.post(f"{server.url}/admin/cache/flush", headers=headers, timeout=60)
        assert flushed.status_code == 200 and flushed.json()["flushed"][QWEN]["saved"] == 1
        expected, timings = _chat(server, follow_up)  # its live slot: nothing prefilled again
        assert timings["cache_n"] > 500
    model_dir = next(p for p in kv.iterdir() if p.is_dir())
    (sidecar,) = model_dir.glob("*.json")
    original = tmp_path / "original"
    original.mkdir()
    for path in (sidecar, sidecar.with_suffix(".bin")):
        shutil.copy2(path, original / path.name)

    # Three broken copies of it, and not the snapshot itself: each must be refused.
    damaged = tmp_path / "damaged"
    shutil.copytree(kv, damaged)
    folder = damaged / model_dir.name
    for path in folder.iterdir():
        path.unlink()
    meta = json.loads(sidecar.read_text())
    data = sidecar.with_suffix(".bin").read_bytes()
    for name, payload, key_model in (  # named as the store names snapshots: 40 hex digits
            ("f" * 40, data[:5000] + bytes([data[5000] ^ 0xFF]) + data[5001:], None),
            ("e" * 40, data[: len(data) // 2], None),
            ("d" * 40, data, "/models/other.gguf|1|1")):
        (folder / f"{name}.bin").write_bytes(payload)
        changed = json.loads(json.dumps(meta))
        if key_model:
            changed["key"]["model"] = key_model
        (folder / f"{name}.json").write_text(json.dumps(changed))
    with serve(tmp_path / "broken", "--config", config, "--budget", ONE_MODEL,
               "--kv-cache-dir", str(damaged)) as server:
        answer, timings = _chat(server, follow_up)
        assert answer == expected and timings["cache_n"] == 0, timings
        skipped = server.stats()["kv_cache"]["skipped"]
        assert set(skipped) == {"its checksum does not match", "made for another model file",
                                f"its data file has {len(data) // 2} bytes, not {len(data)}"}
        assert _kv(server)["restored"] == 0

    # The intact snapshot, under another context size: another KV layout.
    other = tmp_path / "other-context"
    (other / model_dir.name).mkdir(parents=True)
    (other / ".bunkhouse-kv").touch()  # a snapshot directory, moved here
    for path in original.iterdir():
        shutil.copy2(path, other / model_dir.name / path.name)
    with serve(tmp_path / "resized", "--config", _config(tmp_path, 8192), "--budget",
               ONE_MODEL, "--kv-cache-dir", str(other)) as server:
        answer, timings = _chat(server, follow_up)
        assert answer == expected and timings["cache_n"] == 0, timings
        assert server.stats()["kv_cache"]["skipped"] == {
            "made for another KV layout (slot_context 8192, here 4096)": 1}
    assert (other / model_dir.name / sidecar.name).exists()  # kept: valid for its own key


def test_a_snapshot_directory_removed_under_a_running_server_fails_no_request(
        tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    with serve(tmp_path / "removed", "--kv-cache-dir", str(kv), "--api-key", "client-k",
               "--admin-key", ADMIN) as server:
        shutil.rmtree(kv)
        for _ in range(2):  # a load, then the same worker
            resp = httpx.post(f"{server.url}/v1/completions", timeout=300,
                              headers={"authorization": "Bearer client-k"},
                              json={"model": GEMMA, "prompt": "Hello " * 300, "max_tokens": 2})
            assert resp.status_code == 200, resp.text
        unloaded = httpx.post(f"{server.url}/v1/models/{GEMMA}/unload", timeout=60,
                              headers={"authorization": f"Bearer {ADMIN}"})
        assert unloaded.status_code == 204
        gemma = httpx.get(f"{server.url}/v1/models/{GEMMA}",
                          headers={"authorization": f"Bearer {ADMIN}"}).json()
        assert gemma["state"] == "absent"
        flush = gemma["kv_cache"]["last_flush"]
        assert flush["saved"] == 1, flush  # the directory is made again
        client = httpx.get(f"{server.url}/stats",
                           headers={"authorization": "Bearer client-k"}).text
        assert str(tmp_path) not in client
