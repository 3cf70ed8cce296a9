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
"""

from __future__ import annotations

from ..bridge import LoopReply, SchedulerInbox, acquire
from ..messages import Grant, Refusal, Release, Withdraw


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
        scheduler.tell(Release(share.ticket, shared=share.joined > 0))

    def withdraw(self, message: Withdraw) -> None:
        """The Scheduler: no new request may join grants of this model's generation."""
        model, generation = message.model, message.generation
        self.withdrawn[model] = max(self.withdrawn.get(model, 0), generation)
        share = self.open.get(model)
        if share is not None and share.grant.generation <= generation:
            del self.open[model]
