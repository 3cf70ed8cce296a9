"""The journal's file: its layout (pages of up to PAGE rows, one SQLite row each: the
rows as msgpack, and beside them the ids, models, keys, (model, key) pairs and statuses
they hold), how it is opened, kept in bounds, and read. The writer process (writer.py)
writes it; corral's process (store.py) only reads it, with a connection of its own.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

import msgspec

from .record import Row

log = logging.getLogger("corral.journal")

PAGE = 500
"""Rows in one page of the file, at most."""
PRUNE_EVERY_S = 60.0
MAX_LIMIT = 10_000
"""The most records one query returns."""
VERSION = 2
"""The file's layout (PRAGMA user_version); a file of another is moved aside."""
SEP, PAIR = "\x1f", "\x1e"
INSERT = "INSERT INTO pages VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
SCHEMA = ("CREATE TABLE IF NOT EXISTS pages (first_at, last_at, ids, models, keys, pairs, "
          "statuses, rows)", f"PRAGMA user_version = {VERSION}")
"""No index: a query reads the pages backwards from the newest, matching their columns
with instr() (a full pass over 1,000 pages takes milliseconds: bench journal)."""
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
    session: str | None = None
    """Its session header's value (no column of the file: its rows decide)."""
    limit: int = 100

    def matches(self, r: Row) -> bool:
        return ((self.id is None or r.id == self.id)
                and (self.model is None or self.model in (r.model, r.served))
                and (self.key is None or r.key == self.key)
                and (self.status is None or r.status == self.status
                     or (self.status < 10 and r.status // 100 == self.status))
                and (self.since is None or r.at >= self.since)
                and (self.session is None or r.session == self.session))

    def where(self) -> tuple[str, list[object]]:
        """The pages that may hold a match: each value is in its page's column between
        separators (a value that holds one still finds itself; the rows decide)."""
        conditions = [(column, value) for column, value in (
            ("ids", self.id), ("models", self.model if self.key is None else None),
            ("keys", self.key if self.model is None else None),
            ("pairs", None if self.model is None or self.key is None
             else self.model + PAIR + self.key)) if value is not None]
        sql = [f"instr({column}, ?)" for column, _ in conditions]
        args: list[object] = [SEP + value + SEP for _, value in conditions]
        if self.status is not None:  # (a class: the statuses that start with it)
            sql.append("instr(statuses, ?)")
            args.append(SEP + str(self.status) + (SEP if self.status >= 10 else ""))
        if self.since is not None:
            sql.append("last_at >= ?")
            args.append(self.since)
        return " AND ".join(sql), args


def select(path: Path, q: Query, limit: int) -> list[Row]:
    """The newest rows of the file at `path` that match `q` (blocking)."""
    where, args = q.where()
    sql = ("SELECT rows FROM pages" + (f" WHERE {where}" if where else "")
           + " ORDER BY rowid DESC")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        out: list[Row] = []
        for (rows,) in db.execute(sql, args):
            out += [r for r in reversed(_decode(rows)) if q.matches(r)]
            if len(out) >= limit:
                break
        return out[:limit]
    finally:
        db.close()


def prune(db: sqlite3.Connection, keep_days: float, max_mib: float) -> None:
    """Delete what is older than keep_days, then the oldest while over max_mib."""
    db.execute("DELETE FROM pages WHERE last_at < ?", (time.time() - keep_days * 86400,))
    limit = max_mib * 1024 * 1024
    for _ in range(20):
        pages, free, size = (db.execute(f"PRAGMA {p}").fetchone()[0]
                             for p in ("page_count", "freelist_count", "page_size"))
        if (pages - free) * size <= limit:
            return
        db.execute("DELETE FROM pages WHERE rowid < (SELECT min(rowid) + count(*) / 5 + 1 "
                   "FROM pages)")


def open_file(path: Path) -> sqlite3.Connection:
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
    for statement in SCHEMA:
        db.execute(statement)
    return db
