"""The snapshot keeper against a real llama.cpp worker (Qwen): a slot saved at a drain is
restored into another slot, the follow-up prefills only the new tokens and says the same; a
conversation pushed out of its slot by another one is saved first and comes back."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

from bunkhouse.catalog import Catalog, CatalogModel
from bunkhouse.kvcache.keeper import KeeperOptions, SnapshotKeeper
from bunkhouse.kvcache.store import SnapshotStore
from bunkhouse.residency.events import EventLog
from bunkhouse.residency.slots import SlotGate
from bunkhouse.supervisor.process import LaunchOptions, WorkerLaunch, WorkerProcess
from tests.models import QWEN

PROMPT = "Count the items. " + " ".join(f"Item {i}: a red apple." for i in range(30))
OTHER = "List the colours. " + " ".join(f"Colour {i}: a deep blue." for i in range(30))
THIRD = "Name the towns. " + " ".join(f"Town {i}: a small harbour." for i in range(30))


def test_slots_saved_and_restored_by_the_keeper(packaged_catalog: Catalog,
                                                tmp_path: Path) -> None:
    base = packaged_catalog.get(QWEN)
    model = dataclasses.replace(base, options=dataclasses.replace(
        base.options, context=2048, parallel=2, engine_keys=(("threads", 2),)))
    store = SnapshotStore(tmp_path / "kv", 1 << 30)
    events = EventLog()
    keeper = SnapshotKeeper(store, events, KeeperOptions(min_tokens=32, idle_flush_s=3600))
    gate = SlotGate(QWEN, 2, 4)
    launch = WorkerLaunch(tmp_path / "w.sock", LaunchOptions(120, 10), store.model_dir(QWEN))

    async def complete(worker: WorkerProcess, prompt: str) -> tuple[dict[str, Any], int]:
        """A request as the front runs it: tokens, a slot, prepare, the slot, check."""
        data = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
        tokens = await keeper.prompt_tokens(model, worker.engine, "/v1/completions", data)
        slot = await gate.enter(tokens)
        try:
            restore = await keeper.prepare(model, worker.engine, slot, tokens)
            resp = await worker.engine.generate("/v1/completions", data, slot=slot.id)
            answer: dict[str, Any] = json.loads(await resp.aread())
            await resp.aclose()
            timings = worker.engine.timings(answer)
            if restore is not None and timings is not None:
                keeper.check(model, restore, timings)
            return answer, slot.id
        finally:
            gate.leave(slot)

    async def start(m: CatalogModel) -> WorkerProcess:
        worker = WorkerProcess(m, launch)
        await worker.start()
        gate.reset()
        return worker

    async def main() -> None:
        worker = await start(model)
        try:
            first, _ = await complete(worker, PROMPT)
            follow_up = PROMPT + first["choices"][0]["text"] + " And the next one?"
            report = await keeper.flush(model, worker.engine, gate, "test")
            assert report.saved == 1 and not report.failed
            assert (await keeper.flush(model, worker.engine, gate, "again")).saved == 0  # clean
        finally:
            await worker.stop()
        worker = await start(model)  # a new worker: nothing in its slots
        try:
            warm, _ = await complete(worker, follow_up)
            assert keeper.counts(QWEN).restored == 1
            assert warm["timings"]["prompt_n"] < 20 <= warm["timings"]["cache_n"]
            # two other conversations take both slots: it is saved before it is overwritten
            _, other_slot = await complete(worker, OTHER)
            _, third_slot = await complete(worker, THIRD)
            assert other_slot != third_slot
            assert keeper.counts(QWEN).saved == 2  # the first save and the displaced one
        finally:
            await worker.stop()
        worker = await start(model)
        try:
            again, _ = await complete(worker, follow_up)
            cold_worker_answer = again["choices"][0]["text"]
            assert cold_worker_answer == warm["choices"][0]["text"]
        finally:
            await worker.stop()
        assert not keeper.counts(QWEN).missed
        assert {"restored", "flushed"} <= set(events.counts)

    asyncio.run(main())
