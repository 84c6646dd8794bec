"""What a request's constraint costs the engine, measured before a shared worker meets it.

llama.cpp prepares a request's grammar, JSON schema, tool schemas and sampler lists on its
one scheduling loop, which every slot of the worker shares. Some shapes cost it tens of
seconds (a JSON schema ``{"enum": [3,000 strings]}`` on the chat route: 31 s of CPU on
2 cores), long enough for the worker to miss its liveness probes and be replaced, cutting
every other client's stream; a static reading (engines/grammar_cost.py) cannot foresee
every such shape. So each constraint is first run on its own in a disposable process
(worker/engines/llamacpp_probe.py: the same model with one slot, a 256-token context, one
thread), and the front watches that process's CPU time and memory:

- past :data:`MAX_CONSTRAINT_CPU_S` of CPU or :data:`MAX_CONSTRAINT_MEMORY` of memory more
  than the same prompt without the constraint, the process is killed and the request gets a
  400 naming the field; nothing reached a worker; the same if the engine dies on it;
- within them, the request goes on. The verdict is kept (:data:`VERDICTS`, by the model and
  the constraint's exact text), so a client repeating its tools or schema pays once.

One probe process runs at a time, for one model, and checks run one at a time: a process for
another model replaces it when it is idle, and it exits after :data:`PROBE_IDLE_S` unused.
Its memory is not counted in the residency budget: the model's weights are mapped from the
same file the worker maps (shared pages), the rest is about 100 MiB for a small model.
A check whose process gets no CPU for :data:`CHECK_WALL_S` (a machine saturated by others) is
a 503 ``server_busy``: the cost was not measured, and the request may be retried.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import itertools
import json
import logging
import os
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bunkhouse.catalog import CatalogModel
from bunkhouse.engines import engine_for
from bunkhouse.engines.contract import ConstraintCheck
from bunkhouse.errors import InvalidRequest, ServerBusy, StalledTooOften
from bunkhouse.supervisor.process import OpenedModel, open_model_file

log = logging.getLogger(__name__)

MAX_CONSTRAINT_CPU_S = 2.0
"""CPU seconds a constraint may add to a two-token answer. The liveness probe replaces a
worker whose loop misses two probes 5 s apart (defaults.PROBE_INTERVAL_S); this keeps what
one request may take from every other slot's stream inside that even when the machine is
busy. Measured on 2 cores with Qwen2.5-Coder 0.5B on the chat route: JSON mode 0.1 s, a
nested object schema 0.14 s, 20 tools of 10 parameters each 0.33 s, 128 optional
properties 0.46 s, an enum of 100 strings 0.8 s, of 500 strings 3.6 s, of 3,000 strings
31 s (benchmarks/constraint_costs.py)."""

MAX_CONSTRAINT_MEMORY = 256 * 1024 * 1024
"""Bytes of anonymous memory a constraint may add to the probe process (the enum of 3,000
strings took 80 MiB on the completion route)."""

PROBE_START_S = 120.0
"""Deadline for the probe process to load its model (a small model: 2-3 s)."""

CHECK_WALL_S = 60.0
"""Wall-clock ceiling of one check; reached only when the probe gets no CPU."""

PROBE_IDLE_S = 120.0
"""An unused probe process exits after this long."""

VERDICTS = 1024
"""Verdicts kept, most recently used first."""

MAX_STALLS = 2
STALL_WINDOW_S = 600.0
"""A client whose constraints stalled workers :data:`MAX_STALLS` times within
:data:`STALL_WINDOW_S` (a cost the probe could not see, after a fixed prefix) gets 429 for
any request with a constraint until the oldest stall is out of the window: each new variant
of a constraint would otherwise cut every other client's streams on that worker again."""

_KINDS = {"grammar": "grammar", "json_schema": "JSON schema", "response_format": "output format",
          "tools": "tools' schemas"}  # else: sampler lists
_POLL_S = 0.02
_PROMPT_FIELDS = frozenset({"messages", "max_tokens", "prompt", "n_predict", "stream",
                            "cache_prompt"})
_SERIAL = itertools.count()


_EXITED_S = 5.0
"""Seconds to wait for a probe process that exited to close its stdout."""


@dataclass
class _Probe:
    key: tuple[str, str, int, str]
    proc: asyncio.subprocess.Process
    process: psutil.Process
    opened: OpenedModel
    baselines: dict[str, tuple[float, int]] = field(default_factory=dict)
    used: float = field(default_factory=time.monotonic)

    def usage(self) -> tuple[float, int]:
        """CPU seconds so far, anonymous resident bytes now."""
        cpu = self.process.cpu_times()
        memory = self.process.memory_info()
        return cpu.user + cpu.system, memory.rss - memory.shared

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        self.opened.close()


class TooCostly(Exception):
    """A constraint went past a bound in the probe (the message says which)."""


class ConstraintGate:
    """The one owner of the probe process and the verdicts (module doc)."""

    def __init__(self, cpu_limit_s: float = MAX_CONSTRAINT_CPU_S,
                 memory_limit: int = MAX_CONSTRAINT_MEMORY) -> None:
        self.cpu_limit_s = cpu_limit_s
        self.memory_limit = memory_limit
        self._lock = asyncio.Lock()
        self._probe: _Probe | None = None
        self._verdicts: OrderedDict[bytes, str] = OrderedDict()  # "": within bounds
        self._idle: asyncio.TimerHandle | None = None
        self._stalls: dict[str, collections.deque[float]] = {}  # by client: when

    async def check(self, model: CatalogModel, path: str, body: dict[str, Any],
                    client: str = "") -> bool:
        """Raise InvalidRequest (400, naming the field) for a constraint in the worker-bound
        ``body`` that costs past the bounds, ServerBusy (503) when it could not be measured,
        StalledTooOften (429) when ``client``'s constraints stalled workers too often lately;
        return whether ``body`` has any, once every one is within them."""
        checks = engine_for(model).constraint_checks(path, body)
        if checks:
            self._refuse_stalling(client)
        for check in checks:
            key = _key(model, check)
            verdict = self._verdicts.get(key)
            if verdict is None:
                async with self._lock:
                    verdict = self._verdicts.get(key)
                    if verdict is None:
                        verdict = await self._measure(model, check)
            self._keep(key, verdict)
            if verdict:
                raise _too_costly(check, verdict)
        return bool(checks)

    def refuse_known(self, model: CatalogModel, path: str, body: dict[str, Any],
                     client: str = "") -> None:
        """What :meth:`check` would refuse without measuring anything (a client whose
        constraints stall workers too often, a constraint already found too costly): raised
        before the model's lease, so that such a request never waits for a load."""
        checks = engine_for(model).constraint_checks(path, body)
        if checks:
            self._refuse_stalling(client)
        for check in checks:
            verdict = self._verdicts.get(_key(model, check))
            if verdict:
                raise _too_costly(check, verdict)

    def blame(self, model: CatalogModel, path: str, body: dict[str, Any],
              client: str = "") -> str:
        """``body``'s constraints stalled a worker though they passed the probe (their cost
        came after its two tokens): each is refused from now on, and the stall counts
        against ``client`` (:data:`MAX_STALLS`). Returns the field to name."""
        checks = engine_for(model).constraint_checks(path, body)
        for check in checks:
            self._keep(_key(model, check), "stalled a worker")
        self._stalls.setdefault(client, collections.deque()).append(time.monotonic())
        return checks[0].param if checks else "grammar"

    def _refuse_stalling(self, client: str) -> None:
        stalls = self._stalls.get(client)
        if not stalls:
            return
        now = time.monotonic()
        while stalls and stalls[0] <= now - STALL_WINDOW_S:
            stalls.popleft()
        if not stalls:
            del self._stalls[client]
        elif len(stalls) >= MAX_STALLS:
            raise StalledTooOften(
                f"this client's requests stalled a worker {len(stalls)} times in the last "
                f"{STALL_WINDOW_S / 60:.0f} minutes; its requests with a grammar, a schema, "
                "tools or sampler lists are refused until then; simplify them",
                retry_after_s=stalls[0] + STALL_WINDOW_S - now)

    def _keep(self, key: bytes, verdict: str) -> None:
        self._verdicts[key] = verdict
        self._verdicts.move_to_end(key)
        while len(self._verdicts) > VERDICTS:
            self._verdicts.popitem(last=False)

    async def cost(self, model: CatalogModel, check: ConstraintCheck) -> tuple[float, int]:
        """CPU seconds and bytes of memory ``check`` adds to the same prompt without it.
        Raises TooCostly past the bounds (the probe process is killed), ServerBusy when it
        could not be measured."""
        async with self._lock:
            return await self._cost(model, check)

    async def _measure(self, model: CatalogModel, check: ConstraintCheck) -> str:
        """"" within bounds, else what it exceeded. The lock is held."""
        try:
            await self._cost(model, check)
        except TooCostly as e:
            log.warning("model %s: %s refused: it %s in the constraint probe", model.id,
                        check.param, e)
            return str(e)
        return ""

    async def _cost(self, model: CatalogModel, check: ConstraintCheck) -> tuple[float, int]:
        probe = await self._probe_for(model)
        baseline = probe.baselines.get(check.route)
        if baseline is None:
            body = {k: v for k, v in check.body.items() if k in _PROMPT_FIELDS}
            await self._run(probe, check.route, body, None)  # warms the prompt cache
            baseline = await self._run(probe, check.route, body, None)
            probe.baselines[check.route] = baseline
        try:
            cpu, memory = await self._run(probe, check.route, check.body, baseline)
        finally:
            self._arm_idle()
        return cpu - baseline[0], memory - baseline[1]

    async def _run(self, probe: _Probe, route: str, body: dict[str, Any],
                   baseline: tuple[float, int] | None) -> tuple[float, int]:
        """Run one request in the probe; its CPU seconds and the memory after it. Raises
        TooCostly (and kills the probe) past the bounds over ``baseline``."""
        assert probe.proc.stdin is not None and probe.proc.stdout is not None
        cpu0, _ = probe.usage()
        probe.proc.stdin.write(json.dumps({"route": route, "body": body}).encode() + b"\n")
        reply = asyncio.ensure_future(probe.proc.stdout.readline())
        deadline = time.monotonic() + CHECK_WALL_S
        try:
            while True:
                done, _ = await asyncio.wait({reply}, timeout=_POLL_S)
                try:
                    cpu, memory = probe.usage()
                except psutil.Error:  # it exited: its stdout ends at once
                    await asyncio.wait({reply}, timeout=_EXITED_S)
                    done, (cpu, memory) = {reply}, (cpu0, 0)
                if done:
                    if not reply.done() or not reply.result():  # the engine died on it
                        if baseline is not None:
                            raise TooCostly("crashed the engine")
                        raise ServerBusy("the constraint probe exited; retry")
                    probe.used = time.monotonic()
                    return cpu - cpu0, memory
                if baseline is not None:
                    if cpu - cpu0 > baseline[0] + self.cpu_limit_s:
                        raise TooCostly(f"took over {self.cpu_limit_s:g} s of CPU")
                    if memory > baseline[1] + self.memory_limit:
                        raise TooCostly(
                            f"took over {self.memory_limit >> 20} MiB of memory")
                if time.monotonic() > deadline:
                    raise ServerBusy("the machine is too busy to measure this request's "
                                     "constraint; retry")
        except BaseException:
            reply.cancel()
            self._drop()
            raise

    async def _probe_for(self, model: CatalogModel) -> _Probe:
        key = (model.id, str(model.path), model.size_bytes, model.chat_template or "")
        if self._probe is not None and (self._probe.key != key
                                        or self._probe.proc.returncode is not None):
            self._drop()
        if self._probe is None:
            self._probe = await _start(model, key)
        return self._probe

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = asyncio.get_running_loop().call_later(PROBE_IDLE_S, self._idle_out)

    def _idle_out(self) -> None:
        if not self._lock.locked():
            self._drop()

    def _drop(self) -> None:
        if self._probe is not None:
            self._probe.kill()
            self._probe = None

    def close(self) -> None:
        """Kill the probe process (the front's shutdown)."""
        if self._idle is not None:
            self._idle.cancel()
        self._drop()


def _too_costly(check: ConstraintCheck, verdict: str) -> InvalidRequest:
    return InvalidRequest(  # the protocols name the field (param) their way
        f"this request's {_KINDS.get(check.param, 'sampler lists')} would cost the engine "
        f"too much to prepare ({verdict}); simplify it: fewer alternatives, enum values or "
        "optional properties", param=check.param)


def _key(model: CatalogModel, check: ConstraintCheck) -> bytes:
    text = json.dumps([model.id, str(model.path), model.size_bytes, model.chat_template,
                       check.param, check.route, check.body], sort_keys=True)
    return hashlib.sha256(text.encode()).digest()


async def _start(model: CatalogModel, key: tuple[str, str, int, str]) -> _Probe:
    """The probe process for ``model``, loaded; ServerBusy when it cannot start."""
    module = engine_for(model).probe_module
    assert module is not None
    # a split model's links to its parts (made with mode 0700; removed with the probe)
    link_dir = Path(tempfile.gettempdir()) / f"bunkhouse-probe-{os.getpid()}-{next(_SERIAL)}"
    opened = open_model_file(model, link_dir)
    argv = [sys.executable, "-m", module, "--model-path", opened.worker_path]
    if model.chat_template:
        argv += ["--chat-template", model.chat_template]
    log.info("model %s: starting its constraint probe", model.id)
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, pass_fds=opened.fds, start_new_session=True)
    opened.close_descriptors()  # the probe has its copies
    probe = _Probe(key, proc, psutil.Process(proc.pid), OpenedModel((), "", opened.link_dir))
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), PROBE_START_S)
    except TimeoutError:
        probe.kill()
        raise ServerBusy(f"model {model.id!r}: its constraint probe did not load in "
                         f"{PROBE_START_S:g} s; retry") from None
    except BaseException:
        probe.kill()
        raise
    if not line:
        probe.kill()
        raise ServerBusy(f"model {model.id!r}: its constraint probe could not load the model "
                         f"(exit code {await proc.wait()}); retry")
    return probe
