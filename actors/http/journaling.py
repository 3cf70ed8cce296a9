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

import msgspec

from ..journal.record import HeadOf, Record, Row, Said, encode
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

    def add(self, row: bytes, head: HeadOf | None = None) -> None: ...


class Trace:
    """One request's journal fields, filled as it goes."""

    __slots__ = ("answer", "asked", "asked_at", "at", "bytes_out", "capture", "copy", "cut",
                 "error", "events", "first_body", "granted_at", "id", "made_id", "model",
                 "queue_s", "replays", "room", "said", "served", "spans", "started", "tail",
                 "to_api", "waited", "waited_s")

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
        self.replays = 0
        """How often it was sent on to its model's next instance (tries.py)."""
        self.tail: bytearray | None = None
        """The answer's last TAIL bytes (or up to eight times that), where its tokens
        are read at its end (a request without a key: a key's meter reads them as they
        pass)."""
        self.events = 0
        """Its stream's JSON events so far (a request without a key)."""
        self.said: Said | None = None
        """What its answer said it used, once it has ended (figures.py)."""
        self.granted_at: float | None = None
        self.waited_s = 0.0
        """How long the load or wake it waited for took."""
        self.spans: Spans | None = None
        """Its trace's ids, when it is traced ([tracing]: spans.py)."""
        self.capture = 0
        """[journal] capture: how much of its body and its answer's is kept (0: none)."""
        self.asked: bytes | None = None
        self.answer: bytearray | None = None

    def keep(self, body: bytes) -> None:
        tail = self.tail
        assert tail is not None
        tail += body
        self.events += body.count(b"data: {")
        if len(tail) > 8 * TAIL:
            del tail[:-TAIL]

    def captures(self, req: Request, limit: int) -> None:
        """Keep its body and its answer's, `limit` bytes of each ([journal] capture)."""
        self.capture, self.asked, self.answer = limit, req.body[:limit], bytearray()

    def captured(self, body: bytes) -> None:
        answer = self.answer
        assert answer is not None
        if len(answer) < self.capture:
            answer += body[:self.capture - len(answer)]

    def read(self, meter: Meter | None, stream: bool) -> Said | None:
        """What the answer said it used, read once at its end."""
        if meter is not None:
            self.said = meter.as_said()
        elif (tail := self.tail):
            self.said = said(tail, whole=not stream and self.bytes_out == len(tail))
        return self.said

    def asking(self, now: float) -> None:
        self.asked_at = now

    def granted(self, grant: Grant, now: float, joined: bool = False) -> Grant:
        """`joined`: another's open grant (shares.py), whose load or wake it did not wait
        for."""
        self.queue_s += now - self.asked_at
        self.granted_at = now
        self.served, self.copy = grant.model, grant.instance
        if grant.waited and not joined:
            self.waited, self.room, self.waited_s = grant.waited, grant.room, grant.waited_s
        return grant


def record(recorder: Recorder, t: Trace, req: Request, status: int, first_at: float | None,
           now: float, meter: Meter | None, streamed: bool) -> None:
    """The row of a request at its end, encoded (a tuple of `Row`'s fields, in order:
    little more than its figures, copied), given to `recorder` with its head."""
    url, key = req.url, req.key.name if req.key is not None else ""
    recorder.add(encode((t.id, t.at, key, t.model, t.served, status, req.method,
                   url.partition(b"?")[0][:512] if b"?" in url else url[:512], t.copy,
                   t.error[:1000], req.body_size, t.bytes_out, t.queue_s, t.waited, t.room,
                   None if first_at is None else first_at - t.started,
                   None if t.first_body is None or not streamed else t.first_body - t.started,
                   now - t.started, t.said, t.cut, bool(req.conversation), t.asked,
                   bytes(t.answer) if t.answer is not None else None,
                   req.session.decode("utf-8", "replace") if req.session else "", t.replays)),
                 (t.id, t.at, key, t.model, t.served, status))


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
        recorder.add(encode(Row(
            id_, at, key, "", "", answer.status, req.method, req.url.partition(b"?")[0][:512],
            "", answer.message[:1000], req.body_size, 0, 0.0, "", (), None, None, 0.0, None,
            False, False)), (id_, at, key, "", "", answer.status))
    return msgspec.structs.replace(answer, headers=(*answer.headers, ("X-Request-Id", id_)))
