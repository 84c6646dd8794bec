"""Slots saved into the snapshot store and restored, against a real llama.cpp worker (Qwen):
the follow-up after a restore prefills only the new tokens, and says the same."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

from bunkhouse.catalog import Catalog
from bunkhouse.engines.llamacpp import saved_tokens
from bunkhouse.kvcache.flush import flush_slots, restore_longest
from bunkhouse.kvcache.store import SnapshotKey, SnapshotStore
from bunkhouse.supervisor.process import LaunchOptions, WorkerLaunch, WorkerProcess

QWEN = "qwen2.5-coder-0.5b-instruct"
KEY = SnapshotKey.of("qwen", "llama.cpp", {"slot_context": 1024})
PROMPT = "Count the items. " + " ".join(f"Item {i}: a red apple." for i in range(30))


def test_a_flushed_slot_restores_into_another_and_saves_the_prefill(
        packaged_catalog: Catalog, tmp_path: Path) -> None:
    base = packaged_catalog.get(QWEN)
    model = dataclasses.replace(base, options=dataclasses.replace(
        base.options, context=2048, parallel=2, threads=2))
    store = SnapshotStore(tmp_path / "kv", 1 << 30)
    launch = WorkerLaunch(tmp_path / "w.sock", LaunchOptions(120, 10), store.model_dir(QWEN))

    async def complete(worker: WorkerProcess, prompt: str, slot: int) -> dict[str, Any]:
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "id_slot": slot,
                "cache_prompt": True}
        resp = await worker.engine.generate("/v1/completions", json.dumps(body).encode())
        data: dict[str, Any] = json.loads(await resp.aread())
        await resp.aclose()
        return data

    async def main() -> None:
        worker = WorkerProcess(model, launch)
        await worker.start()
        try:
            first = await complete(worker, PROMPT, 0)
            prompt_tokens = first["timings"]["prompt_n"]
            result = await flush_slots(worker.engine, store, QWEN, KEY, saved_tokens,
                                       min_tokens=32)
            assert result.ok and len(result.saved) == 1 and result.skipped == 1
            snapshot = result.saved[0]
            assert len(snapshot.tokens) >= prompt_tokens  # the prompt, and what it generated
            again = await flush_slots(worker.engine, store, QWEN, KEY, saved_tokens, 32)
            assert again.saved[0].digest == snapshot.digest  # stored once
            assert store.stats.written == 1 and store.stats.deduplicated == 1

            follow_up = PROMPT + first["choices"][0]["text"] + " And the next one?"
            tokens = (*snapshot.tokens, 1, 2, 3)  # any continuation of the covered prefix
            restored = await restore_longest(worker.engine, store, QWEN, KEY, list(tokens),
                                             slot_id=1, min_tokens=32)
            assert restored is not None and restored.digest == snapshot.digest
            warm = await complete(worker, follow_up, 1)
            await complete(worker, "Something else entirely.", 0)  # slot 0 forgets the turn
            cold = await complete(worker, follow_up, 0)
            assert warm["timings"]["prompt_n"] < 20 <= cold["timings"]["prompt_n"]
            assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        finally:
            await worker.stop()

    asyncio.run(main())
