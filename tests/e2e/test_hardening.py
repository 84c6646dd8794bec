"""A hostile client against `bunkhouse serve` with keys and runtime loading on: model files
checked at every load, no internals shown to a client key, no DNS rebinding."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import anthropic
import httpx
import psutil
import pytest

from bunkhouse.catalog import Catalog
from tests.e2e.server import Server, serve
from tests.helpers import write_tiny_gguf
from tests.models import GEMMA

ADMIN = {"authorization": "Bearer admin-k"}
CLIENT = {"authorization": "Bearer client-k"}
SECRET = "SECRET-CONTENT-OF-A-PRIVATE-FILE"


def _maps_of_workers(server: Server) -> str:
    maps = ""
    for proc in server.workers():
        with contextlib.suppress(OSError):
            maps += Path(f"/proc/{proc.pid}/maps").read_text()
    return maps


def _load(server: Server, model_id: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/models/{model_id}/load", headers=ADMIN, timeout=180)


def _unload(server: Server, model_id: str) -> None:
    resp = httpx.post(f"{server.url}/v1/models/{model_id}/unload", headers=ADMIN, timeout=60)
    assert resp.status_code in (200, 204), resp.text  # 200: absent already


def _no_internals(text: str, tmp_path: Path) -> None:
    assert SECRET not in text and str(tmp_path) not in text and "/proc/" not in text, text


def test_model_files_are_checked_at_every_load_and_clients_see_no_internals(
        tmp_path: Path, packaged_catalog: Catalog) -> None:
    gemma = packaged_catalog.get(GEMMA).path
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    shutil.copy(gemma, root / "sub" / "t.gguf")
    (outside / "secret.txt").write_text(SECRET * 1000)
    os.symlink(gemma, outside / "t.gguf")  # a real GGUF, outside the roots
    broken = write_tiny_gguf(tmp_path / "models" / "broken.gguf")  # no weights: cannot load
    with serve(tmp_path, "--no-packaged", "--models-dir", str(broken.parent),
               "--admin-key", "admin-k", "--api-key", "client-k", "--allow-runtime-load",
               "--allowed-root", str(root)) as server:
        path = str(root / "sub" / "t.gguf")
        resp = httpx.post(f"{server.url}/v1/models", headers=ADMIN, timeout=180,
                          json={"id": "t", "path": path, "context": 512, "parallel": 1})
        assert resp.status_code == 200, resp.text
        _unload(server, "t")

        # The file swapped for a symlink to a file outside the roots: refused at load.
        os.replace(path, root / "kept.gguf")
        os.symlink(outside / "secret.txt", path)
        resp = _load(server, "t")
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "model_load_failed"
        assert SECRET not in _maps_of_workers(server) and not server.model_workers("client-k")
        client_view = httpx.get(f"{server.url}/v1/models/t", headers=CLIENT).json()
        assert client_view["state"] == "failed" and "last_error_detail" not in client_view
        _no_internals(json.dumps(client_view), tmp_path)
        chat = httpx.post(f"{server.url}/v1/completions", headers=CLIENT, timeout=60,
                          json={"model": "t", "prompt": "a", "max_tokens": 2})
        assert chat.status_code == 503
        _no_internals(chat.text, tmp_path)
        admin_view = httpx.get(f"{server.url}/v1/models/t", headers=ADMIN).json()
        assert str(outside / "secret.txt") in admin_view["last_error_detail"]

        # Put back, it loads again; then a directory above it swapped for a symlink.
        os.replace(root / "kept.gguf", path)
        assert _load(server, "t").status_code == 200
        _unload(server, "t")
        os.rename(root / "sub", root / "sub.orig")
        os.symlink(outside, root / "sub")
        resp = _load(server, "t")
        assert resp.status_code == 503, resp.text
        assert str(gemma) not in _maps_of_workers(server) and not server.model_workers("client-k")

        # A model whose worker fails: its output (with server paths) only for the admin key.
        resp = httpx.post(f"{server.url}/v1/completions", headers=CLIENT, timeout=120,
                          json={"model": "broken", "prompt": "a", "max_tokens": 2})
        assert resp.status_code == 503 and "failed to load" in resp.json()["error"]["message"]
        _no_internals(resp.text, tmp_path)
        listing = httpx.get(f"{server.url}/v1/models", headers=CLIENT).text
        _no_internals(listing, tmp_path)
        stats = httpx.get(f"{server.url}/stats", headers=CLIENT).text
        _no_internals(stats, tmp_path)
        admin_view = httpx.get(f"{server.url}/v1/models/broken", headers=ADMIN).json()
        assert "llama" in admin_view["last_error_detail"].lower()
        # Anthropic's API names the failure api_error (not overloaded_error, its type for a
        # lack of capacity), answered before a stream or in one alike (docs/protocols.md)
        with anthropic.Anthropic(base_url=server.url, api_key="client-k",
                                 max_retries=0) as sdk:
            ask: list[anthropic.types.MessageParam] = [{"role": "user", "content": "a"}]
            with pytest.raises(anthropic.APIStatusError) as whole:
                sdk.messages.create(model="broken", max_tokens=2, messages=ask)
            with pytest.raises(anthropic.APIStatusError) as streamed, \
                    sdk.messages.stream(model="broken", max_tokens=2, messages=ask) as stream:
                stream.until_done()
            for failed in (whole, streamed):
                assert failed.value.body["error"]["type"] == "api_error"  # type: ignore[index]

        # Failed registrations leave nothing behind; /health shows no models without a key.
        for i in range(20):
            resp = httpx.post(f"{server.url}/v1/models", headers=ADMIN, timeout=60,
                              json={"id": f"bad{i}", "path": str(root / "nope.gguf")})
            assert resp.status_code == 400
        health = httpx.get(f"{server.url}/health", headers=CLIENT).json()
        assert set(health["models"]) == {"t", "broken"}
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_rebinding_and_cross_site_requests_are_refused_but_curl_works(
        tmp_path: Path) -> None:
    with serve(tmp_path, "--preload", GEMMA) as server:
        body = json.dumps({"model": GEMMA, "prompt": "The sky is", "max_tokens": 2})
        rebound = httpx.post(f"{server.url}/v1/completions", content=body, timeout=60,
                             headers={"host": "attacker.example:8080",
                                      "content-type": "application/json"})
        assert rebound.status_code == 403 and "--allowed-host" in rebound.text
        cross = httpx.post(f"{server.url}/v1/completions", content=body, timeout=60,
                           headers={"content-type": "text/plain",
                                    "origin": "https://attacker.example"})
        assert cross.status_code == 403
        # `curl -d` sends a form content type and no Origin: served.
        curl = httpx.post(f"{server.url}/v1/completions", content=body, timeout=120,
                          headers={"content-type": "application/x-www-form-urlencoded"})
        assert curl.status_code == 200 and curl.json()["choices"][0]["text"]
        local = httpx.get(f"http://localhost:{server.url.rsplit(':', 1)[1]}/health")
        assert local.status_code == 200
        _amplification_and_bad_text_are_400(server)


def _amplification_and_bad_text_are_400(server: Server) -> None:
    gemma, url = GEMMA, server.url
    front = psutil.Process(server.proc.pid)
    for route, body, param in [
        ("completions", {"prompt": "a", "max_tokens": 16, "n_probs": 300000}, "n_probs"),
        ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
                              "top_logprobs": 300000}, "top_logprobs"),
        ("completions", {"prompt": "a", "logit_bias": {str(i): 1 for i in range(5000)}},
         "logit_bias"),
        ("completions", {"prompt": "a", "stop": ["x"] * 50}, "stop"),
        ("embeddings", {"input": ["a"] * 3000}, "input"),
        ("completions", {"prompt": "\ud800 a", "max_tokens": 2}, "prompt"),
        ("chat/completions", {"messages": [{"role": "user", "content": "a\udfff"}]},
         "messages.0.content"),
        ("embeddings", {"input": ["ok", "\ud800"]}, "input.1"),
        ("completions", {"prompt": "x", "max_tokens": 2,
                         "grammar": 'root ::= (("a"{0,30}){0,30}){0,30}'}, "grammar"),
        ("completions", {"prompt": "x", "max_tokens": 2, "json_schema": {
            "type": "string", "pattern": "^((a{0,45}){0,45}){0,45}$"}}, "json_schema"),
    ]:
        raw = json.dumps({"model": gemma, **body}).replace("\\\\u", "\\u")
        resp = httpx.post(f"{url}/v1/{route}", content=raw, timeout=60,
                          headers={"content-type": "application/json"})
        assert resp.status_code == 400, (route, param, resp.text)
        assert resp.json()["error"]["param"] == param, resp.text
    # At the caps, answers are bounded and the front stays small while relaying them.
    before = front.memory_info().rss
    resp = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": gemma, "prompt": "a", "max_tokens": 16, "n_probs": 20})
    assert resp.status_code == 200 and len(resp.content) < 1 << 20
    assert front.memory_info().rss - before < 64 << 20
    flat = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": gemma, "prompt": "x", "max_tokens": 2, "grammar": 'root ::= "a"{0,5000}'})
    assert flat.status_code == 200, flat.text  # a flat repetition costs little: served


def test_hostile_model_files_are_skipped_and_scanned_off_the_event_loop(
        tmp_path: Path) -> None:
    import struct
    import subprocess
    import sys
    import threading

    from gguf import GGUFValueType

    from bunkhouse.gguf.meta import MAX_HEADER_ITEMS
    from tests import hostile_gguf
    hostile = hostile_gguf.write_all(tmp_path / "models")
    listing = subprocess.run([sys.executable, "-m", "bunkhouse", "models", "--no-packaged",
                              "--models-dir", str(tmp_path / "models")],
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0 and "Traceback" not in listing.stderr, listing.stderr
    assert "skipping" in listing.stderr
    # The most items a header may hold (its key is one), each an empty string: the slowest
    # scan, then a 400.
    root = tmp_path / "root"
    root.mkdir()
    items = MAX_HEADER_ITEMS - 1
    slow = root / "slow.gguf"
    with slow.open("wb") as f:
        f.write(hostile_gguf.header([hostile_gguf.kv("x", GGUFValueType.ARRAY, b"")]))
        f.write(struct.pack("<IQ", GGUFValueType.STRING, items))
        f.write(bytes(8 * items))
    with serve(tmp_path, "--no-packaged", "--models-dir", str(tmp_path / "models"),
               "--admin-key", "admin-k", "--allow-runtime-load", "--allowed-root",
               str(root)) as server:
        answered: list[int] = []
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                answered.append(httpx.get(f"{server.url}/health", timeout=60).status_code)

        poller = threading.Thread(target=poll)
        poller.start()
        front = psutil.Process(server.proc.pid)
        before = front.memory_info().rss
        try:
            for i, path in enumerate([slow, *hostile]):
                target = root / f"h{i}.gguf"
                if path != slow:
                    os.link(path, target)  # sparse files stay sparse
                resp = httpx.post(f"{server.url}/v1/models", headers=ADMIN, timeout=120,
                                  json={"id": f"r{i}", "path": str(slow if path == slow
                                                                   else target)})
                error = resp.json()["error"]
                assert (resp.status_code, error["param"]) == (400, "path") or \
                    (resp.status_code, error["code"]) == (503, "model_too_large"), resp.text
        finally:
            done.set()
            poller.join()
        assert answered and set(answered) == {200}
        # a sparse file declaring a 1 GiB chat template once took the front to 2 GiB
        status = Path(f"/proc/{front.pid}/status").read_text()
        peak = int(status.split("VmHWM:")[1].split()[0]) << 10
        assert peak - before < 256 << 20


def test_every_part_of_a_split_model_is_checked_and_counted(
        tmp_path: Path, split_gemma: tuple[Path, Path]) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    first, second = (Path(shutil.copy(part, root / f"sp-0000{i}-of-00002.gguf"))
                     for i, part in enumerate(split_gemma, 1))
    total = first.stat().st_size + second.stat().st_size
    shutil.copy(second, outside / second.name)
    other = shutil.copy(first, root / "ot-00001-of-00002.gguf")
    os.symlink(outside / second.name, root / "ot-00002-of-00002.gguf")
    with serve(tmp_path, "--no-packaged", "--admin-key", "admin-k", "--allow-runtime-load",
               "--allowed-root", str(root)) as server:
        resp = httpx.post(f"{server.url}/v1/models", headers=ADMIN, timeout=180,
                          json={"id": "sp", "path": str(first), "context": 512, "parallel": 1})
        assert resp.status_code == 200, resp.text
        assert resp.json()["size_bytes"] == total and resp.json()["estimated_bytes"] > total
        answer = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": "sp", "prompt": "The sky is", "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
        assert str(outside) not in _maps_of_workers(server)
        _unload(server, "sp")
        # A part that leads outside the roots: refused at registration and at every load.
        resp = httpx.post(f"{server.url}/v1/models", headers=ADMIN, timeout=60,
                          json={"id": "ot", "path": str(other)})
        assert resp.status_code == 403 and resp.json()["error"]["param"] == "path"
        os.replace(second, root / "kept.gguf")
        os.symlink(outside / second.name, second)
        resp = _load(server, "sp")
        assert resp.status_code == 503, resp.text
        assert str(outside) not in _maps_of_workers(server) and not server.model_workers("client-k")
        os.replace(root / "kept.gguf", second)
        assert _load(server, "sp").status_code == 200
