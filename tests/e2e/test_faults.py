"""Fault paths with real worker processes running the fault engine (tests/fault_engine.py)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import psutil
import pytest

from bunkhouse.catalog import Catalog
from tests.e2e.server import Server, serve
from tests.fault_engine import ENGINE
from tests.helpers import CHILD_PYTHONPATH, wait_for, write_tiny_gguf
from tests.models import QWEN


def _serve_faulty(tmp_path: Path, faults: dict[str, dict[str, object]], *args: str):  # type: ignore[no-untyped-def]
    models = tmp_path / "models"
    for model_id in faults:
        write_tiny_gguf(models / f"{model_id}.gguf")
    env = {"BUNKHOUSE_FAULTS": json.dumps(faults), "PYTHONPATH": CHILD_PYTHONPATH}
    return serve(tmp_path, "--no-packaged", "--models-dir", str(models), "--worker-engine", ENGINE,
                 *args, env=env)


def _ask(server: Server, model: str, **extra: object) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        **extra})


def _kinds(server: Server, model: str) -> list[str]:
    return [e["kind"] for e in server.stats()["events"] if e["model"] == model]


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """One server for the crash loop and the full line: ``crashy`` never loads; ``slow``
    (1 slot, a queue of 8) loads once the gate file exists."""
    tmp_path = tmp_path_factory.mktemp("faulty")
    gate = tmp_path / "slow-may-load"
    with _serve_faulty(tmp_path, {"crashy": {"fail_load": "weights are garbage"},
                                  "slow": {"load_gate": str(gate)}},
                       "--parallel", "1") as server:
        yield server, gate


def test_a_crash_loop_ends_in_failed_after_the_budget(faulty: tuple[Server, Path]) -> None:
    """... and logs the worker's output once (a retry that fails the same way says so in
    one line); each request refused, by a failed load or in the
    cool-down after (in every protocol, through the real SDKs) logs one short line."""
    server, _ = faulty
    answers = [_ask(server, "crashy") for _ in range(7)]
    codes = [a.json()["error"]["code"] for a in answers]
    assert codes == ["model_load_failed"] * 4 + ["model_failed"] * 3
    for a in answers:  # each says when the model is tried again, its load's failures too
        assert f"tried again in {a.headers['retry-after']} s" in a.json()["error"]["message"]
    assert _kinds(server, "crashy").count("loading") == 4  # 1 + 3 restarts: no storm
    last = _ask(server, "crashy")
    assert last.status_code == 503 and int(last.headers["retry-after"]) > 0
    said = last.json()["error"]["message"]  # once, with one figure and what to do
    assert said.count("failed to load") == 1 and "is failed" not in said, said
    assert f"tried again in {last.headers['retry-after']} s" in said, said
    assert "bunkhouse load crashy" in said, said
    assert server.model("crashy")["state"] == "failed"
    with anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0) as claude, \
            pytest.raises(anthropic.InternalServerError) as refused:
        claude.messages.create(model="crashy", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 503 and "tried again in" in str(refused.value)
    with ollama.Client(host=server.url, timeout=60) as local, \
            pytest.raises(ollama.ResponseError) as gone:
        local.chat(model="crashy", messages=[{"role": "user", "content": "hi"}])
    assert gone.value.status_code == 503 and "tried again in" in gone.value.error
    log = wait_for(lambda: _refusals(server.log.read_text(), 6), 10, "6 refusals logged")
    failures = [line for line in log.splitlines() if "crashy: load failed" in line]
    assert len(failures) == 4 and all(" ERROR " in line for line in failures), failures
    outputs = log.count("Last lines of its output")
    assert outputs == 1, outputs  # once, never per request nor per retry failing the same
    assert "\\x0a" not in log  # the output's lines, indented under their ERROR line
    after = log.split("crashy: load failed:")[1].split("\n")
    assert len(after) > 2 and after[1].startswith("    ") and after[2].startswith("    "), after


def _refusals(log: str, count: int) -> str | None:
    """The log once it has ``count`` short lines of requests refused in the cool-down."""
    lines = [line for line in log.splitlines() if "crashy" in line and "tried again in" in line
             and "failed to load" in line]
    if len(lines) < count:
        return None
    assert all(" WARNING " in line and "tried again in" in line for line in lines), lines
    return log


def test_a_full_line_is_refused_at_once_while_its_model_loads(faulty: tuple[Server, Path]
                                                              ) -> None:
    """14 requests (the OpenAI, Anthropic and Ollama SDKs) to a 1-slot, queue-8 model that
    is loading: 9 wait for it, and the other 5 get 429 while it still loads, each in its
    protocol's shape; once it is loaded the 9 are answered."""
    server, gate = faulty
    prompt = [{"role": "user", "content": "hi"}]
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                       timeout=120) as oai, \
            anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0,
                                timeout=120) as claude, \
            ollama.Client(host=server.url, timeout=120) as local:
        calls: list[Callable[[], object]] = [
            lambda: oai.chat.completions.create(model="slow", max_tokens=4,
                                                messages=prompt),  # type: ignore[arg-type]
            lambda: claude.messages.create(model="slow", max_tokens=4,
                                           messages=prompt),  # type: ignore[arg-type]
            lambda: local.chat(model="slow", messages=prompt, options={"num_predict": 4})]
        _fourteen_at_a_loading_model(server, gate, calls)


def _fourteen_at_a_loading_model(server: Server, gate: Path,
                                 calls: list[Callable[[], object]]) -> None:
    with ThreadPoolExecutor(14) as pool:
        futures = [pool.submit(calls[i % 3]) for i in range(14)]
        early = wait_for(lambda: [f for f in futures if f.done()]
                         if sum(f.done() for f in futures) >= 5 else None, 60, "5 refusals")
        refused = [f.exception() for f in early]
        assert len(refused) == 5 and server.model("slow")["state"] == "loading"
        assert server.model("slow")["queued"] == 9
        for error in refused:
            if isinstance(error, openai.RateLimitError):
                assert error.code == "queue_full"
                assert int(error.response.headers["retry-after"]) > 0
            elif isinstance(error, anthropic.RateLimitError):
                assert error.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
                assert int(error.response.headers["retry-after"]) > 0
            else:
                assert isinstance(error, ollama.ResponseError), error
                assert error.status_code == 429 and "queue" in error.error
        gate.touch()  # the model may load now
        answered = [f.result() for f in futures if f not in early]  # raises if refused
        assert len(answered) == 9


def test_a_worker_crashing_mid_stream_is_respawned(tmp_path: Path) -> None:
    with _serve_faulty(tmp_path, {"flaky": {"crash_after_tokens": 3}}) as server:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30, json={
                "model": "flaky", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 10, "stream": True}) as resp:
            lines = [line for line in resp.iter_lines() if line]
        assert lines[:3] == [line for line in lines[:3] if line.startswith("data: ")]
        assert lines[3] == "event: error"
        assert json.loads(lines[4][6:])["error"]["code"] == "engine_unavailable"
        wait_for(lambda: "respawning" in _kinds(server, "flaky"), 10, "the respawn")
        # The new worker has the same fault: ask for fewer tokens than it survives.
        assert _ask(server, "flaky", max_tokens=2).status_code == 200


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    with _serve_faulty(tmp_path, {"stubborn": {"ignore_sigterm": True}},
                       "--stop-grace", "1") as server:
        assert _ask(server, "stubborn").status_code == 200
        worker = psutil.Process(server.model("stubborn")["pid"])
        started = time.monotonic()
        server.proc.terminate()
        assert server.proc.wait(timeout=20) == 0
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
        assert time.monotonic() - started < 15
        assert "ignored SIGTERM" in server.log.read_text()


def test_a_hung_worker_is_detected_and_replaced(tmp_path: Path) -> None:
    with _serve_faulty(tmp_path, {"hangs": {"hang_after_requests": 1}},
                       "--probe-interval", "0.5") as server:
        assert _ask(server, "hangs").status_code == 200  # from now on it answers nothing
        first = server.model("hangs")["pid"]
        wait_for(lambda: server.model("hangs")["pid"] not in (first, None)
                 and server.model("hangs")["state"] == "ready", 20, "a replacement worker")
        assert "crashed" in _kinds(server, "hangs")
        assert _ask(server, "hangs").status_code == 200


def test_answers_never_count_against_a_workers_health(tmp_path: Path) -> None:
    """A worker that answers, even with a 500 every time, is alive: only what proves it sick
    (transport failures, timeouts, missed probes, a stream it cut) replaces it."""
    with _serve_faulty(tmp_path, {"broken": {"fail_generation": True}},
                       "--probe-interval", "0.5") as server:
        assert [_ask(server, "broken").status_code for _ in range(6)] == [500] * 6
        pid = server.model("broken")["pid"]
        time.sleep(2)  # several probe rounds: it answers them all
        assert server.model("broken")["pid"] == pid and server.model("broken")["state"] == "ready"
        assert "crashed" not in _kinds(server, "broken")


def test_a_stall_on_a_requests_grammar_is_that_requests_not_the_models(
        tmp_path: Path, packaged_catalog: Catalog) -> None:
    """The constraint probe measures the real model (a cheap grammar passes it); the fault
    engine's worker then stalls on that grammar past its liveness probes, three times: each
    request gets a 400 naming ``grammar``, its grammar is refused from then on, the client
    whose requests stalled it twice gets 429 for its next constrained request, and the model
    never counts a failure (nor gives up)."""
    models = tmp_path / "models"
    models.mkdir()
    os.link(packaged_catalog.get(QWEN).path, models / "stally.gguf")
    env = {"BUNKHOUSE_FAULTS": json.dumps({"stally": {"stall_on_grammar": True}}),
           "PYTHONPATH": CHILD_PYTHONPATH}
    with serve(tmp_path, "--no-packaged", "--models-dir", str(models), "--worker-engine",
               ENGINE, "--probe-interval", "1", "--api-key", "one", "--api-key", "two",
               env=env) as server:
        def ask(key: str, **extra: object) -> httpx.Response:
            return httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
                "model": "stally", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, **extra}, headers={"authorization": f"Bearer {key}"})

        assert ask("one").status_code == 200
        for n, key in enumerate(["one", "one", "two"]):
            grammar = f'root ::= "yes{n}" | "no{n}"'
            resp = ask(key, grammar=grammar)
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["param"] == "grammar" and "stalled" in error["message"], error
            again = ask("two", grammar=grammar)  # refused before any worker, for anyone
            assert again.status_code == 400 and again.json()["error"]["param"] == "grammar"
            if n == 1:  # two stalls: this client's constrained requests wait a while
                cooled = ask("one", grammar='root ::= "other"')
                assert cooled.status_code == 429 and int(cooled.headers["retry-after"]) > 0
                assert cooled.json()["error"]["code"] == "stalled_too_often"
        assert ask("one").status_code == 200  # unconstrained: served
        kinds = _kinds_keyed(server, "stally", "one")
        assert kinds.count("crashed") == 3 and "gave_up" not in kinds, kinds
        model = httpx.get(f"{server.url}/v1/models/stally",
                          headers={"authorization": "Bearer two"}).json()
        assert model["state"] == "ready"


def _kinds_keyed(server: Server, model: str, key: str) -> list[str]:
    stats = httpx.get(f"{server.url}/stats", headers={"authorization": f"Bearer {key}"}).json()
    return [e["kind"] for e in stats["events"] if e["model"] == model]
