"""Where the journal's records go: the newest in memory (at least `ring` of them), and an
SQLite file (file.py) written by a process of its own (writer.py), bounded by age
(`keep_days`) and size (`max_mib`).

The event loop only encodes a request's row (its `Trace`: record.py) onto the end of the
page it fills (PAGE rows, then a new one), and takes no lock: the page is its own, and
what it has filled it says in one store (`filled`), which other threads read whole. It
keeps no object a row: rows kept as objects, a request's struct or even its own bytes,
left the allocator's blocks of the request's sizes over cold memory, and every later
request paid for that (bench/README.md, issue 40). A feeder thread, every BATCH_WAIT_S,
takes the full pages, reads what is new on the page being filled, writes both to the
writer's stdin as one frame, and keeps the newest full pages as the ring.
The writer seals each page into the row of the file that holds it (record.py `sealed`:
what queries select pages by) and inserts them; that work and SQLite's cost corral's
process nothing (in a thread of its own SQLite cost three times its own time, in the
interpreter's lock). Rows past MAX_PENDING are dropped, counted. A writer that cannot
open or write its file (a full disk, a broken file) says why and exits: that stops the
file for the rest of the run, said once in the log; the ring goes on, and so do the
requests.
"""

from __future__ import annotations

import collections
import logging
import struct
import subprocess
import sys
import threading
from pathlib import Path

import msgspec

from ..config.journal import JournalConfig
from ..config.model import Config
from .file import MAX_LIMIT, PAGE, Query, select
from .record import Row, decoded, encode_into

__all__ = ["MAX_LIMIT", "Journal", "Query"]

log = logging.getLogger("corral.journal")

BATCH_WAIT_S = 1.0
"""How long the feeder sleeps between batches: what came meanwhile is one batch (each
costs the writer a transaction, about 0.7 ms: at 0.25 s that was a third of its cost
per row at 2,000 requests/s)."""
MAX_PENDING = 100_000
"""Rows waiting for the feeder past which new ones are dropped (and counted)."""
_LENGTH = struct.Struct(">I")
_encode = msgspec.msgpack.Encoder().encode
Page = tuple[int, bytes | bytearray]
"""Rows as the journal holds them: (how many, the rows encoded back to back)."""


class Journal:
    """The records of one corral: `add` them on the loop, `query` them off it."""

    def __init__(self, config: JournalConfig, path: Path | None) -> None:
        self.config = config
        self.path = path
        self.capture = config.capture_kib * 1024 if config.capture else 0
        """Bytes of each body and answer its records keep (0: none)."""
        self.filled: tuple[bytearray, int, int, int] = (bytearray(), 0, 0, 0)
        """The page the loop fills, how many rows it holds, where they end, and its number
        (one more than the page before it): changed by the loop alone, and in one store,
        so another thread reads the four alike; the bytes before that end never change
        after."""
        self.full: collections.deque[tuple[int, int, bytearray]] = collections.deque()
        """The pages the loop filled (PAGE rows each), oldest first, not taken yet: (its
        number, how many rows, the rows)."""
        self.taken_to = -1
        """The number of the newest page the feeder took: one read as being filled that is
        not newer went on already (to the ring, and maybe out of it)."""
        self.lock = threading.Lock()
        """Held by the feeder as it moves pages on, and by a query's look at them; never
        by the loop (with its checks, it cost a request 2.2k instructions, against 2.9k
        for its row's encoding: bench/README.md)."""
        self.taken: list[Page] = []
        """What the feeder took and has not put in the ring yet."""
        self.ring: collections.deque[Page] = collections.deque()
        """The newest pages the feeder took, as many as hold `config.ring` rows."""
        self.in_ring = 0
        self.sent: tuple[bytearray | None, int, int] = (None, 0, 0)
        """How much of the page being filled the writer was sent (its rows, their end)."""
        self.closing = threading.Event()
        self.broken: str | None = None if path is not None else "no file (state_dir)"
        """Why the file is not written (None: it is)."""
        self.dropped = 0
        """Rows lost on the loop: the feeder was too far behind, or a row did not encode."""
        self.unsent = 0
        """Rows the writer could not be sent (it broke)."""
        self.written = 0
        """Rows the writer wrote (known once it has ended: `close`)."""
        self.unreadable = False
        """A query found the file unreadable (said once in the log)."""
        self.unkept = False
        """A record could not be encoded (said once in the log)."""
        self.writer: subprocess.Popen[bytes] | None = None
        self.thread = threading.Thread(target=self._feed, name="journal", daemon=True)
        self.thread.start()

    @classmethod
    def of(cls, config: Config) -> Journal | None:
        """`config`'s journal, in its state_dir (None: [journal] is off)."""
        if not config.journal.enabled:
            return None
        return cls(config.journal, config.state_path() / "journal.sqlite")

    def add(self, row: Row) -> None:
        """A request's row, as it ended (nothing of it changes after): on the loop only."""
        page, n, end, number = self.filled
        try:
            encode_into(row, page, -1)
        except Exception as e:  # (a field it cannot keep: the page stays whole)
            del page[end:]
            self._lost(row, e)
            return
        if n < PAGE - 1:
            self.filled = (page, n + 1, len(page), number)
        else:
            self._cut(page, number)

    def add_encoded(self, row: bytes) -> None:
        """A row encoded already (a front worker's, sent over its channel): on the loop."""
        page, n, _, number = self.filled
        page += row
        if n < PAGE - 1:
            self.filled = (page, n + 1, len(page), number)
        else:
            self._cut(page, number)

    def _cut(self, page: bytearray, number: int) -> None:
        """A full page goes to the feeder (first: a reader that saw it as being filled
        finds it there), a new one is begun."""
        if len(self.full) < MAX_PENDING // PAGE:
            self.full.append((number, PAGE, page))
        else:
            self.dropped += PAGE
        self.filled = (bytearray(), 0, 0, number + 1)

    def _lost(self, row: Row, e: Exception) -> None:
        self.dropped += 1
        if not self.unkept:
            log.error("the request journal could not keep a record (%s: %s), and keeps none "
                      "like it; the request went on: %r", type(e).__name__, e, row)
        self.unkept = True

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is pending, then stop the writer (it ends with its stdin)."""
        self.closing.set()
        self.thread.join(timeout_s)

    # ------------------------------------------------------------ reading

    def memory(self) -> list[Row]:
        """The rows in memory, the oldest first: the ring's, then those the feeder has
        not put there yet (the file may not have them yet)."""
        page, n, end, number = self.filled  # (first: if it is cut meanwhile, it is
        with self.lock:                      # found below, or it went on)
            pages = [*self.ring, *self.taken]
            full, gone = list(self.full), number <= self.taken_to
        pages += [(k, rows) for _, k, rows in full]
        if n and not gone and not any(p is page for _, _, p in full):
            pages.append((n, page[:end]))
        return [row for n, rows in pages for row in decoded(n, rows)]

    def query(self, q: Query) -> list[Row]:
        """The newest rows that match (blocking: call it off the loop), the newest to end
        first: those in memory, then the file's."""
        limit = max(1, min(q.limit, MAX_LIMIT))
        newest = [r for r in reversed(self.memory()) if q.matches(r)][:limit]
        if self.path is not None and self.path.exists():  # (what it has, written or not)
            try:
                seen = {(r.id, r.at) for r in newest}
                newest += [r for r in select(self.path, q, limit) if (r.id, r.at) not in seen]
            except Exception as e:  # (sqlite3.Error, a page it cannot decode)
                if not self.unreadable:
                    log.warning("the journal's file could not be read (%s); answered from "
                                "the %d records in memory", e, self.in_ring)
                self.unreadable = True
        return newest[:limit]

    # ------------------------------------------------------------ the feeder thread

    def _feed(self) -> None:
        writer = None  # (started by the first rows: a corral that serves none has none)
        while True:
            stop = self.closing.wait(BATCH_WAIT_S)
            pages, new = self._take()
            if new and self.broken is None and writer is None:
                writer = self._start()
            if new and writer is not None and writer.stdin is not None:
                try:
                    data = _encode(new)
                    writer.stdin.write(_LENGTH.pack(len(data)) + data)
                    writer.stdin.flush()
                except OSError:  # (its stdin closed: it broke, and says why)
                    self.unsent += sum(n for n, _ in new)
            self._keep(pages)
            if writer is not None and (stop or writer.poll() is not None):
                self._end(writer)  # (one that broke stops the file; the ring goes on)
                writer = None
            if stop:
                return

    def _take(self) -> tuple[list[Page], list[Page]]:
        """The pages filled since the last take (for the ring), and what of them and of
        the page being filled the writer has not been sent (the loop's page is not taken
        from it, only read: the rows of a page cut since are sent from the page)."""
        page, n, end, number = self.filled  # (first: if it is cut meanwhile, it is
        with self.lock:                      # taken below, or was before)
            full = [self.full.popleft() for _ in range(len(self.full))]
            pages: list[Page] = [(k, rows) for _, k, rows in full]
            self.taken = pages
            if full:
                self.taken_to = full[-1][0]
        was, was_n, was_end = self.sent
        new = [(k - was_n, p[was_end:]) if p is was else (k, p) for k, p in pages]
        if number <= self.taken_to:
            self.sent = (None, 0, 0)
        else:
            new.append((n - was_n, page[was_end:end]) if page is was else (n, page[:end]))
            self.sent = (page, n, end)
        return pages, [(k, rows) for k, rows in new if k]

    def _keep(self, pages: list[Page]) -> None:
        """Pages into the ring, its oldest let go while the rest hold `config.ring`."""
        with self.lock:
            self.ring.extend(pages)
            self.in_ring += sum(n for n, _ in pages)
            while self.ring and self.in_ring - self.ring[0][0] >= self.config.ring:
                self.in_ring -= self.ring.popleft()[0]
            self.taken = []

    def _start(self) -> subprocess.Popen[bytes] | None:
        assert self.path is not None
        try:
            self.writer = subprocess.Popen(
                [sys.executable, "-m", "actors.journal.writer", str(self.path),
                 repr(self.config.keep_days), repr(self.config.max_mib)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=_ROOT,
                start_new_session=True)  # (Ctrl-C is corral's: it ends with its stdin)
        except OSError as e:
            self._broke(f"its writer could not start: {e}")
            return None
        return self.writer

    def _end(self, writer: subprocess.Popen[bytes]) -> None:
        """Close its stdin (it writes what it has, then exits) and read what it says."""
        assert writer.stdin is not None and writer.stdout is not None
        try:
            writer.stdin.close()
        except OSError:
            pass
        said = writer.stdout.read().decode(errors="replace").strip()
        writer.wait()
        if said.startswith("written "):
            self.written = int(said.split()[1])
        else:
            self._broke(said.removeprefix("broken: ") or f"its writer exited {writer.returncode}")

    def _broke(self, why: str) -> None:
        self.broken = why
        log.error("the request journal stopped writing %s (%s); requests go on, and the "
                  "newest %d records stay in memory", self.path, why, self.config.ring)


_ROOT = str(Path(__file__).resolve().parents[2])
"""Where `actors` is: the writer is run as its module from there."""
