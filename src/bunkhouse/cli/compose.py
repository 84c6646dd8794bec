"""The composition root of ``bunkhouse serve``: the one place that builds the object graph
(the catalog, the event log, the KV snapshot keeper, the worker launcher, residency, the
HTTP app) from Settings, and starts the server.

Read ``serve`` top to bottom for the order things are made in; each part is a small
function below it. Nothing else in bunkhouse constructs these parts for a real server."""

from __future__ import annotations

import argparse
import logging
import shutil
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import uvicorn

from bunkhouse import defaults
from bunkhouse.catalog import Catalog, build_catalog
from bunkhouse.cli.prestart import check_before_start, warn_at_start
from bunkhouse.cli.server import Server
from bunkhouse.cli.settings import settings_from
from bunkhouse.config import Settings
from bunkhouse.engines import ENGINES, LLAMA_SERVER
from bunkhouse.residency.events import EventLog

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from bunkhouse.cluster.front import Cluster
    from bunkhouse.front.auth import Keys
    from bunkhouse.front.pulls import Pulls
    from bunkhouse.front.reload import Reloader
    from bunkhouse.front.response_store import ResponseStore
    from bunkhouse.kvcache.keeper import SnapshotKeeper
    from bunkhouse.residency.manager import ResidencyManager
    from bunkhouse.supervisor.launcher import LocalLauncher

log = logging.getLogger("bunkhouse")

Rebuild = Callable[[], "tuple[Catalog, Keys]"]


def catalog_of(settings: Settings) -> Catalog:
    """The catalog ``settings`` describe; a configured model's engine must be one there is.
    The llama-server engine is told its binary first (it is inspected at its first use)."""
    LLAMA_SERVER.locate(settings.llama_server)
    return build_catalog(settings, engines=ENGINES)


def reread(args: argparse.Namespace) -> tuple[Catalog, Keys]:
    """The catalog the configuration describes now and the keys its key files hold, for
    reloads (SIGHUP, ``POST /admin/reload``): key files are read again, so a rotated key
    applies."""
    from bunkhouse.front.auth import Keys

    again = settings_from(args)
    return catalog_of(again), Keys(again.api_keys, again.admin_keys)


def serve(settings: Settings, catalog: Catalog, rebuild: Rebuild | None = None) -> int:
    """Serve until stopped. ``rebuild()``: the catalog the configuration describes now and
    the keys its key files hold, for reloads (SIGHUP, ``POST /admin/reload``)."""
    from bunkhouse.front.auth import Keys
    from bunkhouse.front.pulls import Pulls
    from bunkhouse.front.reload import Reloader
    from bunkhouse.residency.estimate import default_budget_bytes

    budget = settings.budget_bytes or default_budget_bytes()
    cluster = _cluster(settings, catalog)
    if cluster is not None:
        if settings.budget_bytes:
            log.warning("--budget is not used with --ray: each node's budget is its "
                        "bunkhouse_memory_mib resource, else half its memory")
        budget = max(n.budget for n in cluster.nodes.values())  # the preload check's
    check_before_start(settings, catalog, budget)
    events = EventLog()
    keeper = _snapshot_keeper(settings, events, cluster)
    launcher = _launcher(settings, keeper)
    residency = _residency(settings, catalog, budget, launcher, events, keeper, cluster)
    keys = Keys(settings.api_keys, settings.admin_keys)
    reloader = Reloader(rebuild, residency, keys) if rebuild else None
    pulls = Pulls(settings.data_dir, events, _reloading(reloader) if reloader else None)
    app = _app(settings, catalog, residency, launcher=launcher, keeper=keeper, keys=keys,
               reloader=reloader, pulls=pulls, cluster=cluster)
    warn_at_start(settings, catalog, budget)
    where = (f"memory budget {budget // 2**20} MiB" if cluster is None else
             f"on {len(cluster.nodes)} Ray node(s) of {cluster.address}")
    serving = (f"serving {len(catalog)} model(s) on http://{settings.host}:{settings.port} "
               f"(default: {catalog.default_id}), {where}")
    server = Server(_uvicorn_config(app, settings), _stop_workers(residency, launcher),
                    settings.stop_grace_s, serving,
                    on_stop=_on_stop(residency, events, pulls))
    server.run()
    return 0 if server.started else 1


def _snapshot_keeper(settings: Settings, events: EventLog,
                     cluster: Cluster | None = None) -> SnapshotKeeper | None:
    """The KV snapshot keeper over its store (a store per node, with a cluster), or None
    when snapshots are off."""
    from bunkhouse.kvcache.keeper import KeeperOptions, SnapshotKeeper
    from bunkhouse.kvcache.nodes import NodeStores
    from bunkhouse.kvcache.store import SnapshotStore

    root = settings.kv_cache_dir
    limit = settings.kv_cache_max
    options = KeeperOptions(min_tokens=settings.kv_min_tokens)
    if limit == 0:
        log.info("KV snapshots off (--kv-cache-max 0)")
        return None
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if limit is None:
            free = shutil.disk_usage(root).free
            limit = min(int(free * defaults.KV_CACHE_DISK_SHARE), defaults.KV_CACHE_MAX_BYTES)
        if cluster is not None:
            nodes = NodeStores.open(root, limit)
            nodes.prune(set(cluster.nodes))
            cluster.snapshots = nodes
            log.info("KV snapshots per node in %s, at most %d MiB each (on the nodes that "
                     "see it: docs/scaling.md)", nodes.root, limit // 2**20)
            return SnapshotKeeper(nodes, events, options)
        store = SnapshotStore(root, limit)
    except OSError as e:
        log.warning("KV snapshots off: cannot use %s: %s; pass another --kv-cache-dir DIR",
                    root, e)
        return None
    log.info("KV snapshots in %s, at most %d MiB (%d kept, %d MiB)", root, limit // 2**20,
             len(store.snapshots()), store.stats.bytes // 2**20)
    return SnapshotKeeper(store, events, options)


def _launcher(settings: Settings, keeper: SnapshotKeeper | None) -> LocalLauncher:
    """What starts worker processes (and keeps the spare one)."""
    from bunkhouse.kvcache.keeper import OneStore
    from bunkhouse.supervisor.launcher import LocalLauncher
    from bunkhouse.supervisor.process import LaunchOptions

    local = keeper.stores if keeper is not None and isinstance(keeper.stores, OneStore) \
        else None  # with a cluster, each node's: its workers start there (cluster/front.py)
    return LocalLauncher(LaunchOptions(settings.ready_timeout_s, settings.stop_grace_s,
                                       settings.worker_engine),
                         snapshot_dir=local.worker_dir if local is not None else None)


def _cluster(settings: Settings, catalog: Catalog) -> Cluster | None:
    """The Ray cluster whose nodes run the workers (``--ray``), checked before serving:
    reachable, with a node that fits a model (a node too small for every model is named
    with a warning); None without ``--ray``."""
    if settings.ray_address is None:
        return None
    import os

    from bunkhouse.cluster.front import Cluster, check_cluster
    from bunkhouse.errors import ConfigError
    from bunkhouse.residency.estimate import estimate
    from bunkhouse.supervisor.process import LaunchOptions

    address = settings.ray_address
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "")
        if not address:
            raise ConfigError("--ray auto reads RAY_ADDRESS, which is not set; pass the "
                              "cluster's address (host:port of its head)")
    nodes = check_cluster(address)
    needs = sorted(estimate(m).total for m in catalog)
    if not nodes:
        raise ConfigError(f"--ray {address}: the Ray cluster has no alive node")
    small = [n for n in nodes if needs and n.budget < needs[0]]
    for n in small:
        log.warning("Ray node %s (%s) has a budget of %d MiB, too small for every model "
                    "(the smallest needs %d MiB): it gets no workers", n.id, n.address,
                    n.budget // 2**20, needs[0] // 2**20)
    if needs and len(small) == len(nodes):
        raise ConfigError(f"--ray {address}: no node's budget fits any model (the largest "
                          f"budget is {max(n.budget for n in nodes) // 2**20} MiB, the "
                          f"smallest model needs {needs[0] // 2**20} MiB); set each node's "
                          "bunkhouse_memory_mib resource (docs/scaling.md)")
    cluster = Cluster(address, LaunchOptions(settings.ready_timeout_s, settings.stop_grace_s,
                                             settings.worker_engine),
                      spares=settings.spare_worker)
    cluster.nodes = {n.id: n for n in nodes}  # as checked; the agent reports them again
    log.info("Ray cluster at %s: %s", address, ", ".join(
        f"{n.id[:12]} ({n.address}, {n.budget // 2**20} MiB)" for n in nodes))
    return cluster


def _residency(settings: Settings, catalog: Catalog, budget: int, launcher: LocalLauncher,
               events: EventLog, keeper: SnapshotKeeper | None,
               cluster: Cluster | None = None) -> ResidencyManager:
    """Which models are loaded, within the memory budget (each node's, with a cluster)."""
    from bunkhouse.residency.manager import ResidencyManager, ResidencyOptions

    # a cluster's start takes the node residency chose (``node=``): StartWorker's contract
    start: Callable[..., Awaitable[Any]] = \
        launcher.start if cluster is None else cluster.start_worker
    return ResidencyManager(
        catalog,
        ResidencyOptions(budget_bytes=budget, ttl_s=settings.ttl_s,
                         admission_wait_s=settings.admission_wait_s,
                         probe_interval_s=settings.probe_interval_s,
                         probe_timeout_s=settings.probe_interval_s,
                         local_node=cluster is None),
        start, events=events, flush=keeper.flush if keeper else None,
        spare=(launcher if cluster is None else cluster) if settings.spare_worker else None,
    )



def _response_store(settings: Settings) -> ResponseStore | None:
    """Where Responses API answers are stored, or None when none are (opened by the app)."""
    from bunkhouse.front.response_store import ResponseStore

    if settings.responses_keep == 0:
        log.info("responses not stored (--responses-keep 0)")
        return None
    return ResponseStore(settings.responses_db, settings.responses_keep,
                         settings.responses_max_age_s, settings.responses_max_bytes)


def _app(settings: Settings, catalog: Catalog, residency: ResidencyManager, *,
         launcher: LocalLauncher, keeper: SnapshotKeeper | None, keys: Keys,
         reloader: Reloader | None, pulls: Pulls, cluster: Cluster | None = None
         ) -> Starlette:
    """The front's HTTP app over residency."""
    from bunkhouse.front.admin import AdminOptions
    from bunkhouse.front.admission import ComputeGates
    from bunkhouse.front.app import FrontOptions, Parts, build_app
    from bunkhouse.front.site import SitePolicy
    from bunkhouse.front.waiting import WaitingOptions

    return build_app(catalog, residency, Parts(
        preload=settings.preload, on_shutdown=launcher.close, keeper=keeper, cluster=cluster,
        responses=_response_store(settings), keys=keys,
        compute=ComputeGates(enabled=settings.compute_gate, turn_s=settings.compute_turn_s,
                             suspend=residency.suspend, resume=residency.resume),
        reloader=reloader, pulls=pulls,
    ), FrontOptions(
        max_body_bytes=settings.max_body_bytes, max_audio_bytes=settings.max_audio_bytes,
        admin=AdminOptions(allow_runtime_load=settings.allow_runtime_load,
                           roots=settings.allowed_roots or settings.models_dirs,
                           defaults=settings.defaults, drain_grace_s=settings.stop_grace_s,
                           default_engine=settings.default_engine),
        site=SitePolicy.for_bind(settings.host, settings.allowed_hosts, settings.cors_origins),
        strict_context=settings.strict_context,
        waiting=WaitingOptions(ping_s=settings.sse_ping_s,
                               send_loading_state=settings.send_loading_state),
        cors_origins=settings.cors_origins))


def _uvicorn_config(app: Starlette, settings: Settings) -> uvicorn.Config:
    from bunkhouse.front.heads import HeadLimits, bounded_http

    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        # Only a last resort: Server cuts every stream cleanly after the grace, by then.
        timeout_graceful_shutdown=int(2 * settings.stop_grace_s) + 10,
        log_config=None,
        http=bounded_http(HeadLimits()),  # size, count and time bounds on request heads
    )


def _stop_workers(residency: ResidencyManager, launcher: LocalLauncher
                  ) -> Callable[[], Awaitable[None]]:
    async def stop_workers() -> None:
        await residency.close()
        launcher.close()

    return stop_workers


def _reloading(reloader: Reloader) -> Callable[[str], Awaitable[Any]]:
    """What a finished pull calls: the catalog re-read, with the pull's record."""
    return lambda name: reloader.reload(f"pulled {name}")


def _on_stop(residency: ResidencyManager, events: EventLog,
             pulls: Pulls) -> Callable[[], None]:
    def stopping() -> None:
        pulls.stop()  # first: a stop waits for no download (its followers' streams end)
        residency.stop_loads()  # the grace is for running requests, not for new loads
        if not events.closed:  # open streams would hold uvicorn's wait for connections
            events.emit("*", "stopping", "the server is stopping; event streams end")
            events.close()

    return stopping
