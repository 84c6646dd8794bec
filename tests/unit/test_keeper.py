"""The snapshot keeper's decisions over a fake engine (the real one: tests/integration/
test_kv_flush.py and tests/e2e/test_kv_persistence.py): which slots are saved and when, what
is restored, and a restore the engine did not reuse turning restores off for that key."""

from __future__ import annotations

import asyncio
import dataclasses
import struct
from pathlib import Path
from typing import Any

import pytest

from bunkhouse.catalog import CatalogModel
from bunkhouse.config import EngineOptions
from bunkhouse.engines.contract import SlotSnapshot, Timings
from bunkhouse.gguf.meta import GGUFInfo
from bunkhouse.kvcache.keeper import KeeperOptions, SnapshotKeeper
from bunkhouse.kvcache.store import SnapshotStore
from bunkhouse.residency.events import EventLog
from bunkhouse.residency.slots import SlotGate

INFO = GGUFInfo("qwen2", None, 32768, 24, 896, 14, 2, 64, 64, None, None, None, 0)


class FakeEngine:
    """Slots as token lists; save writes a llama.cpp-shaped slot file; one token a word."""

    def __init__(self, folder: Path, slots: int) -> None:
        self.folder = folder
        self.held: list[list[int]] = [[] for _ in range(slots)]
        self.saves = 0
        self.restores = 0

    async def tokenize(self, prompt: Any) -> list[int]:
        text = prompt if isinstance(prompt, str) else str(prompt["messages"])
        return [sum(map(ord, w)) for w in text.split()]

    async def save_slot(self, slot_id: int, filename: str) -> SlotSnapshot:
        tokens = self.held[slot_id]
        words = [-1, 1, len(tokens), *tokens, 0]
        (self.folder / filename).write_bytes(
            struct.pack("<III", 0x67677371, 4, len(words)) + struct.pack(f"<{len(words)}i", *words)
            + b"kv" * 100)
        self.saves += 1
        return SlotSnapshot(slot_id, filename, len(tokens), 0)

    async def restore_slot(self, slot_id: int, filename: str) -> SlotSnapshot:
        from bunkhouse.engines.llamacpp import saved_tokens

        self.held[slot_id] = saved_tokens(self.folder / filename)
        self.restores += 1
        return SlotSnapshot(slot_id, filename, len(self.held[slot_id]), 0)


def _model(tmp_path: Path, **options: Any) -> CatalogModel:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return CatalogModel("m", path, "config", INFO,
                        EngineOptions(context=4096, parallel=2, **options), 4)


def _setup(tmp_path: Path, idle_s: float = 3600) -> tuple[SnapshotKeeper, SlotGate, FakeEngine]:
    store = SnapshotStore(tmp_path / "kv", 1 << 30)
    keeper = SnapshotKeeper(store, EventLog(), KeeperOptions(min_tokens=8, idle_flush_s=idle_s))
    return keeper, SlotGate("m", 2, 4), FakeEngine(store.model_dir("m"), 2)


async def _run(keeper: SnapshotKeeper, gate: SlotGate, engine: FakeEngine, model: CatalogModel,
               prompt: str, reused: int | None = None) -> tuple[int, Any]:
    """One request as the front runs it; ``reused``: the engine's cache_n (default: all the
    restore should have saved)."""
    data = {"prompt": prompt}
    tokens = await keeper.prompt_tokens(model, engine, "/v1/completions", data)  # type: ignore[arg-type]
    slot = await gate.enter(tokens)
    restore = await keeper.prepare(model, engine, slot, tokens)  # type: ignore[arg-type]
    engine.held[slot.id] = list(tokens or [])
    if restore is not None:
        keeper.check(model, restore, Timings(
            prompt_tokens=1, cached_tokens=restore.shared if reused is None else reused,
            generated_tokens=0))
    gate.leave(slot)
    keeper.slot_idle(model, engine, gate, slot)  # type: ignore[arg-type]
    return slot.id, restore


LONG = " ".join(f"w{i}" for i in range(40))
OTHER = " ".join(f"other{i}" for i in range(40))


def test_short_prompts_and_several_answers_are_not_tokenized(tmp_path: Path) -> None:
    keeper, _, engine = _setup(tmp_path)
    model = _model(tmp_path)

    async def go() -> None:
        assert await keeper.prompt_tokens(model, engine, "/v1/completions",  # type: ignore[arg-type]
                                          {"prompt": "hi"}) is None
        assert await keeper.prompt_tokens(model, engine, "/v1/completions",  # type: ignore[arg-type]
                                          {"prompt": LONG, "n": 2}) is None
        assert await keeper.prompt_tokens(model, engine, "/v1/completions",  # type: ignore[arg-type]
                                          {"prompt": list(range(9))}) == list(range(9))

    asyncio.run(go())


def test_a_restore_the_engine_did_not_reuse_stops_restores_until_the_config_changes(
        tmp_path: Path) -> None:
    keeper, gate, engine = _setup(tmp_path)
    model = _model(tmp_path)

    async def go() -> None:
        await _run(keeper, gate, engine, model, LONG)
        assert (await keeper.flush(model, engine, gate, "evicted")).saved == 1  # type: ignore[arg-type]
        gate.reset()
        _, restore = await _run(keeper, gate, engine, model, LONG + " more", reused=0)
        assert restore is not None and keeper.counts("m").missed
        assert not keeper.active(model)
        gate.reset()
        _, again = await _run(keeper, gate, engine, model, LONG + " more")
        assert again is None and engine.restores == 1  # its snapshots are not used again
        swa_full = dataclasses.replace(model, options=dataclasses.replace(
            model.options, engine_keys=(("swa_full", True),)))  # no sliding window: same key
        assert keeper.key(swa_full) == keeper.key(model) and not keeper.active(swa_full)
        fixed = dataclasses.replace(model, options=dataclasses.replace(
            model.options, context=8192))  # a new key; its old snapshots do not match it
        assert keeper.active(fixed)

    asyncio.run(go())


def test_an_idle_slot_is_saved_once_it_stays_idle(tmp_path: Path) -> None:
    keeper, gate, engine = _setup(tmp_path, idle_s=0.05)
    model = _model(tmp_path)

    async def go() -> None:
        await _run(keeper, gate, engine, model, LONG)
        for _ in range(100):
            if keeper.counts("m").saved:
                break
            await asyncio.sleep(0.02)
        assert keeper.counts("m").saved == 1 and keeper.counts("m").last_flush.reason == "idle"  # type: ignore[union-attr]
        assert not any(s.dirty for s in gate.table)
        assert (await keeper.flush(model, engine, gate, "evicted")).saved == 0  # nothing new
        # a slot taken again before its save is due is not saved behind the request's back
        slot = await gate.enter()
        await asyncio.sleep(0.2)
        assert engine.saves == 1
        gate.leave(slot)
        await keeper.close()

    asyncio.run(go())


def test_a_conversation_pushed_out_of_its_slot_is_saved_and_comes_back(tmp_path: Path) -> None:
    keeper, gate, engine = _setup(tmp_path)
    model = _model(tmp_path)

    async def go() -> None:
        first, _ = await _run(keeper, gate, engine, model, LONG)
        await _run(keeper, gate, engine, model, OTHER)
        third, _ = await _run(keeper, gate, engine, model, OTHER.replace("other", "x"))
        assert third == first and keeper.counts("m").saved == 1  # LONG saved, then overwritten
        _, restore = await _run(keeper, gate, engine, model, LONG + " again")
        assert restore is not None and restore.shared == 40
        assert keeper.counts("m").restored == 1

    asyncio.run(go())


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/chat/completions"])
def test_no_tokens_where_the_prompt_is_not_one_text(tmp_path: Path, path: str) -> None:
    keeper, _, engine = _setup(tmp_path)
    body: dict[str, Any] = {"input": LONG} if path == "/v1/embeddings" else {"messages": "x"}
    assert asyncio.run(keeper.prompt_tokens(_model(tmp_path), engine, path, body)) is None  # type: ignore[arg-type]
