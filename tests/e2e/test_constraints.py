"""A request's constraint is measured before a worker that others share meets it: an
expensive one gets a 400 naming its field while another client's stream on the same model
goes on, on the same worker, and the model never fails."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.e2e.server import Server, serve
from tests.models import QWEN


def _enum_schema(n: int, tag: str) -> dict[str, Any]:
    """An enum of ``n`` strings: 48 KB at 3,000 (the probe's instance)."""
    return {"type": "json_schema", "json_schema": {
        "name": "pick", "schema": {"enum": [f"{tag}-{i:05d}-abcdef" for i in range(n)]}}}


def _alternatives(n: int) -> str:
    """A GBNF grammar of ``n`` alternatives: 55 KB at 5,000, under the 64 KiB bound."""
    return "root ::= " + " | ".join(f'"w{i:05d}"' for i in range(n))


class _Stream(threading.Thread):
    """Another client's long streamed answer, its events counted."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.tokens, self.finish, self.error = url, 0, "", ""  # tokens: its usage
        self.started = threading.Event()

    def run(self) -> None:
        body = {"model": QWEN, "stream": True, "max_tokens": 400, "ignore_eos": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "Count from 1 to 1000."}]}
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body,
                          timeout=600) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.error = line
                    continue
                if event.get("usage"):
                    self.tokens = event["usage"]["completion_tokens"]
                if not event.get("choices"):
                    continue
                choice = event["choices"][0]
                if choice["delta"].get("content"):
                    self.started.set()
                self.finish = choice.get("finish_reason") or self.finish
        self.started.set()


def _states(server: Server, seen: set[str], stop: threading.Event) -> None:
    while not stop.wait(0.2):
        seen.add(server.model(QWEN)["state"])


def _chat(server: Server, **extra: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
        "model": QWEN, "max_tokens": 4, **extra,
        "messages": [{"role": "user", "content": "Pick one."}]})


def test_expensive_constraints_are_refused_before_a_shared_worker_meets_them(
        tmp_path: Path) -> None:
    with serve(tmp_path, "--parallel", "2") as server:
        assert _chat(server).status_code == 200
        [worker] = server.model_workers()
        seen: set[str] = set()
        stop = threading.Event()
        watcher = threading.Thread(target=_states, args=(server, seen, stop), daemon=True)
        watcher.start()
        stream = _Stream(server.url)
        stream.start()
        assert stream.started.wait(300)
        # one within the bounds is served, constrained (first: a refusal kills the probe)
        small = _chat(server, response_format=_enum_schema(5, "c"), max_tokens=40)
        assert small.status_code == 200, small.text
        assert json.loads(small.json()["choices"][0]["message"]["content"]).startswith("c-")
        # a schema the engine cannot convert: the engine's own refusal, naming the field,
        # and the probe still measures the next one
        for _ in range(2):
            invalid = _chat(server, response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "bogus"}}})
            assert invalid.status_code == 400, invalid.text
            assert invalid.json()["error"]["param"] == "response_format", invalid.text
        other = _chat(server, response_format=_enum_schema(6, "d"), max_tokens=40)
        assert other.status_code == 200, other.text
        refusals = [
            ("response_format", {"response_format": _enum_schema(3000, "a")}),
            ("grammar", {"grammar": _alternatives(5000)}),
            # the same enum behind a fixed prefix, which the probe's two tokens never pass:
            # measured as a part of its own
            ("response_format", {"response_format": {"type": "json_schema", "json_schema": {
                "name": "pick", "schema": {
                    "type": "object", "required": ["intro", "pick"], "properties": {
                        "intro": {"const": "The answer, after careful thought, is"},
                        "pick": _enum_schema(3000, "b")["json_schema"]["schema"]}}}}}),
            ("dry_sequence_breakers", {"dry_multiplier": 0.8, "dry_sequence_breakers": [
                f"zq{i}xw abcdefghijklmnopqrstuvwxyz0123456789" for i in range(300)]}),
        ]
        for field, extra in refusals:
            resp = _chat(server, **extra)
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["param"] == field, resp.text
        # the same constraint again: refused from the kept verdict
        again = _chat(server, response_format=_enum_schema(3000, "a"))
        assert again.status_code == 400 and again.json()["error"]["param"] == "response_format"
        stream.join(600)
        stop.set()
        watcher.join()
        assert not stream.error, stream.error
        assert stream.finish == "length" and stream.tokens == 400, (stream.finish, stream.tokens)
        assert [p.pid for p in server.model_workers()] == [worker.pid]  # never replaced
        assert "failed" not in seen and "absent" not in seen, seen
        probes = [p for p in server.workers()
                  if "bunkhouse.worker.engines.llamacpp_probe" in p.cmdline()]
        assert len(probes) <= 1
    assert not [p for p in probes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
