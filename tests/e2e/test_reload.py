"""The configuration re-read while serving: SIGHUP adds a model and removes one that is
streaming (the stream completes, then the model is gone), a broken file is refused with its
error while the old configuration keeps serving, a changed setting is taken at the next load,
and an operator switches the default model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bunkhouse.catalog import Catalog
from tests.e2e.server import Server, serve
from tests.helpers import wait_for
from tests.models import GEMMA, QWEN

ADMIN = {"authorization": "Bearer adm"}


def _write(config: Path, text: str) -> None:
    tmp = config.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, config)  # as an editor saves: never half a file


def _ids(server: Server) -> set[str]:
    data = httpx.get(f"{server.url}/v1/models", headers=ADMIN).json()["data"]
    return {m["id"] for m in data}


def _stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return events


def test_sighup_adds_removes_mid_stream_and_refuses_a_broken_file(
        tmp_path: Path, packaged_catalog: Catalog) -> None:
    gemma = packaged_catalog.get(GEMMA).path
    qwen = packaged_catalog.get(QWEN).path
    config = tmp_path / "bunkhouse.toml"
    _write(config, f'include_packaged = false\n[[models]]\nid = "g"\npath = "{gemma}"\n'
                   'parallel = 2\ncontext = 2048\n')
    with serve(tmp_path / "serve", "--config", str(config), "--admin-key", "adm",
               "--no-source", "hf_cache") as server:
        assert _ids(server) == {"g"}
        body = {"model": "g", "prompt": "Once upon a time", "max_tokens": 150,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(_stream, server.url, body)
            wait_for(lambda: httpx.get(f"{server.url}/v1/models/g").json()["running"] == 1,
                     300, "the stream to start")
            # g removed mid-stream, q added with an alias
            _write(config, f'include_packaged = false\n[[models]]\nid = "q"\npath = "{qwen}"\n'
                           'aliases = ["coder"]\ncontext = 2048\n')
            server.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: "q" in _ids(server), 120, "the added model to appear")
            events = streaming.result(timeout=900)
        assert events[-1]["usage"]["completion_tokens"] == 150  # the stream completed
        wait_for(lambda: _ids(server) == {"q"}, 120, "the removed model to go")
        gone = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"model": "g", "prompt": "Hi", "max_tokens": 1})
        assert gone.status_code == 404
        answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
            "model": "coder", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Say hi."}]})
        assert answer.status_code == 200, answer.text

        # a broken file is refused with its error; the running configuration serves on
        _write(config, 'include_packaged = false\n[[models]]\nid = "q"\npath = \n')
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "configuration not reloaded (SIGHUP)" in server.log.read_text(),
                 120, "the broken file to be refused")
        refused = httpx.post(f"{server.url}/admin/reload", headers=ADMIN, timeout=120)
        assert refused.status_code == 400
        assert "not valid TOML" in refused.json()["error"]["message"]
        assert _ids(server) == {"q"}
        again = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
            "model": "q", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert again.status_code == 200

        # a changed setting is taken at the next load; an operator switches the default
        _write(config, f'include_packaged = false\n[[models]]\nid = "q"\npath = "{qwen}"\n'
                       f'context = 4096\n[[models]]\nid = "g"\npath = "{gemma}"\n')
        change = httpx.post(f"{server.url}/admin/reload", headers=ADMIN, timeout=120).json()
        assert change == {"added": ["g"], "removed": [], "changed": ["q"]}
        assert httpx.get(f"{server.url}/v1/models/q").json()["context"] == 2048  # loaded
        httpx.post(f"{server.url}/v1/models/q/unload", headers=ADMIN, timeout=120)
        assert httpx.get(f"{server.url}/v1/models/q").json()["context"] == 4096
        assert httpx.post(f"{server.url}/admin/default", json={"model": "g"}).status_code \
            == 401  # an admin call
        switched = subprocess.run(
            [sys.executable, "-m", "bunkhouse", "default", "g", "--url", server.url,
             "--admin-key", "adm"], capture_output=True, text=True, timeout=120)
        assert switched.returncode == 0 and "default model: g" in switched.stdout
        assert httpx.get(f"{server.url}/v1/models/g").json()["default"] is True
        reloaded = subprocess.run(
            [sys.executable, "-m", "bunkhouse", "reload", "--url", server.url,
             "--admin-key", "adm"], capture_output=True, text=True, timeout=120)
        assert reloaded.returncode == 0 and "nothing changed" in reloaded.stdout
        assert httpx.get(f"{server.url}/v1/models/g").json()["default"] is True  # kept


def test_a_refused_reload_tells_clients_no_path_and_an_emptied_key_file_is_refused(
        tmp_path: Path) -> None:
    """Client keys read /stats and /admin/events: a refused reload's event says so without
    the server's paths, which the log and admin keys get. A reload whose key file has come to
    hold no key is refused: the server never opens; one whose key file holds another key
    applies it, and the old key is refused."""
    config, keys = tmp_path / "bunkhouse.toml", tmp_path / "client.keys"
    _write(config, "include_packaged = false\n")
    keys.write_text("client-1\n")
    client = {"authorization": "Bearer client-1"}
    with serve(tmp_path / "serve", "--config", str(config), "--api-key-file", str(keys),
               "--admin-key", "adm", "--spare-worker", "off", "--no-source", "hf_cache",
               "--no-source", "ollama", "--no-source", "lmstudio") as server:
        _write(config, "include_packaged = \n")
        refused = httpx.post(f"{server.url}/admin/reload", headers=ADMIN, timeout=120)
        assert refused.status_code == 400 and str(config) in refused.json()["error"]["message"]
        keys.write_text("# the key was here\n\n")
        _write(config, "include_packaged = false\n")
        refused = httpx.post(f"{server.url}/admin/reload", headers=ADMIN, timeout=120)
        assert refused.status_code == 400 and str(keys) in refused.json()["error"]["message"]
        assert httpx.get(f"{server.url}/v1/models").status_code == 401  # still closed
        assert httpx.get(f"{server.url}/v1/models", headers=client).status_code == 200

        stats = httpx.get(f"{server.url}/stats", headers=client).json()
        seen = [e for e in stats["events"] if e["kind"] == "config refused"]
        assert len(seen) == 2 and str(tmp_path) not in json.dumps(stats)
        assert all("detail" not in e for e in seen)
        with httpx.stream("GET", f"{server.url}/admin/events?after=0", headers=client,
                          timeout=60) as stream:
            lines = []
            for line in stream.iter_lines():
                lines.append(line)
                if line.startswith("data:") and '"seq": 2' in line:
                    break
        assert "config refused" in "\n".join(lines) and str(tmp_path) not in "\n".join(lines)
        admin = httpx.get(f"{server.url}/stats", headers=ADMIN).json()
        details = [e["detail"] for e in admin["events"] if e["kind"] == "config refused"]
        assert str(config) in details[0] and str(keys) in details[1]
        assert str(keys) in server.log.read_text()

        # a leaked key is revoked by editing its file and reloading
        keys.write_text("client-2\n")
        assert httpx.post(f"{server.url}/admin/reload", headers=ADMIN,
                          timeout=120).status_code == 200
        assert httpx.get(f"{server.url}/v1/models", headers=client).status_code == 401
        assert httpx.get(f"{server.url}/v1/models", headers={
            "authorization": "Bearer client-2"}).status_code == 200
