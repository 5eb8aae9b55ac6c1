"""A prefix store in a local directory, shared by the processes that open it.

    <dir>/index.sqlite          one row per entry: parent, size, score, state (SQLite, WAL mode)
    <dir>/entries/ab/<key>.kvstore   the entries' bytes (`codec`), one file each
    <dir>/tmp/                  files being written

Why SQLite: the index answers "the lowest score", "bytes held" and "is this key held" from
indexes, in one transaction per insert that every process sees (WAL lets readers go on while one
writes), so no operation scans the directory or reads other entries' files, and the byte count
cannot drift between processes. A row is written (and its bytes counted) *before* its file
appears and deleted only after its file is gone, so every byte on disk is counted: a writer killed
mid-write leaves a counted "writing" row that the next insert, once that writer is dead, removes
with its temporary file. Files are read by name without the index (a read-only directory still
serves hits), and only regular files are opened, without following links or blocking (a FIFO
named like an entry is an unreadable entry, not a hang).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sqlite3
import stat
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import CacheInputError
from ..progress import Progress
from .backends import Inserted, StoreUnavailable, floor, score

SUFFIX = ".kvstore"
#: A "writing" row whose writer cannot be checked (another host) is stale after this many seconds.
STALE_WRITE_S = 3600.0
#: How long a process waits for another's transaction before the directory counts as unavailable.
BUSY_TIMEOUT_S = 10.0
READY, WRITING = 1, 0
_HOST = socket.gethostname()
_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key BLOB PRIMARY KEY, parent BLOB, size INTEGER NOT NULL, score INTEGER NOT NULL,
    state INTEGER NOT NULL, writer TEXT, started REAL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_by_score ON entries(score) WHERE state = 1;
CREATE INDEX IF NOT EXISTS entries_writing ON entries(started) WHERE state = 0;
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO counters VALUES ('bytes', 0), ('stamp', 0), ('lookups', 0), ('hits', 0),
    ('tokens_reused', 0), ('chunks', 0), ('roots', 0);
"""


def _alive(writer: str) -> bool:
    """Whether the process that wrote `host:pid` may still be writing (unknown hosts: yes)."""
    host, _, pid = writer.rpartition(":")
    if host != _HOST or not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class DirectoryBackend:
    """Entries as files in `path` (created if missing) with an SQLite index (module docstring).

    `strict`: a damaged entry or an unavailable directory raises instead of warning. A directory
    this process cannot write is opened read-only: lookups hit, inserts are skipped."""

    holds_objects = False

    def __init__(self, path: str | os.PathLike[str], *, strict: bool = False) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise CacheInputError(f"prefix store directory {str(path)!r} is a file, not a directory")
        self.strict = strict
        self._lock = threading.Lock()
        self._writer = f"{_HOST}:{os.getpid()}"
        self._writing: set[bytes] = set()  # keys this process's inserts are writing now
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / "tmp").mkdir(exist_ok=True)
            (self.path / "entries").mkdir(exist_ok=True)
            self.writable = os.access(self.path, os.W_OK)
        except OSError as exc:
            if not self.path.is_dir():
                raise CacheInputError(f"prefix store directory {str(path)!r}: {exc.strerror or exc}") from exc
            self.writable = False
        fresh = not (self.path / "index.sqlite").exists()
        self._closed = False
        self._db = self._connect()
        if fresh and self.writable:
            self._remove_old_format()

    @property
    def location(self) -> str:
        return str(self.path)

    def _connect(self) -> sqlite3.Connection | None:
        index = self.path / "index.sqlite"
        if self.writable:
            deadline = time.monotonic() + BUSY_TIMEOUT_S
            while True:  # processes opening a new directory at once: one creates, the others wait
                try:
                    db = sqlite3.connect(index, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
                    if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                        db.execute("PRAGMA journal_mode=WAL")
                    db.execute("PRAGMA synchronous=NORMAL")
                    db.executescript(_SCHEMA)
                    return db
                except sqlite3.OperationalError as exc:
                    if "readonly" in str(exc) or "read-only" in str(exc):
                        self.writable = False
                        break
                    if "locked" not in str(exc) or time.monotonic() > deadline:
                        raise StoreUnavailable(f"prefix store {self.path}: its index cannot be opened ({exc})") from exc
                    time.sleep(0.01)
                except sqlite3.DatabaseError as exc:  # not a database, or a damaged one
                    raise StoreUnavailable(f"prefix store {self.path}: its index {index} is damaged ({exc}); remove "
                                           "the directory (or move it aside) to start an empty store") from exc
        for uri in (f"file:{index}?mode=ro", f"file:{index}?immutable=1"):  # read-only: hits still work
            with contextlib.suppress(sqlite3.Error):
                db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
                db.execute("SELECT 1 FROM counters LIMIT 1")
                return db
        return None

    def _remove_old_format(self) -> None:
        """kvcache 0.2 kept `<key>.kvstore` files at the top of the directory, in a format this
        version does not read: they are removed (once, when the index is created)."""
        old = [p for p in self.path.glob(f"*{SUFFIX}") if p.is_file()]
        for path in [*old, self.path / ".lock", self.path / "stats.json"]:
            with contextlib.suppress(OSError):
                path.unlink()
        if old:
            warnings.warn(f"prefix store {self.path}: removed {len(old)} entries of kvcache 0.2's store format",
                          stacklevel=4)  # fmt: skip

    # -------------------------------------------------------------------------- plumbing
    def close(self) -> None:
        """Close the index (its WAL checkpointed into it): later calls are `StoreUnavailable`."""
        with self._lock:
            db, self._db, self._closed = self._db, None, True
            if db is not None:
                with contextlib.suppress(sqlite3.Error):
                    db.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable(f"prefix store {self.path} is closed")

    def _file(self, key: bytes) -> Path:
        hexkey = key.hex()
        return self.path / "entries" / hexkey[:2] / (hexkey + SUFFIX)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE: other processes wait, up to BUSY_TIMEOUT_S)."""
        self._check_open()
        if self._db is None or not self.writable:
            raise StoreUnavailable(f"prefix store {self.path} is read-only here")
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreUnavailable(f"prefix store {self.path}: {exc}") from exc
            try:
                yield self._db
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                raise StoreUnavailable(f"prefix store {self.path}: {exc}") from exc

    def _read_db(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        self._check_open()
        if self._db is None:
            return []
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise StoreUnavailable(f"prefix store {self.path}: {exc}") from exc

    @staticmethod
    def _add(db: sqlite3.Connection, name: str, delta: int) -> None:
        db.execute("UPDATE counters SET value = value + ? WHERE name = ?", (delta, name))

    def _forget(self, db: sqlite3.Connection, key: bytes, size: int, parent: Any) -> None:
        """Delete one entry: its file first, then its row and its bytes."""
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            self._file(key).unlink()
        db.execute("DELETE FROM entries WHERE key = ?", (key,))
        self._add(db, "bytes", -size)
        self._add(db, "chunks", -1)
        if parent is None:
            self._add(db, "roots", -1)

    # ------------------------------------------------------------------------- interface
    def begin(self) -> int:
        self._check_open()
        if not self.writable or self._db is None:
            return int(time.time())  # read-only: no stamp to take, nothing is written
        with self._transaction() as db:
            query = "UPDATE counters SET value = value + 1 WHERE name = 'stamp' RETURNING value"
            (stamp,) = db.execute(query).fetchone()
        return int(stamp)

    def read(self, key: bytes) -> bytes | None:
        """The bytes of `key`'s file; None when there is none; `OSError` when it cannot be read
        (not a regular file, unreadable)."""
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(self._file(key), flags)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise OSError(f"not a regular file ({stat.filemode(info.st_mode)})")
            with os.fdopen(fd, "rb", closefd=False) as file:
                return file.read()
        finally:
            os.close(fd)

    def get_many(self, keys: Sequence[bytes]) -> list[Any]:
        self._check_open()
        out: list[Any] = []
        for key in keys:
            try:
                data = self.read(key)
            except OSError as exc:
                out.append(exc)  # a damaged entry: the store drops it and says why
                break
            if data is None:
                break
            out.append(data)
        return out

    def record_lookup(self, keys: Sequence[bytes], stamp: int, tokens: int) -> None:
        """Raise the scores of a lookup's path (`keys`, root first) and count the lookup."""
        if not self.writable:
            return
        with self._transaction() as db:
            db.executemany("UPDATE entries SET score = max(score, ?) WHERE key = ?",
                           [(score(stamp, depth), key) for depth, key in enumerate(keys)])  # fmt: skip
            for name, value in (("lookups", 1), ("hits", int(bool(keys))), ("tokens_reused", tokens)):
                self._add(db, name, value)

    def insert(self, key: bytes, parent: bytes | None, record: Any, size: int, depth: int, stamp: int,
               max_bytes: int) -> Inserted:  # fmt: skip
        if not self.writable:
            return Inserted("readonly")
        with self._lock:
            self._writing.add(key)
        try:
            return self._write(key, parent, record, size, depth, stamp, max_bytes)
        finally:
            with self._lock:
                self._writing.discard(key)

    def _write(self, key: bytes, parent: bytes | None, record: Any, size: int, depth: int, stamp: int,
               max_bytes: int) -> Inserted:  # fmt: skip
        with self._transaction() as db:
            outcome = self._reserve(db, key, parent, size, depth, stamp, max_bytes)
        if outcome.outcome != "stored":
            return outcome
        target = self._file(key)
        tmp = self.path / "tmp" / f"{key.hex()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            target.parent.mkdir(exist_ok=True)
            tmp.write_bytes(record)
            os.replace(tmp, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            with self._transaction() as db:
                self._forget(db, key, size, parent)
            raise StoreUnavailable(f"prefix store {self.path}: cannot write an entry ({exc.strerror or exc})") from exc
        with self._transaction() as db:
            db.execute("UPDATE entries SET state = ?, writer = NULL WHERE key = ? AND writer = ?",
                       (READY, key, self._writer))  # fmt: skip
        return outcome

    def _reserve(self, db: sqlite3.Connection, key: bytes, parent: bytes | None, size: int, depth: int,
                 stamp: int, max_bytes: int) -> Inserted:  # fmt: skip
        """The insert's transaction: count the entry before its file exists, evicting to fit."""
        row = db.execute("SELECT state, size, parent, writer FROM entries WHERE key = ?", (key,)).fetchone()
        if row is not None:
            state, old_size, old_parent, writer = row
            if state == WRITING and self._alive(writer, key):
                return Inserted("exists")  # someone is writing it now
            if state == READY and self._file(key).is_file():
                db.execute("UPDATE entries SET score = max(score, ?) WHERE key = ?", (score(stamp, depth), key))
                return Inserted("exists")
            self._forget(db, key, old_size, old_parent)  # its file vanished, or its writer died: store it again
        if parent is not None and db.execute(
            "SELECT 1 FROM entries WHERE key = ? AND state = ?", (parent, READY)
        ).fetchone() is None:  # fmt: skip
            return Inserted("orphan")
        self._sweep(db)
        evicted = 0
        (held,) = db.execute("SELECT value FROM counters WHERE name = 'bytes'").fetchone()
        while held + size > max_bytes:
            victim = db.execute("SELECT key, size, parent, score FROM entries WHERE state = 1 ORDER BY score LIMIT 1")
            found = victim.fetchone()
            if found is None or found[3] >= floor(stamp):
                return Inserted("full", evicted)
            self._forget(db, found[0], found[1], found[2])
            held -= found[1]
            evicted += 1
        db.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (key, parent, size, score(stamp, depth), WRITING, self._writer, time.time()))  # fmt: skip
        self._add(db, "bytes", size)
        self._add(db, "chunks", 1)
        if parent is None:
            self._add(db, "roots", 1)
        if parent is not None:
            db.execute("UPDATE entries SET score = max(score, ?) WHERE key = ?", (score(stamp, depth - 1), parent))
        return Inserted("stored", evicted)

    def _sweep(self, db: sqlite3.Connection, limit: int = 8) -> None:
        """Remove a few rows of writers that died mid-write, and their temporary files."""
        rows = db.execute("SELECT key, size, parent, writer, started FROM entries WHERE state = 0 ORDER BY started "
                          "LIMIT ?", (limit,)).fetchall()  # fmt: skip
        now = time.time()
        for key, size, parent, writer, started in rows:
            if (writer is not None and self._alive(writer, key)) and now - (started or 0) < STALE_WRITE_S:
                continue
            for leftover in (self.path / "tmp").glob(f"{key.hex()}.*.tmp"):
                with contextlib.suppress(OSError):
                    leftover.unlink()
            self._forget(db, key, size, parent)

    def _alive(self, writer: str, key: bytes) -> bool:
        """Whether `writer` may still be writing `key`: this process knows which inserts it runs (one
        whose write and clean-up both failed left a row no one writes), others are asked by pid."""
        if writer == self._writer:
            return key in self._writing
        return _alive(writer)

    def discard(self, key: bytes) -> None:
        if not self.writable:
            return
        with self._transaction() as db:
            row = db.execute("SELECT size, parent FROM entries WHERE key = ?", (key,)).fetchone()
            if row is None:
                with contextlib.suppress(OSError):
                    self._file(key).unlink()  # a file nobody counted (planted): gone too
            else:
                self._forget(db, key, row[0], row[1])

    def _counter(self, name: str) -> int:
        rows = self._read_db("SELECT value FROM counters WHERE name = ?", (name,))
        return int(rows[0][0]) if rows else 0

    def nbytes(self) -> int:
        return self._counter("bytes")

    def summary(self) -> dict[str, int]:
        return {"chunks": self._counter("chunks"), "roots": self._counter("roots"), "bytes": self.nbytes()}

    def shrink_to(self, max_bytes: int) -> int:
        """Evict the lowest scores until at most `max_bytes` are held (a store opened with a
        smaller budget than the directory holds)."""
        if not self.writable or self.nbytes() <= max_bytes:
            return 0
        evicted = 0
        with Progress(None, f"prefix store {self.path}: evicting to {max_bytes:,} bytes", unit="chunk") as shown:
            while True:
                with self._transaction() as db:
                    (held,) = db.execute("SELECT value FROM counters WHERE name = 'bytes'").fetchone()
                    rows = db.execute("SELECT key, size, parent FROM entries WHERE state = 1 ORDER BY score "
                                      "LIMIT 256").fetchall()  # fmt: skip
                    done = 0
                    for key, size, parent in rows:
                        if held <= max_bytes:
                            break
                        self._forget(db, key, size, parent)
                        held -= size
                        done += 1
                evicted += done
                shown.update(done)
                if held <= max_bytes or not rows:
                    return evicted

    def clear(self) -> None:
        """Delete every entry (and every leftover file in the entry folders)."""
        if not self.writable:
            raise StoreUnavailable(f"prefix store {self.path} is read-only here")
        files = [p for p in (self.path / "entries").glob(f"*/*{SUFFIX}")] + list((self.path / "tmp").glob("*"))
        with Progress(len(files), f"prefix store {self.path}: clearing", unit="file") as shown:
            for path in files:
                with contextlib.suppress(OSError):
                    path.unlink()
                shown.update(1)
        with self._transaction() as db:
            db.execute("DELETE FROM entries")
            db.execute("UPDATE counters SET value = 0 WHERE name IN ('bytes', 'chunks', 'roots')")

    def counters(self) -> dict[str, int]:
        return {name: self._counter(name) for name in ("lookups", "hits", "tokens_reused")}

