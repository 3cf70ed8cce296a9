"""Where the journal's records go: a ring of the newest in memory, and an SQLite file
written by one thread, in batches, bounded by age (`keep_days`) and size (`max_mib`).

The event loop only appends to the ring and puts the record on the writer's queue (a
queue that is over MAX_PENDING drops records, counted, rather than grow). A file that
cannot be opened or written (a full disk, a broken file) stops the file for the rest of
the run, said once in the log: the ring goes on, and so do the requests.
"""

from __future__ import annotations

import collections
import logging
import queue
import sqlite3
import threading
import time
from pathlib import Path

import msgspec

from ..config.journal import JournalConfig
from ..config.model import Config
from .record import Record

log = logging.getLogger("corral.journal")

BATCH_WAIT_S = 0.25
"""How long the writer gathers records after the first of a batch."""
BATCH_MAX = 2000
MAX_PENDING = 100_000
"""Records waiting for the writer past which new ones are dropped (and counted)."""
PRUNE_EVERY_S = 60.0
MAX_LIMIT = 10_000
"""The most records one query returns."""

_INSERT = "INSERT INTO requests VALUES (?, ?, ?, ?, ?, ?, ?)"
_SCHEMA = ("CREATE TABLE IF NOT EXISTS requests (at, id, key, model, served, status, record)",)
"""No index: a row costs its insert alone (each index doubled it), and a query reads the
file backwards from its newest row, comparing columns without decoding a record, until
it has its page (a full pass over 100,000 rows takes milliseconds: bench journal)."""
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Record).decode


class Query(msgspec.Struct, kw_only=True):
    """Which records: newest first, each condition if given."""

    id: str | None = None
    model: str | None = None
    """Matches the model asked for or the one that answered."""
    key: str | None = None
    status: int | None = None
    """An exact status, or a class: 4 for every 4xx."""
    since: float | None = None
    limit: int = 100

    def matches(self, r: Record) -> bool:
        return ((self.id is None or r.id == self.id)
                and (self.model is None or self.model in (r.model, r.served))
                and (self.key is None or r.key == self.key)
                and (self.status is None or r.status == self.status
                     or (self.status < 10 and r.status // 100 == self.status))
                and (self.since is None or r.at >= self.since))


def _row(r: Record) -> tuple[object, ...]:
    """A record as a row: what queries select by, and the whole record (msgpack)."""
    return r.at, r.id, r.key, r.model, r.served, r.status, _encode(r)


class Journal:
    """The records of one corral: `add` them on the loop, `query` them off it."""

    def __init__(self, config: JournalConfig, path: Path | None) -> None:
        self.config = config
        self.path = path
        self.ring: collections.deque[Record] = collections.deque(maxlen=config.ring)
        self.pending: queue.SimpleQueue[Record | None] = queue.SimpleQueue()
        self.broken: str | None = None if path is not None else "no file (state_dir)"
        """Why the file is not written (None: it is)."""
        self.dropped = 0
        """Records the file lost: its writer was too far behind, or it broke."""
        self.written = 0
        self.thread: threading.Thread | None = None
        if path is not None:
            self.thread = threading.Thread(target=self._write, name="journal", daemon=True)
            self.thread.start()

    @classmethod
    def of(cls, config: Config) -> Journal | None:
        """`config`'s journal, in its state_dir (None: [journal] is off)."""
        if not config.journal.enabled:
            return None
        return cls(config.journal, config.state_path() / "journal.sqlite")

    def add(self, record: Record) -> None:
        self.ring.append(record)
        if self.broken is not None:
            return
        if self.pending.qsize() > MAX_PENDING:
            self.dropped += 1
            return
        self.pending.put(record)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is pending, then stop the writer."""
        if self.thread is not None:
            self.pending.put(None)
            self.thread.join(timeout_s)

    # ------------------------------------------------------------ reading

    def query(self, q: Query) -> list[Record]:
        """The newest records that match (blocking: call it off the loop). From the file
        while it is written, else from the ring."""
        limit = max(1, min(q.limit, MAX_LIMIT))
        if self.broken is None and self.path is not None:
            try:
                return self._select(q, limit)
            except sqlite3.Error as e:
                log.warning("the journal's file could not be read (%s); answered from the "
                            "%d records in memory", e, len(self.ring))
        out = [r for r in reversed(self.ring) if q.matches(r)]
        return out[:limit]  # (the newest to end first, as the file answers)

    def _select(self, q: Query, limit: int) -> list[Record]:
        where: list[str] = []
        args: list[object] = []
        for column, value in (("id", q.id), ("key", q.key)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if q.model is not None:
            where.append("(model = ? OR served = ?)")
            args += [q.model, q.model]
        if q.status is not None:
            where.append("status = ?" if q.status >= 10 else "status / 100 = ?")
            args.append(q.status)
        if q.since is not None:
            where.append("at >= ?")
            args.append(q.since)
        sql = ("SELECT record FROM requests"
               + (f" WHERE {' AND '.join(where)}" if where else "")
               + " ORDER BY rowid DESC LIMIT ?")
        assert self.path is not None
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5)
        try:
            return [_decode(row[0]) for row in db.execute(sql, (*args, limit))]
        finally:
            db.close()

    # ------------------------------------------------------------ the writer thread

    def _write(self) -> None:
        assert self.path is not None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, isolation_level=None, timeout=5)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            for statement in _SCHEMA:
                db.execute(statement)
        except (sqlite3.Error, OSError) as e:
            self._broke(e)
            return
        pruned = 0.0
        while True:
            batch, stop = self._batch()
            try:
                if batch:  # (one transaction: a statement alone would be one each)
                    db.execute("BEGIN")
                    db.executemany(_INSERT, [_row(r) for r in batch])
                    db.execute("COMMIT")
                    self.written += len(batch)
                if time.monotonic() - pruned > PRUNE_EVERY_S:
                    self._prune(db)
                    pruned = time.monotonic()
            except (sqlite3.Error, OSError) as e:
                self.dropped += len(batch)
                self._broke(e)
                db.close()
                return
            if stop:
                db.close()
                return

    def _batch(self) -> tuple[list[Record], bool]:
        """The next records to write: the first, then what came while the writer slept
        (it sleeps rather than wait on the queue, so that a record put does not wake it:
        a wake a record cost the event loop's thread the GIL, each time)."""
        first = self.pending.get()
        if first is None:
            return [], True
        time.sleep(BATCH_WAIT_S)
        batch = [first]
        while len(batch) < BATCH_MAX:
            try:
                item = self.pending.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    def _prune(self, db: sqlite3.Connection) -> None:
        """Delete what is older than keep_days, then the oldest while over max_mib."""
        db.execute("DELETE FROM requests WHERE at < ?",
                   (time.time() - self.config.keep_days * 86400,))
        limit = self.config.max_mib * 1024 * 1024
        for _ in range(20):
            pages, free, size = (db.execute(f"PRAGMA {p}").fetchone()[0]
                                 for p in ("page_count", "freelist_count", "page_size"))
            if (pages - free) * size <= limit:
                return
            db.execute("DELETE FROM requests WHERE rowid < (SELECT min(rowid) + count(*) / 5 + 1 "
                       "FROM requests)")

    def _broke(self, e: BaseException) -> None:
        self.broken = f"{type(e).__name__}: {e}"
        log.error("the request journal stopped writing %s (%s); requests go on, and the "
                  "newest %d records stay in memory", self.path, self.broken,
                  self.config.ring)
        while True:  # what waits is lost with the file
            try:
                if self.pending.get_nowait() is not None:
                    self.dropped += 1
            except queue.Empty:
                return
