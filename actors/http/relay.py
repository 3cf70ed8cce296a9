"""The answer's side of an exchange (exchange.py): what an upstream connection reports
(upstream.py's `Sink`), relayed to the client, and a WebSocket's opening handed to its
tunnel. `Relay` is the exchange's base, as deadlines.py's `Timers` is its connection's:
it declares what it uses of the exchange.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from .edge import SSE_PREFIX, Answer, interim_head, relay_head, sse_error_event
from .journaling import Trace, Work
from .loading import Loading, error_event
from .phase import API, Phase
from .resumable import Tee
from .services import Services
from .tunnel import Client, open_tunnel
from .upstream import Broke, Upstream
from .usage import Meter

if TYPE_CHECKING:
    from ..runtime.bridge import LoopReply
    from .request import Request

log = logging.getLogger("corral.front")
HELD = 64 * 1024
"""How much of a child's error answer after a loading head is kept for its error event."""
PARTIAL = 64 * 1024
"""How much of an event stream's unended event is held back at most (`_whole_events`)."""
_EVENT_END = (b"\n\n", b"\r\n\r\n")


class Relay:
    """An exchange's answer, as its upstream connection reports it."""

    __slots__ = ("chunked", "client", "first_at", "head_only", "held", "keep_alive", "kept",
                 "late", "loading", "loop", "meter", "out", "partial", "phase", "req",
                 "services", "sse", "status", "ticket", "upstream", "what")

    services: Services
    client: Client
    req: Request
    loop: asyncio.AbstractEventLoop
    phase: Phase
    what: str
    out: list[bytes]
    status: int
    first_at: float | None
    head_only: bool
    keep_alive: bool
    chunked: bool
    sse: bool
    late: str | None
    meter: Meter | None
    ticket: LoopReply | None
    kept: Tee | None
    upstream: Upstream | None
    trace: Trace
    work: Work
    loading: Loading | None
    held: bytearray | None
    partial: bytes | None

    def _to(self, phase: Phase) -> None: ...
    def _unreachable(self, why: str, kind: Broke) -> None: ...
    def _resolve(self) -> None: ...
    def answer(self, answer: Answer) -> None: ...

    def _may_keep_alive(self) -> bool:
        """The client connection may serve another request after this answer: corral is
        not draining, and no upload is still arriving (its rest is dropped)."""
        return (self.keep_alive and not self.services.draining
                and (self.req.upload is None or self.req.complete))

    @property
    def head_sent(self) -> bool:
        """Its answer's head went before its grant (loading.py): only chunks follow."""
        return self.loading is not None and self.loading.sent

    def response_interim(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        if self.phase is not Phase.FORWARDING or self.req.http10 or self.head_sent:
            return  # an HTTP/1.0 client knows no interim answers
        self.out.append(interim_head(status, headers))

    def _head(self, status: int) -> None:
        self.status = status
        if self.first_at is None:
            self.first_at = self.loop.time()

    def response_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._head(status)
        self._to(Phase.STREAMING)
        if self.loading is not None and self.loading.sent:
            self._after_loading(status, headers)
            return
        head = relay_head(status, headers, from_child=self.what != API,
                          keep_alive=self._may_keep_alive(),
                          head_only=self.head_only, http10=self.req.http10,
                          request_id=self.trace.id)
        self.keep_alive, self.chunked, self.sse = head.keep_alive, head.chunked, head.sse
        self.out.append(head.data)
        if self.meter is not None:
            self.meter.began(status, head.sse)
        if self.kept is not None and head.sse and status == 200:
            self.kept.began()
        elif self.kept is not None:  # an error, or a whole answer: nothing to resume
            self.kept.drop()
            self.kept = None

    def _after_loading(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The child's answer to a stream whose head went already (loading.py): its
        events follow; an answer that is not an event stream is held, and ends the
        stream as an error event."""
        sse = any(n.lower() == b"content-type" and v.startswith(SSE_PREFIX)
                  for n, v in headers)
        self.chunked = self.sse = True
        if status != 200 or not sse:
            self.held = bytearray()
        if self.meter is not None:
            self.meter.began(status, sse)
        if self.kept is not None and self.held is None:
            self.kept.began()
        elif self.kept is not None:
            self.kept.drop()
            self.kept = None

    def response_body(self, body: bytes) -> None:
        trace, work = self.trace, self.work
        if work.first_body is None:
            work.first_body = self.loop.time()
        trace.bytes_out += len(body)
        if (meter := self.meter) is not None:
            meter.feed(body)
            if self.ticket is not None and (more := meter.due()):
                self.services.shares.spend(self.ticket, more)  # the key's next sees it
        elif work.tail is not None:
            work.keep(body)
        if trace.answer is not None:
            trace.captured(body, work.capture)
        if self.kept is not None:
            self.kept.feed(body)
        if (held := self.held) is not None:  # (loading.py: an error after the head)
            held += body[:HELD - len(held)]
            return
        if self.sse and ((partial := self.partial) is not None or not body.endswith(_EVENT_END)):
            body = self._whole_events(body if partial is None else partial + body)
            if not body:
                return
        self.out.append(b"%x\r\n%b\r\n" % (len(body), body) if self.chunked else body)

    def _whole_events(self, body: bytes) -> bytes:
        """What of an event stream's bytes ends whole events; the unended rest is held for
        the next read (at most PARTIAL bytes): a child that dies mid-event leaves its
        client no half event, which a client reads as an event of broken JSON."""
        lf, crlf = body.rfind(b"\n\n"), body.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        if len(body) - end > PARTIAL:
            end = len(body)  # (no event this long: not events, sent on as they come)
        self.partial = body[end:] or None
        return body[:end]

    def flush(self) -> None:
        """What one read of the child's answer produced, in one write."""
        out = self.out
        if out:
            self.client.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()

    def response_done(self) -> None:
        self.upstream = None  # given back to its pool, or closed, by itself
        if (partial := self.partial) is not None:  # (its end, as the child ended it)
            self.partial = None
            self.out.append(b"%x\r\n%b\r\n" % (len(partial), partial) if self.chunked
                            else partial)
        if self.held is not None:  # (an answer that is no stream: an error to its client)
            said = self.held.decode("utf-8", "replace")
            self.trace.error = f"{self.what} answered {self.status}: {said}"[:1000]
            self.status = self.status if self.status >= 400 else 502
            self.out.append(error_event(self.status, self.trace.error))
        if self.chunked:
            self.out.append(b"0\r\n\r\n")
        self.flush()
        if self.kept is not None:
            self.kept.end()
            self.kept = None
        self._to(Phase.DONE)
        self._resolve()

    def upstream_broke(self, why: str, kind: Broke) -> None:
        self.upstream = None
        if self.phase is Phase.FORWARDING:
            self.out.clear()  # interim answers only; the final one is ours
            self._unreachable(why, kind)
        elif self.phase is Phase.STREAMING:
            self.trace.error = why[:1000]
            log.warning("%s broke off a response: %s", self.what, why)
            if kind is Broke.SILENT:
                self.late = why
            self._break_off(why)
        self._resolve()

    def _break_off(self, why: str) -> None:
        """End a begun answer that will not be whole: an error event (after its last whole
        event: an unended one is dropped), and the close."""
        self.partial = None
        if self.sse and self.chunked:
            self.response_body(sse_error_event(self.what, why))
            self.out.append(b"0\r\n\r\n")
        self.flush()
        self.keep_alive = False
        self._to(Phase.DONE)

    def upgraded(self, transport: asyncio.Transport, headers: list[tuple[bytes, bytes]],
                 rest: bytes) -> None:
        """The child took the WebSocket: tunnel.py's (with the grant) till it ends."""
        self._head(101)
        self._to(Phase.STREAMING)
        self.upstream = None
        open_tunnel(self.client, transport, headers, rest, self.services.http, self.what)
