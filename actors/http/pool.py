"""Pools of connections to children: idle, leased or closed, never two of these.

A `Pool` holds the connections to one child process (keyed by its address and
`model#generation`), at most `cap` at once; `Pools` holds every pool of the front, sweeps
the stale and the silent, and ends a gone child's connections at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os

from .remote import Far, tls_context
from .upstream import UpState, Upstream

log = logging.getLogger("corral.front")

CHECK = os.environ.get("CORRAL_CHECK_INVARIANTS") == "1"
"""Assert the pool invariant after every change (the edge's fuzz test sets it)."""

API_TAG = "api"
"""The tag of the management API's pool (its event streams may be silent for long)."""
PoolKey = tuple[str, int, str]
"""(host, port, tag): the tag names the process behind the port (`model#generation`), so a
new child that gets a dead one's port never receives the dead one's connections."""


class Pool:
    """Connections to one child process, at most `cap` at once (None: no cap).

    Beyond the cap a lease waits for a connection to come back; a connection idle for
    `idle_s` is closed (before the child's own keep-alive timeout closes it under a
    request that is just being sent).
    """

    def __init__(self, pools: Pools, key: PoolKey, cap: int | None,
                 far: Far | None = None) -> None:
        self.pools = pools
        self.key = key
        self.cap = cap
        self.far = far
        """A remote model's (remote.py): TLS, a timeout to connect, its Host and base path."""
        self.host = (far.end.host_header if far is not None else key[0]).encode()
        """What a request's Host header says."""
        self.prefix = far.prefix if far is not None else b""
        """What goes before a request's path."""
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

    async def alive(self, timeout_s: float) -> bool:
        """Whether the child still accepts connections (after one broke with a request on
        it: a live child may have that request, so it is not sent anywhere again)."""
        host, port, _ = self.key
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await asyncio.wait_for(
                loop.create_connection(asyncio.Protocol, host, port), timeout_s)
        except (OSError, TimeoutError):
            return False
        transport.close()
        return True

    @property
    def max_head(self) -> int:
        return self.pools.max_head

    def closes_after_streams(self) -> None:
        if not self.no_reuse_after_stream:
            self.no_reuse_after_stream = True
            log.info("%s closes its connection after a streamed answer although it says "
                     "keep-alive; corral no longer reuses a connection after a stream",
                     self.key[2])

    def take(self) -> Upstream | None:
        """An idle connection for one exchange, or None (then `lease`)."""
        while self.idle:
            up = self.idle.pop()
            if up.idle_since < up.loop.time() - self.pools.idle_s or not up.usable:
                up.close()  # about to be closed by the child: do not send into it
                continue
            up.state = UpState.LEASED
            self.leased.add(up)
            if CHECK:
                self.check()
            return up
        return None

    async def lease(self, fresh: bool = False) -> Upstream:
        """A connection for one exchange: an idle one (unless `fresh`), a new one, or (at
        the cap) the next one given back. Raises OSError if the child cannot be reached."""
        while True:
            if not fresh and (up := self.take()) is not None:
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
            else:  # a fresh one was asked for: it takes this one's place at the cap
                self.leased.discard(handed)  # (passed on, two fresh waiters would spin)
                handed.state = UpState.CLOSED
                handed.close()
                return await self._open()

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
            if (far := self.far) is not None:
                try:
                    _, up = await asyncio.wait_for(loop.create_connection(
                        lambda: Upstream(self), host, port,
                        ssl=tls_context(far.ca_file) if far.end.tls else None),
                        far.connect_timeout_s)
                except TimeoutError:
                    raise OSError(f"no connection within {far.connect_timeout_s:g} s "
                                  "(connect_timeout_s)") from None
            else:
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
        up.idle_since = up.loop.time()
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

    def get(self, key: PoolKey, cap: int | None, far: Far | None = None) -> Pool:
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = Pool(self, key, cap, far)
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
