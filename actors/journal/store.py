"""Where the journal's records go: a ring of the newest in memory, and an SQLite file
(file.py) written by a process of its own (writer.py), bounded by age (`keep_days`)
and size (`max_mib`).

The event loop only appends a request's row, encoded (record.py), to the ring and to a
list, and its head (the id, time, key, models and status the front has) to another. A
feeder thread, every BATCH_WAIT_S, takes both, seals each PAGE of them into the row of
the file that holds them (record.py `sealed`: what queries select pages by, read in a few
calls over the heads) and writes them to the writer's stdin as one frame; the writer
decodes nothing of a row and inserts the pages as they came, and the SQLite work costs
corral's process nothing (in a thread of its own it cost three times its own time, in
the interpreter's lock). A list over MAX_PENDING drops rows, counted, rather than grow. A
writer that cannot open or write its file (a full disk, a broken file) says why and
exits: that stops the file for the rest of the run, said once in the log; the ring goes
on, and so do the requests.
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
from .file import MAX_LIMIT, PAGE, PAIR, SEP, Query, select
from .record import HeadOf, Row, decoded, head_of, sealed

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


class Journal:
    """The records of one corral: `add` them on the loop, `query` them off it."""

    def __init__(self, config: JournalConfig, path: Path | None) -> None:
        self.config = config
        self.path = path
        self.capture = config.capture_kib * 1024 if config.capture else 0
        """Bytes of each body and answer its records keep (0: none)."""
        self.ring: collections.deque[bytes] = collections.deque(maxlen=config.ring)
        """The newest rows, encoded (record.py `encode`)."""
        self.incoming: collections.deque[tuple[bytes, HeadOf]] = collections.deque()
        """Rows for the feeder, with their heads: appended on the loop, taken from the
        other end by the feeder (a deque's two ends need no lock)."""
        self.closing = threading.Event()
        self.broken: str | None = None if path is not None else "no file (state_dir)"
        """Why the file is not written (None: it is)."""
        self.dropped = 0
        """Rows the file lost: the feeder was too far behind, or the file broke."""
        self.written = 0
        """Rows the writer wrote (known once it has ended: `close`)."""
        self.unreadable = False
        """A query found the file unreadable (said once in the log)."""
        self.writer: subprocess.Popen[bytes] | None = None
        self.thread: threading.Thread | None = None
        if path is not None:
            self.thread = threading.Thread(target=self._feed, name="journal", daemon=True)
            self.thread.start()

    @classmethod
    def of(cls, config: Config) -> Journal | None:
        """`config`'s journal, in its state_dir (None: [journal] is off)."""
        if not config.journal.enabled:
            return None
        return cls(config.journal, config.state_path() / "journal.sqlite")

    def add(self, row: bytes, head: HeadOf | None = None) -> None:
        """A request's row, encoded (record.py `encode`), and its head (None: read from
        it, for a front worker's)."""
        self.ring.append(row)  # (the loop's only steps: a deque's appends take no lock)
        if self.broken is not None:
            return
        if len(self.incoming) > MAX_PENDING:
            self.dropped += 1
            return
        self.incoming.append((row, head or head_of(row)))

    @property
    def pending(self) -> list[bytes]:
        """The rows the feeder has not taken yet (a copy)."""
        return [row for row, _ in list(self.incoming)]

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is pending, then stop the writer (it ends with its stdin)."""
        self.closing.set()
        if self.thread is not None:
            self.thread.join(timeout_s)

    # ------------------------------------------------------------ reading

    def query(self, q: Query) -> list[Row]:
        """The newest rows that match (blocking: call it off the loop), the newest to end
        first: the ring's (those not in the file yet among them), then the file's."""
        limit = max(1, min(q.limit, MAX_LIMIT))
        ring, waiting = list(self.ring), self.pending  # (copies: the loop appends meanwhile)
        # the rows the ring let go of that the file has not been sent yet (a high rate)
        memory = waiting[:-len(ring)] + ring if len(waiting) > len(ring) else ring
        newest = [r for r in reversed(decoded(memory)) if q.matches(r)][:limit]
        if self.path is not None and self.path.exists():  # (what it has, written or not)
            try:
                seen = {(r.id, r.at) for r in newest}
                newest += [r for r in select(self.path, q, limit) if (r.id, r.at) not in seen]
            except Exception as e:  # (sqlite3.Error, a page it cannot decode)
                if not self.unreadable:
                    log.warning("the journal's file could not be read (%s); answered from "
                                "the %d records in memory", e, len(self.ring))
                self.unreadable = True
        return newest[:limit]

    # ------------------------------------------------------------ the feeder thread

    def _feed(self) -> None:
        writer = None  # (started by the first rows: a corral that serves none has none)
        while True:
            stop = self.closing.wait(BATCH_WAIT_S)
            taken = [self.incoming.popleft() for _ in range(len(self.incoming))]
            batch, heads = [row for row, _ in taken], [head for _, head in taken]
            if batch and writer is None and (writer := self._start()) is None:
                return
            try:
                if batch and writer is not None and writer.stdin is not None:
                    data = _encode([sealed(batch[i:i + PAGE], heads[i:i + PAGE], SEP, PAIR)
                                    for i in range(0, len(batch), PAGE)])
                    writer.stdin.write(_LENGTH.pack(len(data)) + data)
                    writer.stdin.flush()
            except OSError:  # (its stdin closed: it broke, and said why)
                self.dropped += len(batch)
            if stop or (writer is not None and writer.poll() is not None):
                break
        if writer is not None:
            self._end(writer)

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
        self.dropped += len(self.incoming)  # what waits is lost with the file
        self.incoming.clear()


_ROOT = str(Path(__file__).resolve().parents[2])
"""Where `actors` is: the writer is run as its module from there."""
