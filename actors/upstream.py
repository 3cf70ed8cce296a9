"""Connections from the front to children (and to the management API), and their pools.

Invariant: an `Upstream` is in exactly one place — its pool's idle list (IDLE), leased to
one exchange (LEASED), or CLOSED — and `Pool.check()` asserts it. A connection goes back
to the idle list only when its answer ended cleanly: the whole message read, the child
willing to keep it open, no byte after it, reading not paused. Anything else closes it,
so no answer can ever reach a request it does not belong to through a reused connection
(issue 10: a doubled pool entry handed one client's answer to another).

Answers are parsed strictly: 100 Continue is consumed, other 1xx answers (103 Early
Hints) are passed on as interim answers and never end the exchange, 101 is an error, and
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
import collections
import enum
import logging
import os
from typing import Protocol

import httptools

log = logging.getLogger("corral.front")

CHECK = os.environ.get("CORRAL_CHECK_INVARIANTS") == "1"
"""Assert the pool invariant after every change (the edge's fuzz test sets it)."""

API_TAG = "api"
"""The tag of the management API's pool (its event streams may be silent for long)."""
PoolKey = tuple[str, int, str]
"""(host, port, tag): the tag names the process behind the port (`model#generation`), so a
new child that gets a dead one's port never receives the dead one's connections."""


CLOSE_AFTER_STREAM_S = 1.0
"""A connection the child closes within this of a streamed answer ending was closed
because of that answer: the child does it after every stream."""


class Broke(enum.Enum):
    """How an answer failed, which says whether the request may be sent again."""

    UNSENT = "unsent"
    """A reused connection ended before a byte of the answer came back: the child had
    closed it (the keep-alive race). Sent again at once, on a fresh connection."""
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


class UpState(enum.Enum):
    IDLE = "idle"
    LEASED = "leased"
    CLOSED = "closed"


class Upstream(asyncio.Protocol):
    """One HTTP/1.1 connection to a child; parses its answers for the exchange that holds it."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
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
        self.received = False
        """A byte of the current answer has come back (the child has the request)."""
        self.head_bytes = 0
        """Bytes read before the answer's head was whole (bounded: R6)."""
        self.streamed = False
        """The answer is chunked (a stream): some children close after those."""
        self.after_stream = False
        """The answer before the current one on this connection was a stream."""
        self.last_read = 0.0
        """When the child last sent something (loop time), for the silence timeout."""

    # ------------------------------------------------------------ exchange side

    def send(self, sink: Sink, data: bytes, head_only: bool) -> None:
        """Write one request; its answer goes to `sink`."""
        assert self.state is UpState.LEASED and self.sink is None and self.transport is not None
        self.sink = sink
        self.head_only = head_only
        self.headers = []
        self.head_seen = self.finished = self.extra = self.close_delimited = False
        self.after_stream = self.streamed  # what the answer before this one was
        self.keep_alive = self.received = self.streamed = False
        self.head_bytes = 0
        self.last_read = asyncio.get_running_loop().time()
        self.parser = httptools.HttpResponseParser(self)
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
            self.last_read = asyncio.get_running_loop().time()  # silence counts from here
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
                and now - self.last_read >= timeout_s):
            self._broke(sink, f"the child sent nothing for {timeout_s:g} s in the middle of "
                        "its answer (http.upstream_idle_timeout_s)", Broke.SILENT)

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

    def connection_lost(self, exc: Exception | None) -> None:
        was_idle = self.state is UpState.IDLE
        self._forget()
        sink, self.sink = self.sink, None
        if sink is None:
            if (was_idle and self.streamed and asyncio.get_running_loop().time()
                    - self.idle_since < CLOSE_AFTER_STREAM_S):
                self.pool.closes_after_streams()
            return
        if self.head_seen and self.close_delimited and not self.finished:
            sink.response_done()  # the close is how this answer ends
            return
        why = str(exc) if exc else "the child closed the connection"
        if self.reused and not self.received:
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
        self.received = True
        self.last_read = asyncio.get_running_loop().time()
        if not self.head_seen:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._broke(sink, "it answered 101 Switching Protocols, which corral does not "
                        "pass on")
            return
        except httptools.HttpParserError as e:
            if not self.finished:
                self._broke(sink, f"malformed answer: {e}")
                return
            self.extra = True  # garbage after a whole answer
        if self.finished:
            self.sink = None
            self.answers += 1
            if self.extra or not self.keep_alive or (
                    self.streamed and self.pool.no_reuse_after_stream):
                self.close()
            else:
                self.resume_reading()  # paused for a slow client: not for the next one
                self.pool.give_back(self)
            sink.response_done()
        elif self.sink is not None:
            if not self.head_seen and self.head_bytes > self.pool.pools.max_head:
                # Bounded before httptools gathers more (it appends a header arriving in
                # pieces one piece at a time, quadratically): one read past the limit.
                self._broke(sink, f"its answer head is over the "
                            f"{self.pool.pools.max_head // 1024} KiB limit "
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
        self.head_seen = True
        self.streamed = any(n.lower() == b"transfer-encoding" for n, _ in headers)
        self.close_delimited = (status not in (204, 304) and not self.head_only and not any(
            n.lower() in (b"content-length", b"transfer-encoding") for n, _ in headers))
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


class Pool:
    """Connections to one child process, at most `cap` at once (None: no cap).

    Beyond the cap a lease waits for a connection to come back; a connection idle for
    `idle_s` is closed (before the child's own keep-alive timeout closes it under a
    request that is just being sent).
    """

    def __init__(self, pools: Pools, key: PoolKey, cap: int | None) -> None:
        self.pools = pools
        self.key = key
        self.cap = cap
        self.no_reuse_after_stream = False
        """The child was seen closing a connection after a streamed answer that said
        keep-alive: such connections are closed by corral first, never reused."""
        self.idle: list[Upstream] = []
        """Most recently used last; the stalest first."""
        self.leased: set[Upstream] = set()
        self.opening = 0
        self.waiters: collections.deque[asyncio.Future[Upstream | None]] = collections.deque()

    @property
    def empty(self) -> bool:
        return not (self.idle or self.leased or self.opening or self.waiters)

    def closes_after_streams(self) -> None:
        if not self.no_reuse_after_stream:
            self.no_reuse_after_stream = True
            log.info("%s closes its connection after a streamed answer although it says "
                     "keep-alive; corral no longer reuses a connection after a stream",
                     self.key[2])

    async def lease(self, fresh: bool = False) -> Upstream:
        """A connection for one exchange: an idle one (unless `fresh`), a new one, or (at
        the cap) the next one given back. Raises OSError if the child cannot be reached."""
        while True:
            deadline = asyncio.get_running_loop().time() - self.pools.idle_s
            while self.idle and not fresh:
                up = self.idle.pop()
                if up.idle_since < deadline or not up.usable:
                    up.close()  # about to be closed by the child: do not send into it
                    continue
                up.state = UpState.LEASED
                self.leased.add(up)
                if CHECK:
                    self.check()
                return up
            if self.cap is None or len(self.leased) + self.opening < self.cap:
                return await self._open()
            handed = await self._wait_turn()
            if handed is None:
                return await self._open()  # room to open one
            if handed.state is not UpState.LEASED:
                continue  # the child closed it on its way here
            if not handed.usable:
                handed.close()
            elif not fresh:
                return handed
            else:  # a fresh one was asked for: this one goes to the next in line
                self.give_back(handed)

    async def _wait_turn(self) -> Upstream | None:
        """Wait at the cap: a connection handed over, or None (room to open one)."""
        turn: asyncio.Future[Upstream | None] = asyncio.get_running_loop().create_future()
        self.waiters.append(turn)
        try:
            return await turn
        except asyncio.CancelledError:
            if turn in self.waiters:
                self.waiters.remove(turn)
            elif turn.done() and not turn.cancelled():  # handed over as we were cancelled
                up = turn.result()
                if up is not None:
                    self.give_back(up)
                else:
                    self._wake()
            raise
        finally:
            self.pools.forget_if_empty(self)

    async def _open(self) -> Upstream:
        loop = asyncio.get_running_loop()
        host, port, _ = self.key
        self.opening += 1
        try:
            _, up = await loop.create_connection(lambda: Upstream(self), host, port)
        except BaseException:
            self._wake()  # its place at the cap is free again: the next one tries
            raise
        finally:
            self.opening -= 1
        if up.transport is None or up.transport.is_closing():
            raise ConnectionResetError("the connection closed as it opened")
        self.leased.add(up)
        return up

    def give_back(self, up: Upstream) -> None:
        """An answer ended cleanly: to the next waiter, or to the idle list."""
        assert up.state is UpState.LEASED and up in self.leased, up.state
        assert up.sink is None and not up.paused
        while self.waiters:
            turn = self.waiters.popleft()
            if not turn.done():
                turn.set_result(up)  # stays leased, to its new holder
                return
        self.leased.remove(up)
        up.state = UpState.IDLE
        up.idle_since = asyncio.get_running_loop().time()
        self.idle.append(up)
        if CHECK:
            self.check()

    def remove(self, up: Upstream) -> None:
        """`up` is closing: forget it, and let a waiter open a connection in its place."""
        if up.state is UpState.LEASED:
            self.leased.discard(up)
        elif up.state is UpState.IDLE and up in self.idle:
            self.idle.remove(up)
        self._wake()
        self.pools.forget_if_empty(self)
        if CHECK:
            self.check()

    def _wake(self) -> None:
        while self.waiters:
            turn = self.waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return

    def sweep(self, now: float) -> None:
        """Close the connections idle longer than idle_s (the stalest are first), and cut
        answers whose child has gone silent."""
        while self.idle and self.idle[0].idle_since < now - self.pools.idle_s:
            self.idle[0].close()
        silence_s = self.pools.silence_s
        if silence_s and self.key[2] != API_TAG:
            for up in list(self.leased):
                up.check_silence(now, silence_s)

    def abort(self, reason: str) -> None:
        for up in [*self.idle, *self.leased]:
            up.abort(reason)

    def check(self) -> None:
        """Assert the invariant (tests call it after every step)."""
        assert len(set(map(id, self.idle))) == len(self.idle), "a connection is idle twice"
        assert not (set(self.idle) & self.leased), "a connection is idle and leased"
        for up in self.idle:
            assert up.state is UpState.IDLE and up.sink is None
        for up in self.leased:
            assert up.state is UpState.LEASED
        if self.cap is not None:
            assert len(self.leased) <= self.cap, (len(self.leased), self.cap)


class Pools:
    """Every pool of the front, by child."""

    def __init__(self, idle_s: float, max_head: int = 32 * 1024,
                 silence_s: float = 0.0) -> None:
        self.idle_s = idle_s
        self.max_head = max_head
        """Most bytes of an answer head a child may send (its request limit's twin)."""
        self.silence_s = silence_s
        """A child silent this long in the middle of an answer is cut (0: never)."""
        self.pools: dict[PoolKey, Pool] = {}

    def get(self, key: PoolKey, cap: int | None) -> Pool:
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = Pool(self, key, cap)
        return pool

    def forget_if_empty(self, pool: Pool) -> None:
        if pool.empty and self.pools.get(pool.key) is pool:
            del self.pools[pool.key]  # the child may be gone: so is its key

    def sweep(self, now: float) -> None:
        for pool in list(self.pools.values()):
            pool.sweep(now)

    def abort(self, tag: str, reason: str) -> None:
        """The process behind `tag` (`model#generation`) is gone: end its connections."""
        for key, pool in list(self.pools.items()):
            if key[2] == tag:
                pool.abort(reason)

    def close(self) -> None:
        for pool in list(self.pools.values()):
            for up in [*pool.idle, *pool.leased]:
                up.close()

    def check(self) -> None:
        for pool in self.pools.values():
            pool.check()
