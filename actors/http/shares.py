"""Shared grants and leases: requests for a model the front holds a grant of skip the
Scheduler.

A grant from the Scheduler counts one request in flight (R-4.6). While that request runs,
further requests for the same model join its grant instead of each making a round trip
to the Scheduler's thread and back, which is the front's largest cost per small request.
After the last request on it ends, the front keeps the grant for `linger_s` (a *lease*,
`http.lease_linger_ms`): a lone client's next request joins it too, with no hop at all.
Only then is it released, so the model counts as busy the whole time and is never an LRU
or memory victim meanwhile (R-4.4).

The Scheduler stays the only decider, with two notices:

- it *withdraws* a grant (no one may join it any more) when the model stops serving or is
  to restart for a reload; requests already on it go on, new ones ask the Scheduler and
  queue for the next instance, and a lease that no request is on is released at once;
- it *revokes* a grant when a queued request needs the model's slot or memory: a lease
  that no request is on is released at once, one that has requests is released when the
  last ends, with no linger, so the model becomes idle and may be evicted.

The one window left open is the hop that carries the withdrawal: a request that joins
during it meets the fate of those already running on that child (a manual unload or a
crash ends them all). A revocation can overtake the grant it revokes on the loop too: the
grant is then used and not kept.

A request whose child went away with it asks past that child's generation
(`acquire_past`): the exchange then sends it to the model's next instance (issue 19).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pykka

from ..config.keys import KeyRule
from ..messages import Grant, Refusal, Release, Releases, Revoke, Spend, Withdraw
from ..runtime.bridge import LoopReply, SchedulerInbox, acquire, requeue
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
    __slots__ = ("affinity", "count", "grant", "idle_since", "joined", "keep", "linger_s",
                 "ticket", "tokens")

    def __init__(self, ticket: LoopReply, grant: Grant) -> None:
        self.ticket = ticket
        self.grant = grant
        self.count = 1
        """Requests running on this grant."""
        self.joined = 0
        """Requests that joined it without asking the Scheduler."""
        self.keep = True
        """It may be kept idle after its last request (a lease); False once revoked."""
        self.idle_since = 0.0
        """When its last request ended (loop time), while it is kept idle."""
        self.linger_s = 0.0
        """For how long from then."""
        self.tokens = 0
        """Tokens its requests used (told to the Scheduler with its release)."""
        self.affinity = 0
        """The prompt hash of the request it was granted for (Grant.solo)."""


class Shares:
    """The open grants the front may still share, one per model, plus counts for views."""

    def __init__(self, scheduler: Callable[[], SchedulerInbox]) -> None:
        self.scheduler = scheduler
        self.keeping = True
        """Whether grants are kept after their last request at all (not while draining)."""
        self.open: dict[str, SharedGrant] = {}
        self.withdrawn: dict[str, tuple[int, int]] = {}
        """Model, or a copy's own name (Grant.instance) -> the newest generation
        withdrawn. A grant can reach its request after its withdrawal did (both come
        through the loop, and a resumed request runs after the callbacks of its turn):
        such a grant is used, never opened to others."""
        self.revoked: dict[str, tuple[int, int]] = {}
        """Model -> (Revokes seen, the newest generation revoked). A Revoke can reach the
        loop before the request whose grant it revokes has resumed (the grant's answer
        only wakes it): such a grant is used, never kept."""
        self.joined_total = 0
        """Requests that joined a grant, ever (each also counts as granted)."""
        self.extra: dict[str, int] = {}
        """Model -> requests running beyond the one each grant counts, less the grants
        kept idle (for GET /models: the Scheduler counts each grant as one request)."""
        self._sweep: asyncio.TimerHandle | None = None
        self._bound: asyncio.AbstractEventLoop | None = None

    def _loop(self) -> asyncio.AbstractEventLoop:
        """The front's loop, held once known (looking it up costs a system call)."""
        if self._bound is None:
            self._bound = asyncio.get_running_loop()
        return self._bound

    def join(self, model: str, key: KeyRule | None = None, affinity: int = 0,
             among: tuple[str, ...] = ()) -> SharedGrant | None:
        """The model's open grant, joined, where `acquire` may join it; else None."""
        share = self.open.get(model) if (key is None or key.shares) and not among else None
        if share is None:
            return None
        if share.grant.solo and (share.count or share.affinity != affinity):
            return None  # a copy's grant: the Scheduler routes all but the lone request
        share.count += 1
        share.joined += 1
        self.joined_total += 1
        self._shift(model, 1)
        return share

    async def acquire(self, model: str, autoload: bool, key: KeyRule | None = None,
                      retry: bool = False, cuttable: bool = True,
                      affinity: int = 0, among: tuple[str, ...] = (), spill: bool = False,
                      ) -> SharedGrant | Refusal:
        """Join the model's open grant, or ask the Scheduler for one. A request whose
        `key` has limits always asks: the Scheduler counts each of them (once: `retry`
        says it asked before); one cut before is not `cuttable` again; `affinity`: its
        prompt's hash, for a model with copies (a copy's grant is joined only idle);
        `among`: a virtual model's members, one of which the Scheduler picks (always
        asked: which is warmest is its to say)."""
        share = self.join(model, key, affinity, among)
        if share is not None:
            return share
        revokes = {name: self.revoked.get(name, (0, 0))[0] for name in among or (model,)}
        ticket, answer = await acquire(self.scheduler(), model, autoload,
                                       key.name if key is not None else "", retry, cuttable,
                                       affinity, among, spill)
        if isinstance(answer, Refusal):
            return answer
        model = answer.model  # (a virtual model's: the member that serves it)
        share = SharedGrant(ticket, answer)
        share.affinity = affinity
        seen, newest = self.revoked.get(model, (0, 0))
        if seen != revokes.get(model, -1) and answer.generation <= newest:
            share.keep = False
        copy = answer.instance or model  # (each copy's generations are its own)
        if answer.shareable and answer.serving > self.withdrawn.get(copy, (0, 0)):
            self.open.setdefault(model, share)  # another may have opened one meanwhile
        return share

    async def requeue(self, share: SharedGrant) -> SharedGrant | Refusal:
        """The grant of a request cut for a higher class (policy/cuts.py; never a shared
        one): its slot goes back and the request waits again, for its next grant."""
        answer = await requeue(self.scheduler(), share.ticket)
        return answer if isinstance(answer, Refusal) else SharedGrant(share.ticket, answer)

    async def acquire_past(self, share: SharedGrant | Refusal | None, gone: int, autoload: bool,
                           probe: Pool | None, key: KeyRule | None = None,
                           affinity: int = 0) -> SharedGrant | Refusal | None:
        """A grant that is not for generation `gone`, whose child went away with a request:
        until the Scheduler has seen that child's exit (a few ms behind the connection's
        end), it may still grant it. None if that child still takes connections after
        ALIVE_AFTER_S (asked through `probe`, the pool of the child that had the request),
        or is still granted after RETRY_POLLS."""
        probe_at = round(ALIVE_AFTER_S / RETRY_POLL_S) if probe is not None else -1
        for poll in range(RETRY_POLLS):
            if not isinstance(share, SharedGrant) or share.grant.generation != gone:
                return share
            self.release(share, keep=False)
            if poll == probe_at and probe is not None and await probe.alive(PROBE_TIMEOUT_S):
                return None
            await asyncio.sleep(RETRY_POLL_S)
            share = await self.acquire(share.grant.model, autoload, key, retry=True,
                                       affinity=affinity)
        if isinstance(share, SharedGrant) and share.grant.generation == gone:
            self.release(share, keep=False)
            return None
        return share

    def release(self, share: SharedGrant, linger_s: float = 0.0, keep: bool = True,
                tokens: int = 0) -> None:
        """A request on `share` ended, having used `tokens`; if it was the last, the grant
        is kept `linger_s` (a lease). `keep=False`: its child broke with it, so no one
        joins the grant any more and it is not kept idle."""
        share.count -= 1
        share.tokens += tokens
        model = share.grant.model
        self._shift(model, -1)
        if not keep:
            share.keep = False
            if self.open.get(model) is share:
                del self.open[model]
        if share.count:
            return
        if share.keep and linger_s > 0 and self.keeping and self.open.get(model) is share:
            share.idle_since = self._loop().time()
            share.linger_s = linger_s
            self._sweep_by(share.idle_since + linger_s)
            return
        self._give_back(share)

    def spend(self, ticket: LoopReply, tokens: int) -> None:
        """The stream holding `ticket` (a grant of its own) has used `tokens` more so far,
        for its key's tokens_per_min; its release carries the rest."""
        self._tell(Spend(ticket=ticket, tokens=tokens))

    def _give_back(self, share: SharedGrant, idle_s: float = 0.0) -> None:
        """Release the grant to the Scheduler: no request is on it any more."""
        self._tell(self._let_go(share, idle_s))

    def _let_go(self, share: SharedGrant, idle_s: float) -> Release:
        model = share.grant.model
        if self.open.get(model) is share:
            del self.open[model]
        self._shift(model, 1)  # the Scheduler's count of it drops by one
        return Release(ticket=share.ticket, shared=share.joined > 0, idle_s=idle_s,
                       tokens=share.tokens)

    def _tell(self, message: Release | Releases | Spend) -> None:
        try:
            self.scheduler().tell(message)
        except pykka.ActorDeadError:
            pass  # corral is stopping: there is nothing left to release to

    def sweep(self) -> None:
        """Release the grants kept idle for their `linger_s`; look again when the next is
        due."""
        self._sweep = None
        now = self._loop().time()
        next_due: float | None = None
        for share in [s for s in self.open.values() if not s.count]:
            idle_s = now - share.idle_since
            if idle_s >= share.linger_s:
                self._give_back(share, idle_s)
            else:
                due = share.linger_s - idle_s
                next_due = due if next_due is None else min(next_due, due)
        if next_due is not None:
            self._sweep_by(now + next_due)

    def _sweep_by(self, at: float) -> None:
        """Have a sweep run at loop time `at` at the latest."""
        if self._sweep is not None:
            if self._sweep.when() <= at:
                return
            self._sweep.cancel()
        self._sweep = self._loop().call_at(at, self.sweep)

    def withdraw(self, message: Withdraw) -> None:
        """The Scheduler: no new request may join grants of this copy's generation."""
        model, serving = message.model, message.serving
        copy = message.instance or model
        self.withdrawn[copy] = max(self.withdrawn.get(copy, (0, 0)), serving)
        share = self.open.get(model)
        if (share is not None and (share.grant.instance or model) == copy
                and share.grant.serving <= serving):
            del self.open[model]
            share.keep = False
            if not share.count:
                self._give_back(share)

    def revoke(self, message: Revoke) -> None:
        """The Scheduler: keep no grant of these models' generations idle; those kept idle
        now go back together (the Scheduler then picks among all of them)."""
        idle = self.revoked_idle(message)
        if idle:
            self._tell(Releases(releases=idle))

    def revoked_idle(self, message: Revoke) -> tuple[Release, ...]:
        """`revoke`, with the releases of the grants kept idle returned, not told: a front
        among several gives them to corral, which tells the Scheduler every front's in one
        Releases (workers.Revoking)."""
        now = self._loop().time()
        idle = []
        for model, generation in message.grants:
            seen, newest = self.revoked.get(model, (0, 0))
            self.revoked[model] = (seen + 1, max(newest, generation))
            share = self.open.get(model)
            if share is None or share.grant.generation > generation:
                continue
            share.keep = False
            if not share.count:
                idle.append(self._let_go(share, now - share.idle_since))
        return tuple(idle)

    def kept_idle_s(self, model: str) -> float | None:
        """How long the front has kept `model`'s grant with no request on it (None: it
        keeps none idle)."""
        share = self.open.get(model)
        if share is None or share.count:
            return None
        return self._loop().time() - share.idle_since

    def stop_keeping(self) -> None:
        """corral is draining: release every grant kept idle, and keep none from now on."""
        self.keeping = False
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for share in [s for s in self.open.values() if not s.count]:
            self._give_back(share)

    def _shift(self, model: str, by: int) -> None:
        left = self.extra.get(model, 0) + by
        if left:
            self.extra[model] = left
        else:
            self.extra.pop(model, None)
