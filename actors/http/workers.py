"""Front workers (`http.workers = N`): N - 1 more fronts, each a process of its own on
corral's port (each accepts on corral's listening sockets, inherited), so that the
proxy is not held to one core. There is still one Scheduler, in corral's process: a
worker asks it for grants over a control channel (control.py), keeps and shares them as
the front beside the Scheduler does (shares.py, leases included), and is told every
Withdraw and Revoke. What is not a model's request a worker passes to the management API
in corral's process, as any front does.

A Revoke is answered by every front, with the grants it kept idle (maybe none), and corral
tells the Scheduler all of them in one Releases (`Revoking`): it then picks its LRU victim
among every front's, as it does with one front.

corral's end of each worker's channel is a `Link` (link.py); a worker that goes away
has all its requests cancelled there, and is started again here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pykka

from ..config.model import Config
from ..messages import GetModels, ModelsSnapshot, Release, Releases, Revoke, Withdraw
from ..runtime.bridge import LoopReply, SchedulerInbox
from .control import BoardNow, Drain, FrontCounts, NewRoutes, Notice, RevokeAsk, Setup, merge
from .front import Front
from .inflight import Running, ranked
from .journaling import Recorder
from .link import Link, tell
from .loading import TICK_S, board_of
from .resumable import Keeper
from .routes import Routes

log = logging.getLogger("corral.workers")

RESTART_AFTER_S = 1.0
RESTART_MAX_S = 30.0
HEALTHY_S = 60.0
"""A worker that ends within this of its start is started again after twice the last
wait (up to RESTART_MAX_S); one that ran longer, after RESTART_AFTER_S."""
START_TIMEOUT_S = 30.0
HEARTBEAT_S = 5.0
BOARD_TIMEOUT_S = 5.0
"""A Scheduler that gives no snapshot within this leaves the board as it was."""
HUNG_AFTER_S = 20.0
REVOKE_WAIT_S = 1.0
"""A worker that has not answered a Revoke within this is not waited for: the others'
releases go to the Scheduler, and its own when they come."""


@dataclass
class Revoking:
    """One Revoke, asked of every front: the releases of the grants they kept idle, told
    to the Scheduler together once each has answered (or REVOKE_WAIT_S has passed)."""

    releases: list[Release]
    waiting: set[int]
    """The workers that have not answered."""
    timer: asyncio.TimerHandle | None = None


class Workers:
    """corral's front workers: started, told, counted, drained, restarted."""

    def __init__(self, n: int, setup: Callable[[int], Setup],
                 scheduler: Callable[[], SchedulerInbox], pass_fds: tuple[int, ...],
                 keeper: Keeper, recorder: Recorder | None = None) -> None:
        self.n = n
        self.recorder = recorder
        self.keeper = keeper
        """corral's resumable answers, a worker's among them."""
        self.setup = setup
        self.scheduler = scheduler
        self.links: dict[int, Link] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        self.pass_fds = pass_fds
        """The listening socket the workers accept on (inherited, not bound again)."""
        self.retired = FrontCounts()
        """What the workers that ended had counted."""
        self.delays: dict[int, float] = {}
        self.beat: asyncio.Task[None] | None = None
        self.revoking: dict[int, Revoking] = {}
        self._rounds = itertools.count(1)

    async def start(self) -> None:
        """Start every worker and wait until each listens; raises OSError, with those
        started stopped again, if one cannot."""
        try:
            await asyncio.gather(*(self._start(i) for i in range(1, self.n)))
        except (OSError, RuntimeError, TimeoutError) as e:
            await self.drain(0.0)
            raise OSError(f"a front worker could not start: {e or type(e).__name__}") from e
        self.beat = asyncio.get_running_loop().create_task(self._heartbeat())

    async def _start(self, index: int) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "actors.http.worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, pass_fds=self.pass_fds)
        link = self.links[index] = Link(index, proc, self.scheduler, self.revoked,
                                             self.keeper, self.recorder)
        link.send(self.setup(index))
        task = asyncio.get_running_loop().create_task(self._run(link))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        try:
            port = await asyncio.wait_for(asyncio.shield(link.listening), START_TIMEOUT_S)
        except TimeoutError:
            proc.kill()  # hung before it listened: not left behind
            raise
        link.started_at = asyncio.get_running_loop().time()
        log.info("front worker %d (pid %d) listening on port %d", index, proc.pid, port)

    async def _run(self, link: Link) -> None:
        await link.serve()
        for round_ in list(self.revoking):  # it answers none of them now
            self.revoked(link.index, round_, ())
        code = await link.proc.wait()
        self.retired = merge([self.retired, link.last_counts])  # counters never go back
        if self.stopping or self.links.get(link.index) is not link:
            return
        loop = asyncio.get_running_loop()
        healthy = link.started_at is not None and loop.time() - link.started_at > HEALTHY_S
        delay = RESTART_AFTER_S if healthy else min(2 * self.delays.get(link.index, 0.5),
                                                     RESTART_MAX_S)
        self.delays[link.index] = delay
        log.warning("front worker %d (pid %d) exited with status %s; starting it again in "
                    "%g s", link.index, link.proc.pid, code, delay)
        await asyncio.sleep(delay)
        if not self.stopping:
            try:
                await self._start(link.index)
            except (OSError, RuntimeError, TimeoutError) as e:  # its own _run tries again
                log.error("front worker %d could not be started again: %s", link.index, e)

    async def _heartbeat(self) -> None:
        """Ask every worker for its counts every HEARTBEAT_S: one that has answered none
        for HUNG_AFTER_S is hung (stopped, or its loop stuck) and holds grants the
        Scheduler waits for: it is killed, its tickets cancelled, and it starts again."""
        loop = asyncio.get_running_loop()
        while not self.stopping:
            await asyncio.sleep(HEARTBEAT_S)
            await self.counts()
            for link in list(self.links.values()):
                if (link.proc.returncode is None and link.started_at is not None
                        and loop.time() - max(link.answered_at, link.started_at)
                        > HUNG_AFTER_S):
                    log.error("front worker %d (pid %d) has answered nothing for %g s; "
                              "killing it", link.index, link.proc.pid, HUNG_AFTER_S)
                    link.proc.kill()

    def notice(self, notice: Withdraw) -> None:
        for link in self.links.values():
            link.send(Notice(notice=notice))

    def revoke(self, notice: Revoke, own: tuple[Release, ...]) -> None:
        """Ask every worker to carry out `notice`; tell the Scheduler its releases and
        `own` (corral's front's) in one Releases once all have answered."""
        live = [link for link in self.links.values() if not link.ended]
        if not live:
            self._release(list(own))
            return
        round_ = next(self._rounds)
        pending = self.revoking[round_] = Revoking(list(own), {link.index for link in live})
        pending.timer = asyncio.get_running_loop().call_later(
            REVOKE_WAIT_S, self._revoke_late, round_)
        for link in live:
            link.send(RevokeAsk(round=round_, revoke=notice))

    def revoked(self, index: int, round_: int, releases: tuple[Release, ...]) -> None:
        """Worker `index` answered RevokeAsk `round_` (or went away: no releases)."""
        pending = self.revoking.get(round_)
        if pending is None:  # after REVOKE_WAIT_S: on their own
            self._release(list(releases))
            return
        pending.releases += releases
        pending.waiting.discard(index)
        if not pending.waiting:
            self._end_round(round_)

    def _revoke_late(self, round_: int) -> None:
        pending = self.revoking.get(round_)
        if pending is not None:
            log.warning("front workers %s did not answer a revocation within %g s; the "
                        "Scheduler gets the other fronts' releases without theirs",
                        sorted(pending.waiting), REVOKE_WAIT_S)
            self._end_round(round_)

    def _end_round(self, round_: int) -> None:
        pending = self.revoking.pop(round_)
        if pending.timer is not None:
            pending.timer.cancel()
        self._release(pending.releases)

    def _release(self, releases: list[Release]) -> None:
        if releases:
            tell(self.scheduler, Releases(releases=tuple(releases)))

    def routes(self, routes: Routes) -> None:
        for link in self.links.values():
            link.send(NewRoutes(routes=routes))

    async def counts(self) -> list[FrontCounts]:
        """Every worker's counts (the last known for one that is late), and those of the
        workers that ended, so that no counter ever goes back."""
        live = [link for link in self.links.values() if link.proc.returncode is None]
        got = await asyncio.gather(*(link.ask_counts() for link in live))
        return [self.retired, *(c if c is not None else link.last_counts
                                for c, link in zip(got, live, strict=True))]

    async def drain(self, timeout_s: float) -> None:
        """Have every worker drain as corral's own front does, then end; one that outlasts
        the drain by 5 s is killed. All at once: N workers take one drain, not N."""
        self.stopping = True
        if self.beat is not None:
            self.beat.cancel()
        for link in self.links.values():
            link.send(Drain(timeout_s=timeout_s))

        async def end(link: Link) -> None:
            try:
                await asyncio.wait_for(link.proc.wait(), timeout_s + 5)
            except TimeoutError:
                log.warning("front worker %d did not end after its drain; killing it",
                            link.index)
                link.proc.kill()
                await link.proc.wait()
        await asyncio.gather(*(end(link) for link in list(self.links.values())))
        for task in list(self.tasks):
            task.cancel()


class Fronts:
    """corral's port: its own front and, with http.workers above 1, its workers; what
    the management API tells them and asks of them."""

    def __init__(self, front: Front, config: Config, api_port: int, api_secret: str,
                 scheduler: Callable[[], SchedulerInbox]) -> None:
        self.front = front
        self.config = config
        self.api_port = api_port
        self.api_secret = api_secret
        self.workers: Workers | None = None
        self.scheduler = scheduler
        self.boarding: asyncio.Task[None] | None = None

    async def listen(self, host: str, port: int) -> int:
        n = self.config.http.workers
        port = await self.front.listen(host, port)
        self.boarding = asyncio.create_task(self._keep_board())
        if n > 1:
            # The workers accept on corral's own listening sockets, inherited: nothing else
            # can bind the port beside them (SO_REUSEPORT would let any process of the same
            # user take a share of corral's clients), and a hung worker takes no new ones.
            assert self.front.server is not None
            fds = tuple(s.fileno() for s in self.front.server.sockets)

            def setup(index: int) -> Setup:
                return Setup(index=index, log_level=logging.getLogger().getEffectiveLevel(),
                             host=host, port=port, fds=list(fds), api_port=self.api_port,
                             api_secret=self.api_secret,
                             http=self.config.http, max_body_mib=self.config.max_body_mib,
                             routes=self.front.routes,
                             journal=self.front.recorder is not None,
                             tracing=self.config.tracing, capture=self.front.capture)
            self.workers = Workers(n, setup, self.scheduler, fds, self.front.keeper,
                                   self.front.recorder)
            await self.workers.start()
        return port

    def grant_notice(self, notice: Withdraw | Revoke) -> None:
        if self.workers is None:
            self.front.grant_notice(notice)
        elif isinstance(notice, Revoke):
            self.workers.revoke(notice, self.front.shares.revoked_idle(notice))
        else:
            self.front.grant_notice(notice)
            self.workers.notice(notice)

    def set_routes(self, routes: Routes) -> None:
        self.front.reroute(routes)
        if self.workers is not None:
            self.workers.routes(routes)

    async def counts(self) -> FrontCounts:
        own = self.front.counts()
        if self.workers is None:
            return own
        return merge([own, *await self.workers.counts()])

    async def running(self, cancel: str = "", key: str | None = None,
                      by: str = "") -> tuple[list[Running], int]:
        """Every front's requests now, ranked (inflight.py), after cancelling those with
        id `cancel` (of key `key`, when given); and how many were."""
        live = self.front.live
        n = live.cancel(cancel, key, by) if cancel else 0
        running = live.running(asyncio.get_running_loop().time())
        if self.workers is not None:
            for answer in await asyncio.gather(*(
                    link.ask_live(cancel, key, by) for link in self.workers.links.values()
                    if link.proc.returncode is None)):
                if answer is not None:
                    running += answer.running
                    n += answer.cancelled
        return ranked(running), n

    async def _keep_board(self) -> None:
        """Each TICK_S while a model sends its loading state: what each model's requests
        wait for (loading.py), from the Scheduler's snapshot, to every front."""
        while True:
            if any(r.loading for r in self.front.routes.models.values()):
                reply = LoopReply(asyncio.get_running_loop())
                try:
                    self.scheduler().tell(GetModels(reply=reply))
                    snap = await asyncio.wait_for(reply.future, BOARD_TIMEOUT_S)
                except (TimeoutError, pykka.ActorDeadError):
                    snap = None
                if isinstance(snap, ModelsSnapshot):
                    self.front.board = board = board_of(snap)
                    for link in self.workers.links.values() if self.workers else ():
                        link.send(BoardNow(board=board))
            await asyncio.sleep(TICK_S)

    async def drain(self, timeout_s: float) -> None:
        if self.boarding is not None:
            self.boarding.cancel()
        if self.workers is None:
            await self.front.drain(timeout_s)
            return
        await asyncio.gather(self.front.drain(timeout_s), self.workers.drain(timeout_s))
