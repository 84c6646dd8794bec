"""KV snapshots per cluster node (kvcache/nodes.py) under the keeper's decisions, over the
fake engine of test_keeper.py: a model's snapshots are kept in its worker's node's store and
restored only there; placed on another node it starts cold, counted as a miss naming the
node that holds them; a node that does not see the store keeps none; a lost node's
directory goes, and so do dead nodes' at a front's start. (End to end on a Ray cluster:
tests/e2e/test_ray.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

from bunkhouse.catalog import CatalogModel
from bunkhouse.kvcache.keeper import KeeperOptions, SnapshotKeeper
from bunkhouse.kvcache.nodes import NodeStores
from bunkhouse.residency.events import EventLog
from bunkhouse.residency.slots import SlotGate
from tests.unit.test_keeper import LONG, FakeEngine, _model, _run

A, B, C = "a" * 56, "b" * 56, "c" * 56  # Ray node ids: 28 bytes, hex


def _keeper(tmp_path: Path) -> tuple[SnapshotKeeper, NodeStores]:
    stores = NodeStores.open(tmp_path / "kv", 1 << 30)
    return SnapshotKeeper(stores, EventLog(), KeeperOptions(min_tokens=8)), stores


async def _serve_and_drain(keeper: SnapshotKeeper, stores: NodeStores, model: CatalogModel,
                           node: str) -> tuple[FakeEngine, object]:
    """The model's worker started on ``node``: one request, then its drain's flush."""
    folder = stores.worker_dir(model.id, node)
    assert folder is not None and folder.is_dir() and folder.is_relative_to(
        stores.root / node)
    stores.placed(model.id, node, snapshots=True)
    engine, gate = FakeEngine(folder, 2), SlotGate(model.id, 2, 4)
    _, restore = await _run(keeper, gate, engine, model, LONG)
    await keeper.flush(model, engine, gate, "evicted")  # type: ignore[arg-type]
    return engine, restore


def test_snapshots_are_restored_on_their_node_only_and_elsewhere_count_a_miss(
        tmp_path: Path) -> None:
    keeper, stores = _keeper(tmp_path)
    model = _model(tmp_path)

    async def go() -> None:
        _, restore = await _serve_and_drain(keeper, stores, model, A)
        assert restore is None and keeper.model_stats("m")[0] == 1
        engine, restore = await _serve_and_drain(keeper, stores, model, A)  # back on A
        assert restore is not None and engine.restores == 1
        engine, restore = await _serve_and_drain(keeper, stores, model, B)  # on B: cold
        assert restore is None and engine.restores == 0
        missed = keeper.model_report("m")["missed"]
        assert missed == {f"its snapshots are on node {A}, its worker on another": 1}
        await _serve_and_drain(keeper, stores, model, B)
        assert sum(keeper.model_report("m")["missed"].values()) == 1  # once per node
        assert keeper.model_stats("m")[0] == 2  # one on each node now
        assert keeper.report()["written"] == 2

    asyncio.run(go())


def test_a_node_that_does_not_see_the_store_keeps_no_snapshots(tmp_path: Path) -> None:
    keeper, stores = _keeper(tmp_path)
    model = _model(tmp_path)
    assert stores.worker_dir(model.id, A) is not None
    stores.placed(model.id, A, snapshots=False)  # its host did not find the directory
    assert not keeper.active(model) and stores.of(model.id) is None
    assert stores.worker_dir(model.id, A) is None  # not asked again
    assert stores.worker_dir(model.id, B) is not None
    stores.placed(model.id, B, snapshots=True)
    assert keeper.active(model)


def test_a_lost_node_s_snapshots_go_and_dead_nodes_are_pruned_at_start(
        tmp_path: Path) -> None:
    keeper, stores = _keeper(tmp_path)
    model = _model(tmp_path)

    async def go() -> None:
        await _serve_and_drain(keeper, stores, model, A)
        await _serve_and_drain(keeper, stores, model, B)
        await _serve_and_drain(keeper, stores, model, C)

    asyncio.run(go())
    stores.lost(C)
    assert not (tmp_path / "kv" / "nodes" / C).exists()
    assert keeper.model_stats("m")[0] == 2
    stores.close()  # the front stops; the next finds only B alive
    (tmp_path / "kv" / "nodes" / "not-a-node").mkdir()
    again = NodeStores.open(tmp_path / "kv", 1 << 30)
    assert again.prune({B}) == [A]
    assert sorted(p.name for p in (tmp_path / "kv" / "nodes").iterdir()
                  if p.is_dir()) == [B, "not-a-node"]
