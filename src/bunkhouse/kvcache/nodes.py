"""KV snapshot stores per cluster node (``--ray``): a model's snapshots are kept where its
worker ran, in a store of that node's own, and restored only there.

Each node's store is a :class:`SnapshotStore` in ``<--kv-cache-dir>/nodes/<node id>`` (the
Ray node id, hex), on that node's disk, bounded by ``--kv-cache-max`` per node. The front
does the store's file work (committing, checking, finding), so a node keeps snapshots only
when it sees the front's directory: a node on the front's machine, or one sharing its
filesystem. Which nodes do is found at each worker start, by the worker's host on the node
(cluster/host.py): the model's directory, made by the front just before, must be there.
A node that does not see it runs its workers without snapshots (said once in the log);
keeping a store on a node of another machine, its file work done there, is the next step
(docs/scaling.md).

A model whose worker starts on a node other than the one holding its snapshots starts cold:
:meth:`NodeStores.elsewhere` names that node, and the keeper counts it as a miss with that
reason. A lost node's directory is removed (Ray never gives its id to another node), and so
are those of nodes no longer alive when the front starts; a node alive across a front's
restart keeps its snapshots.

File work is blocking, as the store's: callers run these methods on a thread where they
touch the disk (:meth:`worker_dir`, :meth:`lost`, :meth:`prune`).
"""

from __future__ import annotations

import logging
import re
import shutil
import threading
from pathlib import Path

from bunkhouse.kvcache.store import MARKER, SnapshotStore, StoreInUse

log = logging.getLogger(__name__)

_NODE_ID = re.compile(r"[0-9a-f]{8,128}")


class NodeStores:
    """One snapshot store per node that sees the front's directory, and the node each
    model's worker last started on."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        """``root``: ``<--kv-cache-dir>/nodes``; ``max_bytes``: each node's bound."""
        self.root = root
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._stores: dict[str, SnapshotStore] = {}
        self._unshared: set[str] = set()  # nodes that do not see root: no snapshots there
        self._model_node: dict[str, str] = {}  # model id -> its worker's node, when kept

    @classmethod
    def open(cls, root: Path, max_bytes: int) -> NodeStores:
        """The node stores under ``root`` (``--kv-cache-dir``: made a store's directory if
        new; NotAStore for a user's own directory), in its ``nodes`` directory."""
        SnapshotStore.claim(root)
        SnapshotStore.claim(root / "nodes")
        return cls(root / "nodes", max_bytes)

    def _store(self, node: str) -> SnapshotStore:
        if not _NODE_ID.fullmatch(node):
            raise ValueError(f"not a Ray node id: {node!r}")
        with self._lock:
            store = self._stores.get(node)
            if store is None:
                store = self._stores[node] = SnapshotStore(self.root / node, self.max_bytes)
            return store

    def worker_dir(self, model_id: str, node: str) -> Path | None:
        """The directory the model's worker on ``node`` saves slots into (made now, for the
        node to find); None: no snapshots there (the node does not see this directory, or
        it cannot be made: logged)."""
        if node in self._unshared:
            return None
        try:
            return self._store(node).model_dir(model_id)
        except (OSError, ValueError) as e:
            log.warning("model %s: KV snapshots off for its worker on node %s: %s",
                        model_id, node, e)
            return None

    def placed(self, model_id: str, node: str, snapshots: bool) -> None:
        """The model's worker started on ``node``; ``snapshots``: the node found its
        directory (else the node does not share this filesystem: none are kept there)."""
        with self._lock:
            if snapshots:
                self._model_node[model_id] = node
                return
            self._model_node.pop(model_id, None)
            if node in self._unshared:
                return
            self._unshared.add(node)
        log.info("node %s does not see the KV snapshot directory %s (another machine, "
                 "without a shared filesystem): its workers keep no snapshots",
                 node, self.root)

    def of(self, model_id: str) -> SnapshotStore | None:
        """The store of the node the model's worker runs on (None: it keeps none)."""
        with self._lock:
            node = self._model_node.get(model_id)
            return self._stores.get(node) if node is not None else None

    def elsewhere(self, model_id: str) -> str | None:
        """A node other than the model's own whose store holds snapshots of it."""
        with self._lock:
            here = self._model_node.get(model_id)
            stores = list(self._stores.items())
        return next((node for node, store in sorted(stores)
                     if node != here and store.has(model_id)), None)

    def all(self) -> list[SnapshotStore]:
        with self._lock:
            return list(self._stores.values())

    def lost(self, node: str) -> None:
        """The node is gone for good: its store and directory go."""
        with self._lock:
            store = self._stores.pop(node, None)
            self._unshared.discard(node)
            for model_id in [m for m, n in self._model_node.items() if n == node]:
                del self._model_node[model_id]
        if store is not None:
            store.close()
            shutil.rmtree(self.root / node, ignore_errors=True)

    def prune(self, alive: set[str]) -> list[str]:
        """Remove the directories of nodes no longer alive (those another front holds
        stay); returns their ids."""
        with self._lock:
            dead = [node for node in self._stores if node not in alive]
        for node in dead:
            self.lost(node)
        removed = dead
        for path in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            if path.name in alive or not _NODE_ID.fullmatch(path.name) \
                    or not (path / MARKER).is_file() or path.is_symlink():
                continue
            try:
                held = SnapshotStore(path, 0)  # its lock: no other front uses it
            except (StoreInUse, OSError):
                continue
            held.close()
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
        if removed:
            log.info("KV snapshots of %d nodes no longer alive removed: %s", len(removed),
                     ", ".join(removed))
        return removed

    def close(self) -> None:
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        for store in stores:
            store.close()
