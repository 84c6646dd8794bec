"""Pulls from the Hugging Face hub end to end, against a local hub (tests/hub.py, reached
through ``HF_ENDPOINT``: real ``huggingface_hub``, real HTTP) serving the packaged models as
repos: Qwen as one file, Gemma split into two parts, and Gemma again under repos with faults.

`bunkhouse pull` of each repo prints the id it is served under, and `bunkhouse serve` (with
``hf_cache = false``: the pull's record is what serves them) answers through the openai SDK
under that id and under the name pulled. Against the running server, the real ``ollama``
client pulls a repo whose first download is cut half way (resumed, Ollama's statuses in
Ollama's order) and chats on it without a restart. A file with flipped bytes is refused and
deleted; a file larger than the disk is refused before a byte is fetched; two pulls of one
file make one download; a client key cannot pull; a pull is cancelled, and one under way
when the server stops is cancelled by the stop. The shell's progress bar, in a pty."""

from __future__ import annotations

import dataclasses
import json
import os
import pty
import select
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from bunkhouse.catalog import Catalog
from tests.e2e.server import Server, serve
from tests.helpers import served
from tests.hub import Hub, hub_file
from tests.models import GEMMA, QWEN

pytestmark = pytest.mark.slow

ORG = "bunkhouse-test"
QWEN_REPO = f"{ORG}/Qwen2.5-Coder-0.5B-Instruct-GGUF"
GEMMA_REPO = f"{ORG}/gemma-3-270m-GGUF"  # split in two
GEMMA_FILE = "gemma-3-270m-Q4_K_M.gguf"
QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
ADMIN, CLIENT = "pull-admin", "pull-client"


class LocalHub:
    def __init__(self, hub: Hub, url: str, env: dict[str, str], root: Path) -> None:
        self.hub, self.url, self.env, self.root = hub, url, env, root

    def pull(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "bunkhouse", "pull", *args],
                              env=self.env, capture_output=True, text=True, timeout=timeout)

    def blobs(self, repo: str) -> list[Path]:
        folder = self.root / "hf" / f"models--{repo.replace('/', '--')}" / "blobs"
        return sorted(folder.iterdir()) if folder.is_dir() else []


@pytest.fixture(scope="module")
def local_hub(tmp_path_factory: pytest.TempPathFactory, packaged_catalog: Catalog,
              split_gemma: tuple[Path, Path]) -> Iterator[LocalHub]:
    root = tmp_path_factory.mktemp("hub")
    qwen, gemma = packaged_catalog.get(QWEN).path, packaged_catalog.get(GEMMA).path
    parts = split_gemma
    hub = Hub()
    chat = hub_file(qwen)
    hub.add(QWEN_REPO, {QWEN_FILE: chat, "README.md": hub_file(Path(__file__))})
    hub.add(GEMMA_REPO, {p.name: hub_file(p) for p in parts})
    hub.add(f"{ORG}/cut-GGUF", {QWEN_FILE: dataclasses.replace(chat, drop_after=chat.size // 2)})
    whole = hub_file(gemma)
    for repo in ("flipped", "huge", "shared", "slow", "bar", "stopped", "console"):
        hub.add(f"{ORG}/{repo}-GGUF", {GEMMA_FILE: dataclasses.replace(whole)})
    files = {r: f[GEMMA_FILE] for r, f in hub.repos.items() if GEMMA_FILE in f}
    files[f"{ORG}/flipped-GGUF"].flip = True
    files[f"{ORG}/huge-GGUF"].declared = 2**50  # a petabyte
    files[f"{ORG}/slow-GGUF"].delay_s = 0.05
    files[f"{ORG}/stopped-GGUF"].delay_s = 0.05
    with served(hub.app()) as url:
        env = {**os.environ, "HF_ENDPOINT": url, "HF_HUB_CACHE": str(root / "hf"),
               "BUNKHOUSE_DATA_DIR": str(root / "data"), "HF_HUB_DISABLE_TELEMETRY": "1"}
        env.pop("HF_TOKEN", None)
        yield LocalHub(hub, url, env, root)


@pytest.fixture(scope="module")
def pulled_ids(local_hub: LocalHub) -> dict[str, str]:
    """`bunkhouse pull` of each repo before the server starts: the ids printed."""
    ids = {}
    for name in (QWEN_REPO, f"hf.co/{GEMMA_REPO}:q4_k_m"):
        done = local_hub.pull(name)
        assert done.returncode == 0, done.stderr
        ids[name] = done.stdout.strip().splitlines()[-1]
        assert "served as" in done.stderr
    return ids


@pytest.fixture(scope="module")
def server(local_hub: LocalHub, pulled_ids: dict[str, str]) -> Iterator[Server]:
    workdir = local_hub.root / "serve"
    workdir.mkdir()
    config = workdir / "bunkhouse.toml"
    config.write_text("hf_cache = false\nollama = false\nlmstudio = false\n"
                      "include_packaged = false\n[defaults]\ncontext = 2048\n")
    with serve(workdir, "--config", str(config), "--admin-key", ADMIN, "--api-key", CLIENT,
               "--spare-worker", "off", env=local_hub.env) as s:
        yield s


def _admin(key: str = ADMIN) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_pulled_models_are_served_under_the_printed_id_and_the_name_pulled(
        server: Server, pulled_ids: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=CLIENT, timeout=300)
    listed = {m.id for m in client.models.list()}
    assert set(pulled_ids.values()) <= listed, listed
    gemma = pulled_ids[f"hf.co/{GEMMA_REPO}:q4_k_m"]
    assert gemma == f"{GEMMA_REPO}:gemma-3-270m-Q4_K_M"  # the split model, once
    answer = client.completions.create(model=gemma, prompt="The sky is", max_tokens=8)
    assert answer.choices[0].text
    typed = client.completions.create(model=f"huggingface.co/{GEMMA_REPO}:q4_k_m",
                                      prompt="The sky is", max_tokens=2)  # as it was typed
    assert typed.model == gemma
    qwen = client.chat.completions.create(
        model=f"hf.co/{QWEN_REPO}:Q4_K_M", max_tokens=8,
        messages=[{"role": "user", "content": "Say hello."}])
    assert qwen.model == pulled_ids[QWEN_REPO] and qwen.choices[0].message.content


def test_ollama_pulls_a_cut_download_and_chats_on_it_without_a_restart(
        server: Server, local_hub: LocalHub) -> None:
    name = f"hf.co/{ORG}/cut-GGUF:Q4_K_M"
    with ollama.Client(host=server.url, headers=_admin(), timeout=300) as client:
        steps = [dict(s) for s in client.pull(name, stream=True)]
    statuses = [s["status"] for s in steps]
    digest = "sha256:" + local_hub.hub.repos[f"{ORG}/cut-GGUF"][QWEN_FILE].sha256
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    pulling = [s for s in steps if s["status"] == f"pulling {digest}"]
    assert pulling and pulling[-1]["completed"] == pulling[-1]["total"] > 0
    assert statuses.index(f"pulling {digest}") < statuses.index("verifying sha256 digest")
    assert local_hub.hub.gets[f"{ORG}/cut-GGUF/{QWEN_FILE}"] == 1  # resumed, not begun again
    with ollama.Client(host=server.url, headers=_admin(CLIENT), timeout=300) as client:
        reply = client.chat(model=name, messages=[{"role": "user", "content": "Say hello."}],
                            options={"num_predict": 8})
    assert reply.message.content


def test_a_file_that_fails_its_checksum_is_refused_and_deleted(
        server: Server, local_hub: LocalHub) -> None:
    answer = httpx.post(f"{server.url}/admin/pull", headers=_admin(), timeout=300,
                        json={"model": f"{ORG}/flipped-GGUF", "stream": False})
    assert answer.status_code == 502, answer.text
    assert "failed its checksum" in answer.json()["error"]["message"]
    assert not local_hub.blobs(f"{ORG}/flipped-GGUF")
    listed = httpx.get(f"{server.url}/v1/models", headers=_admin()).json()["data"]
    assert not [m for m in listed if "flipped" in m["id"]]


def test_a_pull_larger_than_the_disk_is_refused_before_a_byte(
        server: Server, local_hub: LocalHub) -> None:
    answer = httpx.post(f"{server.url}/admin/pull", headers=_admin(), timeout=300,
                        json={"model": f"{ORG}/huge-GGUF", "stream": False})
    assert answer.status_code == 507, answer.text
    message = answer.json()["error"]["message"]
    assert "needs 1,073,741,824 MiB" in message and "MiB free" in message
    assert local_hub.hub.gets[f"{ORG}/huge-GGUF/{GEMMA_FILE}"] == 0
    assert not local_hub.blobs(f"{ORG}/huge-GGUF")
    missing = httpx.post(f"{server.url}/api/pull", headers=_admin(), timeout=60,
                         json={"model": f"hf.co/{ORG}/huge-GGUF:Q8_0"})
    assert missing.status_code == 404 and "its quantizations: Q4_K_M" in missing.json()["error"]


def test_two_pulls_of_one_file_make_one_download(server: Server, local_hub: LocalHub) -> None:
    results: list[Any] = []

    def pull(name: str) -> None:
        results.append(httpx.post(f"{server.url}/admin/pull", headers=_admin(), timeout=300,
                                  json={"model": name, "stream": False}))

    # one name twice (one pull), and another name for the same file (the hub client's lock)
    names = [f"{ORG}/shared-GGUF", f"{ORG}/shared-GGUF", f"{ORG}/shared-GGUF:q4_k_m"]
    threads = [threading.Thread(target=pull, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [r.status_code for r in results] == [200] * 3, [r.text for r in results]
    assert len({r.json()["id"] for r in results}) == 1
    assert local_hub.hub.gets[f"{ORG}/shared-GGUF/{GEMMA_FILE}"] == 1


def test_a_client_key_cannot_pull(server: Server) -> None:
    for route in ("/admin/pull", "/api/pull"):
        answer = httpx.post(f"{server.url}{route}", headers=_admin(CLIENT),
                            json={"model": f"{ORG}/bar-GGUF"})
        assert answer.status_code == 403, answer.text
    pulls = httpx.get(f"{server.url}/admin/pull", headers=_admin()).json()["pulls"]
    assert all("bar-GGUF" not in p["model"] for p in pulls), pulls


def test_the_console_pulls_with_a_bar(server: Server) -> None:
    """The console's pull box, in headless chromium: the admin key entered, a repo pulled,
    its row's bar full and its status naming the served id, which the model table lists."""
    from tests.e2e.test_console import console_page

    with console_page(server.url) as (page, errors):
        page.fill("#client-key", CLIENT)
        page.fill("#admin-key", ADMIN)
        page.click("#keys button")
        page.fill("#pull-model", f"{ORG}/console-GGUF")
        page.click("#pull button")
        page.wait_for_selector('.pull[data-ended="ok"]')
        status = page.inner_text(".pull .pull-status")
        assert status == f"served as {ORG}/console-GGUF:gemma-3-270m-Q4_K_M", status
        bar = page.eval_on_selector(".pull progress", "b => [b.value, b.max]")
        assert bar[0] == bar[1] > 1, bar
        page.wait_for_selector(f'#models tr[data-model="{ORG}/console-GGUF:'
                               'gemma-3-270m-Q4_K_M"]')
    assert not errors, errors


def test_a_pull_is_cancelled_and_one_under_way_ends_with_the_server(
        server: Server, local_hub: LocalHub) -> None:
    with httpx.stream("POST", f"{server.url}/admin/pull", headers=_admin(), timeout=300,
                      json={"model": f"{ORG}/slow-GGUF"}) as stream:
        pull_id = stream.headers["x-pull-id"]
        steps = []
        for line in stream.iter_lines():
            if line.startswith("data:"):
                steps.append(json.loads(line.removeprefix("data:")))
                if "completed" in steps[-1] and steps[-1]["completed"] > 0:
                    cancelled = httpx.delete(f"{server.url}/admin/pull/{pull_id}",
                                             headers=_admin())
                    assert cancelled.status_code == 200
            if steps and "error" in steps[-1]:
                break
    assert steps[-1]["code"] == "pull_cancelled", steps[-1]
    [view] = [p for p in httpx.get(f"{server.url}/admin/pull", headers=_admin()).json()["pulls"]
              if p["id"] == pull_id]
    assert (view["status"], view["ended"]) == ("cancelled", True), view
    assert not local_hub.blobs(f"{ORG}/slow-GGUF")  # and no half file: the hub's is gone
    folder = local_hub.root / "hf" / f"models--{ORG}--slow-GGUF"
    assert not list(folder.rglob("*.incomplete"))
    # one left under way: the server's stop (the fixture's SIGTERM) cancels it, and the
    # fixture checks that no child outlives the server
    with httpx.stream("POST", f"{server.url}/admin/pull", headers=_admin(), timeout=60,
                      json={"model": f"{ORG}/stopped-GGUF"}) as started:
        assert started.status_code == 200  # and the client leaves: the pull goes on
    pulls = httpx.get(f"{server.url}/admin/pull", headers=_admin()).json()["pulls"]
    assert [p["ended"] for p in pulls if "stopped" in p["model"]] == [False]


def test_the_shell_shows_a_progress_bar(local_hub: LocalHub) -> None:
    """`bunkhouse pull` in a terminal: a bar with the bytes, the speed and the time left."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command, in the pty
        os.execve(sys.executable, [sys.executable, "-m", "bunkhouse", "pull", f"{ORG}/bar-GGUF"],
                  local_hub.env)
    out = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 300)
        if not ready:
            break
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child ended: its end of the pty is closed
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    text = out.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "100%" in text and "B/s" in text and "\r" in text, text
    assert f"{ORG}/bar-GGUF:gemma-3-270m-Q4_K_M" in text
