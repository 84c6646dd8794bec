"""What the front says of its models: ``GET /v1/models`` and ``/v1/models/{id}``, ``/health``
and ``/stats`` (the state of each model, the memory budget, the KV snapshots, events)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bunkhouse.catalog import Catalog, CatalogModel
from bunkhouse.engines import ENGINES
from bunkhouse.front.auth import Keys, Level
from bunkhouse.front.metrics import DraftTally
from bunkhouse.kvcache.keeper import SnapshotKeeper
from bunkhouse.residency.manager import ResidencyManager
from bunkhouse.residency.state import LOCAL


class ModelViews:
    """The model routes' answers, over one catalog and one residency manager."""

    def __init__(self, catalog: Catalog, residency: ResidencyManager, keys: Keys,
                 keeper: SnapshotKeeper | None = None, drafts: DraftTally | None = None
                 ) -> None:
        self.catalog = catalog
        self.residency = residency
        self.keys = keys
        self.keeper = keeper
        self.drafts = drafts or DraftTally()

    def model_object(self, model: CatalogModel, *, detail: bool = False) -> dict[str, Any]:
        """The model as ``GET /v1/models/{id}`` shows it; ``detail`` (admin-key callers only)
        adds ``last_error_detail``, the failed worker's last output."""
        base = self.catalog.served(model)[0] if model.adapter_of else model
        status = self.residency.status(base.id)  # an adapter is in its base's worker
        described = {
            "id": model.id,
            "object": "model",
            "created": model.modified,
            "owned_by": "bunkhouse",
            "state": status.state,
            "source": model.source,
            "kind": base.kind,  # chat, completion, embedding or transcription
            "architecture": model.info.architecture,
            "size_bytes": model.size_bytes,
            "aliases": list(model.aliases),
            "context": None if model.transcribes else model.options.context,
            "parallel": model.options.parallel,
            "slot_context": None if model.transcribes else
            model.options.context // model.options.parallel,
            "trained_context": model.info.context_length,
            "chat_template": base.has_chat_template,
            "engine": model.engine,
            "embeddings": base.embeddings,
            "default": model.id == self.catalog.default_id,
            "pinned": status.pinned,
            "leases": status.leases,
            "running": self.residency.slots(base.id).running,
            "queued": self.residency.slots(base.id).waiting,
            "waiting": status.waiting,  # for a lease: its load, memory, a pause
            "queue": model.options.queue,
            "last_used": status.last_used,
            "estimated_bytes": status.estimated_bytes,
            "measured_bytes": status.measured_bytes,
            "pid": status.pid,
            "last_error": status.last_error,
        }
        if status.node is not None and status.node != LOCAL:  # a cluster's node (Ray's id)
            described["node"] = status.node
        if base.refused and status.state in ("absent", "failed"):  # listed, never loaded
            described.update(state="failed", last_error=f"cannot be served under its "
                             f"options: {base.refused}")
        options = ENGINES[base.engine].shown_options(base)
        if options:
            described["options"] = options
        if options.get("speculative"):
            described.update(self.drafts.report(model.id))
        if model.adapter_of is not None:  # vLLM's and Ray Serve's way to show an adapter
            described.update(parent=model.adapter_of, scale=model.scale)
        elif model.adapters:
            described.update(adapters=[a.id for a in model.adapters],
                             default_adapter=model.default_adapter)
        if model.projector is not None:  # noted; images are not served yet
            described["projector"] = model.projector.name
        if self.keeper is not None and model.adapter_of is None:
            described["kv_cache"] = self.keeper.model_report(model.id, detail)
        if detail:
            described["last_error_detail"] = status.last_error_detail
        return described

    def is_admin(self, request: Request) -> bool:
        return self.keys.level_of(request) is Level.ADMIN

    async def list_models(self, request: Request) -> Response:
        detail = self.is_admin(request)
        data = [self.model_object(m, detail=detail) for m in self.catalog]
        return JSONResponse({"object": "list", "data": data})

    async def get_model(self, request: Request) -> Response:
        model = self.catalog.get(request.path_params["model_id"])
        return JSONResponse(self.model_object(model, detail=self.is_admin(request)))

    async def health(self, request: Request) -> Response:
        """Liveness, open to all; each model's state only to a caller the client key (or
        its absence) admits."""
        if self.keys.level_of(request) < Level.CLIENT:
            return JSONResponse({"status": "ok"})
        states = {s.id: s.state for s in self.residency.statuses()}
        return JSONResponse({"status": "ok", "models": states})

    async def stats(self, request: Request) -> Response:
        r = self.residency
        detail = self.is_admin(request)
        nodes = r.nodes()
        budget, used = sum(n["budget_bytes"] for n in nodes), r.used_bytes()
        return JSONResponse({
            "nodes": nodes,
            "budget_bytes": budget,
            "used_bytes": used,
            "free_bytes": budget - used,
            "peak_used_bytes": r.peak_bytes,
            "models": [self.model_object(m, detail=detail) for m in self.catalog],
            "kv_cache": self.keeper.report(detail) if self.keeper else None,
            "pause": r.pause_status(),  # an operator's pause (POST /admin/pause)
            "spare_worker": r.spare_status(),  # the worker kept for the next load, if any
            "event_counts": r.events.counts,
            "events": [e.as_dict(detail) for e in r.events.recent(100)],
        })
