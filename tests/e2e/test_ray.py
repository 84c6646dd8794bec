"""Scale-out on Ray end to end: a local cluster of 3 nodes on this machine
(``ray.cluster_utils.Cluster``, one CPU each, a ``bunkhouse_memory_mib`` budget of 1,200 MiB
so that Qwen (1,058 MiB estimated) and Gemma (646) cannot share a node), and
`bunkhouse serve --ray ADDRESS` over it.

The packaged models answer through the openai SDK, each from its own node (``node`` in
/v1/models is Ray's node id); a third model goes to the third node; a fourth evicts the model
on a node where it then fits. A worker's relay answers 401 to a request without its secret.
The console draws a bar per node. A node removed while a stream runs on it: the stream ends
with an error event, /health never stops answering, the next request is served from another
node, and nothing of the lost node is left running. A conversation of about 600 tokens is
restored from its node's KV snapshots when Qwen loads there again, and starts cold (counted
as a miss naming that node) on another. A node keeps a spare worker that its next load
becomes. The front outlives its Ray agent (the driver Ray ends when its GCS is lost) and
connects again; with the cluster's GCS lost, requests fail at once and /health answers. Bad
configurations are refused before anything starts.
Skipped, saying why, where Ray is not installed (it is the ``ray`` extra)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from bunkhouse.catalog import Catalog
from tests.e2e.server import Server, serve
from tests.e2e.shared import post_stream
from tests.helpers import still_running, wait_for
from tests.models import GEMMA, QWEN

pytestmark = pytest.mark.slow
cluster_utils = pytest.importorskip("ray.cluster_utils", reason="the 'ray' extra is not "
                                    "installed (pip install -e '.[ray]')")

NODE_MIB = 1200
ADMIN = "test-admin-key"
EXTRA = ("gemma-b", "gemma-c")  # the packaged Gemma's file under other ids


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    # the nodes' processes inherit it: a host the agent left ends within 10 s, not 30
    os.environ["BUNKHOUSE_RAY_HEARTBEAT_S"] = "10"
    c = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"bunkhouse_memory_mib": NODE_MIB}})
    for _ in range(2):
        c.add_node(num_cpus=1, resources={"bunkhouse_memory_mib": NODE_MIB})
    c.wait_for_nodes()
    try:
        yield c
    finally:
        c.shutdown()
        os.environ.pop("BUNKHOUSE_RAY_HEARTBEAT_S", None)


@pytest.fixture(scope="module")
def server(cluster: Any, tmp_path_factory: pytest.TempPathFactory,
           packaged_catalog: Catalog) -> Iterator[Server]:
    gemma = packaged_catalog.get(GEMMA).path
    workdir = tmp_path_factory.mktemp("ray")
    config = workdir / "bunkhouse.toml"
    config.write_text("hf_cache = false\nollama = false\nlmstudio = false\n"
                      "[defaults]\nthreads = 1\n"
                      + "".join(f'[[models]]\nid = "{m}"\npath = "{gemma}"\n' for m in EXTRA))
    with serve(workdir, "--config", str(config), "--ray", cluster.address,
               "--spare-worker", "off", "--admin-key", ADMIN) as s:
        yield s


def _node(server: Server, model_id: str) -> str | None:
    node: str | None = server.model(model_id).get("node")
    return node


def _complete(server: Server, model_id: str) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=300)
    answer = client.completions.create(model=model_id, prompt="The capital of France is",
                                       max_tokens=4)
    return answer.choices[0].text


def _http_status(url: str) -> int | None:
    """The HTTP status ``url`` answers with; None where what listens speaks no HTTP (Ray's
    own ports in a worker host's process)."""
    try:
        return httpx.get(url, timeout=10).status_code
    except httpx.HTTPError:
        return None


def _relay_ports() -> list[int]:
    """The TCP ports the worker hosts on this machine listen on (their relays, and Ray's
    own)."""
    ports = []
    for proc in psutil.process_iter(["name"]):
        if "WorkerHost" not in (proc.info["name"] or ""):
            continue
        try:
            ports += [c.laddr.port for c in proc.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
    return ports


def test_models_are_placed_on_nodes_by_fit_and_answer_through_their_relays(
        server: Server, cluster: Any) -> None:
    nodes = {n.node_id for n in cluster.list_all_nodes()}
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=300)
    chat = client.chat.completions.create(
        model=QWEN, messages=[{"role": "user", "content": "Say hello in one word."}],
        max_tokens=8)
    assert chat.choices[0].message.content
    assert _complete(server, GEMMA)
    qwen_node, gemma_node = _node(server, QWEN), _node(server, GEMMA)
    assert qwen_node in nodes and gemma_node in nodes and qwen_node != gemma_node

    assert _complete(server, EXTRA[0])  # the third model: on the third node, the empty one
    third = _node(server, EXTRA[0])
    assert third in nodes - {qwen_node, gemma_node}
    stats = server.stats()
    assert {n["id"] for n in stats["nodes"]} == nodes
    assert all(n["budget_bytes"] == NODE_MIB * 2**20 for n in stats["nodes"])
    for model_id in (QWEN, GEMMA, EXTRA[0]):  # read on its node, every second
        wait_for(lambda m=model_id: server.model(m)["measured_bytes"], 60,
                 f"{model_id}'s memory as its node measured it")

    assert _complete(server, EXTRA[1])  # fits no node as they are: one Gemma makes room
    fourth = _node(server, EXTRA[1])
    assert fourth in (gemma_node, third)
    evicted = GEMMA if fourth == gemma_node else EXTRA[0]
    kept = EXTRA[0] if evicted == GEMMA else GEMMA
    assert server.model(evicted)["state"] == "absent"
    assert server.model(kept)["state"] == "ready" and server.model(QWEN)["state"] == "ready"

    host = cluster.address.split(":")[0]
    answers = {port: _http_status(f"http://{host}:{port}/health") for port in _relay_ports()}
    relays = {port: status for port, status in answers.items() if status is not None}
    assert len(relays) == 3, answers  # one per worker: Qwen, a Gemma, the fourth
    assert set(relays.values()) == {401}
    for port in relays:
        answer = httpx.get(f"http://{host}:{port}/v1/models", timeout=30,
                           headers={"Authorization": "Bearer not-its-secret"})
        assert answer.status_code == 401


def test_the_console_draws_each_node_with_its_models(server: Server) -> None:
    from tests.e2e.test_console import console_page

    where = {m["id"]: m["node"] for m in server.stats()["models"] if m.get("node")}
    assert len(set(where.values())) == 3  # after the test above: a model on each node
    with console_page(server.url) as (page, errors):
        page.wait_for_selector(".node-bar .seg")
        assert page.locator(".node").count() == 3
        assert not page.locator("#bar").is_visible()  # one bar per node instead
        for model_id, node in where.items():
            page.locator(f'.node-bar[data-node="{node}"] .seg[data-model="{model_id}"]'
                         ).wait_for()
            label = page.locator(f'.node[data-node="{node}"] .node-label').inner_text()
            assert model_id in label and f"of {NODE_MIB} MiB" in label, label
        assert "on 3 nodes" in page.locator("#memory-figures").inner_text()
    assert not errors, errors


MODULE = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(36))
CHAT = [{"role": "user", "content": f"Here is a module:\n{MODULE}\nWhich function returns "
                                    "x * 12 + 5?"}]  # about 600 tokens for Qwen
QUESTION = {"role": "user", "content": "And which one returns x * 13 + 6?"}


def _chat(server: Server, messages: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Qwen's greedy answer and the engine's timings (prompt_n: the tokens it prefilled;
    cache_n: those it reused)."""
    answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=600, json={
        "model": QWEN, "messages": messages, "max_tokens": 16, "temperature": 0})
    assert answer.status_code == 200, answer.text
    data = answer.json()
    return data["choices"][0]["message"]["content"], data["timings"]


def _unload(server: Server, model_id: str) -> None:
    answer = httpx.post(f"{server.url}/v1/models/{model_id}/unload", timeout=120,
                        headers={"Authorization": f"Bearer {ADMIN}"})
    assert answer.status_code == 204, answer.text
    wait_for(lambda: server.model(model_id)["state"] == "absent" or None, 120,
             f"{model_id} to be unloaded")


def test_a_conversation_is_restored_on_its_node_and_starts_cold_on_another(
        server: Server) -> None:
    home = _node(server, QWEN)
    assert home is not None and server.model(QWEN)["state"] == "ready"
    first, timings = _chat(server, CHAT)
    assert timings["prompt_n"] > 500  # the conversation is as long as meant
    follow_up = [*CHAT, {"role": "assistant", "content": first}, QUESTION]
    _unload(server, QWEN)  # its slot is saved on its node
    assert server.model(QWEN)["kv_cache"]["last_flush"]["saved"] == 1

    expected, timings = _chat(server, follow_up)  # loaded again on its (empty) node
    assert _node(server, QWEN) == home
    assert timings["prompt_n"] < 100 and timings["cache_n"] > 500, timings
    assert server.model(QWEN)["kv_cache"]["restored"] == 1

    # Qwen's node taken by a Gemma that streams (a model in use is not evicted while
    # another node has one idle): Qwen loads on another node, from a cold start
    _unload(server, QWEN)
    gemma = next(m for m in (GEMMA, *EXTRA) if server.model(m)["state"] == "absent")
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=300, json={
            "model": gemma, "prompt": "Once upon a time", "max_tokens": 2000,
            "stream": True}) as streaming:
        assert streaming.status_code == 200
        next(streaming.iter_lines())
        assert _node(server, gemma) == home
        answer, timings = _chat(server, follow_up)
    assert _node(server, QWEN) not in (None, home)
    assert answer == expected  # correct from a cold start
    assert timings["prompt_n"] > 500 and timings["cache_n"] == 0, timings
    missed = server.model(QWEN)["kv_cache"]["missed"]
    assert missed == {f"its snapshots are on node {home}, its worker on another": 1}


def test_a_node_lost_mid_stream_ends_the_stream_and_its_model_moves(
        server: Server, cluster: Any) -> None:
    head = cluster.head_node.node_id  # it holds the cluster: another node is lost
    model_id = next(m for m in (GEMMA, EXTRA[0], EXTRA[1])
                    if server.model(m)["state"] == "ready" and _node(server, m) != head)
    lost = _node(server, model_id)
    node = next(n for n in cluster.list_all_nodes() if n.node_id == lost)
    raylet = node.all_processes["raylet"][0].process.pid
    lost_hosts = {p for p in _worker_hosts() if psutil.Process(p).ppid() == raylet}
    assert len(lost_hosts) == 1  # the worker host of the model on the node to lose

    first = threading.Event()
    result: dict[str, Any] = {}

    def stream() -> None:
        result["status"], result["lines"] = post_stream(
            server.url, "/v1/completions",
            {"model": model_id, "prompt": "Once upon a time", "max_tokens": 2000}, first)

    streamer = threading.Thread(target=stream)
    streamer.start()
    with _health_watched(server) as health:
        assert first.wait(300), "the stream never started"
        cluster.remove_node(node)
        streamer.join(120)
        assert not streamer.is_alive(), "the stream did not end after its node was lost"
    lines = result["lines"]
    assert result["status"] == 200 and "data: [DONE]" not in lines
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "error" in events[-1], lines[-3:]
    assert health and set(health) == {200}

    wait_for(lambda: server.model(model_id)["state"] == "absent" or None, 60,
             f"{model_id} to be absent: nobody asked for it again yet")
    events = [e for e in server.stats()["events"] if e["model"] == model_id]
    kinds = [e["kind"] for e in events[[e["kind"] for e in events].index("lost"):]]
    assert "crashed" not in kinds and "respawning" not in kinds and "gave_up" not in kinds
    assert _complete(server, model_id)  # from a node still there
    assert _node(server, model_id) not in (None, lost)
    wait_for(lambda: not lost_hosts & _worker_hosts() or None, 60,
             "the lost node's worker host to be gone")
    snapshots = server.log.parent / "kv" / "nodes"  # a node's id is never used again
    wait_for(lambda: not (snapshots / str(lost)).exists() or None, 60,
             "the lost node's KV snapshot directory to be removed")
    orphans = [p for p in psutil.process_iter(["cmdline"])
               if f"--model-id {model_id}" in " ".join(p.info["cmdline"] or [])
               and p.ppid() not in _worker_hosts()]
    assert not orphans, "a worker of the lost node runs on"


@contextlib.contextmanager
def _health_watched(server: Server) -> Iterator[list[int]]:
    """/health's status every 0.2 s while the block runs (0: no answer)."""
    health: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                health.append(httpx.get(f"{server.url}/health", timeout=10).status_code)
            except httpx.HTTPError:
                health.append(0)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield health
    finally:
        stop.set()
        watcher.join(30)


def _worker_hosts() -> set[int]:
    return {p.pid for p in psutil.process_iter(["name"])
            if "WorkerHost" in (p.info["name"] or "")}


def test_the_front_outlives_its_ray_agent_and_connects_again(server: Server) -> None:
    """The agent (the front's Ray driver) killed, as Ray ends a driver that lost its GCS:
    /health answers throughout, the nodes come back once the front has started it again,
    their KV snapshots are kept (the nodes were out of reach, not gone), and the model is
    served again; nothing the old agent started runs on."""
    nodes = {n["id"] for n in server.stats()["nodes"]}
    kept = {p.name for p in (server.log.parent / "kv" / "nodes").iterdir() if p.is_dir()}
    [agent] = [p for p in psutil.Process(server.proc.pid).children()
               if "bunkhouse.cluster.agent" in " ".join(p.cmdline())]
    old_hosts = _worker_hosts()
    with _health_watched(server) as health:
        agent.kill()
        # the front counts every node out of reach once it sees the agent gone (at least
        # the restart's 1 s): the nodes are back only after that
        wait_for(lambda: not server.stats()["nodes"] or None, 60,
                 "the front to count the nodes out of reach")
        wait_for(lambda: {n["id"] for n in server.stats()["nodes"]} == nodes or None, 180,
                 "the nodes to be back")
        assert _complete(server, QWEN)
    assert health and set(health) == {200}
    assert kept <= {p.name for p in (server.log.parent / "kv" / "nodes").iterdir()}
    wait_for(lambda: not old_hosts & _worker_hosts() or None, 120,
             "the old agent's worker hosts to be gone")


def test_a_node_keeps_a_spare_worker_that_its_next_load_becomes(
        cluster: Any, tmp_path: Path) -> None:
    """A front of its own (spare workers on) over the same nodes: a node keeps a spare
    worker in a worker host of its own, a load placed there becomes it (the same process),
    and after the load the node keeps another, which the model's next load there becomes."""
    config = tmp_path / "bunkhouse.toml"
    config.write_text("hf_cache = false\nollama = false\nlmstudio = false\n"
                      "[defaults]\nthreads = 1\n")
    with serve(tmp_path, "--config", str(config), "--ray", cluster.address,
               "--admin-key", ADMIN) as server:
        first = wait_for(lambda: server.stats().get("spare_worker"), 120,
                         "the spare worker kept from the start")
        host = psutil.Process(first["pid"]).parent()
        assert host is not None and "WorkerHost" in host.name()
        assert _complete(server, GEMMA)
        assert server.model(GEMMA)["pid"] == first["pid"]  # placed where the spare was
        node = _node(server, GEMMA)
        second = wait_for(lambda: server.stats().get("spare_worker"), 120,
                          "another spare on the model's node")
        assert second["pid"] != first["pid"]
        _unload(server, GEMMA)
        assert _complete(server, GEMMA)  # back on its node, which has the spare
        assert _node(server, GEMMA) == node
        assert server.model(GEMMA)["pid"] == second["pid"]
        spares = wait_for(lambda: [n["spare"] for n in server.stats()["nodes"] if n["spare"]],
                          120, "the node's next spare, in its node's entry")
        hosts = {psutil.Process(s["pid"]).ppid() for s in spares}
    # the front stopped (serve's SIGTERM): its hosts and their spares went with it
    wait_for(lambda: not hosts & _worker_hosts() or None, 60, "the spares' hosts to end")


def test_a_lost_cluster_fails_requests_at_once_and_health_answers(
        server: Server, cluster: Any) -> None:
    """The cluster's GCS killed (the module's last use of the cluster): the agent counts
    the cluster lost within its 10 s, so a request for a model fails at once with a 503
    (never a hang or a 500), /health answers throughout, and the front's stop (the serve
    fixture's SIGTERM) does not wait for the agent, which keeps trying to connect."""
    gcs = cluster.head_node.all_processes["gcs_server"][0].process
    workers = [c for h in _worker_hosts() for c in psutil.Process(h).children()]
    absent = next(m for m in (GEMMA, *EXTRA) if server.model(m)["state"] == "absent")
    gcs.kill()
    statuses: list[int] = []
    health: list[int] = []

    def failed_cleanly() -> bool | None:
        health.append(httpx.get(f"{server.url}/health", timeout=30).status_code)
        answer = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": absent, "prompt": "Hello", "max_tokens": 2})
        statuses.append(answer.status_code)
        return (answer.status_code == 503 and "no node" in answer.text) or None

    wait_for(failed_cleanly, 180, "a quick 503 once the cluster is lost")
    assert set(health) == {200}
    assert set(statuses) <= {503}, statuses  # each a clean refusal, none a server error
    # Ray cannot end the agent's actors without its GCS: each ends itself, with its worker,
    # once the agent stops calling it
    wait_for(lambda: not _worker_hosts() or None, 120, "the worker hosts to end")
    wait_for(lambda: not any(still_running(p) for p in workers) or None, 60,
             "the hosts' workers to end with them")

    # and no worker runs on outside a front (the suite's shared server has its own)
    def strays() -> list[str]:
        found = []
        for p in psutil.process_iter(["cmdline", "ppid", "status"]):
            if "bunkhouse.worker" not in " ".join(p.info["cmdline"] or []) \
                    or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                parent = " ".join(psutil.Process(p.info["ppid"]).cmdline())
            except psutil.Error:
                parent = ""
            if "bunkhouse" not in parent or "serve" not in parent:
                found.append(f"{p.pid} (parent {p.info['ppid']} {parent[:80]!r}): "
                             f"{' '.join(p.info['cmdline'])[:200]}")
        return found

    deadline = time.monotonic() + 60
    while strays() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not strays(), f"workers outside a front run on: {strays()}"


@pytest.mark.parametrize(("args", "says"), [
    (["--ray", "127.0.0.1:1"], "cannot reach the Ray cluster"),
    (["--ray", "auto"], "RAY_ADDRESS, which is not set"),
])
def test_a_cluster_that_cannot_be_used_is_refused_before_serving(
        args: list[str], says: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["BUNKHOUSE_RAY_CONNECT_S"] = "5"  # nothing answers there: no need to wait 30 s
    done = subprocess.run([sys.executable, "-m", "bunkhouse", "serve", "--port", "1", *args],
                          capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert says in done.stderr

