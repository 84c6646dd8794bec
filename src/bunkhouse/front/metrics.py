"""``GET /metrics``: residency in Prometheus' text format, written by ``prometheus-client``.

A collector reads residency's own state at each scrape (no second copy of it to keep in
step): each model's state, estimated and measured bytes, leases, running and queued
requests; the budget, used and peak bytes; residency events by kind (loads, evictions,
crashes, restarts: ``EventLog.counts``). The per-model label is ``model``, whose values come
from the catalog only, so a client cannot grow the label set.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from bunkhouse.residency.manager import ResidencyManager

STATES = ("absent", "loading", "ready", "draining", "failed")


class ResidencyCollector(Collector):
    def __init__(self, residency: ResidencyManager) -> None:
        self.residency = residency

    def collect(self) -> Iterator[Metric]:
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
                      ("queued_requests", "requests waiting for a slot"))}
        for s in r.statuses():
            for name in STATES:
                state.add_metric([s.id, name], 1.0 if s.state == name else 0.0)
            slots = r.slots(s.id)
            gauges["estimated_bytes"].add_metric([s.id], s.estimated_bytes)
            gauges["measured_bytes"].add_metric([s.id], s.measured_bytes or 0)
            gauges["leases"].add_metric([s.id], s.leases)
            gauges["running_requests"].add_metric([s.id], slots.running)
            gauges["queued_requests"].add_metric([s.id], slots.waiting)
        yield state
        yield from gauges.values()
        for name, doc, value in (
                ("budget_bytes", "memory all workers together may use", r.options.budget_bytes),
                ("used_bytes", "memory the resident models hold", r.used_bytes()),
                ("peak_used_bytes", "the most they held at once", r.peak_bytes)):
            yield GaugeMetricFamily(f"bunkhouse_{name}", doc, value=value)
        events = CounterMetricFamily("bunkhouse_residency_events",
                                     "residency events by kind (loading, ready, draining, "
                                     "crashed, ...)", labels=["kind"])
        for kind, count in sorted(r.events.counts.items()):
            events.add_metric([kind], count)
        yield events


class Metrics:
    def __init__(self, residency: ResidencyManager) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ResidencyCollector(residency))

    async def scrape(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
