"""What the front keeps of each request for the journal (actors/journal/): its id
(`X-Request-Id`, the client's or corral's own, returned on its answer and sent on to
the child), and a `Trace` its exchange fills as it goes, made a `Record` at its end.
A front worker's records go over its channel to corral's journal (`RemoteRecorder`)."""

from __future__ import annotations

import collections
import itertools
import os
import time
from typing import Protocol

from ..journal.record import Record
from ..messages import Grant
from .request import Request
from .usage import Meter

TAIL = 8192
"""How much of an answer's end is kept to read its usage in (`usage`, `timings`)."""
_PREFIX = os.urandom(4).hex()
_COUNT = itertools.count(1)


def new_id() -> str:
    """A request id unique to this process's run (a random prefix, then a count)."""
    return f"{_PREFIX}-{next(_COUNT):x}"


class Recorder(Protocol):
    """Where a front's records go."""

    def add(self, record: Record) -> None: ...


class Trace:
    """One request's journal fields, filled as it goes."""

    __slots__ = ("asked_at", "at", "bytes_out", "copy", "cut", "error", "first_body", "id",
                 "made_id", "model", "queue_s", "room", "served", "started", "tail",
                 "tail_size", "to_api", "waited")

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
        self.tail: collections.deque[bytes] | None = None
        """The answer's last TAIL bytes, where its tokens are read at its end (a request
        without a key: a key's meter reads them as they pass)."""
        self.tail_size = 0

    def keep(self, body: bytes) -> None:
        tail = self.tail
        assert tail is not None
        tail.append(body)
        self.tail_size += len(body)
        while self.tail_size - len(tail[0]) >= TAIL:
            self.tail_size -= len(tail.popleft())

    def asking(self, now: float) -> None:
        self.asked_at = now

    def granted(self, grant: Grant, now: float) -> Grant:
        self.queue_s += now - self.asked_at
        self.served, self.copy = grant.model, grant.instance
        if grant.waited:
            self.waited, self.room = grant.waited, grant.room
        return grant


def record_of(t: Trace, req: Request, status: int, first_at: float | None, now: float,
              meter: Meter | None, streamed: bool) -> Record:
    """The record of a request at its end."""
    path = req.url.partition(b"?")[0][:512].decode("latin-1")
    tokens_in = tokens_out = cached = None
    speeds: tuple[float | None, float | None] = (None, None)
    if meter is None and t.tail and status:
        meter = Meter(req, lines=False)
        meter.began(status, streamed)
        meter.feed(b"".join(t.tail))
    if meter is not None and meter.answered:
        (tokens_in, tokens_out, cached), speeds = meter.said(), meter.speeds
    return Record(
        id=t.id, at=t.at, method=req.method.decode("latin-1"), path=path,
        key=req.key.name if req.key is not None else "", model=t.model, served=t.served,
        copy=t.copy, status=status, error=t.error[:1000], bytes_in=req.body_size,
        bytes_out=t.bytes_out, queue_s=round(t.queue_s, 6), waited=t.waited,
        room=list(t.room), ttfb_s=None if first_at is None else round(first_at - t.started, 6),
        ttft_s=None if t.first_body is None or not streamed else round(
            t.first_body - t.started, 6),
        duration_s=round(now - t.started, 6), tokens_in=tokens_in, tokens_out=tokens_out,
        tokens_cached=cached, prompt_per_s=speeds[0], predicted_per_s=speeds[1],
        cut=t.cut, kept=bool(req.conversation))
