"""Saving a worker's slots into the snapshot store (store.py), and restoring one.

The engine writes each slot's KV state into the model's directory of the store (the worker's
snapshot directory) under a staging name; the store then keeps it under its digest, with a
sidecar naming what makes it valid, or refuses it. Only slots that are idle and hold at least
``min_tokens`` tokens are saved: a short prefix costs less to prefill again than to keep.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bunkhouse.engines.contract import EngineClient
from bunkhouse.errors import BunkhouseError
from bunkhouse.kvcache.store import Snapshot, SnapshotKey, SnapshotRefused, SnapshotStore

log = logging.getLogger(__name__)

TokenReader = Callable[[Path], list[int]]
"""The token ids a saved slot file covers (the engine adapter's; raises ValueError)."""


@dataclass
class FlushResult:
    """What one flush of one worker did."""

    saved: list[Snapshot] = field(default_factory=list)
    skipped: int = 0  # busy, or too short to be worth keeping
    failed: list[str] = field(default_factory=list)  # a reason per slot

    @property
    def ok(self) -> bool:
        return not self.failed


async def flush_slots(engine: EngineClient, store: SnapshotStore, model_id: str,
                      key: SnapshotKey, read_tokens: TokenReader,
                      min_tokens: int) -> FlushResult:
    """Save every idle slot of ``engine`` holding at least ``min_tokens`` tokens."""
    result = FlushResult()
    model_dir = store.model_dir(model_id)
    for slot in await engine.slots():
        if slot.busy or slot.tokens < min_tokens:
            result.skipped += 1
            continue
        staged = store.staging_name()
        try:
            await engine.save_slot(slot.id, staged)
            tokens = await asyncio.to_thread(read_tokens, model_dir / staged)
            if len(tokens) < min_tokens:
                (model_dir / staged).unlink(missing_ok=True)
                result.skipped += 1
                continue
            result.saved.append(await asyncio.to_thread(store.commit, model_id, staged, key,
                                                        tokens))
        except (BunkhouseError, SnapshotRefused, ValueError, OSError) as e:
            (model_dir / staged).unlink(missing_ok=True)
            reason = getattr(e, "message", None) or str(e)
            log.warning("model %s: slot %d not saved: %s", model_id, slot.id, reason)
            result.failed.append(f"slot {slot.id}: {reason}")
    return result


async def restore_longest(engine: EngineClient, store: SnapshotStore, model_id: str,
                          key: SnapshotKey, tokens: list[int], slot_id: int,
                          min_tokens: int) -> Snapshot | None:
    """Restore into ``slot_id`` the valid snapshot covering the longest prefix of ``tokens``
    (at least ``min_tokens``); None when there is none, or the engine refused it."""
    snapshot = await asyncio.to_thread(store.find, model_id, key, tokens, min_tokens)
    if snapshot is None:
        return None
    try:
        restored = await engine.restore_slot(slot_id, snapshot.filename)
    except BunkhouseError as e:
        log.warning("model %s: snapshot %s not restored: %s", model_id, snapshot.digest,
                    e.message)
        return None
    if restored.tokens != len(snapshot.tokens):
        log.warning("model %s: snapshot %s restored %d tokens of %d", model_id,
                    snapshot.digest, restored.tokens, len(snapshot.tokens))
        return None
    return snapshot
