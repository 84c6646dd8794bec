"""Runtime control against `bunkhouse serve` with real workers and the CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from bunkhouse.catalog import Catalog
from tests.e2e.server import Server, serve
from tests.helpers import wait_for, write_tiny_gguf
from tests.models import GEMMA

ADMIN = {"authorization": "Bearer admin-e2e"}


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory, packaged_catalog: Catalog) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("admin")
    root = workdir / "root"
    root.mkdir()
    shutil.copy(packaged_catalog.get(GEMMA).path, root / "g.gguf")
    with serve(workdir, "--admin-key", "admin-e2e", "--allow-runtime-load", "--allowed-root",
               str(root), "--stop-grace", "1") as server:
        server.root = root  # type: ignore[attr-defined]
        yield server


def _complete(server: Server, model: str, tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": model, "prompt": "Once upon a time", "max_tokens": tokens})


def test_runtime_round_trip(host: Server) -> None:
    path = str(host.root / "g.gguf")  # type: ignore[attr-defined]
    resp = httpx.post(f"{host.url}/v1/models", headers=ADMIN, timeout=120,
                      json={"id": "rt", "path": path, "context": 2048, "parallel": 2,
                            "embeddings": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["state"] == "ready" and resp.json()["source"] == "runtime"
    assert resp.json()["embeddings"] is True and resp.json()["engine"] == "llama.cpp"
    pid = resp.json()["pid"]
    assert "rt" in [m["id"] for m in httpx.get(f"{host.url}/v1/models").json()["data"]]
    answer = _complete(host, "rt")
    assert answer.status_code == 200 and answer.json()["model"] == "rt"
    embedded = httpx.post(f"{host.url}/v1/embeddings", json={"model": "rt", "input": "hi"},
                          timeout=120)
    assert embedded.status_code == 200, embedded.text
    assert httpx.delete(f"{host.url}/v1/models/rt", headers=ADMIN).status_code == 204
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert _complete(host, "rt").status_code == 404


def test_delete_while_a_stream_runs_is_202_and_the_stream_finishes(host: Server) -> None:
    path = str(host.root / "g.gguf")  # type: ignore[attr-defined]
    assert httpx.post(f"{host.url}/v1/models", headers=ADMIN, timeout=120,
                      json={"id": "busy", "path": path}).status_code == 200
    started = threading.Event()

    def stream() -> list[str]:
        body = {"model": "busy", "prompt": "Once upon a time", "max_tokens": 120,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{host.url}/v1/completions", json=body,
                          timeout=120) as resp:
            lines = []
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    started.set()
            return lines

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream)
        assert started.wait(60)
        assert httpx.delete(f"{host.url}/v1/models/busy", headers=ADMIN).status_code == 202
        assert _complete(host, "busy").status_code in (404, 503)  # nothing new admitted
        lines = running.result(timeout=120)
    assert lines[-1] == "data: [DONE]" and len(lines) > 100
    wait_for(lambda: httpx.get(f"{host.url}/v1/models/busy").status_code == 404, 10,
             "the drained model to leave the catalog")


def test_a_refused_registration_and_a_delete_leave_nothing_behind(host: Server) -> None:
    """A refused registration left an empty KV snapshot directory and two /metrics series."""
    root = host.root  # type: ignore[attr-defined]
    kv = host.log.parent / "kv"  # serve's --kv-cache-dir
    before = set(kv.iterdir())
    broken = write_tiny_gguf(root / "broken.gguf")  # a header llama.cpp then refuses
    resp = httpx.post(f"{host.url}/v1/models", headers=ADMIN, timeout=120,
                      json={"id": "broken", "path": str(broken)})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "path", resp.text
    resp = httpx.post(f"{host.url}/v1/models", headers=ADMIN, timeout=120,
                      json={"id": "gone", "path": str(root / "g.gguf")})
    assert resp.status_code == 200, resp.text
    assert httpx.delete(f"{host.url}/v1/models/gone", headers=ADMIN).status_code == 204
    assert set(kv.iterdir()) == before
    metrics = httpx.get(f"{host.url}/metrics").text
    assert 'model="broken"' not in metrics and 'model="gone"' not in metrics
    ids = [m["id"] for m in httpx.get(f"{host.url}/v1/models").json()["data"]]
    assert "broken" not in ids and "gone" not in ids


def _cli(*args: str, url: str | None = None) -> subprocess.CompletedProcess[str]:
    """``bunkhouse ARGS``; with ``url``, the server named by ``$BUNKHOUSE_URL`` alone."""
    exe = shutil.which("bunkhouse")
    argv = [exe] if exe else [sys.executable, "-m", "bunkhouse"]
    env = {**os.environ, "BUNKHOUSE_URL": url} if url else None
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_cli_controls_a_catalog_model(host: Server) -> None:
    key = ("--url", host.url, "--admin-key", "admin-e2e")
    loaded = _cli("load", GEMMA, *key).stdout.strip()
    assert loaded.startswith(f"{GEMMA}: loaded: ready (pid ") and "MiB measured" in loaded, \
        loaded
    again = _cli("load", GEMMA, *key).stdout  # what changed, from the server's answer
    assert again.startswith(f"{GEMMA}: already loaded: nothing changed; ready (pid "), again
    pinned = _cli("pin", GEMMA, *key)  # what changed, and the model as it is now
    assert pinned.returncode == 0 and pinned.stdout.startswith(
        f"{GEMMA}: pinned: never evicted; ready (pid "), pinned.stdout
    again = _cli("pin", GEMMA, *key).stdout
    assert again.startswith(f"{GEMMA}: already pinned: nothing changed; ready"), again
    assert httpx.get(f"{host.url}/v1/models/{GEMMA}").json()["pinned"] is True
    unpinned = _cli("unpin", GEMMA, "--admin-key", "admin-e2e", url=host.url)
    assert unpinned.stdout.startswith(f"{GEMMA}: unpinned: "), unpinned  # $BUNKHOUSE_URL
    assert _cli("unload", GEMMA, *key).stdout.strip() == \
        f"{GEMMA}: unloaded: its worker stopped and its memory is free"
    assert httpx.get(f"{host.url}/v1/models/{GEMMA}").json()["state"] == "absent"
    again = _cli("unload", GEMMA, *key)  # absent already: nothing to unload
    assert again.returncode == 0 and again.stdout.startswith(
        f"{GEMMA}: nothing to unload: it holds no worker and no memory; not loaded"), again
    refused = _cli("pin", GEMMA, "--url", host.url)
    assert refused.returncode == 1 and "401" in refused.stderr
