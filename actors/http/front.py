"""The front: corral's port, on raw asyncio protocols with httptools (as uvicorn does).

Every request that names a model (the POSTs of R-6.1 and GETs with `?model=` on paths
that are not corral's own) is parsed here, granted by the Scheduler and streamed to and
from the child over pooled keep-alive connections, with no framework in between.
Everything else (the management API) is passed, bytes in and bytes out, to the aiohttp
application on an internal loopback port. The parts:

    Front       what the connections share: routes, pools, limits, the drain
    Connection  one client connection: parsing, limits, timers, flow control
    Exchange    one request and its answer, in named phases
    Pool        connections to one child: idle, leased or closed, never two of these
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import socket
import time
from collections.abc import Callable

from ..config.keys import Keys
from ..config.model import HttpConfig
from ..config.tracing import TracingConfig
from ..messages import Revoke, Withdraw
from ..runtime.bridge import SchedulerInbox
from .callers import Origins
from .connection import Connection
from .control import FrontCounts, TimeRow
from .edge import FRONT_HEADER
from .inflight import Live
from .journaling import Recorder
from .loading import Waiting
from .loras import Loras
from .metrics import RequestTimes
from .pool import API_TAG, Pool, Pools
from .remote import Breakers
from .request import Limits
from .resumable import Keeper, Resumables
from .routes import Routes
from .shares import Shares
from .spans import Tracer
from .speeds import KeyUses, Speeds

log = logging.getLogger("corral.front")

BACKLOG = 2048
"""Pending connections the front accepts: at 100 (asyncio's default) a burst of 256
streams lost SYNs and waited out a 1 s retransmit (bench overhead, p99 time to first byte)."""
POOL_IDLE_S = 4.0
"""A pooled connection idle this long is closed: below the 5 s keep-alive of llama-server
(cpp-httplib) and uvicorn (vLLM), so corral never sends into a connection being closed."""
FD_LOW = 8
"""Within this many of the open-file limit, corral says it has run out."""
EVENT_STREAM_END_S = 1.0
"""At shutdown, an event stream of corral's own API whose reader has not taken its end
within this is cut: it has no answer to finish, and a stalled reader must not hold the
drain."""
FD_RESERVE = 64
"""File descriptors kept back from clients for children's pipes, logs and the API."""


def default_max_connections() -> int:
    """Half of what the open-file limit leaves: each client may hold a child connection."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 10_000
    return max(16, (soft - FD_RESERVE) // 2)


class Front:
    """Everything the client connections share."""

    def __init__(self, routes: Routes, scheduler: Callable[[], SchedulerInbox], api_port: int,
                 http: HttpConfig, max_body_mib: float, api_secret: str = "",
                 keeper: Keeper | None = None, recorder: Recorder | None = None,
                 tracing: TracingConfig | None = None) -> None:
        self.routes = routes
        """Replaced whole on reload (edge.Routes is immutable)."""
        self.scheduler = scheduler
        self.shares = Shares(scheduler)
        self.times = RequestTimes()
        """Time to first byte and duration of the proxied requests (GET /metrics)."""
        self.key_uses = KeyUses()
        self.speeds = Speeds()
        """How fast each model answered through it, and what it used (GET /metrics)."""
        """What each named key used through this front (GET /metrics, GET /keys)."""
        self.http = http
        self.limits = Limits(http, max_body_mib)
        self.max_connections = http.max_connections or default_max_connections()
        self.pools = Pools(POOL_IDLE_S, self.limits.max_header, http.upstream_idle_timeout_s)
        self.breakers = Breakers()  # (remote models': remote.py)
        self.loras = Loras()  # (adapters loaded into children: loras.py)
        self.api_address = ("127.0.0.1", api_port, API_TAG)
        self.to_api: tuple[bytes, ...] = (FRONT_HEADER + b": " + api_secret.encode(),)
        """What the front adds to every request it passes to the management API."""
        self.batch_secret = api_secret.encode()
        """What corral's batch runner shows in X-Corral-Batch (request.py)."""
        self.keeper: Keeper = keeper or Resumables(http.resumable_max_mib,
                                                   http.resumable_ttl_s)
        """Where resumable answers are kept: corral's one registry (a worker's goes over
        its channel to it)."""
        self.recorder = recorder
        """Where each request's record goes: corral's journal (None: [journal] is off)."""
        self.tracer = Tracer(tracing) if tracing is not None and tracing.endpoint else None
        """Where its requests' spans go ([tracing]; None: off)."""
        self.capture = recorder.capture if recorder is not None else 0
        """[journal] capture: bytes of each model request's body and answer kept (0: none)."""
        self.board: dict[str, Waiting] = {}
        """What each model's requests wait for now (loading.py; corral's process sets it
        each TICK_S while a model sends its loading state)."""
        self.live = Live()
        """Its model requests now (GET /requests?state=running, and their cancel)."""
        self.stopped: dict[str, tuple[tuple[int, int], float]] = {}
        """Model, or a replica's own name -> the newest (generation, epoch) withdrawn to stop
        or suspend on purpose, and when (loop time): a request its child dropped after
        that is not sent on to the next instance (one that broke before was not dropped
        for the stop: a child killed, then evicted once its requests let go of it)."""
        self.origins: Origins | None = None
        """Without keys: the Host and Origin a request may carry (R5); set by `listen`."""
        self.connections: set[Connection] = set()
        self.draining = False
        self.drained = asyncio.Event()
        """Set once draining and no answer is running any more."""
        self.server: asyncio.Server | None = None
        self.more_servers: list[asyncio.Server] = []
        """A worker's: one per inherited socket after the first."""
        self._sweeper: asyncio.TimerHandle | None = None
        self._last_warning: dict[str, float] = {}

    async def listen(self, host: str, port: int, fds: list[int] | None = None) -> int:
        """Start accepting on host:port (0 picks one); return the port. `fds`: accept on
        these listening sockets instead (a front worker's, inherited from corral)."""
        loop = asyncio.get_running_loop()
        self.origins = Origins(host, self.http.allowed_hosts, self.http.allowed_origins)
        if fds:
            servers = [await loop.create_server(lambda: Connection(self),
                                                sock=socket.socket(fileno=fd), backlog=BACKLOG)
                       for fd in fds]
            self.server, self.more_servers = servers[0], servers[1:]
        else:
            self.server = await loop.create_server(lambda: Connection(self), host, port,
                                                   backlog=BACKLOG)
            port = int(self.server.sockets[0].getsockname()[1])
        self._sweeper = loop.call_later(1.0, self._sweep)
        return port

    @property
    def keys(self) -> Keys | None:
        return self.routes.keys

    def reroute(self, routes: Routes) -> None:
        """A reload's model table: a remote it changed starts with a closed breaker."""
        old, self.routes = self.routes, routes

        def same(name: str) -> bool:  # (a `models = "*"` peer's are by the name asked)
            remote = name if name in old.remote else old.catch_all
            return remote == (name if name in routes.remote else routes.catch_all) and \
                old.remote.get(remote) == routes.remote.get(remote) is not None and \
                old.rewrites.get(remote) == routes.rewrites.get(remote)
        self.breakers.keep(same)

    def grant_notice(self, message: Withdraw | Revoke) -> None:
        """The Scheduler: keep no grant of this child idle (Revoke); or let no request join
        them any more, and if it is gone, end its connections now (a lost node's never
        close by themselves)."""
        if isinstance(message, Revoke):
            self.shares.revoke(message)
            return
        self.shares.withdraw(message)
        if message.gone:
            self.pools.abort(tag := f"{message.model}#{message.generation}", "the child is gone")
            self.loras.forget(tag)
        elif message.stopping:  # it is to stop: on purpose (not another model's turn)
            copy = message.instance or message.model  # per copy: one's stop is not another's
            if message.serving > self.stopped.get(copy, ((0, 0), 0.0))[0]:
                self.stopped[copy] = (message.serving, asyncio.get_running_loop().time())

    def counts(self) -> FrontCounts:
        """What this front knows that the Scheduler does not (GET /models, /metrics)."""
        shares = self.shares
        kept = {m: idle for m in shares.open if (idle := shares.kept_idle_s(m)) is not None}
        times = [TimeRow(model=model, status=status, first_byte=hist.view(),
                         duration=self.times.duration[(model, status)].view())
                 for (model, status), hist in self.times.first_byte.items()]
        return FrontCounts(joined_total=shares.joined_total, extra=dict(shares.extra),
                           kept_idle_s=kept, kept_idle=dict.fromkeys(kept, 1), times=times,
                           keys=dict(self.key_uses.counts), speeds=self.speeds.rows())

    def api_pool(self) -> Pool:
        return self.pools.get(self.api_address, None)

    def admit(self, conn: Connection) -> bool:
        """Count a new client connection in, unless the cap is reached (then log it)."""
        if len(self.connections) >= self.max_connections:
            self.warn("cap", f"refusing connections: {self.max_connections} are open "
                      "(http.max_connections)")
            return False
        self.connections.add(conn)
        return True

    def forget(self, conn: Connection) -> None:
        self.connections.discard(conn)

    def warn(self, what: str, message: str) -> None:
        """Log `message` at most once a second per kind (a flood must not flood the log)."""
        now = time.monotonic()
        if now - self._last_warning.get(what, 0.0) >= 1.0:
            self._last_warning[what] = now
            log.warning("%s", message)

    def note_timeout(self, phase: str) -> None:
        self.warn(f"timeout-{phase}", f"a client was too slow sending its request {phase}s "
                  f"(http.{phase}_timeout_s); answered 408")

    def _sweep(self) -> None:
        """Once a second: run the connections' timeouts (so they fire up to a second late),
        close stale pooled connections, and say so when the open-file
        limit is reached (the event loop then drops new connections without a word)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self.pools.sweep(now)
        for conn in list(self.connections):
            conn.check_deadline(now)
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            open_fds = len(os.listdir("/proc/self/fd"))
        except OSError as e:  # EMFILE: not even this one could be opened
            open_fds = soft if e.errno == errno.EMFILE else 0
        if soft != resource.RLIM_INFINITY and open_fds >= soft - FD_LOW:
            self.warn("emfile", f"out of file descriptors ({open_fds} open, limit {soft}): "
                      "new clients are being dropped; raise the limit (ulimit -n) or lower "
                      "http.max_connections")
        self._sweeper = loop.call_later(1.0, self._sweep)

    async def drain(self, timeout_s: float) -> None:
        """Stop accepting, let running answers finish (up to timeout_s), answer nothing
        new (503 + close), then close what is left — uvicorn's order."""
        self._stop_accepting()
        self.draining = True
        busy = sum(c.exchange is not None for c in self.connections)
        log.info("draining: %d answers running, %d connections open; new requests get 503",
                 busy, len(self.connections))
        for conn in list(self.connections):
            conn.drain()
        self.shares.stop_keeping()
        self.exchange_finished()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            await asyncio.wait_for(self.drained.wait(), min(timeout_s, EVENT_STREAM_END_S))
        except TimeoutError:
            for conn in list(self.connections):
                if (conn.exchange is not None and conn.exchange.is_event_stream()
                        and conn.transport is not None):
                    conn.transport.abort()
        try:
            await asyncio.wait_for(self.drained.wait(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            busy = sum(c.exchange is not None for c in self.connections)
            log.warning("drain: %d answers still running after %g s (http.drain_timeout_s); "
                        "cutting them", busy, timeout_s)
        self.close()
        if self.tracer is not None:  # (the spans of what ended are sent first)
            await asyncio.to_thread(self.tracer.close)

    def exchange_finished(self) -> None:
        if self.draining and not any(c.exchange is not None for c in self.connections):
            self.drained.set()

    def _stop_accepting(self) -> None:
        for server in [self.server, *self.more_servers]:
            if server is not None:
                server.close()

    def close(self) -> None:
        self._stop_accepting()
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.shares.stop_keeping()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        self.pools.close()
