"""Shared grants: requests for a model that is already busy skip the Scheduler.

A grant from the Scheduler counts one request in flight (R-4.6). While that request runs,
further requests for the same model join its grant instead of each making a round trip
to the Scheduler's thread and back, which is the front's largest cost per small request.
The grant is released once the last request on it ends, so the model counts as busy the
whole time and is never an LRU or memory victim meanwhile (R-4.4).

The Scheduler withdraws a grant (tells the front that no one may join it any more) when
the model stops serving or is to restart for a reload; requests already on it go on, new
ones ask the Scheduler and queue for the next instance. The one window left open is the
hop that carries the withdrawal: a request that joins during it meets the fate of those
already running on that child (a manual unload or a crash ends them all).

A request whose child went away with it asks past that child's generation
(`acquire_past`): the exchange then sends it to the model's next instance (issue 19).
"""

from __future__ import annotations

import asyncio

from ..bridge import LoopReply, SchedulerInbox, acquire
from ..messages import Grant, Refusal, Release, Withdraw
from .pool import Pool

RETRY_POLLS = 200
RETRY_POLL_S = 0.01
"""A request whose child went away waits up to 2 s for the Scheduler to see the exit (it
does within a few ms of the child's end: the exit watcher's wait returns at once)."""
ALIVE_AFTER_S = 0.25
PROBE_TIMEOUT_S = 1.0
"""A child whose exit the Scheduler has not seen ALIVE_AFTER_S after it dropped a request
it had is asked whether it is still there: a connect, which may take PROBE_TIMEOUT_S."""


class SharedGrant:
    __slots__ = ("count", "grant", "joined", "ticket")

    def __init__(self, ticket: LoopReply, grant: Grant) -> None:
        self.ticket = ticket
        self.grant = grant
        self.count = 1
        """Requests running on this grant."""
        self.joined = 0
        """Requests that joined it without asking the Scheduler."""


class Shares:
    """The open grants the front may still share, one per model, plus counts for views."""

    def __init__(self) -> None:
        self.open: dict[str, SharedGrant] = {}
        self.withdrawn: dict[str, int] = {}
        """Model -> the newest generation withdrawn. A grant can reach its request after
        its withdrawal did (both come through the loop, and a resumed request runs after
        the callbacks of its turn): such a grant is used, never opened to others."""
        self.joined_total = 0
        """Requests that joined a grant, ever (each also counts as granted)."""
        self.extra: dict[str, int] = {}
        """Model -> requests running beyond the one each grant counts (for GET /models)."""

    async def acquire(self, scheduler: SchedulerInbox, model: str,
                      autoload: bool) -> SharedGrant | Refusal:
        """Join the model's open grant, or ask the Scheduler for one."""
        share = self.open.get(model)
        if share is not None:
            share.count += 1
            share.joined += 1
            self.joined_total += 1
            self.extra[model] = self.extra.get(model, 0) + 1
            return share
        ticket, answer = await acquire(scheduler, model, autoload)
        if isinstance(answer, Refusal):
            return answer
        share = SharedGrant(ticket, answer)
        if answer.shareable and answer.generation > self.withdrawn.get(model, 0):
            self.open.setdefault(model, share)  # another may have opened one meanwhile
        return share

    async def acquire_past(self, scheduler: SchedulerInbox, share: SharedGrant | Refusal | None,
                           gone: int, autoload: bool,
                           probe: Pool | None) -> SharedGrant | Refusal | None:
        """A grant that is not for generation `gone`, whose child went away with a request:
        until the Scheduler has seen that child's exit (a few ms behind the connection's
        end), it may still grant it. None if that child still takes connections after
        ALIVE_AFTER_S (asked through `probe`, the pool of the child that had the request),
        or is still granted after RETRY_POLLS."""
        probe_at = round(ALIVE_AFTER_S / RETRY_POLL_S) if probe is not None else -1
        for poll in range(RETRY_POLLS):
            if not isinstance(share, SharedGrant) or share.grant.generation != gone:
                return share
            self.release(scheduler, share)
            if poll == probe_at and probe is not None and await probe.alive(PROBE_TIMEOUT_S):
                return None
            await asyncio.sleep(RETRY_POLL_S)
            share = await self.acquire(scheduler, share.grant.model, autoload)
        if isinstance(share, SharedGrant) and share.grant.generation == gone:
            self.release(scheduler, share)
            return None
        return share

    def release(self, scheduler: SchedulerInbox, share: SharedGrant) -> None:
        share.count -= 1
        model = share.grant.model
        if share.count:
            self.extra[model] -= 1
            if not self.extra[model]:
                del self.extra[model]
            return
        if self.open.get(model) is share:
            del self.open[model]
        scheduler.tell(Release(ticket=share.ticket, shared=share.joined > 0))

    def withdraw(self, message: Withdraw) -> None:
        """The Scheduler: no new request may join grants of this model's generation."""
        model, generation = message.model, message.generation
        self.withdrawn[model] = max(self.withdrawn.get(model, 0), generation)
        share = self.open.get(model)
        if share is not None and share.grant.generation <= generation:
            del self.open[model]
