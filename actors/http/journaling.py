"""What the front keeps of each request for the journal (actors/journal/): its id
(`X-Request-Id`, the client's or corral's own, returned on its answer and sent on to
the child), and a `Trace` its exchange fills as it goes, handed to the journal as it is at
its end: its figures raw, read into a `Record` (its tokens too) only when someone asks. A
front worker's rows go over its channel to corral's journal, encoded (`RemoteRecorder`)."""

from __future__ import annotations

import itertools
import os
import time
from typing import Protocol

import msgspec

from ..journal.record import Record, Row, Said
from ..messages import Grant
from .edge import Answer
from .figures import said
from .request import Request
from .usage import Meter

TAIL = 4096
"""How much of an answer's end is kept to read its tokens in (`usage` and `timings` end
an answer, or its stream's last events)."""
_PREFIX = os.urandom(4).hex()
_COUNT = itertools.count(1)


def new_id() -> str:
    """A request id unique to this process's run (a random prefix, then a count)."""
    return f"{_PREFIX}-{next(_COUNT):x}"


class Spans:
    """One request's ids: its trace's, its parent's (the client's span), its own, and
    the one its child is told."""

    __slots__ = ("child", "parent", "root", "trace_id")

    def __init__(self, trace_id: bytes, parent: bytes) -> None:
        self.trace_id, self.parent = trace_id, parent
        self.root, self.child = os.urandom(8), os.urandom(8)

    def header(self) -> bytes:
        """The traceparent its child is sent."""
        return b"traceparent: 00-%s-%s-01" % (self.trace_id.hex().encode(),
                                               self.child.hex().encode())


class Recorder(Protocol):
    """Where a front's records go."""

    capture: int
    """[journal] capture: bytes of each body and answer its records keep (0: none)."""

    def add(self, row: Row) -> None: ...

    def add_encoded(self, row: bytes) -> None:
        """A row encoded already (a front worker's, sent over its channel)."""


class Work:
    """What its exchange holds of a request only while it runs, beside its `Trace`: not
    kept (a field of the trace, it cost each row a call of the encoder's hook)."""

    __slots__ = ("asked_at", "capture", "events", "first_body", "granted_at", "made_id",
                 "spans", "started", "tail", "to_api", "waited_s")

    def __init__(self, started: float, made_id: bool) -> None:
        self.started = self.asked_at = started
        self.made_id = made_id
        """Its id is corral's own (sent on to its child: the client's goes with its head)."""
        self.first_body: float | None = None
        self.to_api = False
        """It was for corral's own API: not a request the journal keeps."""
        self.tail: bytearray | None = None
        """The answer's last TAIL bytes (or up to eight times that), where its tokens
        are read at its end (a request without a key: a key's meter reads them as they
        pass)."""
        self.events = 0
        """Its stream's JSON events so far (a request without a key)."""
        self.granted_at: float | None = None
        self.waited_s = 0.0
        """How long the load or wake it waited for took."""
        self.spans: Spans | None = None
        """Its trace's ids, when it is traced ([tracing]: spans.py)."""
        self.capture = 0
        """[journal] capture: how much of its body and its answer's is kept (0: none)."""

    def keep(self, body: bytes) -> None:
        tail = self.tail
        assert tail is not None
        tail += body
        self.events += body.count(b"data: {")
        if len(tail) > 8 * TAIL:
            del tail[:-TAIL]


class Trace(Row, gc=False):
    """One request's journal fields, filled as it goes: a `Row` (the journal encodes the
    struct itself, in one call: record.py). Not tracked by the collector: it refers to
    nothing that refers back to it."""

    answer: bytearray | None = None  # type: ignore[assignment]
    """Its answer's body's first capture_kib, as it comes (capture = true)."""

    @staticmethod
    def of(req: Request) -> Trace:
        """A request's, as its exchange begins."""
        url = req.url
        return Trace(req.request_id or new_id(), time.time(),
                     req.key.name if req.key is not None else "", "", "", 0, req.method,
                     url.partition(b"?")[0][:512] if b"?" in url else url[:512], "", "",
                     0, 0, 0.0, "", (), None, None, 0.0, None, False,
                     bool(req.conversation), None, None,
                     req.session.decode("utf-8", "replace") if req.session else "", 0)

    def captures(self, req: Request, work: Work, limit: int) -> None:
        """Keep its body and its answer's, `limit` bytes of each ([journal] capture)."""
        work.capture, self.asked, self.answer = limit, req.body[:limit], bytearray()

    def captured(self, body: bytes, limit: int) -> None:
        answer = self.answer
        assert answer is not None
        if len(answer) < limit:
            answer += body[:limit - len(answer)]

    def read(self, meter: Meter | None, work: Work, stream: bool) -> Said | None:
        """What the answer said it used, read once at its end."""
        if meter is not None:
            self.tokens = meter.as_said()
        elif (tail := work.tail):
            self.tokens = said(tail, whole=not stream and self.bytes_out == len(tail))
        return self.tokens

    def granted(self, grant: Grant, work: Work, now: float, joined: bool = False) -> Grant:
        """`joined`: another's open grant (shares.py), whose load or wake it did not wait
        for."""
        self.queue_s += now - work.asked_at
        work.granted_at = now
        self.served, self.copy = grant.model, grant.instance
        if grant.waited and not joined:
            self.waited, self.room, work.waited_s = grant.waited, grant.room, grant.waited_s
        return grant


def record(recorder: Recorder, t: Trace, work: Work, req: Request, status: int,
           first_at: float | None, now: float, streamed: bool) -> None:
    """Give `recorder` a request's row at its end: its trace, with its last figures."""
    started, first_body = work.started, work.first_body
    t.status, t.bytes_in, t.duration_s = status, req.body_size, now - started
    if first_at is not None:
        t.ttfb_s = first_at - started
    if first_body is not None and streamed:
        t.ttft_s = first_body - started
    recorder.add(t)


def record_of(r: Row, bodies: bool = False) -> Record:
    """A row as the journal's readers see it (`bodies`: what capture kept, for an admin)."""
    t = r.tokens or Said()
    return Record(
        id=r.id, at=r.at, method=r.method.decode("latin-1"), path=r.path.decode("latin-1"),
        key=r.key, model=r.model, served=r.served, copy=r.copy, status=r.status,
        error=r.error, bytes_in=r.bytes_in, bytes_out=r.bytes_out,
        queue_s=round(r.queue_s, 6), waited=r.waited, room=list(r.room),
        ttfb_s=None if r.ttfb_s is None else round(r.ttfb_s, 6),
        ttft_s=None if r.ttft_s is None else round(r.ttft_s, 6),
        duration_s=round(r.duration_s, 6), tokens_in=t.prompt, tokens_out=t.completion,
        tokens_cached=t.cached, prompt_per_s=t.prompt_per_s, predicted_per_s=t.predicted_per_s,
        cut=r.cut, kept=r.kept, session=r.session, replays=r.replays,
        body=r.asked.decode("utf-8", "replace") if bodies and r.asked is not None else None,
        answer=r.answer.decode("utf-8", "replace") if bodies and r.answer is not None
        else None)


def refused(answer: Answer, req: Request | None, recorder: Recorder | None) -> Answer:
    """corral's answer to a request it refused before it was one (its head: no key, too
    big; or bytes that were none): with an id, and (a request's) its record."""
    id_ = req.request_id if req is not None and req.request_id else new_id()
    if req is not None and recorder is not None:
        at, key = time.time(), req.key.name if req.key is not None else ""
        recorder.add(Row(
            id_, at, key, "", "", answer.status, req.method, req.url.partition(b"?")[0][:512],
            "", answer.message[:1000], req.body_size, 0, 0.0, "", (), None, None, 0.0, None,
            False, False))
    return msgspec.structs.replace(answer, headers=(*answer.headers, ("X-Request-Id", id_)))
