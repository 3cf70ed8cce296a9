"""The journal's file writer: a process of its own, fed rows by corral (store.py) on its
stdin, so that the pages it makes and the SQLite work it does cost corral's event loop
nothing, not even the interpreter's lock.

    python -m actors.journal.writer PATH KEEP_DAYS MAX_MIB

Its stdin carries frames (a 4-byte big-endian length, then a msgpack list of `Row`);
each is written as pages of up to PAGE rows in one transaction. At the end of its stdin
(corral closed it, or corral is gone) it prints `written N` and exits 0; a file it cannot
open or write prints `broken: WHY` and exits 3, and corral's ring goes on without it.
"""

from __future__ import annotations

import logging
import struct
import sys
import time
from collections.abc import Iterable
from operator import attrgetter
from pathlib import Path
from typing import BinaryIO

import msgspec

from .file import INSERT, PAGE, PAIR, PRUNE_EVERY_S, SEP, open_file, prune
from .record import Row

_decode = msgspec.msgpack.Decoder(list[Row]).decode
_encode = msgspec.msgpack.Encoder().encode
_LENGTH = struct.Struct(">I")


def page(rows: list[Row]) -> tuple[object, ...]:
    """Rows as one row of the file: what queries select pages by, and the rows."""
    models, served, keys = (list(map(attrgetter(a), rows)) for a in ("model", "served", "key"))
    ats = list(map(attrgetter("at"), rows))
    pairs = {*zip(models, keys, strict=True), *zip(served, keys, strict=True)}
    return (min(ats), max(ats), _joined(map(attrgetter("id"), rows)),
            _joined({*models, *served}), _joined(set(keys)),
            _joined(m + PAIR + k for m, k in pairs),
            _joined(map(str, set(map(attrgetter("status"), rows)))), _encode(rows))


def _joined(values: Iterable[str]) -> str:
    return SEP + SEP.join(values) + SEP


def frames(stream: BinaryIO) -> Iterable[list[Row]]:
    while len(head := stream.read(4)) == 4:
        body = stream.read(_LENGTH.unpack(head)[0])
        yield _decode(body)


def main(argv: list[str]) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path, keep_days, max_mib = Path(argv[0]), float(argv[1]), float(argv[2])
    written = 0
    try:
        db = open_file(path)
        pruned = 0.0
        for rows in frames(sys.stdin.buffer):
            db.execute("BEGIN")  # (one transaction: a statement alone would be one each)
            db.executemany(INSERT, [page(rows[i:i + PAGE]) for i in range(0, len(rows), PAGE)])
            db.execute("COMMIT")
            written += len(rows)
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
