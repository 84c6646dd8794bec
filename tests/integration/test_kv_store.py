"""The KV snapshot store's directory lock, between processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bunkhouse.kvcache.store import SnapshotStore


def test_one_process_at_a_time_holds_the_directory(tmp_path: Path) -> None:
    code = ("import sys; from pathlib import Path; from bunkhouse.kvcache.store import "
            "SnapshotStore, StoreInUse\ntry:\n    SnapshotStore(Path(sys.argv[1]), 1000)\n"
            "except StoreInUse:\n    sys.exit(3)\n")
    store = SnapshotStore(tmp_path / "kv", 1 << 20)
    other = subprocess.run([sys.executable, "-c", code, str(tmp_path / "kv")], timeout=60)
    assert other.returncode == 3  # another process: refused
    SnapshotStore(tmp_path / "kv", 1 << 20).close()  # this process: shared
    store.close()
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path / "kv")],
                          timeout=60).returncode == 0
