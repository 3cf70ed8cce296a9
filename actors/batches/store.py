"""Where files and batches are kept: `state_dir/batches/`, one JSON per file and batch
beside its data, written whole through a temporary file (a crash leaves the old or the
new, never half), and each batch's results appended a line at a time, so that a restart
knows which lines are done.

    batches/files/file-ID.json  .data      a file (an input, or a batch's output)
    batches/batch_ID.json                  a batch
    batches/batch_ID.out.jsonl  .err.jsonl its results so far (made files at its end)
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import msgspec

from .shapes import Batch, FileObject

log = logging.getLogger("corral.batches")
T = TypeVar("T")


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class Store:
    """The files and batches of one state_dir (blocking: called off the loop, or at start)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = root / "files"

    def ready(self) -> None:
        """Its folders made, and what a crash left half made (an upload, a write) gone."""
        self.files.mkdir(parents=True, exist_ok=True)
        for left in (*self.files.glob("*.part"), *self.files.glob("*.tmp"),
                     *self.root.glob("*.tmp")):
            left.unlink(missing_ok=True)

    # ------------------------------------------------------------ files

    def data_of(self, file_id: str) -> Path:
        return self.files / f"{file_id}.data"

    def add_file(self, meta: FileObject, data: Path) -> FileObject:
        """Keep `data` (a temporary file here, moved) as file `meta.id`."""
        os.replace(data, self.data_of(meta.id))
        self._write(self.files / f"{meta.id}.json", meta)
        return meta

    def file(self, file_id: str) -> FileObject | None:
        if not _ID.fullmatch(file_id):
            return None
        return self._read(self.files / f"{file_id}.json", FileObject)

    def read(self, file_id: str, start: int, end: int) -> bytes:
        """Bytes `start` to `end` of a file (a batch's line)."""
        with open(self.data_of(file_id), "rb") as f:
            return os.pread(f.fileno(), end - start, start)

    def file_list(self) -> list[FileObject]:
        found = (self._read(p, FileObject) for p in self.files.glob("file-*.json"))
        return sorted((f for f in found if f is not None), key=lambda f: -f.created_at)

    def delete_file(self, file_id: str) -> None:
        for path in (self.files / f"{file_id}.json", self.data_of(file_id)):
            path.unlink(missing_ok=True)

    # ------------------------------------------------------------ batches

    def save(self, batch: Batch) -> None:
        self._write(self.root / f"{batch.id}.json", batch)

    def batches(self) -> Iterator[Batch]:
        for path in sorted(self.root.glob("batch_*.json")):
            if (batch := self._read(path, Batch)) is not None:
                yield batch

    def results(self, batch_id: str, kind: str) -> Path:
        """Its results so far: `out` (answered 2xx) or `err`."""
        return self.root / f"{batch_id}.{kind}.jsonl"

    def done_ids(self, batch_id: str) -> tuple[set[str], int, int]:
        """The custom_ids a batch has results for, and how many of each kind. A line cut
        short by a crash (or a full disk) is cut off the file, so that the next is
        appended whole, and its line runs again."""
        done: set[str] = set()
        counts = [0, 0]
        for i, kind in enumerate(("out", "err")):
            path = self.results(batch_id, kind)
            if not path.exists():
                continue
            data = path.read_bytes()
            if data and not data.endswith(b"\n"):
                data = data[:data.rfind(b"\n") + 1]
                os.truncate(path, len(data))
            for raw in data.splitlines():
                try:
                    done.add(_custom_id(raw).custom_id)
                    counts[i] += 1
                except msgspec.DecodeError:
                    continue
        return done, counts[0], counts[1]

    def delete_batch(self, batch: Batch) -> None:
        for path in (self.root / f"{batch.id}.json", self.results(batch.id, "out"),
                     self.results(batch.id, "err")):
            path.unlink(missing_ok=True)

    def prune(self, keep_days: float, now: float | None = None) -> list[str]:
        """Delete finished batches and files older than keep_days (not an unfinished
        batch's input); the batches that went."""
        before = (now or time.time()) - keep_days * 86400
        gone, used = [], set()
        for batch in list(self.batches()):
            if batch.done and batch.created_at < before:
                self.delete_batch(batch)
                gone.append(batch.id)
            elif not batch.done:
                used.add(batch.input_file_id)
        for f in self.file_list():
            if f.created_at < before and f.id not in used:
                self.delete_file(f.id)
        return gone

    # ------------------------------------------------------------ whole files

    def _write(self, path: Path, value: object) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(value))
        os.replace(tmp, path)

    def _read(self, path: Path, kind: type[T]) -> T | None:
        try:
            return msgspec.json.decode(path.read_bytes(), type=kind)
        except FileNotFoundError:
            return None
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("%s could not be read (%s); left out", path, e)
            return None


class _CustomId(msgspec.Struct):
    custom_id: str


_custom_id = msgspec.json.Decoder(_CustomId).decode
_ID = re.compile(r"file-[0-9a-f]{24}")
