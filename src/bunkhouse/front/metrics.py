"""``GET /metrics``: the server in Prometheus' text format, written by ``prometheus-client``.

Two kinds of figures:

* **Read at each scrape** from their one owner (no second copy to keep in step), by
  :class:`StateCollector`: each model's state, estimated and measured bytes, leases,
  running and queued requests, residency events by kind (loads are ``loading``, crashes
  ``crashed``, restarts ``respawning``), evictions by cause, KV snapshots kept and their
  bytes; the budget, used and peak bytes; the compute gate's waits; an operator's pause.
* **Observed as they happen**, by :class:`Metrics`: requests by route, protocol and status
  (from the access log's record of each request, front/access.py); time to first token of
  streamed generations and the wait for a load, a slot and a compute turn; tokens in and
  out; the engine's own prompt and decode counts and seconds (from each answer's
  ``timings``, so tokens per second is ``rate(tokens) / rate(seconds)`` with no scrape of
  the workers); load time (from the ``ready`` event).

Label values are bounded: ``model`` only takes catalog ids (a request for an unknown model
is counted under ``-``), and a model gone for good (deleted, a refused registration, removed
from the configuration) takes its series with it; ``route`` the route's template
(``unmatched`` for a 404), ``protocol`` and ``cause`` a fixed set each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

from bunkhouse.engines.contract import Timings
from bunkhouse.front.admission import ComputeGates
from bunkhouse.front.cors import admin_route
from bunkhouse.kvcache.keeper import SnapshotKeeper
from bunkhouse.residency.events import Event
from bunkhouse.residency.manager import ResidencyManager

STATES = ("absent", "loading", "ready", "draining", "failed")

# Seconds; a model's first token ranges from milliseconds (a warm slot) to a minute (a cold
# load of a large model behind a queue).
LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
LOAD_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def protocol_of(route: str, method: str = "POST") -> str:
    """The API a route belongs to (a bounded label): ``admin`` for every change of state
    and the event stream (front/cors.py's admin routes)."""
    if admin_route(method, route):
        return "admin"
    if route.startswith("/v1/messages"):
        return "anthropic"
    if route.startswith("/v1/responses"):
        return "responses"
    if route.startswith("/api/"):
        return "ollama"
    if route.startswith("/v1/"):
        return "openai"
    if route in ("/infill", "/tokenize", "/detokenize", "/apply-template"):
        return "llamacpp"
    return "other"


class StateCollector(Collector):
    def __init__(self, residency: ResidencyManager, compute: ComputeGates,
                 keeper: SnapshotKeeper | None) -> None:
        self.residency = residency
        self.compute = compute
        self.keeper = keeper

    def collect(self) -> Iterator[Metric]:
        yield from self._models()
        yield from self._host()
        yield from self._compute_gate()

    def _models(self) -> Iterator[Metric]:
        """Each model's state and figures."""
        r = self.residency
        state = GaugeMetricFamily("bunkhouse_model_state",
                                  "1 for the state each model is in, 0 for the others",
                                  labels=["model", "state"])
        gauges = {name: GaugeMetricFamily(f"bunkhouse_model_{name}", doc, labels=["model"])
                  for name, doc in (
                      ("estimated_bytes", "memory the model may take (its estimate)"),
                      ("measured_bytes", "the worker's measured peak memory"),
                      ("leases", "requests holding the model"),
                      ("running_requests", "requests in the model's slots"),
                      ("queued_requests", "requests waiting for a slot"),
                      ("waiting_requests", "requests waiting for the model to load, for "
                                           "memory or for a pause to end"),
                      ("pinned", "1 if the model is pinned resident"),
                      ("kv_snapshots", "KV cache snapshots kept on disk for the model"),
                      ("kv_snapshot_bytes", "their bytes on disk"))}
        for s in r.statuses():
            for name in STATES:
                state.add_metric([s.id, name], 1.0 if s.state == name else 0.0)
            slots = r.slots(s.id)
            gauges["estimated_bytes"].add_metric([s.id], s.estimated_bytes)
            gauges["measured_bytes"].add_metric([s.id], s.measured_bytes or 0)
            gauges["leases"].add_metric([s.id], s.leases)
            gauges["running_requests"].add_metric([s.id], slots.running)
            gauges["queued_requests"].add_metric([s.id], slots.waiting)
            gauges["waiting_requests"].add_metric([s.id], s.waiting)
            gauges["pinned"].add_metric([s.id], 1.0 if s.pinned else 0.0)
            if self.keeper is not None:
                count, size = self.keeper.model_stats(s.id)
                gauges["kv_snapshots"].add_metric([s.id], count)
                gauges["kv_snapshot_bytes"].add_metric([s.id], size)
        yield state
        yield from gauges.values()

    def _host(self) -> Iterator[Metric]:
        """The memory budget, residency's events and evictions, an operator's pause."""
        r = self.residency
        nodes = r.nodes()
        for name, doc, value in (
                ("budget_bytes", "memory all workers together may use (every node's)",
                 sum(n["budget_bytes"] for n in nodes)),
                ("used_bytes", "memory the resident models hold", r.used_bytes()),
                ("peak_used_bytes", "the most they held at once", r.peak_bytes)):
            yield GaugeMetricFamily(f"bunkhouse_{name}", doc, value=value)
        budget = GaugeMetricFamily("bunkhouse_node_budget_bytes", "each node's budget (one "
                                   "node, local, without --ray)", labels=["node"])
        used = GaugeMetricFamily("bunkhouse_node_used_bytes", "what each node's models hold",
                                 labels=["node"])
        for n in nodes:
            budget.add_metric([n["id"]], n["budget_bytes"])
            used.add_metric([n["id"]], n["used_bytes"])
        yield budget
        yield used
        events = CounterMetricFamily(
            "bunkhouse_residency_events", "residency events by model and kind (loading is a "
            "load begun, ready one done, crashed a worker's death, respawning a restart)",
            labels=["model", "kind"])
        for (model, kind), count in sorted(r.events.by_model.items()):
            if kind != "load_progress":
                events.add_metric([model, kind], count)
        yield events
        evictions = CounterMetricFamily(
            "bunkhouse_evictions", "models drained, by cause (room, idle, keep_alive, operator, "
            "removed, crashed, node_lost, shutdown, remount, other)", labels=["model", "cause"])
        for (model, cause), count in sorted(r.events.drains.items()):
            evictions.add_metric([model, cause], count)
        yield evictions
        left = r.pause_left_s()
        yield GaugeMetricFamily("bunkhouse_paused", "1 while an operator's pause holds every "
                                "model (POST /admin/pause), else 0",
                                value=0 if left is None else 1)
        yield GaugeMetricFamily("bunkhouse_pause_remaining_seconds", "seconds until the "
                                "pause ends by itself (0 when none is held)", value=left or 0)

    def _compute_gate(self) -> Iterator[Metric]:
        yield CounterMetricFamily("bunkhouse_compute_gate_waits",
                                  "requests that waited for another model's compute turn",
                                  value=self.compute.waits)
        yield CounterMetricFamily("bunkhouse_compute_gate_wait_seconds",
                                  "seconds they waited, all together",
                                  value=self.compute.wait_s)
        yield CounterMetricFamily("bunkhouse_compute_gate_preemptions",
                                  "turns ended by their time slice (--compute-turn): the model "
                                  "suspended while another model computed",
                                  value=self.compute.preemptions)
        yield GaugeMetricFamily("bunkhouse_compute_gate_suspended",
                                "models whose worker is suspended now, waiting for its turn",
                                value=len(self.compute.suspended))


class Metrics:
    """The registry behind ``GET /metrics``, and the observers that feed it."""

    def __init__(self, residency: ResidencyManager, compute: ComputeGates | None = None,
                 keeper: SnapshotKeeper | None = None, drafts: DraftTally | None = None
                 ) -> None:
        self.residency = residency
        self.drafts = drafts or DraftTally()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StateCollector(residency, compute or ComputeGates(), keeper))
        reg = self.registry
        self.requests = Counter("bunkhouse_requests", "client requests answered, by route, "
                                "protocol, status and model", ["route", "protocol", "status",
                                                              "model"], registry=reg)
        self.first_token = Histogram(
            "bunkhouse_time_to_first_token_seconds", "streamed generations: seconds from the "
            "request to its first byte of answer, waits included", ["model"],
            buckets=LATENCY_BUCKETS, registry=reg)
        self.queue_wait = Histogram(
            "bunkhouse_queue_wait_seconds", "generations: seconds waiting for the model's load, "
            "a slot and a compute turn", ["model"], buckets=LATENCY_BUCKETS, registry=reg)
        self.tokens_in = Counter("bunkhouse_prompt_tokens", "prompt tokens of answered "
                                 "requests, cached ones included", ["model"], registry=reg)
        self.tokens_out = Counter("bunkhouse_generated_tokens", "tokens generated", ["model"],
                                  registry=reg)
        self.engine = {name: Counter(f"bunkhouse_engine_{name}", doc, ["model"], registry=reg)
                       for name, doc in (
                           ("prompt_tokens", "prompt tokens the engine computed (not cached)"),
                           ("prompt_seconds", "the engine's seconds of prompt processing"),
                           ("decode_tokens", "tokens the engine decoded"),
                           ("decode_seconds", "the engine's seconds of decoding"))}
        self.drafted = Counter("bunkhouse_draft_tokens", "speculative decoding: tokens "
                               "drafted for the model to verify", ["model"], registry=reg)
        self.accepted = Counter("bunkhouse_draft_accepted_tokens", "speculative decoding: "
                                "drafted tokens the model accepted", ["model"], registry=reg)
        self.load_time = Histogram("bunkhouse_model_load_seconds", "seconds from a load's "
                                   "start to its worker being ready", ["model"],
                                   buckets=LOAD_BUCKETS, registry=reg)
        self._requests_of: dict[str, set[tuple[str, str, str, str]]] = {}  # model -> labels
        residency.events.listen(self.on_event)
        residency.events.on_forget(self.forget)

    def forget(self, model_id: str) -> None:
        """A model gone for good: its series go too."""
        self.drafts.forget(model_id)
        for metric in (self.first_token, self.queue_wait, self.tokens_in, self.tokens_out,
                       self.load_time, self.drafted, self.accepted, *self.engine.values()):
            with contextlib.suppress(KeyError):
                metric.remove(model_id)
        for labels in self._requests_of.pop(model_id, set()):
            with contextlib.suppress(KeyError):
                self.requests.remove(*labels)

    def on_event(self, event: Event) -> None:
        if event.kind == "ready" and isinstance(event.data.get("load_s"), (int, float)):
            self.load_time.labels(event.model).observe(event.data["load_s"])

    def observe(self, scope: Scope, status: int | None, first_s: float | None,
                total_s: float) -> None:
        """One request's figures, when it ends (front/access.py's observer)."""
        state: dict[str, Any] = scope.get("state") or {}
        route = state.get("route", "unmatched")
        model = state.get("model", "-")
        if model not in self.residency.catalog:  # gone meanwhile (e.g. this request deleted it)
            model = "-"
        labels = (route, protocol_of(route, scope.get("method", "")), str(status or 0), model)
        self.requests.labels(*labels).inc()
        if model == "-":
            return
        self._requests_of.setdefault(model, set()).add(labels)
        if state.get("stream") and first_s is not None and status == 200:
            self.first_token.labels(model).observe(first_s)
        if isinstance(state.get("queue_s"), float):
            self.queue_wait.labels(model).observe(state["queue_s"])
        tokens = state.get("tokens")
        if tokens:
            self.tokens_in.labels(model).inc(tokens[0])
            self.tokens_out.labels(model).inc(tokens[1])
        timings = state.get("timings")
        if isinstance(timings, Timings):
            self._engine_figures(model, timings)

    def _engine_figures(self, model: str, timings: Timings) -> None:
        """The engine's own figures of one answer (engines/contract.py ``Timings``)."""
        for name, value in (("prompt_tokens", timings.prompt_tokens),
                            ("decode_tokens", timings.generated_tokens),
                            ("prompt_seconds", _seconds(timings.prompt_ms)),
                            ("decode_seconds", _seconds(timings.generated_ms))):
            if value is not None and value >= 0:
                self.engine[name].labels(model).inc(value)
        if timings.drafted_tokens:
            self.drafted.labels(model).inc(timings.drafted_tokens)
            self.accepted.labels(model).inc(timings.accepted_tokens)
            self.drafts.add(model, timings.drafted_tokens, timings.accepted_tokens)

    async def scrape(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class DraftTally:
    """Tokens drafted and accepted per model id since the start (speculative decoding), for
    the model object and ``bunkhouse ps`` (``/metrics`` has them as counters)."""

    def __init__(self) -> None:
        self._counts: dict[str, tuple[int, int]] = {}

    def add(self, model: str, drafted: int, accepted: int) -> None:
        d, a = self._counts.get(model, (0, 0))
        self._counts[model] = (d + drafted, a + min(accepted, drafted))

    def forget(self, model: str) -> None:
        self._counts.pop(model, None)

    def report(self, model: str) -> dict[str, Any]:
        """``draft_tokens``, ``draft_accepted_tokens`` and ``draft_acceptance`` (accepted /
        drafted; None before the first draft)."""
        drafted, accepted = self._counts.get(model, (0, 0))
        return {"draft_tokens": drafted, "draft_accepted_tokens": accepted,
                "draft_acceptance": round(accepted / drafted, 3) if drafted else None}


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000
