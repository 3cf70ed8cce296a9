"""A client connection's timers: a header block and a body must keep arriving, an idle
connection is closed, a client that takes nothing of what corral writes is cut (R-6.7, R2).

One deadline per connection, checked by the Front once a second: a timer per request cost
more than the rest of the front's bookkeeping.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Protocol

from ..config.model import HttpConfig
from .edge import Answer
from .exchange import Exchange
from .flow import WriteStall, cut, unsent
from .request import Reader, Request

PROBE_FIRST_S = 0.05
PROBE_EVERY_S = 1.0
"""How soon, then how often, a queued request whose client may have left is probed (it
sent EOF, or is not read: a pipelined request, an upload held back)."""


class Watch(Protocol):
    """What the timers use of the front (front.Front)."""

    http: HttpConfig

    def warn(self, what: str, message: str) -> None: ...
    def note_timeout(self, phase: str) -> None: ...


class Timers:
    """The deadline of a connection (connection.Connection) and what happens at it."""

    front: Watch
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport | None
    reader: Reader
    exchange: Exchange | None
    stall: WriteStall
    last_read: float
    reading: bool
    deadline: float
    """When `on_deadline` runs (loop time)."""
    on_deadline: Callable[[], None]

    probing: bool

    def close(self) -> None: ...
    def answer_early(self, answer: Answer, head_only: bool = False,
                     req: Request | None = None) -> None: ...
    def _probe(self, next_s: float) -> None: ...

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self.deadline = self.loop.time() + delay_s
        self.on_deadline = callback

    def _disarm(self) -> None:
        self.deadline = math.inf

    def hand_over(self) -> asyncio.Transport | None:
        """The connection becomes a WebSocket's (tunnel.py): no parse, deadline or watch
        of its own from here; its loss still comes here, through the tunnel."""
        self._disarm()
        self.stall.stop()
        self.reader.stop()
        return self.transport

    def _stall_watch(self) -> None:
        if self.transport is not None:
            self.stall.watch(self.loop.time(), unsent(self.transport))

    def check_deadline(self, now: float) -> None:
        """Called by the Front once a second."""
        if self.transport is not None and self.stall.stalled(
                now, left := unsent(self.transport)):
            self.front.warn("stalled", f"cut a client that took none of the {left} bytes "
                            "waiting for it in "
                            f"{self.front.http.write_timeout_s:g} s (http.write_timeout_s)")
            cut(self.transport)
            return
        if now >= self.deadline:
            self.deadline = math.inf
            self.on_deadline()

    def _idle_late(self) -> None:
        self.close()

    def _header_late(self) -> None:
        if self.reader.req is None and not self.reader.head_bytes:
            self.close()  # connected and sent nothing: nobody to answer
            return
        self.front.note_timeout("header")
        self.answer_early(Answer(408, f"request headers not received within "
                                 f"{self.front.http.header_timeout_s:g} s "
                                 "(http.header_timeout_s)"))

    def _streaming(self) -> bool:
        """The running exchange's upload is still arriving (upload.py)."""
        return self.exchange is not None and self.exchange.req is self.reader.req

    def _body_late(self) -> None:
        if not self.reading and self._streaming():  # held back by corral, not the client
            req, ex = self.reader.req, self.exchange
            stalled = self.loop.time() - self.last_read
            if (ex is not None and req is not None and req.upload is not None
                    and req.upload.to_paused and stalled >= self.front.http.write_timeout_s):
                ex.late = f"its child took none of an upload for {stalled:.0f} s"
                ex.upload_failed(Answer(504, f"{ex.what} took none of the upload for "
                                        f"{stalled:.0f} s (http.write_timeout_s)",
                                        "timeout_error"))
                return
            self._arm(self.front.http.body_timeout_s, self._body_late)
            if not self.probing:  # a client that left is not read: ask it (R3)
                self.probing = True
                self._probe(PROBE_FIRST_S)
            return
        left = self.last_read + self.front.http.body_timeout_s - self.loop.time()
        if left > 0:  # it is still arriving: check again when it could be late
            self._arm(left, self._body_late)
            return
        self.front.note_timeout("body")
        late = Answer(408, f"request body stalled for {self.front.http.body_timeout_s:g} s "
                      "(http.body_timeout_s)")
        if self.exchange is not None and self._streaming():
            self.exchange.upload_failed(late)
        else:
            self.answer_early(late)
