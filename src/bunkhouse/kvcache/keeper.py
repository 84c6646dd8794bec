"""The snapshot keeper: when slots are saved to the snapshot store, and when one is restored.

One keeper per front, over one :class:`SnapshotStore` (with a cluster, one per node:
kvcache/nodes.py, each model's snapshots in its worker's node's store). It owns the
decisions; the store owns the files, the slot gate (residency/slots.py) what each slot holds.

- **Restore.** A request whose prompt is at least :attr:`KeeperOptions.min_tokens` tokens is
  tokenized by its model's worker (template and tokenizer); the slot gate gives it the slot
  that already holds most of it. If a snapshot shares a longer prefix with it, by at least
  ``min_tokens``, the snapshot is restored into that slot first, and the request is sent to
  that slot (the engine contract's ``slot``). Whatever the slot held that the request would
  overwrite, unsaved and ``min_tokens`` or more, is saved first: a conversation pushed out of
  its slot comes back from disk.
- **Check.** The engine's own count of the prompt tokens it reused
  (``Timings.cached_tokens``) tells whether a restore saved the prefill. One that did not (a
  sliding-window model that prefills everything again, for one) is a *miss*: counted, logged
  with its reason, and the model's snapshots are not restored again under that key (a
  changed configuration makes a new key). A model whose worker runs on another node than
  its snapshots starts cold: a miss too, once per node, with that reason.
- **Save.** A slot that stays idle for :attr:`KeeperOptions.idle_flush_s` after a request is
  saved in the background (so a worker killed later loses at most its last turn); every
  unsaved slot is saved when its model is drained (eviction, ttl, unload, shutdown), one
  model at a time. Short slots (under ``min_tokens``) are not kept.

Every save and restore is an event in the residency event log (``flushed``, ``restored``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bunkhouse import defaults
from bunkhouse.api.schemas import text_bytes
from bunkhouse.catalog import CatalogModel
from bunkhouse.engines import engine_for
from bunkhouse.engines.contract import EngineClient, Timings
from bunkhouse.errors import BunkhouseError
from bunkhouse.kvcache.nodes import NodeStores
from bunkhouse.kvcache.store import (
    Snapshot,
    SnapshotKey,
    SnapshotRefused,
    SnapshotStore,
    StoreStats,
    TooLarge,
    common_prefix,
)
from bunkhouse.residency.events import EventLog
from bunkhouse.residency.slots import Slot, SlotGate

log = logging.getLogger(__name__)

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class KeeperOptions:
    min_tokens: int = defaults.KV_MIN_TOKENS
    idle_flush_s: float = defaults.KV_IDLE_FLUSH_S
    flush_timeout_s: float = defaults.KV_FLUSH_TIMEOUT_S


Prime = Callable[[int], Awaitable[None]]
"""Runs one token (a prompt's first) in a slot under a request's adapter setting."""


@dataclass(frozen=True, slots=True)
class Restore:
    """A snapshot restored into a request's slot: ``shared`` tokens of the prompt it holds."""

    snapshot: Snapshot
    shared: int
    prompt: int  # the request's prompt tokens
    key: SnapshotKey | None = None  # the key it was found under


@dataclass
class FlushReport:
    """One flush of one model's slots."""

    reason: str
    at: float = 0.0  # wall clock
    saved: int = 0
    saved_bytes: int = 0
    saved_tokens: int = 0
    skipped: int = 0  # too short to keep
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self, detail: bool = True) -> dict[str, Any]:
        """``detail``: the failures' messages too, as ``failures`` (they may name server
        paths: admins only)."""
        out = {"reason": self.reason, "at": self.at, "saved": self.saved,
               "saved_bytes": self.saved_bytes, "saved_tokens": self.saved_tokens,
               "skipped": self.skipped, "failed": len(self.failed),
               "seconds": round(self.seconds, 3)}
        if detail:
            out["failures"] = self.failed
        return out


@dataclass
class ModelCounts:
    """One model's snapshot activity since the front started."""

    saved: int = 0
    restored: int = 0  # restores whose prefill the engine then skipped
    missed: Counter[str] = field(default_factory=Counter)  # reason -> count
    failed: int = 0
    prefill_saved_tokens: int = 0
    recent: deque[FlushReport] = field(default_factory=lambda: deque(maxlen=8))

    @property
    def last_flush(self) -> FlushReport | None:
        return self.recent[-1] if self.recent else None


class OneStore:
    """The front's one store (no cluster): every model's snapshots are in it."""

    def __init__(self, store: SnapshotStore) -> None:
        self.root = store.root
        self.max_bytes = store.max_bytes
        self._store = store

    def of(self, model_id: str) -> SnapshotStore:
        return self._store

    def worker_dir(self, model_id: str) -> Path | None:
        return self._store.worker_dir(model_id)

    def elsewhere(self, model_id: str) -> str | None:
        return None

    def all(self) -> list[SnapshotStore]:
        return [self._store]


class SnapshotKeeper:
    def __init__(self, store: SnapshotStore | NodeStores, events: EventLog,
                 options: KeeperOptions | None = None) -> None:
        self.stores = store if isinstance(store, NodeStores) else OneStore(store)
        self.events = events
        self.options = options or KeeperOptions()
        self._counts: dict[str, ModelCounts] = {}
        self._disabled: dict[SnapshotKey, str] = {}  # key -> why its restores missed
        self._cold: set[tuple[str, Path]] = set()  # (model, store) counted as placed away
        self._flushing = asyncio.Lock()  # drains flush one model at a time
        self._timers: set[asyncio.TimerHandle] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        events.on_forget(self.forget)

    def forget(self, model_id: str) -> None:
        """A model gone for good: its counts go, and its directory if it holds no snapshot
        (snapshots stay until they are purged or pushed out, for an id registered again)."""
        self._counts.pop(model_id, None)
        for store in self.stores.all():
            store.drop_empty(model_id)

    # -- keys ---------------------------------------------------------------------------

    def key(self, model: CatalogModel, setting: str = "") -> SnapshotKey | None:
        """What a snapshot of ``model`` must match to be restored; None: its engine cannot
        save slots, or the model file cannot be read. ``setting``: the LoRA adapter setting
        the slot's KV state was computed under (residency/slots.py ``Slot.setting``; "" the
        base alone): KV state computed under one adapter is never another's."""
        engine = engine_for(model)
        layout = engine.snapshot_layout(model)
        if layout is None:
            return None
        if setting:
            layout = {**layout, "adapter": setting}
        try:
            st = model.path.stat()
        except OSError:
            return None
        fingerprint = f"{model.path}|{st.st_size}|{st.st_mtime_ns}"
        return SnapshotKey.of(fingerprint, engine.build, layout)

    def active(self, model: CatalogModel) -> bool:
        key = self.key(model)
        return key is not None and key not in self._disabled \
            and self.stores.of(model.id) is not None

    def counts(self, model_id: str) -> ModelCounts:
        return self._counts.setdefault(model_id, ModelCounts())

    # -- a request -----------------------------------------------------------------------

    async def prompt_tokens(self, model: CatalogModel, engine: EngineClient, path: str,
                            data: dict[str, Any]) -> list[int] | None:
        """The prompt's tokens as the engine will prefill them, when it may be worth a
        snapshot (one prompt, one answer, at least ``min_tokens`` long); else None. For a
        model the caller found :meth:`active`."""
        if data.get("n", 1) != 1:
            return None
        if path == "/v1/chat/completions":
            messages = data.get("messages")
            if not isinstance(messages, list) or text_bytes(data) < self.options.min_tokens:
                return None
            prompt: str | dict[str, Any] = data  # the engine templates what it reads of it
        elif path == "/v1/completions":
            raw = data.get("prompt")
            if isinstance(raw, list) and len(raw) == 1:
                raw = raw[0]
            if isinstance(raw, list) and all(type(t) is int for t in raw):
                return list(raw) if len(raw) >= self.options.min_tokens else None
            if not isinstance(raw, str) or len(raw.encode()) < self.options.min_tokens:
                return None
            prompt = raw
        else:
            return None
        try:
            tokens = await engine.tokenize(prompt)
        except BunkhouseError as e:
            log.info("model %s: prompt not tokenized for snapshots: %s", model.id, e.message)
            return None
        return tokens if len(tokens) >= self.options.min_tokens else None

    async def prepare(self, model: CatalogModel, engine: EngineClient, slot: Slot,
                      tokens: Sequence[int] | None, setting: str = "",
                      prime: Prime | None = None) -> Restore | None:
        """Make ``slot`` (taken by a request) hold as much of ``tokens`` as can be had: save
        what the request would overwrite, restore the best snapshot. Returns the restore to
        :meth:`check` once the request ends; None if nothing was restored. ``setting``: the
        request's adapter setting; ``prime(token)``: runs one token in the slot under it,
        before a restore into a slot last run under another (an engine drops a slot's KV
        state when the setting changes: it must do so before the restore, not after)."""
        key = self.key(model, setting)
        store = self.stores.of(model.id)
        if key is None or slot.id < 0 or store is None:
            return None
        restore = None
        async with slot.lock:
            live = common_prefix(slot.held, tokens) \
                if slot.held and tokens and (slot.setting or "") == setting else 0
            displaced = self._slot_key(model, slot)
            if slot.dirty and slot.held is not None and displaced is not None \
                    and len(slot.held) - live >= self.options.min_tokens:
                await self._save(model, engine, slot, displaced, slot.version, "displaced")
            if tokens and key not in self._disabled and store.has(model.id):
                restore = await self._restore(model, store, engine, slot, key, tokens, live,
                                              prime if slot.setting != setting else None)
            elif tokens and key not in self._disabled:
                self._placed_away(model.id, store)
            slot.held = tuple(tokens) if tokens else None
            slot.setting = setting
        return restore

    def _slot_key(self, model: CatalogModel, slot: Slot) -> SnapshotKey | None:
        """The key of what ``slot`` holds: under its adapter setting (None for a model with
        adapters whose slot's setting is not known: it is not saved under a guess)."""
        if not model.adapters:
            return self.key(model)
        return None if slot.setting is None else self.key(model, slot.setting)

    def _placed_away(self, model_id: str, store: SnapshotStore) -> None:
        """The model has no snapshot in its worker's node's store: if another node holds
        some, it starts cold here, counted once as a miss saying where they are."""
        if (model_id, store.root) in self._cold:
            return
        node = self.stores.elsewhere(model_id)
        if node is None:
            return
        self._cold.add((model_id, store.root))
        reason = f"its snapshots are on node {node}, its worker on another"
        self.counts(model_id).missed[reason] += 1
        log.info("model %s: %s: it starts cold there", model_id, reason)
        self.events.emit(model_id, "restore_missed", reason)

    async def _restore(self, model: CatalogModel, store: SnapshotStore, engine: EngineClient,
                       slot: Slot, key: SnapshotKey, tokens: Sequence[int], live: int,
                       prime: Prime | None = None) -> Restore | None:
        least = max(self.options.min_tokens, live + self.options.min_tokens)
        try:
            snapshot = await asyncio.to_thread(store.find, model.id, key, tokens, least)
        except OSError as e:  # the directory itself: the request goes on without it
            self.counts(model.id).failed += 1
            log.warning("model %s: snapshots not searched: %s", model.id, e)
            return None
        if snapshot is None:
            return None
        started = time.monotonic()
        try:
            if prime is not None:
                await prime(tokens[0])
            restored = await engine.restore_slot(slot.id, snapshot.filename)
        except BunkhouseError as e:
            self.counts(model.id).failed += 1
            log.warning("model %s: snapshot %s not restored into slot %d: %s", model.id,
                        snapshot.digest, slot.id, e.message)
            slot.held, slot.dirty = None, True  # whatever the engine left there
            return None
        if restored.tokens != len(snapshot.tokens):
            self.counts(model.id).failed += 1
            log.warning("model %s: snapshot %s restored %d tokens of %d", model.id,
                        snapshot.digest, restored.tokens, len(snapshot.tokens))
            slot.held, slot.dirty = None, True
            return None
        shared = common_prefix(snapshot.tokens, tokens)
        self.events.emit(model.id, "restored",
                         f"{shared} of {len(tokens)} prompt tokens into slot {slot.id} "
                         f"({snapshot.bytes // MIB} MiB in "
                         f"{(time.monotonic() - started) * 1000:.0f} ms)")
        return Restore(snapshot, shared, len(tokens), key)

    def check(self, model: CatalogModel, restore: Restore, timings: Timings) -> None:
        """Whether the restore saved the prefill, by the engine's own counts."""
        reused, prefilled = timings.cached_tokens, timings.prompt_tokens
        counts = self.counts(model.id)
        if reused * 2 >= restore.shared:
            counts.restored += 1
            counts.prefill_saved_tokens += reused
            return
        reason = (f"the engine reused {reused} of {restore.shared} restored tokens and "
                  f"prefilled {prefilled}")
        counts.missed[reason] += 1
        key = restore.key or self.key(model)
        if key is not None:
            self._disabled[key] = reason
        hint = engine_for(model).restore_hint(model)
        hint = f" ({hint})" if hint else ""
        log.warning("model %s: a restored snapshot did not save the prefill (%s); its "
                    "snapshots are not restored again until its configuration changes%s",
                    model.id, reason, hint)
        self.events.emit(model.id, "restore_missed", reason)

    # -- saving ---------------------------------------------------------------------------

    def slot_idle(self, model: CatalogModel, engine: EngineClient, gate: SlotGate,
                  slot: Slot) -> None:
        """A request left ``slot``: save it if it stays idle for ``idle_flush_s``."""
        if self._slot_key(model, slot) is None or slot.id < 0:
            return
        version = slot.version
        loop = asyncio.get_running_loop()

        def due() -> None:
            self._timers.discard(timer)
            if slot.busy or slot.version != version or not slot.dirty or slot not in gate.table:
                return
            task = loop.create_task(self._save_idle(model, engine, slot, version))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        timer = loop.call_later(self.options.idle_flush_s, due)
        self._timers.add(timer)

    async def _save_idle(self, model: CatalogModel, engine: EngineClient, slot: Slot,
                         version: int) -> None:
        key = self._slot_key(model, slot)
        if key is None:
            return
        async with slot.lock:
            if slot.busy or slot.version != version or not slot.dirty:
                return
            report = FlushReport("idle", at=time.time())
            await self._save(model, engine, slot, key, version, "idle", report)
        if report.saved or report.failed:
            self._flushed(model.id, report)

    async def flush(self, model: CatalogModel, engine: EngineClient, gate: SlotGate,
                    reason: str) -> FlushReport:
        """Save every unsaved idle slot of the model's worker (its drain: nothing runs)."""
        report = FlushReport(reason, at=time.time())
        key = self.key(model)
        if key is None:
            return report
        started = time.monotonic()
        deadline = started + self.options.flush_timeout_s
        async with self._flushing:
            for slot in list(gate.table):
                slot_key = self._slot_key(model, slot)
                if slot.busy or not slot.dirty or slot_key is None:
                    continue
                try:
                    async with asyncio.timeout_at(_loop_time(deadline)), slot.lock:
                        await self._save(model, engine, slot, slot_key, slot.version, reason,
                                         report)
                except TimeoutError:
                    report.failed.append(f"slot {slot.id}: not saved within the flush's "
                                         f"{self.options.flush_timeout_s:.0f} s")
        report.seconds = time.monotonic() - started
        self._flushed(model.id, report)
        return report

    def _flushed(self, model_id: str, report: FlushReport) -> None:
        self.counts(model_id).recent.append(report)
        if report.saved or report.failed:
            failed = f", {len(report.failed)} failed" if report.failed else ""
            self.events.emit(model_id, "flushed",
                             f"{report.reason}: {report.saved} slots saved "
                             f"({report.saved_bytes // MIB} MiB in {report.seconds:.2f} s)"
                             f"{failed}")

    async def _save(self, model: CatalogModel, engine: EngineClient, slot: Slot,
                    key: SnapshotKey, version: int, why: str,
                    report: FlushReport | None = None) -> None:
        """Save one slot into the store. Never raises but CancelledError: a failure is
        counted, logged and put in ``report``."""
        report = report or FlushReport(why)
        store = self.stores.of(model.id)
        if store is None:  # its node keeps none
            return
        started = time.monotonic()
        model_dir = store.root
        staged = store.staging_name()
        try:
            model_dir = store.model_dir(model.id)
            await engine.save_slot(slot.id, staged)
            tokens = await asyncio.to_thread(engine_for(model).saved_tokens, model_dir / staged)
            if len(tokens) < self.options.min_tokens:
                (model_dir / staged).unlink(missing_ok=True)
                report.skipped += 1
                if slot.version == version:
                    slot.held, slot.dirty = tuple(tokens), False
                return
            snapshot = await asyncio.to_thread(store.commit, model.id, staged, key, tokens)
        except TooLarge as e:
            report.skipped += 1
            log.info("model %s: slot %d not kept (%s): %s; raise --kv-cache-max to keep "
                     "conversations this long", model.id, slot.id, why, e)
            return
        except (BunkhouseError, SnapshotRefused, ValueError, OSError) as e:
            (model_dir / staged).unlink(missing_ok=True)
            message = getattr(e, "message", None) or str(e)
            with contextlib.suppress(OSError):
                free = shutil.disk_usage(store.root).free
                if free < 1 << 30:
                    message += f" ({free // MIB} MiB free on the snapshot disk)"
            self.counts(model.id).failed += 1
            report.failed.append(f"slot {slot.id}: {message}")
            log.warning("model %s: slot %d not saved (%s): %s", model.id, slot.id, why, message)
            return
        if slot.version == version:  # no request took the slot meanwhile
            slot.held, slot.dirty = snapshot.tokens, False
        self.counts(model.id).saved += 1
        report.saved += 1
        report.saved_bytes += snapshot.bytes
        report.saved_tokens += len(snapshot.tokens)
        report.seconds += time.monotonic() - started
        log.info("model %s: slot %d saved (%s): %d tokens, %d MiB", model.id, slot.id, why,
                 len(snapshot.tokens), snapshot.bytes // MIB)

    # -- reporting, shutdown -----------------------------------------------------------------

    def model_stats(self, model_id: str) -> tuple[int, int]:
        """(snapshots, bytes) kept for the model, on every node."""
        stats = [store.model_stats(model_id) for store in self.stores.all()]
        return sum(n for n, _ in stats), sum(b for _, b in stats)

    def purge(self, model_id: str | None = None) -> int:
        """Remove every snapshot (of one model), on every node; returns how many. Blocking
        file work: run it on a thread."""
        return sum(store.purge(model_id) for store in self.stores.all())

    def _stats(self) -> dict[str, Any]:
        """The stores' counts together (StoreStats' fields)."""
        total: dict[str, Any] = {}
        for store in self.stores.all():
            for name, value in store.stats.as_dict().items():
                if isinstance(value, dict):
                    merged = Counter(total.get(name) or {})
                    merged.update(value)
                    total[name] = dict(merged)
                else:
                    total[name] = total.get(name, 0) + value
        return total or StoreStats().as_dict()

    def model_report(self, model_id: str, detail: bool = False) -> dict[str, Any]:
        """The model's snapshot counts; ``detail`` (admins): failure messages too."""
        counts = self.counts(model_id)
        snapshots, size = self.model_stats(model_id)
        return {
            "snapshots": snapshots, "bytes": size, "saved": counts.saved,
            "restored": counts.restored, "missed": dict(counts.missed),
            "failed": counts.failed, "prefill_saved_tokens": counts.prefill_saved_tokens,
            "last_flush": counts.last_flush.as_dict(detail) if counts.last_flush else None,
            "recent_flushes": [f.as_dict(detail) for f in counts.recent],
        }

    def report(self, detail: bool = False) -> dict[str, Any]:
        """The store's counts; ``detail`` (admins): its directory too."""
        stats = self._stats()
        where = {"dir": str(self.stores.root)} if detail else {}
        return {**where, "max_bytes": self.stores.max_bytes,
                "min_tokens": self.options.min_tokens, **stats,
                "disabled": sorted(set(self._disabled.values()))}

    def log_shutdown(self, model_ids: list[str]) -> None:
        """One line for the flushes the front's shutdown made, model by model."""
        parts = []
        for model_id in model_ids:
            flush = self.counts(model_id).last_flush
            if flush is not None and flush.reason == "shutdown":
                failed = f", {len(flush.failed)} failed" if flush.failed else ""
                parts.append(f"{model_id}: {flush.saved} saved "
                             f"({flush.saved_bytes // MIB} MiB){failed}")
        if parts:
            log.info("KV snapshots at shutdown: %s; %d kept in %s (%d MiB)", "; ".join(parts),
                     sum(len(s.snapshots()) for s in self.stores.all()), self.stores.root,
                     self._stats()["bytes"] // MIB)

    async def close(self) -> None:
        """Stop the idle saves (a drain's flush saves what they would have)."""
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _loop_time(monotonic: float) -> float:
    """A ``time.monotonic()`` instant on the event loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic - time.monotonic())



