"""One client connection: parsing, limits, timers, flow control, and its exchanges in order.

Everything a hostile client can send is bounded before it costs anything (R-6.7): each
request is screened when its headers are complete (request.py), a header block
and a body must keep arriving, an idle connection is closed. One request is served at a
time; while it runs, reading stops as soon as the next one begins, so at most one read's
worth of pipelined bytes (and MAX_PIPELINED requests) waits behind it, and nothing for
the next request (an interim answer, an error) is written until the running answer is
complete.

What corral writes is bounded the same way (R1, R2): while the client takes none of it
(the transport is paused for writing), no further request is read or started, so one
connection holds at most one answer's unsent bytes; and a client that takes nothing for
`http.write_timeout_s` is cut, freeing its slot, its grant and its child connection.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import Callable
from typing import Protocol, cast

import httptools

from .deadlines import PROBE_EVERY_S, PROBE_FIRST_S, Timers, Watch
from .edge import Answer
from .exchange import Exchange
from .flow import WriteStall
from .journaling import refused
from .phase import Phase
from .request import Gate, Limits, Reader, Request
from .services import Services
from .tunnel import Tunnel

log = logging.getLogger("corral.front")

_BEFORE_ANSWER = frozenset({Phase.WAITING, Phase.FORWARDING})
MAX_PIPELINED = 32
"""Whole requests that may wait behind the running one; more are refused (503, then the
connection closes): one read of tiny pipelined requests made thousands of them."""


class Hub(Services, Gate, Watch, Protocol):
    """What a connection uses of the front that accepted it (front.Front), besides what
    it hands on to its exchanges and who may call (Gate)."""

    limits: Limits

    def admit(self, conn: Connection) -> bool: ...
    def forget(self, conn: Connection) -> None: ...
    def exchange_finished(self) -> None: ...


class TooManyPipelined(Exception):
    """Raised in a parser callback to stop parsing a read's further requests."""
LINGER_S = 2.0
"""After an early answer that closes the connection, how long the rest of the request is
read and dropped, so the client reads the answer instead of a reset."""


class Connection(Timers, asyncio.Protocol):
    """One client connection (uvicorn's shape: the protocol parses, exchanges answer)."""

    front: Hub

    def __init__(self, front: Hub) -> None:
        self.front = front
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.reader = Reader(self, front.limits, front)
        self.pending: collections.deque[Request] = collections.deque()
        """Whole requests behind the running exchange (bounded by one read: see module)."""
        self.exchange: Exchange | None = None
        self.tunnel: Tunnel | None = None
        """The WebSocket that took the connection over (tunnel.py)."""
        self.deadline = math.inf
        """When `on_deadline` runs (loop time): the Front checks every connection once a
        second (a timer per request cost more than the rest of the front's bookkeeping)."""
        self.on_deadline: Callable[[], None] = self.close
        self.last_read = 0.0
        self.reading = True
        self.eof = False
        """The client half-closed: answer what it sent, then close."""
        self.lingering = False
        """An early answer closes the connection: what arrives now is dropped."""
        self.deferred: Answer | None = None
        """An error for bytes behind the running exchange, written when it is done."""
        self.write_paused = False
        """The client is not taking what corral writes (its buffer is over the high-water
        mark): nothing new is read or started until it is (R1)."""
        self.stall = WriteStall(front.http.write_timeout_s)
        """When a client that takes nothing is cut (R2)."""
        self.probing = False
        """A chain of `_probe` calls is running."""
        self.closing = False
        """close() was called: nothing more is started (a pipelined request behind an
        answer that ends the connection is never run for a client that cannot get it)."""

    # ------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if not self.front.admit(self):
            transport.write(Answer(503, "corral is at its connection limit "
                                   "(http.max_connections); try again shortly").encode(False))
            transport.close()
            return
        self.transport = transport
        self.last_read = self.loop.time()
        self._arm(self.front.http.header_timeout_s, self._header_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._disarm()
        self.stall.stop()
        if self.exchange is None or not self.exchange.client_gone():
            self.front.forget(self)  # (a kept answer holds its slot until it ends)
        if self.exchange is None and self.front.draining:
            self.front.exchange_finished()
        for req in (self.reader.req, *self.pending):  # uploads no exchange will close:
            if req is not None and req.upload is not None:  # their held start goes now,
                req.upload.close()  # not at the collector's next pass (review S11)

    def eof_received(self) -> bool:
        """The client is done sending: it may have half-closed (answer it) or left (stop).

        Both look the same here. The running answer and the requests already sent are
        answered; a write to a client that left draws a reset, and the reset ends them. A
        request still queued would not write until its model has loaded for nobody, so
        it is probed with interim `100 Continue` answers (which every HTTP/1.1 client
        skips, RFC 9110 15.2) until it is granted or the reset arrives (R-4.7).
        """
        self.eof = True
        if self._streaming() and self.exchange is not None:
            self.exchange.upload_failed(Answer(400, "the client closed its side before the "
                                               "request body was whole"))
            return True
        if not self.busy:
            return False  # nothing to answer (a half-sent request can never complete)
        ex = self.exchange
        if ex is not None and ex.is_event_stream():
            return False  # an endless stream for a client that is done: it has left
        if not self.probing:
            self.probing = True
            self._probe(PROBE_FIRST_S)
        return True

    def _probe(self, next_s: float) -> None:
        """Until the answer's head is written: an interim answer, which draws a reset from
        a client that has left (R3: the child's work is then cancelled, its grant freed).
        Started by the client's EOF, or by a pipelined request (reading stops then, so an
        EOF would not be seen)."""
        ex = self.exchange
        if (self.transport is None or ex is None or ex.phase not in _BEFORE_ANSWER
                or ex.req.http10 or ex.head_sent):  # (a loading head: its ticks probe)
            self.probing = False
            return
        self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.loop.call_later(next_s, self._probe, PROBE_EVERY_S)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        self.last_read = self.loop.time()
        try:
            self.reader.feed(data)
        except httptools.HttpParserUpgrade:
            self.reading_done()  # what follows is not HTTP: its 400 is queued already
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, TooManyPipelined):
                self.fail(Answer(503, f"more than {MAX_PIPELINED} pipelined requests wait "
                                 "behind a running one; send the rest again",
                                 headers=(("Retry-After", "1"),)))
                return
            self.fail(Answer(400, f"malformed HTTP request: {e}"))
            return
        if self.reader.head_too_big() and not self.lingering:
            self.fail(self.front.limits.header_too_big())
        elif self.exchange is not None and self.exchange.req.upload is not None:
            self.exchange.req.upload.flush()  # what this read brought, in one write

    def pause_writing(self) -> None:
        self.write_paused = True
        self._stall_watch()
        self.pause_reading()
        if self.exchange is not None:
            self.exchange.pause_upstream()

    def resume_writing(self) -> None:
        self.write_paused = False
        self.stall.stop()
        if self.exchange is not None:
            self.exchange.resume_upstream()
            if self.pending or (self.reader.req is not None and not self._streaming()):
                return  # reading resumes when the next request may start
            self.resume_reading()
        elif not self.lingering:
            self.next_request()

    # ------------------------------------------------------------ what the reader finds

    def request_begins(self) -> None:
        if self.exchange is not None and len(self.pending) >= MAX_PIPELINED:
            raise TooManyPipelined
        if self.exchange is None:
            self._arm(self.front.http.header_timeout_s, self._header_late)
        else:
            self.pause_reading()  # pipelined: wait for the running answer
            if not self.probing:  # a client that leaves now is not read: ask it (R3)
                self.loop.call_later(PROBE_EVERY_S, self._probe, PROBE_EVERY_S)
                self.probing = True

    def request_head(self, req: Request, refused: Answer | None) -> None:
        if refused is not None:
            self.refuse(req, refused)
        elif not self.busy:
            if req.wants_continue:
                self.send_continue(req)
            self._arm(self.front.http.body_timeout_s, self._body_late)

    def request_done(self, req: Request) -> None:
        if req.upload is not None and req.upload.queued:  # on its way already
            if self.exchange is not None and self.exchange.req is req:
                self._disarm()  # the body timer
            return
        self.pending.append(req)
        if self.exchange is None:
            self._disarm()
            self.next_request()

    # ------------------------------------------------------------ screening

    @property
    def busy(self) -> bool:
        """An answer runs or waits its turn: nothing for a later request is written now."""
        return self.exchange is not None or bool(self.pending)

    def upload_ready(self, req: Request) -> None:
        """An upload's model is known: it is served while its body streams in."""
        assert req.upload is not None
        if isinstance(req.upload.model, Answer):
            self.refuse(req, req.upload.model)
            return
        self.pending.append(req)
        req.upload.queued = True
        if self.exchange is None:
            self.next_request()

    def refuse(self, req: Request, answer: Answer) -> None:
        """corral answers `req` itself and closes: now, or in its turn behind `busy`
        (an upload being served now: its exchange ends with the answer)."""
        if self.exchange is not None and self.exchange.req is req:
            self.exchange.upload_failed(answer)
            return
        req.answer = answer
        req.keep_alive = False
        if not self.busy:
            self.answer_early(answer, req.method == b"HEAD", req)

    def send_continue(self, req: Request) -> None:
        if not req.continue_sent and not req.complete:
            req.continue_sent = True
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    # ------------------------------------------------------------ answering

    def next_request(self) -> None:
        """Serve the next whole request, or wait for one."""
        while self.exchange is None and self.transport is not None and not self.closing:
            if self.write_paused:
                return  # the last answer is not taken yet: `resume_writing` goes on (R1)
            if self.front.draining and (self.pending or self.reader.req is not None):
                self.pending.clear()
                self.answer_early(Answer(503, "corral is shutting down; retry elsewhere "
                                         "or after its restart"))
                return
            if not self.pending:
                self.idle()
                return
            req = self.pending.popleft()
            if req.answer is not None:
                self.write(req.answer.encode(False, req.method == b"HEAD"))
                self.close()
                return
            self.exchange = Exchange(self.front, self, req)
            if self._streaming():  # its body is still arriving: read it, within limits
                self._arm(self.front.http.body_timeout_s, self._body_late)
                self.resume_reading()

    def exchange_done(self, exchange: Exchange) -> None:
        assert exchange is self.exchange
        self.exchange = None
        if self.front.draining:
            self.front.exchange_finished()
        if self.transport is None:
            self.front.forget(self)
            return
        if exchange.req.upload is not None and not exchange.req.complete:
            self.linger()  # answered before its body was whole: the rest is dropped
        elif not exchange.keep_alive:
            self.close()
        else:
            self.next_request()

    def idle(self) -> None:
        """Nothing to answer: wait for the next request (or its rest), or close."""
        if self.deferred is not None:
            self.answer_early(self.deferred)
            return
        if self.eof or self.front.draining:
            self.close()
            return
        req = self.reader.req
        if req is None:
            self._arm(self.front.http.keep_alive_timeout_s, self._idle_late)
        elif req.headers_done:
            if req.answer is not None:
                self.answer_early(req.answer, req.method == b"HEAD", req)
                return
            if req.wants_continue:
                self.send_continue(req)
            self._arm(self.front.http.body_timeout_s, self._body_late)
        else:
            self._arm(self.front.http.header_timeout_s, self._header_late)
        self.resume_reading()

    def fail(self, answer: Answer) -> None:
        """Bytes that cannot be served: answer after what runs now, then close (an
        upload streaming in: its exchange ends with the answer)."""
        if self.exchange is not None and self._streaming():
            self.reading_done()
            self.exchange.upload_failed(answer)
        elif self.busy:
            self.deferred = self.deferred or answer
            self.reading_done()
        else:
            self.answer_early(answer)

    def answer_early(self, answer: Answer, head_only: bool = False,
                     req: Request | None = None) -> None:
        """Answer now, with an id (`req`'s record kept), and close (the rest is dropped)."""
        self.write(refused(answer, req, self.front.recorder).encode(False, head_only))
        self.linger()

    def linger(self) -> None:
        """Close once the answer is read: what the client still sends is dropped, so it
        reads the answer instead of a reset."""
        self.lingering = True
        self.pending.clear()
        if self.transport is not None:
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.resume_reading()
        self._arm(LINGER_S, self.close)

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def close(self) -> None:
        """Close once what was written is sent; cut after http.write_timeout_s if the
        client does not take it (a graceful close alone waits for it for ever: R2)."""
        self._disarm()
        self.closing = True
        self.pending.clear()
        if self.transport is not None:
            if self.transport.get_write_buffer_size() and not self.stall.watching:
                self._stall_watch()
            self.transport.close()

    def pause_reading(self) -> None:
        if self.reading and self.transport is not None:
            self.reading = False
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        req = self.reader.req
        if (not self.reading and self.transport is not None and not self.eof
                and not self.write_paused
                and (req is None or req.upload is None or not req.upload.throttled)):
            self.reading = True
            self.transport.resume_reading()

    def reading_done(self) -> None:
        """Nothing more will be parsed on this connection."""
        self.pause_reading()
        self.reader.stop()

    def drain(self) -> None:
        """Shutdown: let the running answer finish, answer nothing new; a kept answer
        whose client has left is stopped (nobody may resume it now)."""
        if self.tunnel is not None:
            self.tunnel.shut("corral is shutting down")
        elif self.transport is None and self.exchange is not None:
            self.exchange.stop("corral is shutting down")
        elif self.exchange is None and not self.lingering:
            self.next_request()
