"""``bunkhouse cache list|purge [ID]``: the KV snapshot directory itself, while no server
holds it (a running server's is reached through its admin API instead)."""

from __future__ import annotations

import sys
from pathlib import Path

from bunkhouse.cli.output import mib


def cache(action: str, model: str | None, root: Path | None) -> int:
    """``bunkhouse cache list|purge [MODEL]`` on the snapshot directory."""
    from bunkhouse.config import default_kv_cache_dir
    from bunkhouse.kvcache.store import NotAStore, SnapshotStore, StoreInUse

    root = root or default_kv_cache_dir()
    if not root.is_dir():
        print(f"no KV snapshots: {root} does not exist")
        return 0
    try:  # a listing reads only; a purge holds the directory as a server would
        store = SnapshotStore(root, 1 << 62, read_only=action == "list")
    except StoreInUse:
        print(f"bunkhouse: error: a running bunkhouse uses {root}; stop it first, or remove "
              "snapshots through it: DELETE /admin/cache[/MODEL] with an admin key",
              file=sys.stderr)
        return 1
    except NotAStore as e:
        print(f"bunkhouse: error: {e}; nothing done", file=sys.stderr)
        return 1
    if action == "purge":
        removed = store.purge(model)
        print(f"removed {removed} snapshot(s) of {model or 'every model'} from {root}")
        return 0
    totals: dict[str, list[int]] = {}
    for model_id, _, size in store.snapshots(model):
        totals.setdefault(model_id, [0, 0])
        totals[model_id][0] += 1
        totals[model_id][1] += size
    for model_id, (count, size) in sorted(totals.items()):
        print(f"{model_id}  {count} snapshot(s)  {mib(size)}")
    print(f"{sum(c for c, _ in totals.values())} snapshot(s), "
          f"{mib(sum(s for _, s in totals.values()))} in {root}")
    return 0
