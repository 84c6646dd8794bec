"""Stored Responses API answers: SQLite in the front, so that ``previous_response_id``
continues a conversation after the worker that answered was evicted, crashed or the front
restarted (the seeds keep this history in the parent process too).

One row per stored response: its owner (a hash of the client key that made it, so that one
client never reads, continues or deletes another's; "" on a server without client keys), the
response object, its input items (for the input-items
listing) and the whole conversation after it as chat messages (api/responses.py
``conversation``). A row holds its whole conversation rather than pointing at its parent, so
that retention or a ``DELETE`` of an earlier turn never breaks a later one; the price is a
conversation stored once per turn, bounded by the retention below and the request body limit.

Every database call runs on one thread of its own, in the order made: that thread is the one
writer (WAL mode lets other readers of the file in), a write never blocks the event loop, and
a read made after a write (a client's ``GET`` after ``response.completed``) sees it.

Retention: at most ``max_count`` responses, at most ``max_bytes`` bytes of them together, and
none older than ``max_age_s`` seconds, applied at start, after each write and before a lookup
a minute after the last pass, oldest first; a lookup never returns one past its age. A single
response larger than ``max_bytes`` is not stored (logged); the route refuses beforehand a
request that could not fit (front/responses.py).

Deleted is gone: ``secure_delete`` zeroes what a delete frees, and after every delete (a
client's, or retention's) the WAL is checkpointed into the file and truncated, so the text
of a deleted response is in none of the files (the database, its ``-wal`` and ``-shm``).

Only a new or empty file, or one this class made (its ``bunkhouse`` table says so), is opened
for writing: another file is left untouched. The file and its WAL are private (0600) in a
private directory (0700): it holds conversations.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from bunkhouse import defaults
from bunkhouse.errors import BunkhouseError, InvalidRequest

log = logging.getLogger(__name__)

T = TypeVar("T")

RETAIN_EVERY_S = 60.0
"""A lookup applies retention first if none ran for this long (a write always does)."""


_MARK = "bunkhouse-responses-1"
"""The format, kept in the file's own table ``bunkhouse``: a file without it is not ours."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS bunkhouse (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    bytes INTEGER NOT NULL DEFAULT 0,
    response TEXT NOT NULL,
    items TEXT NOT NULL,
    conversation TEXT NOT NULL
);
"""

_INDEXES = """
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
CREATE INDEX IF NOT EXISTS responses_size ON responses (created, bytes);
"""
# (created, bytes): the byte budget's pass reads the index only, never the rows' text

_BYTES = ("length(CAST(response AS BLOB)) + length(CAST(items AS BLOB)) "
          "+ length(CAST(conversation AS BLOB))")
"""A row's size, for rows of a file made before sizes were kept."""


class ResponseStoreError(BunkhouseError):
    """The database cannot be opened or used (the message names the file)."""

    status = 503
    type = "server_error"
    code = "response_store_unavailable"


class ResponseStore:
    """Stored responses in the SQLite file at ``path``.

    Raises ResponseStoreError from :meth:`open` if the file cannot be made or read."""

    def __init__(self, path: Path, max_count: int = defaults.RESPONSES_KEEP,
                 max_age_s: float = defaults.RESPONSES_MAX_AGE_S,
                 max_bytes: int = defaults.RESPONSES_MAX_BYTES) -> None:
        self.path = path
        self.max_count = max_count
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._db: sqlite3.Connection | None = None
        self._retained = 0.0  # time.monotonic() of the last retention pass

    # -- on the store's thread ---------------------------------------------------------
    def _unavailable(self, why: str) -> ResponseStoreError:
        return ResponseStoreError("stored responses are unavailable on this server; send "
                                  "store: false, or ask its operator",
                                  detail=f"the response store {self.path}: {why}")

    def _ours(self) -> bool:
        """Whether the existing file is a store this class made (read only: a file of
        someone else's is never changed, not even its mode or journal)."""
        try:
            ro = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
            try:
                row = ro.execute("SELECT value FROM bunkhouse WHERE key = 'format'").fetchone()
            finally:
                ro.close()
        except sqlite3.Error:
            return False
        return row is not None and row[0] == _MARK

    def _open(self) -> int:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if size and not self._ours():
                raise self._unavailable("not a bunkhouse response store, left as it is; "
                                        "pass another --responses-db FILE")
            os.chmod(self.path, 0o600)
            db = sqlite3.connect(self.path, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA busy_timeout=10000")
            db.execute("PRAGMA secure_delete=ON")  # a delete zeroes what it frees
            db.executescript(_SCHEMA)
            if "bytes" not in {row[1] for row in db.execute("PRAGMA table_info(responses)")}:
                db.execute("ALTER TABLE responses ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0")
                db.execute(f"UPDATE responses SET bytes = {_BYTES}")
            db.executescript(_INDEXES)
            db.execute("INSERT OR IGNORE INTO bunkhouse (key, value) VALUES ('format', ?)",
                        (_MARK,))
        except (OSError, sqlite3.Error) as e:
            raise self._unavailable(str(e)) from e
        self._db = db
        for suffix in ("-wal", "-shm"):
            extra = Path(f"{self.path}{suffix}")
            if extra.exists():
                os.chmod(extra, 0o600)
        self._retain()
        return int(db.execute("SELECT count(*) FROM responses").fetchone()[0])

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise self._unavailable("closed")
        return self._db

    def _retain(self) -> None:
        db = self._conn()
        self._retained = time.monotonic()
        before = db.total_changes
        db.execute("DELETE FROM responses WHERE created < ?", (time.time() - self.max_age_s,))
        db.execute("DELETE FROM responses WHERE created < (SELECT created FROM responses "
                   "ORDER BY created DESC LIMIT 1 OFFSET ?)", (self.max_count - 1,))
        db.execute("DELETE FROM responses WHERE rowid IN (SELECT rowid FROM (SELECT rowid, "
                   "sum(bytes) OVER (ORDER BY created DESC, rowid DESC) AS newer "
                   "FROM responses) WHERE newer > ?)", (self.max_bytes,))
        if db.total_changes != before:
            self._scrub()

    def _scrub(self) -> None:
        """Deleted rows out of every file: their pages (zeroed by secure_delete) written
        back into the database, and the WAL, which still held their text, truncated."""
        busy, _, _ = self._conn().execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            log.warning("the response store %s: another process reading it kept the WAL "
                        "from being truncated; deleted responses stay in %s-wal until the "
                        "next delete", self.path, self.path)

    def _put(self, owner: str, response: dict[str, Any], items: list[dict[str, Any]],
             conversation: list[dict[str, Any]]) -> None:
        texts = (json.dumps(response), json.dumps(items), json.dumps(conversation))
        size = sum(len(text.encode()) for text in texts)
        if size > self.max_bytes:
            log.warning("response %s not stored: its %d bytes are over the store's %d "
                        "(--responses-max); a later previous_response_id naming it will get "
                        "404", response.get("id"), size, self.max_bytes)
            return
        self._conn().execute(
            "INSERT OR REPLACE INTO responses (id, owner, created, bytes, response, items, "
            "conversation) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (response["id"], owner, time.time(), size, *texts))
        self._retain()

    def _get(self, column: str, response_id: str, owner: str | None) -> Any:
        if column not in ("response", "items", "conversation"):
            raise ValueError(f"no column {column!r}")
        if time.monotonic() - self._retained > RETAIN_EVERY_S:
            self._retain()  # so that age applies without a write too
        row = self._conn().execute(
            f"SELECT {column} FROM responses WHERE id = ? AND (owner = ? OR ?) "
            "AND created >= ?",
            (response_id, owner or "", owner is None, time.time() - self.max_age_s)).fetchone()
        return None if row is None else json.loads(row[0])

    def _delete(self, response_id: str, owner: str | None) -> bool:
        cur = self._conn().execute("DELETE FROM responses WHERE id = ? AND (owner = ? OR ?)",
                                   (response_id, owner or "", owner is None))
        if cur.rowcount > 0:
            self._scrub()  # gone from the files before the delete answers
        return cur.rowcount > 0

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    # -- from the event loop -----------------------------------------------------------
    def check(self, size: int = 0) -> None:
        """Raise ResponseStoreError (503) unless the store is open, and InvalidRequest (400
        naming ``store``) if an answer of at least ``size`` bytes can never fit it."""
        if self._thread is None:
            raise self._unavailable("not open (see the log at start)")
        if size > self.max_bytes:
            raise InvalidRequest(
                f"this response cannot be stored: the request and the conversation it "
                f"continues take {size} bytes, over the {self.max_bytes} bytes this server "
                "keeps for stored responses; send store: false", param="store")

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._thread is None:
            raise self._unavailable("not open")
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def open(self) -> int:
        """Open (or make) the database and apply retention; returns how many it holds.
        Raises ResponseStoreError (then the store stays closed)."""
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="response-store")
        try:
            return await self._call(self._open)
        except ResponseStoreError:
            await self.close()
            raise

    def put(self, owner: str, response: dict[str, Any], items: list[dict[str, Any]],
            conversation: list[dict[str, Any]]) -> None:
        """Store ``response`` for ``owner`` (queued: any later call sees it). A failure is
        logged, not raised: the answer was given; only a later continuation of it will not
        be found."""
        if self._thread is None:
            log.warning("response %s not stored: the store is closed", response.get("id"))
            return
        future = self._thread.submit(self._put, owner, response, items, conversation)

        def logged(done: concurrent.futures.Future[None]) -> None:
            error = done.exception()
            if error is not None:
                log.warning("response %s not stored (%s): a later previous_response_id "
                            "naming it will get 404", response.get("id"), error)

        future.add_done_callback(logged)

    # Each lookup sees only ``owner``'s responses (None: anyone's, for an admin).
    async def response(self, response_id: str, owner: str | None) -> dict[str, Any] | None:
        return await self._call(self._get, "response", response_id, owner)

    async def items(self, response_id: str, owner: str | None) -> list[dict[str, Any]] | None:
        return await self._call(self._get, "items", response_id, owner)

    async def conversation(self, response_id: str,
                           owner: str | None) -> list[dict[str, Any]] | None:
        return await self._call(self._get, "conversation", response_id, owner)

    async def delete(self, response_id: str, owner: str | None) -> bool:
        return await self._call(self._delete, response_id, owner)

    async def close(self) -> None:
        """Finish queued writes and close the database (it may be opened again)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            await asyncio.get_running_loop().run_in_executor(thread, self._close)
            thread.shutdown(wait=True)
