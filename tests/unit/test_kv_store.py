"""The KV snapshot store at the store level: atomic commits, keys that refuse a wrong file,
the longest prefix, the disk budget under concurrent writers, least recently used first."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from bunkhouse.kvcache.store import SnapshotKey, SnapshotRefused, SnapshotStore

KEY = SnapshotKey.of("qwen.gguf:1000:1", "llama.cpp b1", {"type": "f16", "slot_context": 4096})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1
        return self.now


def _save(store: SnapshotStore, model: str, tokens: list[int], size: int = 1000,
          key: SnapshotKey = KEY) -> str:
    """What a worker does: the engine writes the slot into a staging name; then commit."""
    staged = store.staging_name()
    (store.model_dir(model) / staged).write_bytes(bytes([len(tokens) % 251]) * size)
    return store.commit(model, staged, key, tokens).digest


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_the_longest_shared_prefix_is_found(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "kv", 1 << 20, clock=Clock())
    _save(store, "m", [1, 2, 3, 8, 8])
    longer = _save(store, "m", [1, 2, 3, 4, 5, 9])  # a reply the next prompt words otherwise
    _save(store, "m", [9, 9, 9, 9, 9, 9, 9])
    found = store.find("m", KEY, [1, 2, 3, 4, 5, 6, 7])
    assert found is not None and found.digest == longer and found.tokens == (1, 2, 3, 4, 5, 9)
    assert store.find("m", KEY, [1, 2, 3, 4, 5, 6], min_tokens=6) is None  # 5 shared
    assert store.find("m", KEY, [7, 7]) is None
    assert store.find("other", KEY, [1, 2, 3]) is None
    assert store.stats.written == 3 and store.stats.restored == 1


def test_an_earlier_turn_is_superseded_by_the_next(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "kv", 1 << 20, clock=Clock())
    _save(store, "m", [1, 2, 3])
    other_key = _save(store, "m", [1, 2], key=SnapshotKey.of("x", "y", {}))
    branch = _save(store, "m", [1, 2, 7])
    latest = _save(store, "m", [1, 2, 3, 4, 5])
    kept = {d for _, d, _ in store.snapshots("m")}
    assert kept == {other_key, branch, latest} and store.stats.superseded == 1


def test_an_identical_prefix_is_stored_once(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "kv", 1 << 20, clock=Clock())
    first = _save(store, "m", [1, 2, 3])
    assert _save(store, "m", [1, 2, 3]) == first
    assert store.stats.written == 1 and store.stats.deduplicated == 1
    assert len(list(store.model_dir("m").iterdir())) == 2  # one data file, one sidecar


def test_twenty_conversations_never_pass_the_budget_and_the_least_recent_go_first(
        tmp_path: Path) -> None:
    per = 1000 + 400  # data and about a sidecar's size
    store = SnapshotStore(tmp_path / "kv", 5 * per, clock=Clock())
    kept_warm = _save(store, "m", [0, 0])
    for i in range(1, 20):
        _save(store, "m", [i, i])
        assert _disk_bytes(tmp_path / "kv") <= store.max_bytes
        assert store.stats.bytes == _disk_bytes(tmp_path / "kv")
        assert store.find("m", KEY, [0, 0, 1]) is not None  # used: it stays
    digests = [d for _, d, _ in store.snapshots("m")]
    assert kept_warm in digests and len(digests) <= 5
    assert store.stats.evicted >= 14
    with pytest.raises(SnapshotRefused):
        _save(store, "m", [7], size=10 * per)  # can never fit: not kept, and not a failure
    assert store.stats.failed == 0
    assert _disk_bytes(tmp_path / "kv") <= store.max_bytes


def test_concurrent_writers_keep_the_budget(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "kv", 8 * 1500)
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(10):
                _save(store, f"m{n % 3}", [n, i])
                assert store.stats.bytes <= store.max_bytes
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert _disk_bytes(tmp_path / "kv") <= store.max_bytes == 8 * 1500
    assert store.stats.written == 80


@pytest.mark.parametrize(("damage", "reason"), [
    ("flip", "checksum"),
    ("truncate", "bytes, not"),
    ("other model", "made for another model file"),
    ("other context", "another KV layout (slot_context 8192, here 4096)"),
    ("sidecar garbage", "unreadable sidecar"),
    ("data gone", "missing"),
])
def test_an_invalid_snapshot_is_skipped_with_its_reason(tmp_path: Path, damage: str,
                                                        reason: str) -> None:
    store = SnapshotStore(tmp_path / "kv", 1 << 20, clock=Clock())
    good = _save(store, "m", [1, 2, 9])
    bad = _save(store, "m", [1, 2, 3, 4])
    model_dir = store.model_dir("m")
    data, sidecar = model_dir / f"{bad}.bin", model_dir / f"{bad}.json"
    meta = json.loads(sidecar.read_text())
    if damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[10] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(data.read_bytes()[:500])
    elif damage == "other model":
        meta["key"]["model"] = "gemma.gguf:2:2"
        sidecar.write_text(json.dumps(meta))
    elif damage == "other context":
        meta["key"]["layout"]["slot_context"] = 8192
        sidecar.write_text(json.dumps(meta))
    elif damage == "sidecar garbage":
        sidecar.write_text("{not json")
    else:
        data.unlink()
    for restarted in (False, True):
        current = SnapshotStore(tmp_path / "kv", 1 << 20, clock=Clock()) if restarted else store
        found = current.find("m", KEY, [1, 2, 3, 4, 5])  # and again after a restart
        assert found is not None and found.digest == good  # the shorter valid one instead
        assert current.find("m", KEY, [1, 2, 3, 4, 5]).digest == good  # type: ignore[union-attr]
        assert sum(current.stats.skipped.values()) <= 1  # counted once
        assert all(reason in r for r in current.stats.skipped), current.stats.skipped
    if damage.startswith("other"):  # valid for its own key: kept, never restored here
        assert data.exists() and sidecar.exists()
    else:  # never looked at again
        assert not data.exists() and not sidecar.exists()


def test_a_crash_mid_write_leaves_nothing_that_is_read(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "kv", 1 << 20, clock=Clock())
    kept = _save(store, "m", [1, 2, 3])
    model_dir = store.model_dir("m")
    (model_dir / store.staging_name()).write_bytes(b"half a slot")  # the engine was writing
    (model_dir / f"{'0123abcd' * 5}.bin").write_bytes(b"data whose sidecar never came")
    (model_dir / f"{kept}.json.1234abcd.partial").write_bytes(b'{"half')
    (model_dir / "notes.json").write_text("a file the store did not make")
    reopened = SnapshotStore(tmp_path / "kv", 1 << 20, clock=Clock())
    assert sorted(p.name for p in model_dir.iterdir()) == [f"{kept}.bin", f"{kept}.json",
                                                           "notes.json"]
    found = reopened.find("m", KEY, [1, 2, 3, 4])
    assert found is not None and found.digest == kept


def test_the_order_of_use_survives_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    store = SnapshotStore(tmp_path / "kv", 3 * 1400, clock=clock)
    old, new = _save(store, "m", [1]), _save(store, "m", [2])
    assert store.find("m", KEY, [1, 5]) is not None  # old is now the most recently used
    reopened = SnapshotStore(tmp_path / "kv", 3 * 1400, clock=clock)
    assert [d for _, d, _ in reopened.snapshots()] == [new, old]


def test_private_files_and_purge(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "kv", 1 << 20, clock=Clock())
    digest = _save(store, "org/model:q4", [1])
    _save(store, "other", [1])
    model_dir = store.model_dir("org/model:q4")
    assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(model_dir).st_mode) == 0o700
    for suffix in (".bin", ".json"):
        assert stat.S_IMODE(os.stat(model_dir / f"{digest}{suffix}").st_mode) == 0o600
    assert store.purge("org/model:q4") == 1
    assert not model_dir.exists()  # emptied: gone too (made again at the next save)
    assert store.purge() == 1 and store.stats.bytes == 0


def test_a_model_directory_that_holds_nothing_is_removed(tmp_path: Path) -> None:
    """A model gone for good (a refused registration) left an empty directory behind."""
    store = SnapshotStore(tmp_path / "kv", 1 << 20, clock=Clock())
    empty, kept, foreign = (store.model_dir(m) for m in ("empty", "kept", "foreign"))
    _save(store, "kept", [1])
    (foreign / "notes.txt").write_text("not the store's")
    for model in ("empty", "kept", "foreign"):
        store.drop_empty(model)
    assert not empty.exists() and kept.is_dir() and (foreign / "notes.txt").is_file()
    store.close()
    left = tmp_path / "kv" / "left-from-an-earlier-run"
    left.mkdir()
    SnapshotStore(tmp_path / "kv", 1 << 20, clock=Clock()).close()
    assert not left.exists() and kept.is_dir()


def _slot_file(path: Path, words: list[int], magic: int = 0x67677371, version: int = 4,
               count: int | None = None) -> Path:
    import struct
    n = len(words) if count is None else count
    path.write_bytes(struct.pack("<III", magic, version, n)
                     + struct.pack(f"<{len(words)}i", *words) + b"state data")
    return path


def test_the_tokens_of_a_saved_slot_file_and_every_malformed_one_refused(tmp_path: Path) -> None:
    from bunkhouse.engines.llamacpp import saved_tokens
    assert saved_tokens(_slot_file(tmp_path / "ok", [-1, 1, 3, 785, 3974, 13, 0])) == \
        [785, 3974, 13]
    for name, args in {
        "magic": ([-1, 1, 1, 5, 0], {"magic": 0x12345678}),
        "version": ([-1, 1, 1, 5, 0], {"version": 3}),
        "count": ([-1, 1, 2, 5, 0], {}),
        "marker": ([0, 1, 1, 5, 0], {}),
        "trailer": ([-1, 1, 1, 5, 7], {}),
        "negative": ([-1, 1, 1, -5, 0], {}),
        "huge": ([-1, 1, 1, 5, 0], {"count": 1 << 30}),
        "truncated": ([-1, 1, 1, 5, 0], {"count": 50}),
    }.items():
        words, kwargs = args
        with pytest.raises(ValueError):
            saved_tokens(_slot_file(tmp_path / name, words, **kwargs))  # type: ignore[arg-type]
    (tmp_path / "short").write_bytes(b"gg")
    with pytest.raises(ValueError):
        saved_tokens(tmp_path / "short")


def test_a_directory_the_store_did_not_make_is_never_touched(tmp_path: Path) -> None:
    from bunkhouse.kvcache.store import NotAStore

    project = tmp_path / "project"
    (project / "app").mkdir(parents=True)
    (project / "app" / "package.json").write_text("{}")
    (project / "app" / f"{'ab' * 20}.bin").write_bytes(b"x")
    os.chmod(project, 0o755)
    for read_only in (False, True):
        with pytest.raises(NotAStore):
            SnapshotStore(project, 1 << 20, read_only=read_only)
    assert sorted(p.name for p in (project / "app").iterdir()) == [f"{'ab' * 20}.bin",
                                                                    "package.json"]
    assert stat.S_IMODE(os.stat(project).st_mode) == 0o755
    SnapshotStore(tmp_path / "new", 1 << 20).close()  # a new directory is made a store
    (tmp_path / "empty").mkdir()
    SnapshotStore(tmp_path / "empty", 1 << 20).close()  # and so is an empty one


def test_a_lowered_budget_applies_at_start_and_a_listing_changes_nothing(
        tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "kv", 1 << 20, clock=Clock())
    for i in range(4):
        _save(store, "m", [i, i])
    store.close()
    model_dir = store.model_dir("m")
    os.chmod(next(model_dir.glob("*.bin")), 0o644)
    before = sorted(p.name for p in model_dir.iterdir())
    listing = SnapshotStore(tmp_path / "kv", 1500, read_only=True)
    assert len(listing.snapshots()) == 4 and sorted(p.name for p in model_dir.iterdir()) == before
    smaller = SnapshotStore(tmp_path / "kv", 3000, clock=Clock())
    assert len(smaller.snapshots()) == 2 and _disk_bytes(tmp_path / "kv") <= 3000
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in model_dir.iterdir())
    smaller.close()


def test_model_directories_are_distinct_for_every_id(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "kv", 1 << 20)
    assert store.model_dir("team/gem:v1") != store.model_dir("team--gem-v1")
    assert store.model_dir("team/gem:v1").parent == tmp_path / "kv"
    store.close()
