"""The KV snapshot store: slots' saved KV state on disk, keyed so that a wrong file never loads.

One store per front, the only writer of its directory (``--kv-cache-dir``). Per model a
private directory (0700) holds, for each snapshot, its data file (``<digest>.bin``, written by
the engine) and its sidecar (``<digest>.json``): what makes the data valid (the model file's
fingerprint, the engine build, the KV layout), the token ids it covers, its size and its
SHA-256. The digest names the key and the tokens, so an identical prefix is stored once.

- **Atomic.** The engine writes into a temporary name (:meth:`SnapshotStore.staging_name`);
  :meth:`SnapshotStore.commit` fsyncs it, hashes it, writes the sidecar to a temporary file,
  fsyncs it and renames both into place, data first, then fsyncs the directory. A crash at any
  point leaves either a whole snapshot or files no reader looks at (temporary names, or data
  without a sidecar), which the next start removes.
- **Never a wrong restore.** :meth:`SnapshotStore.find` considers only snapshots whose key
  equals the model's key now; the one sharing the longest prefix with the request's tokens
  wins, and only after its data's size and checksum are checked again. A snapshot made under
  another key is skipped (counted once, kept: it is valid for that key); one whose data fails
  its check is skipped and removed. Each is counted by reason and logged.
- **Stored once.** An identical token sequence is one snapshot; a snapshot whose tokens are
  a prefix of a newer one's (an earlier turn of the same conversation) is removed when the
  newer one is committed, since the newer one serves every request the older one could.
- **Bounded.** The data and sidecars of all models together stay within ``max_bytes``:
  a commit that would pass it first removes the least recently used snapshots (restoring
  one counts as a use); one that cannot fit alone is refused.

File work is blocking: callers run these methods on a thread (they lock internally).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_DATA, _SIDECAR, _STAGING = ".bin", ".json", ".partial"
_VERSION = 1
MARKER = ".bunkhouse-kv"
"""The file that marks a directory as a snapshot store's (no other directory is written)."""
# The store's own file names: <digest>.bin/.json, slot-<uuid>.partial, <digest>.json.<8>.partial
_OURS = re.compile(r"[0-9a-f]{40}\.(bin|json)|slot-[0-9a-f]{32}\.partial"
                   r"|[0-9a-f]{40}\.json\.[0-9a-f]{8}\.partial")


def _dir_name(model_id: str) -> str:
    """A model's directory name: readable, and distinct for every id (``a/b`` and ``a--b``
    would otherwise share one)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "-", model_id)[:80]
    return f"{safe}-{hashlib.sha256(model_id.encode()).hexdigest()[:8]}"


@dataclass(frozen=True, slots=True)
class SnapshotKey:
    """What must be equal for a snapshot's KV state to be loadable into a slot."""

    model: str  # the model file's fingerprint (its path, size and modification time)
    engine: str  # the engine and its build
    layout: tuple[tuple[str, Any], ...]  # KV layout: cache type, slot context, SWA settings

    @classmethod
    def of(cls, model: str, engine: str, layout: dict[str, Any]) -> SnapshotKey:
        return cls(model, engine, tuple(sorted(layout.items())))

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "engine": self.engine, "layout": dict(self.layout)}


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A committed snapshot: the engine restores ``model_dir / filename``."""

    model_id: str
    digest: str
    tokens: tuple[int, ...]
    bytes: int
    sha256: str

    @property
    def filename(self) -> str:
        return self.digest + _DATA


@dataclass
class StoreStats:
    """Counts since the store opened, and bytes on disk now."""

    written: int = 0
    deduplicated: int = 0
    superseded: int = 0  # removed: a newer snapshot of the same conversation covers them
    restored: int = 0
    evicted: int = 0
    failed: int = 0
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> count
    bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["skipped"] = dict(self.skipped)
        return out


def _tokens(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise ValueError("tokens must be a list of integers")
    return tuple(value)


class NotAStore(OSError):
    """A directory that is not a snapshot store's, and not new or empty: never written."""


class StoreInUse(OSError):
    """Another process (another front, or ``bunkhouse cache``) holds the store's directory."""


class SnapshotRefused(Exception):
    """A commit that cannot be kept (too large for the budget, unreadable), or a snapshot
    that cannot be restored (the reason)."""


def key_difference(have: Any, want: dict[str, Any]) -> str:
    """Why a snapshot made under key ``have`` (a sidecar's) cannot load under ``want``."""
    if not isinstance(have, dict):
        return "its sidecar names no key"
    if have.get("model") != want["model"]:
        return "made for another model file"
    if have.get("engine") != want["engine"]:
        return "made by another engine build"
    given = have.get("layout")
    layout: dict[str, Any] = given if isinstance(given, dict) else {}
    names = sorted(k for k in {*layout, *want["layout"]}
                   if layout.get(k) != want["layout"].get(k))
    return "made for another KV layout (" + ", ".join(
        f"{k} {layout.get(k)}, here {want['layout'].get(k)}" for k in names) + ")"


def _other_adapter(have: Any, want: dict[str, Any]) -> bool:
    """Whether a snapshot made under key ``have`` differs from ``want`` in its LoRA adapter
    setting alone: another adapter's conversation (or the base's), which is never restored
    here and is no fault to report."""
    if not isinstance(have, dict) or not isinstance(have.get("layout"), dict):
        return False
    strip = {**have, "layout": {k: v for k, v in have["layout"].items() if k != "adapter"}}
    return strip == {**want, "layout": {k: v for k, v in want["layout"].items()
                                        if k != "adapter"}}


class TooLarge(SnapshotRefused):
    """A snapshot larger than the whole budget: not kept, and not a failure."""


class _OtherKey(SnapshotRefused):
    """The sidecar names another key than the index had: valid for that key, not this one."""

    def __init__(self, key: Any, want: dict[str, Any]) -> None:
        super().__init__(key_difference(key, want))
        self.key = key


def _digest(key: SnapshotKey, tokens: Sequence[int]) -> str:
    h = hashlib.sha256(json.dumps(key.as_dict(), sort_keys=True).encode())
    h.update(b"\0" + ",".join(map(str, tokens)).encode())
    return h.hexdigest()[:40]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_HELD: dict[Path, list[int]] = {}  # root -> [descriptor, stores of this process using it]
_HELD_LOCK = threading.Lock()


def _hold(root: Path) -> Path:
    """An exclusive lock on ``root`` for as long as a store of this process uses it (the only
    writer: a second front would delete the first one's half-written files at its start).
    Raises StoreInUse when another process holds it."""
    key = root.resolve()
    with _HELD_LOCK:
        if key in _HELD:
            _HELD[key][1] += 1
            return key
        fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreInUse(f"{root} is in use by another bunkhouse process") from None
        _HELD[key] = [fd, 1]
        return key


def _release(key: Path) -> None:
    with _HELD_LOCK:
        held = _HELD.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            os.close(held[0])
            del _HELD[key]


def _rmdir_if_empty(path: Path) -> None:
    """Remove ``path`` if it is an empty directory (anything else in it stays)."""
    with contextlib.suppress(OSError):  # not empty, gone, not a directory (a link)
        path.rmdir()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}{_STAGING}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


@dataclass
class _Entry:
    model_id: str
    digest: str
    bytes: int  # data and sidecar
    used: float  # last commit or restore (monotonic order: LRU)
    tokens: tuple[int, ...]  # as its sidecar says
    key: dict[str, Any]  # as its sidecar says
    folder: Path  # the directory its files are in


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo


class SnapshotStore:
    """Snapshots of every model under ``root``, at most ``max_bytes`` together."""

    def __init__(self, root: Path, max_bytes: int, clock: Any = time.time, *,
                 read_only: bool = False) -> None:
        """Open (or create) the store in ``root``: a new or empty directory, or one a store
        made (it holds :data:`MARKER`); any other directory is refused (NotAStore), so that
        no file of the user's is ever removed or its mode changed. ``read_only``: index what
        is there and change nothing (no lock, no clean-up, no budget applied).

        Raises NotAStore, StoreInUse (another process holds it), OSError."""
        self.root = root
        self.max_bytes = max_bytes
        self.stats = StoreStats()
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._skipped: set[tuple[str, str]] = set()  # kept, counted once as unusable
        self._read_only = read_only
        self._held: Path | None = None
        if not read_only:
            self.claim(root)
            self._held = _hold(root)
        elif not (root / MARKER).is_file():
            raise NotAStore(f"{root} is not a bunkhouse KV snapshot directory")
        self._load()
        if not read_only:
            with self._lock:
                self._make_room(0)  # a budget lowered since the last run

    @staticmethod
    def claim(root: Path) -> None:
        """Make ``root`` a store's directory (new, empty, or a store's already): NotAStore
        for any other, OSError where it cannot be made."""
        if root.exists() and not (root / MARKER).is_file():
            if not root.is_dir():
                raise NotAStore(f"{root} is not a directory")
            if any(root.iterdir()):
                raise NotAStore(f"{root} is not empty and is not a bunkhouse KV snapshot "
                                "directory: give a new or empty one")
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(root, 0o700)
        (root / MARKER).touch(mode=0o600)

    def close(self) -> None:
        """Let another process have the directory (once every store of this one closed)."""
        if self._held is not None:
            _release(self._held)
            self._held = None

    # -- layout -----------------------------------------------------------------------

    def model_dir(self, model_id: str) -> Path:
        """The model's private directory (the worker's snapshot directory), made again if it
        was removed. Raises OSError when it cannot be (a file in its place, no permission)."""
        path = self.root / _dir_name(model_id)
        if not path.is_dir():
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            (self.root / MARKER).touch(mode=0o600)
            path.mkdir(mode=0o700, exist_ok=True)
        return path

    def drop_empty(self, model_id: str) -> None:
        """Remove the model's directory if it holds nothing (made again when needed)."""
        if not self._read_only:
            _rmdir_if_empty(self.root / _dir_name(model_id))

    def worker_dir(self, model_id: str) -> Path | None:
        """:meth:`model_dir` for a worker's start: None (the worker saves nothing, and says
        so in the log) rather than an error that would fail the model's load."""
        try:
            return self.model_dir(model_id)
        except OSError as e:
            log.warning("model %s: KV snapshots off for this worker: %s", model_id, e)
            return None

    def staging_name(self) -> str:
        """A fresh file name for the engine to save a slot into (in the model's directory)."""
        return f"slot-{uuid.uuid4().hex}{_STAGING}"

    def _load(self) -> None:
        """Index what a previous run left; remove half-written files and orphans. Only
        files named as the store names them are looked at; modes are made private again."""
        for model_dir in sorted(p for p in self.root.iterdir()
                                if p.is_dir() and not p.is_symlink()):
            if not self._read_only:
                os.chmod(model_dir, 0o700)
            for path in model_dir.iterdir():
                name = path.name
                if _OURS.fullmatch(name) is None:
                    continue  # not a file of the store's: left alone
                if name.endswith(_STAGING):
                    self._remove(path)  # a write a crash interrupted
                elif name.endswith(_DATA) and not path.with_suffix(_SIDECAR).exists():
                    self._remove(path)  # its sidecar was never written
                elif name.endswith(_SIDECAR):
                    self._index(model_dir, path)
            if not self._read_only:
                _rmdir_if_empty(model_dir)  # a model's that never kept a snapshot
        self.stats.bytes = sum(e.bytes for e in self._entries.values())

    def _remove(self, path: Path) -> None:
        if not self._read_only:
            path.unlink(missing_ok=True)

    def _index(self, model_dir: Path, sidecar: Path) -> None:
        data = sidecar.with_suffix(_DATA)
        try:
            if not (stat.S_ISREG(data.lstat().st_mode) and stat.S_ISREG(sidecar.lstat().st_mode)):
                raise ValueError("not a regular file")
            meta = json.loads(sidecar.read_text())
            size = data.stat().st_size + sidecar.stat().st_size
            model_id = str(meta["model_id"])
            tokens = _tokens(meta["tokens"])
            key = dict(meta["key"])
        except (OSError, ValueError, KeyError, TypeError):
            if not self._read_only:
                self._discard(model_dir, sidecar.stem, "unreadable sidecar")
            return
        if not self._read_only:
            for path in (data, sidecar):
                os.chmod(path, 0o600)
        used = sidecar.stat().st_mtime  # the last use (see _touch)
        self._entries[(model_id, sidecar.stem)] = _Entry(
            model_id, sidecar.stem, size, used, tokens, key, model_dir)

    def _discard(self, model_dir: Path, digest: str, reason: str | None = None,
                 model_id: str | None = None) -> None:
        """Remove a snapshot's files (the sidecar first: never a sidecar without its data)
        and its index entry; with a ``reason``, it was invalid: counted and logged."""
        for suffix in (_SIDECAR, _DATA):
            (model_dir / f"{digest}{suffix}").unlink(missing_ok=True)
        entry = self._entries.pop((model_id, digest), None) if model_id else None
        self._skipped.discard((model_id or "", digest))
        if entry is not None:
            self.stats.bytes -= entry.bytes
        if reason is not None:
            self.stats.skipped[reason] += 1
            log.warning("KV snapshot %s/%s skipped and removed: %s", model_dir.name, digest,
                        reason)

    # -- writing ------------------------------------------------------------------------

    def commit(self, model_id: str, staged: str, key: SnapshotKey,
               tokens: Sequence[int]) -> Snapshot:
        """Keep the slot the engine saved as ``staged`` (in the model's directory), covering
        ``tokens``. Raises SnapshotRefused when it cannot be kept (it is removed)."""
        model_dir = self.model_dir(model_id)
        staged_path = model_dir / staged
        digest = _digest(key, tokens)
        data = model_dir / f"{digest}{_DATA}"
        with self._lock:
            if (model_id, digest) in self._entries:  # the same prefix: stored once
                try:
                    kept = self._read(model_dir, digest, key, model_id)
                except SnapshotRefused as e:
                    self._discard(model_dir, digest, str(e), model_id)  # replaced below
                else:
                    staged_path.unlink(missing_ok=True)
                    self._touch(model_id, digest)
                    self.stats.deduplicated += 1
                    return kept
            try:
                size = staged_path.stat().st_size
                with staged_path.open("rb") as f:
                    os.fsync(f.fileno())
                checksum = _sha256(staged_path)
                sidecar = json.dumps({
                    "version": _VERSION, "model_id": model_id, "key": key.as_dict(),
                    "tokens": list(tokens), "bytes": size, "sha256": checksum,
                    "written": self._clock()}).encode()
                total = size + len(sidecar)
                if total > self.max_bytes:
                    raise TooLarge(f"{total} bytes is more than the whole budget of "
                                   f"{self.max_bytes}")
                self._make_room(total)
                os.chmod(staged_path, 0o600)
                os.replace(staged_path, data)
                _write_atomic(data.with_suffix(_SIDECAR), sidecar)
                _fsync_dir(model_dir)
            except OSError as e:
                self.stats.failed += 1
                staged_path.unlink(missing_ok=True)
                raise SnapshotRefused(f"cannot keep the snapshot: {e}") from e
            except SnapshotRefused as e:
                if not isinstance(e, TooLarge):
                    self.stats.failed += 1
                staged_path.unlink(missing_ok=True)
                raise
            self._entries[(model_id, digest)] = _Entry(model_id, digest, total, 0.0,
                                                       tuple(tokens),
                                                       json.loads(json.dumps(key.as_dict())),
                                                       model_dir)
            self._touch(model_id, digest)
            self.stats.written += 1
            self.stats.bytes += total
            self._supersede(model_id, digest)
            return Snapshot(model_id, digest, tuple(tokens), size, checksum)

    def _supersede(self, model_id: str, digest: str) -> None:
        """Remove the model's snapshots (same key) whose tokens are a prefix of ``digest``'s."""
        new = self._entries[(model_id, digest)]
        for old in list(self._entries.values()):
            if (old.model_id == model_id and old.digest != digest and old.key == new.key
                    and len(old.tokens) <= len(new.tokens)
                    and new.tokens[: len(old.tokens)] == old.tokens):
                self._discard(old.folder, old.digest, model_id=model_id)
                self.stats.superseded += 1

    def _make_room(self, need: int) -> None:
        """Remove least recently used snapshots until ``need`` more bytes fit."""
        by_age = sorted(self._entries.values(), key=lambda e: e.used)
        for victim in by_age:
            if self.stats.bytes + need <= self.max_bytes:
                return
            self._discard(victim.folder, victim.digest,
                          model_id=victim.model_id)
            self.stats.evicted += 1

    def _touch(self, model_id: str, digest: str) -> None:
        entry = self._entries[(model_id, digest)]
        entry.used = max(self._clock(), entry.used + 1e-6)
        with contextlib.suppress(OSError):  # the order survives a restart
            os.utime(entry.folder / f"{digest}{_SIDECAR}",
                     (entry.used, entry.used))

    # -- reading ------------------------------------------------------------------------

    def _read(self, model_dir: Path, digest: str, key: SnapshotKey, model_id: str) -> Snapshot:
        """The snapshot ``digest`` if it is valid for ``key``; else SnapshotRefused with the
        reason (the caller counts it)."""
        try:
            meta = json.loads((model_dir / f"{digest}{_SIDECAR}").read_text())
        except (OSError, ValueError) as e:
            raise SnapshotRefused("unreadable sidecar") from e
        if not isinstance(meta, dict) or meta.get("version") != _VERSION:
            raise SnapshotRefused("unknown sidecar version")
        wanted = json.loads(json.dumps(key.as_dict()))
        if meta.get("key") != wanted:
            raise _OtherKey(meta.get("key"), wanted)
        try:
            tokens = _tokens(meta.get("tokens"))
        except ValueError as e:
            raise SnapshotRefused("unreadable sidecar") from e
        if tokens != self._entries[(model_id, digest)].tokens:
            raise SnapshotRefused("its sidecar changed since it was written")
        data = model_dir / f"{digest}{_DATA}"
        try:
            size = data.stat().st_size
        except OSError as e:
            raise SnapshotRefused("its data file is missing") from e
        if size != meta.get("bytes"):
            raise SnapshotRefused(f"its data file has {size} bytes, not {meta.get('bytes')}")
        try:
            checksum = _sha256(data)
        except OSError as e:
            raise SnapshotRefused(f"its data file cannot be read ({e.strerror})") from e
        if checksum != meta.get("sha256"):
            raise SnapshotRefused("its checksum does not match")
        return Snapshot(model_id, digest, tuple(tokens), size, str(meta["sha256"]))

    def find(self, model_id: str, key: SnapshotKey, tokens: Sequence[int],
             min_tokens: int = 1) -> Snapshot | None:
        """The valid snapshot sharing the longest prefix with ``tokens`` (at least
        ``min_tokens`` tokens of it), or None. The snapshot may go on past that prefix (the
        engine drops what follows it). Snapshots made under another key are skipped; invalid
        ones met on the way are removed; each is counted by reason and logged."""
        wanted = json.loads(json.dumps(key.as_dict()))  # as a sidecar holds it
        with self._lock:
            model_dir = self.root / _dir_name(model_id)  # where its worker reads them
            found: list[tuple[int, str]] = []
            for entry in list(self._entries.values()):
                if entry.model_id != model_id or entry.folder != model_dir:
                    continue
                shared = common_prefix(entry.tokens, tokens)
                if shared < min_tokens:
                    continue
                if entry.key != wanted:
                    if not _other_adapter(entry.key, wanted):  # another's: not a candidate
                        self._skip_once(model_dir, entry, key_difference(entry.key, wanted))
                    continue
                found.append((shared, entry.digest))
            for _, digest in sorted(found, reverse=True):
                try:
                    snapshot = self._read(model_dir, digest, key, model_id)
                except _OtherKey as e:
                    entry = self._entries[(model_id, digest)]
                    entry.key = e.key if isinstance(e.key, dict) else {}
                    self._skip_once(model_dir, entry, str(e))
                    continue
                except SnapshotRefused as e:
                    self._discard(model_dir, digest, str(e), model_id)
                    continue
                self._touch(model_id, digest)
                self.stats.restored += 1
                return snapshot
            return None

    def _skip_once(self, model_dir: Path, entry: _Entry, reason: str) -> None:
        """Count and log a snapshot kept on disk but not usable now, once per snapshot."""
        if (entry.model_id, entry.digest) in self._skipped:
            return
        self._skipped.add((entry.model_id, entry.digest))
        self.stats.skipped[reason] += 1
        log.warning("KV snapshot %s/%s skipped: %s", model_dir.name, entry.digest, reason)

    def has(self, model_id: str) -> bool:
        """Whether any snapshot of the model is kept (no file is read)."""
        with self._lock:
            return any(e.model_id == model_id for e in self._entries.values())

    def model_stats(self, model_id: str) -> tuple[int, int]:
        """(snapshots, bytes) kept for the model."""
        with self._lock:
            mine = [e.bytes for e in self._entries.values() if e.model_id == model_id]
            return len(mine), sum(mine)

    def purge(self, model_id: str | None = None) -> int:
        """Remove every snapshot (of one model); returns how many."""
        with self._lock:
            victims = [e for e in self._entries.values()
                       if model_id is None or e.model_id == model_id]
            for entry in victims:
                self._discard(entry.folder, entry.digest,
                              model_id=entry.model_id)
            for folder in {entry.folder for entry in victims}:
                _rmdir_if_empty(folder)  # made again at its model's next save
            return len(victims)

    def snapshots(self, model_id: str | None = None) -> list[tuple[str, str, int]]:
        """(model id, digest, bytes) of what is kept, least recently used first."""
        with self._lock:
            return [(e.model_id, e.digest, e.bytes)
                    for e in sorted(self._entries.values(), key=lambda e: e.used)
                    if model_id is None or e.model_id == model_id]
