"""What ``serve`` checks before it starts anything (each failure a ConfigError, exit status 2,
before any model loads), and what it warns about as it starts."""

from __future__ import annotations

import logging
import resource
import socket
import subprocess
import sys

from bunkhouse.catalog import Catalog
from bunkhouse.config import Settings
from bunkhouse.errors import ConfigError

log = logging.getLogger("bunkhouse")


def check_before_start(settings: Settings, catalog: Catalog, budget: int) -> None:
    """Refuse a start that could only fail later; raise the open-files limit."""
    check_preload(catalog, settings.preload, budget)
    if settings.worker_engine:
        check_importable(settings.worker_engine)
    check_port_free(settings.host, settings.port)
    raise_open_files_limit()


def check_preload(catalog: Catalog, preload: tuple[str, ...], budget: int) -> None:
    """Every model to preload exists and fits the budget on its own (else ConfigError)."""
    from bunkhouse.residency.estimate import estimate

    for model_id in preload:
        need = estimate(catalog.get(model_id)).total
        if need > budget:
            raise ConfigError(f"--preload {model_id}: it needs {need // 2**20} MiB "
                              f"({need:,} bytes) and the memory budget is {budget // 2**20} MiB "
                              f"({budget:,} bytes); raise --budget or lower its context")


def check_importable(import_path: str) -> None:
    """A --worker-engine must name a class a worker can import (checked in a child process
    started as workers are, so that the front imports no engine)."""
    module, _, attr = import_path.partition(":")
    if not module or not attr:
        raise ConfigError(f"--worker-engine must be MODULE:CLASS, not {import_path!r}")
    check = (f"import importlib, sys; m = importlib.import_module({module!r}); "
             f"sys.exit(0 if hasattr(m, {attr!r}) else 1)")
    try:
        done = subprocess.run([sys.executable, "-c", check], capture_output=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        raise ConfigError(f"--worker-engine {import_path}: importing it took over 60 s") from e
    if done.returncode != 0:
        raise ConfigError(f"--worker-engine {import_path}: no such module or class for the "
                          "workers' Python")


def check_port_free(host: str, port: int) -> None:
    """Fail before any model loads if the address is taken (uvicorn binds only after the
    app's startup, which may preload models)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e}") from e
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}; is another "
                              "server using that port? Pick another with --port") from e


def raise_open_files_limit(target: int = 65536) -> None:
    """Raise this process's open-files soft limit towards ``target`` (within the hard limit),
    as nginx's worker_rlimit_nofile does: each client connection holds a descriptor, and the
    common default of 1,024 lets a thousand idle connections lock every client out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError) as e:
            log.warning("could not raise the open-files limit from %d: %s", soft, e)


def warn_at_start(settings: Settings, catalog: Catalog, budget: int) -> None:
    """Say what an operator should know before the first request: an open server, a switch
    that does nothing, models the budget can never hold."""
    from bunkhouse.front.site import is_loopback_bind

    if not is_loopback_bind(settings.host) and not settings.api_keys:
        log.warning("listening on %s without --api-key: anyone who can reach this address "
                    "can use every model; set keys (docs/security.md)", settings.host)
    if settings.allow_runtime_load and not settings.admin_keys:
        log.warning("--allow-runtime-load has no effect without an --admin-key")
    if settings.api_keys:
        log.info("inference endpoints need one of %d client key(s)", len(settings.api_keys))
    warn_never_fit(catalog, budget, cluster=settings.ray_address is not None)


def warn_never_fit(catalog: Catalog, budget: int, cluster: bool = False) -> None:
    """Say at start which models the budget can never hold (each would answer 503);
    ``cluster``: ``budget`` is the largest Ray node's."""
    import psutil

    from bunkhouse.residency.estimate import estimate

    ram = psutil.virtual_memory().total
    if budget > ram and not cluster:
        log.warning("the memory budget of %d MiB is more than this machine's %d MiB of RAM: "
                    "models may be loaded until the system runs out of memory",
                    budget // 2**20, ram // 2**20)
    for model in catalog.bases():  # an adapter counts in its base's estimate
        need = estimate(model).total
        if need > budget and cluster:
            log.warning("model %s needs about %d MiB, more than the largest node's budget of "
                        "%d MiB: every request for it will fail; raise that node's "
                        "bunkhouse_memory_mib resource or lower the model's context",
                        model.id, need // 2**20, budget // 2**20)
        elif need > budget:
            log.warning("model %s needs about %d MiB, more than the whole memory budget of %d "
                        "MiB: every request for it will fail; raise --budget or lower its "
                        "context", model.id, need // 2**20, budget // 2**20)
