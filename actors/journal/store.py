"""Where the journal's records go: a ring of the newest in memory, and an SQLite file
written by one thread, in batches, bounded by age (`keep_days`) and size (`max_mib`).

The event loop only appends a request's `Row` to the ring and to the writer's list (a
list that is over MAX_PENDING drops rows, counted, rather than grow). The writer keeps
rows in pages of up to PAGE, one SQLite row each: a page's rows (msgpack), and beside
them the ids, models, keys, (model, key) pairs and statuses it holds, which a query
selects pages by before it decodes one; a request costs the file under a microsecond
(bench journal), where a row of its own cost several. A file that cannot be opened or
written (a full disk, a broken file) stops the file for the rest of the run, said once
in the log: the ring goes on, and so do the requests.
"""

from __future__ import annotations

import collections
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from operator import attrgetter
from pathlib import Path

import msgspec

from ..config.journal import JournalConfig
from ..config.model import Config
from .record import Row

log = logging.getLogger("corral.journal")

BATCH_WAIT_S = 0.25
"""How long the writer sleeps between batches: what came meanwhile is one batch."""
PAGE = 100
"""Rows in one page of the file, at most."""
MAX_PENDING = 100_000
"""Rows waiting for the writer past which new ones are dropped (and counted)."""
PRUNE_EVERY_S = 60.0
MAX_LIMIT = 10_000
"""The most records one query returns."""
VERSION = 2
"""The file's layout (PRAGMA user_version); a file of another is moved aside."""

_SEP, _PAIR = "\x1f", "\x1e"
_INSERT = "INSERT INTO pages VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
_SCHEMA = ("CREATE TABLE IF NOT EXISTS pages (first_at, last_at, ids, models, keys, pairs, "
           "statuses, rows)", f"PRAGMA user_version = {VERSION}")
"""No index: a query reads the pages backwards from the newest, matching their columns
with instr() (a full pass over 1,000 pages takes milliseconds: bench journal)."""
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(list[Row]).decode


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

    def matches(self, r: Row) -> bool:
        return ((self.id is None or r.id == self.id)
                and (self.model is None or self.model in (r.model, r.served))
                and (self.key is None or r.key == self.key)
                and (self.status is None or r.status == self.status
                     or (self.status < 10 and r.status // 100 == self.status))
                and (self.since is None or r.at >= self.since))

    def where(self) -> tuple[str, list[object]]:
        """The pages that may hold a match: each value is in its page's column between
        separators (a value that holds one still finds itself; the rows decide)."""
        conditions = [(column, value) for column, value in (
            ("ids", self.id), ("models", self.model if self.key is None else None),
            ("keys", self.key if self.model is None else None),
            ("pairs", None if self.model is None or self.key is None
             else self.model + _PAIR + self.key)) if value is not None]
        sql = [f"instr({column}, ?)" for column, _ in conditions]
        args: list[object] = [_SEP + value + _SEP for _, value in conditions]
        if self.status is not None:  # (a class: the statuses that start with it)
            sql.append("instr(statuses, ?)")
            args.append(_SEP + str(self.status) + (_SEP if self.status >= 10 else ""))
        if self.since is not None:
            sql.append("last_at >= ?")
            args.append(self.since)
        return " AND ".join(sql), args


def _page(rows: list[Row]) -> tuple[object, ...]:
    """Rows as one row of the file: what queries select pages by, and the rows."""
    models, served, keys = (list(map(attrgetter(a), rows)) for a in ("model", "served", "key"))
    ats = list(map(attrgetter("at"), rows))
    pairs = {*zip(models, keys, strict=True), *zip(served, keys, strict=True)}
    return (min(ats), max(ats), _joined(map(attrgetter("id"), rows)),
            _joined({*models, *served}), _joined(set(keys)),
            _joined(m + _PAIR + k for m, k in pairs),
            _joined(map(str, set(map(attrgetter("status"), rows)))), _encode(rows))


def _joined(values: Iterable[str]) -> str:
    return _SEP + _SEP.join(values) + _SEP


class Journal:
    """The records of one corral: `add` them on the loop, `query` them off it."""

    def __init__(self, config: JournalConfig, path: Path | None) -> None:
        self.config = config
        self.path = path
        self.ring: collections.deque[Row] = collections.deque(maxlen=config.ring)
        self.pending: collections.deque[Row] = collections.deque()
        """Rows for the writer (appended on the loop, taken by the writer: both atomic)."""
        self.closing = threading.Event()
        self.broken: str | None = None if path is not None else "no file (state_dir)"
        """Why the file is not written (None: it is)."""
        self.dropped = 0
        """Rows the file lost: its writer was too far behind, or it broke."""
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

    def add(self, row: Row) -> None:
        self.ring.append(row)
        if self.broken is not None:
            return
        if len(self.pending) > MAX_PENDING:
            self.dropped += 1
            return
        self.pending.append(row)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is pending, then stop the writer."""
        self.closing.set()
        if self.thread is not None:
            self.thread.join(timeout_s)

    # ------------------------------------------------------------ reading

    def query(self, q: Query) -> list[Row]:
        """The newest rows that match (blocking: call it off the loop). From the file
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

    def _select(self, q: Query, limit: int) -> list[Row]:
        where, args = q.where()
        sql = ("SELECT rows FROM pages" + (f" WHERE {where}" if where else "")
               + " ORDER BY rowid DESC")
        assert self.path is not None
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5)
        try:
            out: list[Row] = []
            for (rows,) in db.execute(sql, args):
                out += [r for r in reversed(_decode(rows)) if q.matches(r)]
                if len(out) >= limit:
                    break
            return out[:limit]
        finally:
            db.close()

    # ------------------------------------------------------------ the writer thread

    def _write(self) -> None:
        assert self.path is not None
        try:
            db = _open(self.path)
        except (sqlite3.Error, OSError) as e:
            self._broke(e)
            return
        pruned = 0.0
        while True:  # (it sleeps rather than wait for rows: a row that woke it would
            stop = self.closing.wait(BATCH_WAIT_S)  # cost the loop's thread the GIL)
            batch = list(self._taken())
            try:
                if batch:  # (one transaction: a statement alone would be one each)
                    db.execute("BEGIN")
                    db.executemany(_INSERT, [_page(batch[i:i + PAGE])
                                             for i in range(0, len(batch), PAGE)])
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

    def _taken(self) -> Iterator[Row]:
        """The rows pending now (those added meanwhile wait for the next batch)."""
        take = self.pending.popleft
        for _ in range(len(self.pending)):
            yield take()

    def _prune(self, db: sqlite3.Connection) -> None:
        """Delete what is older than keep_days, then the oldest while over max_mib."""
        db.execute("DELETE FROM pages WHERE last_at < ?",
                   (time.time() - self.config.keep_days * 86400,))
        limit = self.config.max_mib * 1024 * 1024
        for _ in range(20):
            pages, free, size = (db.execute(f"PRAGMA {p}").fetchone()[0]
                                 for p in ("page_count", "freelist_count", "page_size"))
            if (pages - free) * size <= limit:
                return
            db.execute("DELETE FROM pages WHERE rowid < (SELECT min(rowid) + count(*) / 5 + 1 "
                       "FROM pages)")

    def _broke(self, e: BaseException) -> None:
        self.broken = f"{type(e).__name__}: {e}"
        log.error("the request journal stopped writing %s (%s); requests go on, and the "
                  "newest %d records stay in memory", self.path, self.broken,
                  self.config.ring)
        self.dropped += len(self.pending)  # what waits is lost with the file
        self.pending.clear()


def _open(path: Path) -> sqlite3.Connection:
    """The file at `path`, made if need be; one of another layout is moved aside (to
    `journal.sqlite.v1`, say) and a new one begun."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None, timeout=5)
    version = db.execute("PRAGMA user_version").fetchone()[0]
    tables = db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    if tables and version != VERSION:
        db.close()
        aside = path.with_name(f"{path.name}.v{version or 1}")
        for suffix in ("", "-wal", "-shm"):
            if (old := Path(f"{path}{suffix}")).exists():
                old.replace(f"{aside}{suffix}")
        log.warning("the request journal %s was of an older layout: moved to %s, and a new "
                    "one begun", path, aside)
        db = sqlite3.connect(path, isolation_level=None, timeout=5)
    db.execute("PRAGMA journal_mode=TRUNCATE")  # (rows are appended: a rollback journal
    db.execute("PRAGMA synchronous=NORMAL")     # holds little, where WAL wrote all twice)
    for statement in _SCHEMA:
        db.execute(statement)
    return db
