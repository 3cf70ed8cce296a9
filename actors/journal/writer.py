"""The journal's file writer: a process of its own, fed rows by corral (store.py) on its
stdin, so that the pages it makes and the SQLite work it does cost corral's event loop
nothing, not even the interpreter's lock.

    python -m actors.journal.writer PATH KEEP_DAYS MAX_MIB

Its stdin carries frames (a 4-byte big-endian length, then a msgpack list of pages, each
[how many rows, the rows back to back]: what corral's feeder took from its loop at once);
each frame's pages are sealed (record.py `sealed`: what queries select pages by, from the
rows' heads) and inserted in one transaction. That work is here, not in corral: rows made
objects there, even for a moment, cost the requests after them (store.py). At the end of its stdin
(corral closed it, or corral is gone) it prints `written N` and exits 0; a file it cannot
open or write prints `broken: WHY` and exits 3, and corral's ring goes on without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sqlite3
import struct
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import msgspec

from .file import INSERT, PAIR, PRUNE_EVERY_S, SEP, open_file, prune
from .record import array, sealed

_LENGTH = struct.Struct(">I")
_frame = msgspec.msgpack.Decoder(list[tuple[int, bytes]]).decode
BUSY_TRIES = 12
"""With the file's 5 s busy timeout: a reader may hold it a minute before the file stops."""


def pages(frame: bytes) -> tuple[list[tuple[object, ...]], int]:
    """A frame's pages as rows of the file, and how many rows they hold."""
    taken = _frame(frame)
    return ([sealed(n, array(n, rows), SEP, PAIR)[1:] for n, rows in taken],
            sum(n for n, _ in taken))


def frames(stream: BinaryIO) -> Iterable[bytes]:
    while len(head := stream.read(4)) == 4:
        yield stream.read(_LENGTH.unpack(head)[0])


def commit(db: sqlite3.Connection, made: list[tuple[object, ...]]) -> None:
    """Pages in one transaction (a statement alone would be one each); a reader that holds
    the file (a backup, the sqlite3 shell) is waited for, BUSY_TRIES times its timeout."""
    for tries in range(BUSY_TRIES):
        try:
            db.execute("BEGIN")
            db.executemany(INSERT, made)
            db.execute("COMMIT")
            return
        except sqlite3.OperationalError as e:
            if ("locked" not in str(e) and "busy" not in str(e)) or tries == BUSY_TRIES - 1:
                raise
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")


def main(argv: list[str]) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.nice(10)  # (background work: the fronts and the children go first)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a file size limit: an error, said)
    path, keep_days, max_mib = Path(argv[0]), float(argv[1]), float(argv[2])
    written = 0
    try:
        db = open_file(path)
        pruned = 0.0
        for frame in frames(sys.stdin.buffer):
            made, n = pages(frame)
            commit(db, made)
            written += n
            if time.monotonic() - pruned > PRUNE_EVERY_S:
                prune(db, keep_days, max_mib)
                pruned = time.monotonic()
        db.close()
    except Exception as e:  # (sqlite3.Error, OSError, a frame it cannot read)
        print(f"broken: {type(e).__name__}: {e}", flush=True)
        return 3
    print(f"written {written}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
