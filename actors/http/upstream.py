"""One connection from the front to a child (or to the management API), and its answers.

Invariant: an `Upstream` is in exactly one place — its pool's idle list (IDLE), leased to
one exchange (LEASED), or CLOSED — and `Pool.check()` (pool.py) asserts it. A
connection goes back to the idle list only when its answer ended cleanly: the whole
message read, the child willing to keep it open, no byte after it, reading not paused.
Anything else closes it, so no answer can ever reach a request it does not belong to
through a reused connection (issue 10: a doubled pool entry handed one client's answer to
another). The one limit is a faulty child: an answer nobody asked for that it sends while
the connection is idle closes it, but one it sends just after the next request went out
on it cannot be told from that request's answer.

Answers are parsed strictly: 100 Continue is consumed, other 1xx answers (103 Early
Hints) are passed on as interim answers and never end the exchange, 101 is an error but
to a WebSocket's opening (then the connection leaves its pool for the tunnel), and
an answer without a length that ends when the child closes (HTTP/1.0) is complete. An
answer head is bounded like a request's (R6), and a child silent in the middle of an
answer is cut after `upstream_idle_timeout_s` (R7).

Keep-alive is believed only where it holds: a child that closes a connection right after a
streamed (chunked) answer although it said keep-alive (llama-server does, issue 19) is
seen doing it once, and from then on its connections are not reused after a stream. A
request on a reused connection that breaks before a byte of its answer came back is
`Broke.UNSENT`: the child closed that connection as the request went in (the keep-alive
race), and the request is sent again at once on a fresh connection to the same child.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

import httptools

from ..lifecycle import State

if TYPE_CHECKING:
    from .upload import Upload

RACE_WINDOW_S = 0.1
"""A reused connection that ends with nothing back within this of the request's write was
closed by the child as the request went in (the keep-alive race); later, the child may
have had it, and it is not sent to that child again."""
CLOSE_AFTER_STREAM_S = 1.0
"""A connection the child closes within this of a streamed answer ending was closed
because of that answer: the child does it after every stream."""


class Broke(State):
    """How an answer failed, which says whether the request may be sent again."""

    UNSENT = "unsent"
    """A reused connection ended with nothing back within RACE_WINDOW_S of the write: the
    child had closed it (the keep-alive race). Sent again at once, on a fresh one."""
    GONE = "gone"
    """The connection was refused or ended before the final answer's head (on a fresh
    connection, or after bytes of an interim answer): the child may have exited. Sent
    again to its next instance, if there is one, never to this child."""
    REFUSED = "refused"
    """No connection could be made (refused, or closed as it opened): the child never had
    the request. Sent to its next instance, not counted as a replay (the exchange's)."""
    ANSWERED = "answered"
    """The child answered, badly (malformed, 101, a head over the limit): never sent
    again."""
    SILENT = "silent"
    """The child sent nothing for upstream_idle_timeout_s in the middle of its answer."""


class Sink(Protocol):
    """What an upstream connection reports to the exchange that leased it."""

    def response_interim(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...
    def response_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...
    def response_body(self, body: bytes) -> None: ...
    def flush(self) -> None: ...
    def response_done(self) -> None: ...
    def upstream_broke(self, reason: str, kind: Broke) -> None: ...

    @property
    def upgrade(self) -> bool:
        """The request opens a WebSocket: a 101 hands the connection over."""

    def upgraded(self, transport: asyncio.Transport, headers: list[tuple[bytes, bytes]],
                 rest: bytes) -> None:
        """The child answered 101: the connection is the WebSocket's now (`rest`: what
        came after the head)."""


class Home(Protocol):
    """What a connection tells the pool it lives in (pool.py's `Pool`)."""

    @property
    def max_head(self) -> int:
        """Most bytes of an answer head the child may send."""

    no_reuse_after_stream: bool
    """The child closes after streams: a connection is not reused after one."""

    def give_back(self, up: Upstream) -> None: ...
    def remove(self, up: Upstream) -> None: ...
    def closes_after_streams(self) -> None: ...


class UpState(State):
    IDLE = "idle"
    LEASED = "leased"
    CLOSED = "closed"


class Upstream(asyncio.Protocol):
    """One HTTP/1.1 connection to a child; parses its answers for the exchange that holds it."""

    def __init__(self, pool: Home) -> None:
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        """Held, not looked up: asyncio.get_running_loop() costs a getpid() system call
        on Python 3.11 (as glibc caches no pid), and the hot path asked it 9 times a
        request."""
        self.state = UpState.LEASED
        """Invariant: LEASED iff in pool.leased, IDLE iff in pool.idle."""
        self.transport: asyncio.Transport | None = None
        self.sink: Sink | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_only = False
        """The request was HEAD: the answer ends at its headers, whatever they say."""
        self.head_seen = False
        self.finished = False
        """The final answer has been read whole."""
        self.extra = False
        """Bytes followed the answer: the connection can never be trusted again."""
        self.close_delimited = False
        """The answer has no length: it ends when the child closes (HTTP/1.0 style)."""
        self.paused = False
        self.keep_alive = False
        """The child will keep the connection open after this answer."""
        self.idle_since = 0.0
        self.answers = 0
        """Answers read whole on this connection: a request sent after one is on a reused
        connection."""
        self.reads = 0
        """Reads of the current answer so far (0: nothing came back yet)."""
        self.head_bytes = 0
        """Bytes read before the answer's head was whole (bounded: R6)."""
        self.streamed = False
        """The answer is chunked (a stream): some children close after those."""
        self.after_stream = False
        """The answer before the current one on this connection was a stream."""
        self.reads_seen = 0
        self.sent_at = 0.0
        """When the current request was written (loop time)."""
        self.quiet_since = 0.0
        """Since when `reads` has not moved (loop time), as the once-a-second sweep saw it:
        a counter per read is cheaper than a clock per read."""
        self.feeder: Upload | None = None
        """The upload whose body is being written (upload.py): told when to hold off."""
        self.body_open = False
        """The request's body is not all written: the connection cannot be reused."""

    # ------------------------------------------------------------ exchange side

    def send(self, sink: Sink, data: bytes, head_only: bool) -> None:
        """Write one request; its answer goes to `sink`."""
        assert self.state is UpState.LEASED and self.sink is None and self.transport is not None
        self.sink = sink
        self.head_only = head_only
        self.feeder, self.body_open = None, False
        self.headers = []
        self.head_seen = self.finished = self.extra = self.close_delimited = False
        self.after_stream = self.streamed  # what the answer before this one was
        self.keep_alive = self.streamed = False
        self.head_bytes = self.reads = self.reads_seen = 0
        self.quiet_since = self.sent_at = self.loop.time()
        self.parser = httptools.HttpResponseParser(self)
        self.transport.write(data)

    def write(self, data: bytes) -> None:
        """More of the request's body (an upload's)."""
        if self.transport is not None and self.state is UpState.LEASED:
            self.transport.write(data)

    @property
    def reused(self) -> bool:
        return self.answers > 0

    @property
    def usable(self) -> bool:
        """Open, and not seen closing: a request may be sent on it."""
        return self.transport is not None and not self.transport.is_closing()

    def detach(self) -> None:
        """The exchange is over before the answer was: the connection cannot be reused."""
        self.sink = None
        self.close()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and self.paused:
            self.paused = False
            self.quiet_since = self.loop.time()  # silence counts from here
            self.transport.resume_reading()

    def abort(self, reason: str) -> None:
        """The child is gone (its node lost, or it was stopped): end what runs on this
        connection now instead of waiting for a close that may never come."""
        sink, self.sink = self.sink, None
        self._forget()
        if self.transport is not None:
            self.transport.abort()
        if sink is not None:
            sink.upstream_broke(reason, Broke.GONE)

    def check_silence(self, now: float, timeout_s: float) -> None:
        """Cut an answer whose child has sent nothing for `timeout_s` since its head (a
        child paused for a slow client is not silent)."""
        sink = self.sink
        if (sink is not None and self.head_seen and not self.finished and not self.paused
                and self._quiet_for(now) >= timeout_s):
            self._broke(sink, f"the child sent nothing for {timeout_s:g} s in the middle of "
                        "its answer (http.upstream_idle_timeout_s)", Broke.SILENT)

    def _quiet_for(self, now: float) -> float:
        """How long no read has come (as seen by the sweeps)."""
        if self.reads != self.reads_seen:
            self.reads_seen = self.reads
            self.quiet_since = now
        return now - self.quiet_since

    def close(self) -> None:
        self._forget()
        if self.transport is not None:
            self.transport.close()

    def _forget(self) -> None:
        """Out of the pool for good (closing, or closed by the child)."""
        if self.state is not UpState.CLOSED:
            self.pool.remove(self)
            self.state = UpState.CLOSED

    # ------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def pause_writing(self) -> None:
        if self.feeder is not None:  # the child takes no more of the body for now
            self.feeder.pause()

    def resume_writing(self) -> None:
        if self.feeder is not None:
            self.feeder.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        was_idle = self.state is UpState.IDLE
        self._forget()
        sink, self.sink = self.sink, None
        if sink is None:
            if (was_idle and self.streamed and self.loop.time()
                    - self.idle_since < CLOSE_AFTER_STREAM_S):
                self.pool.closes_after_streams()
            return
        if self.head_seen and self.close_delimited and not self.finished:
            sink.response_done()  # the close is how this answer ends
            return
        why = str(exc) if exc else "the child closed the connection"
        if (self.reused and not self.reads
                and self.loop.time() - self.sent_at < RACE_WINDOW_S):
            if self.after_stream:
                self.pool.closes_after_streams()
            sink.upstream_broke(why, Broke.UNSENT)
        else:
            sink.upstream_broke(why, Broke.GONE)

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is None:  # bytes nobody asked for (an idle connection): never reuse it
            self.close()
            return
        self.reads += 1
        if not self.head_seen:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:
            if (sink.upgrade and self.transport is not None
                    and self.parser.get_status_code() == 101):
                self.sink = None
                self._forget()  # out of the pool, open: the tunnel's (tunnel.py)
                sink.upgraded(self.transport, self.headers, data[e.args[0]:])
                return
            self._broke(sink, "it answered 101 Switching Protocols to a request that "
                        "opened no WebSocket")
            return
        except httptools.HttpParserError as e:
            if not self.finished:
                self._broke(sink, f"malformed answer: {e}")
                return
            self.extra = True  # garbage after a whole answer
        if self.finished:
            self.sink = None
            self.answers += 1
            if self.extra or self.body_open or not self.keep_alive or (
                    self.streamed and self.pool.no_reuse_after_stream):
                self.close()
            else:
                self.resume_reading()  # paused for a slow client: not for the next one
                self.pool.give_back(self)
            sink.response_done()
        elif self.sink is not None:
            if not self.head_seen and self.head_bytes > self.pool.max_head:
                # Bounded before httptools gathers more (it appends a header arriving in
                # pieces one piece at a time, quadratically): one read past the limit.
                self._broke(sink, f"its answer head is over the "
                            f"{self.pool.max_head // 1024} KiB limit "
                            "(http.max_header_kib)")
                return
            sink.flush()  # what this read produced goes out in one write

    def _broke(self, sink: Sink, reason: str, kind: Broke = Broke.ANSWERED) -> None:
        self.sink = None
        self.close()
        sink.upstream_broke(reason, kind)

    # ------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        if self.finished:
            self.extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.finished or self.sink is None:
            return
        status = self.parser.get_status_code()
        if status == 101:
            return  # feed_data raises HttpParserUpgrade next
        headers, self.headers = self.headers, []
        if status < 200:  # interim: the final answer is still to come
            if status != 100:
                self.sink.response_interim(status, headers)
            return
        if self.sink.upgrade:  # a WebSocket's opening: 101, or none of the child's answer
            self._broke(self.sink, f"it answered {status} to a WebSocket's opening")
            return  # (it might be a page a key may not GET: /slots shows prompts)
        self.head_seen = True
        self.streamed = has_length = False
        for name, _ in headers:
            lname = name.lower()
            if lname == b"transfer-encoding":
                self.streamed = True
            elif lname == b"content-length":
                has_length = True
        self.close_delimited = (status not in (204, 304) and not self.head_only
                                and not self.streamed and not has_length)
        self.sink.response_head(status, headers)
        if self.head_only:  # the parser would wait for a body that never comes
            self.finished = True
            self.extra = True  # so: never pooled

    def on_body(self, body: bytes) -> None:
        if self.sink is not None and not self.finished:
            self.sink.response_body(body)

    def on_message_complete(self) -> None:
        if self.head_seen and not self.finished:
            self.finished = True
            self.keep_alive = self.parser.should_keep_alive()  # only valid here
