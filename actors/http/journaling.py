"""What the front keeps of each request for the journal (actors/journal/): its id
(`X-Request-Id`, the client's or corral's own, returned on its answer and sent on to
the child), and a `Trace` its exchange fills as it goes, made a `Row` at its end: its
figures raw, read into a `Record` (its tokens too) only when someone asks. A front
worker's rows go over its channel to corral's journal (`RemoteRecorder`)."""

from __future__ import annotations

import itertools
import os
import time
from typing import Protocol

from ..journal.record import Record, Row
from ..messages import Grant
from .request import Request
from .usage import Meter

SAID = 1024
"""How much of an answer's end is kept to read its tokens in, when its record is read
(`usage` and `timings` end an answer, or its stream's last event: a search for them on
the loop cost more than the rest of the record)."""
_PREFIX = os.urandom(4).hex()
_COUNT = itertools.count(1)


def new_id() -> str:
    """A request id unique to this process's run (a random prefix, then a count)."""
    return f"{_PREFIX}-{next(_COUNT):x}"


class Recorder(Protocol):
    """Where a front's records go."""

    def add(self, row: Row) -> None: ...


class Trace:
    """One request's journal fields, filled as it goes."""

    __slots__ = ("asked_at", "at", "bytes_out", "copy", "cut", "error", "first_body", "id",
                 "made_id", "model", "queue_s", "room", "served", "started", "tail",
                 "to_api", "waited")

    def __init__(self, req: Request, started: float) -> None:
        self.made_id = req.request_id is None
        self.id = req.request_id or new_id()
        self.at = time.time()
        self.started = started
        self.queue_s = 0.0
        self.asked_at = started
        self.model = self.served = self.copy = self.waited = self.error = ""
        self.room: tuple[str, ...] = ()
        self.bytes_out = 0
        self.first_body: float | None = None
        self.cut = self.to_api = False
        self.tail: bytearray | None = None
        """The answer's last SAID bytes (or up to eight times that), where its tokens
        are read when its record is (a request without a key: a key's meter reads them
        as they pass)."""

    def keep(self, body: bytes) -> None:
        tail = self.tail
        assert tail is not None
        tail += body
        if len(tail) > 8 * SAID:
            del tail[:-SAID]

    def asking(self, now: float) -> None:
        self.asked_at = now

    def granted(self, grant: Grant, now: float, joined: bool = False) -> Grant:
        """`joined`: another's open grant (shares.py), whose load or wake it did not wait
        for."""
        self.queue_s += now - self.asked_at
        self.served, self.copy = grant.model, grant.instance
        if grant.waited and not joined:
            self.waited, self.room = grant.waited, grant.room
        return grant


def row_of(t: Trace, req: Request, status: int, first_at: float | None, now: float,
           meter: Meter | None, streamed: bool) -> Row:
    """The row of a request at its end: little more than its figures, copied."""
    tokens = said = None
    if meter is not None and meter.answered:
        tokens = (*meter.said(), *meter.speeds)
    elif (tail := t.tail) and status:
        del tail[:-SAID]
        said = tail
    url = req.url
    return Row(t.id, t.at, req.method, url.partition(b"?")[0][:512] if b"?" in url else url[:512],
               req.key.name if req.key is not None else "", t.model, t.served, t.copy,
               status, t.error[:1000], req.body_size, t.bytes_out, t.queue_s, t.waited,
               t.room, None if first_at is None else first_at - t.started,
               None if t.first_body is None or not streamed else t.first_body - t.started,
               now - t.started, tokens, said, t.cut, bool(req.conversation))


class _Sized:
    body_size = 0  # (a meter reads the request's size for its rule of thumb, unused here)


def record_of(r: Row) -> Record:
    """A row as the journal's readers see it, its tokens read from what the answer said."""
    tokens = r.tokens
    if tokens is None and r.said:
        meter = Meter(_Sized(), lines=False)
        meter.began(r.status, False)
        meter.feed(bytes(r.said))
        tokens = (*meter.said(), *meter.speeds)
    tokens_in, tokens_out, cached, prompt_per_s, predicted_per_s = tokens or (None,) * 5
    return Record(
        id=r.id, at=r.at, method=r.method.decode("latin-1"), path=r.path.decode("latin-1"),
        key=r.key, model=r.model, served=r.served, copy=r.copy, status=r.status,
        error=r.error, bytes_in=r.bytes_in, bytes_out=r.bytes_out,
        queue_s=round(r.queue_s, 6), waited=r.waited, room=list(r.room),
        ttfb_s=None if r.ttfb_s is None else round(r.ttfb_s, 6),
        ttft_s=None if r.ttft_s is None else round(r.ttft_s, 6),
        duration_s=round(r.duration_s, 6), tokens_in=tokens_in, tokens_out=tokens_out,
        tokens_cached=cached, prompt_per_s=prompt_per_s, predicted_per_s=predicted_per_s,
        cut=r.cut, kept=r.kept)
