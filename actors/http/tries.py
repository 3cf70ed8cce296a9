"""Which instance a request for a model goes to, and how often it may go again.

A request is sent again only where that cannot run it twice on one child (issue 19): on a
fresh connection to the same child when a reused one broke before a byte of the answer
came back (`Broke.UNSENT`, exchange.py), and to the model's next instance when its child
went away before the client got a byte of the final answer (`Broke.GONE`, at most
`MAX_REPLAYS` times, once per instance). A child that answered badly, or that is still
there after its connection broke, gets a 502 instead.

A request cut for a higher class before its answer began (`priority_preempt`,
policy/cuts.py) gives its slot back and waits again, on the same ticket: the Scheduler
cuts a request at most once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import msgspec

from ..messages import AnswerLate, Refusal
from ..runtime.bridge import LoopReply
from .affinity import affinity
from .edge import NOT_FORWARDED, Answer, refusal_answer
from .pool import Pool
from .request import Request
from .services import Services
from .shares import SharedGrant
from .upstream import Broke
from .usage import Meter

log = logging.getLogger("corral.front")

MAX_REPLAYS = 2
"""How many next instances a request whose child went away with it may be sent to."""
MAX_INSTANCES = 6
"""How many instances a request may try in all: those that could not be reached (they
never had it) do not count as replays, but a limit there must be."""


class Attempt(Protocol):
    """What a request's tries use of its exchange (exchange.py)."""

    services: Services
    req: Request
    what: str
    meter: Meter | None
    broke: str | None
    broke_kind: Broke | None
    late: str | None
    cut: bool
    ticket: LoopReply | None
    may_retry: bool
    may_replay: bool

    @property
    def finished(self) -> bool: ...

    def answer(self, answer: Answer) -> None: ...

    async def forward(self, pool: Pool, drop: frozenset[bytes],
                      first_byte_timeout_s: float | None, extra: tuple[bytes, ...] = ()
                      ) -> None: ...

    def cut_off(self) -> None: ...

    def wait_again(self) -> None: ...


async def to_virtual(ex: Attempt, name: str, autoload: bool) -> None:
    """Serve `ex` with a member of virtual model `name` (issue 25) its key may use: the
    warmest (`pick = "warm"`: the Scheduler knows which serves) or the first; with
    `fallback`, a member that refuses it (503: it cannot load, its queue is full, it
    backs off) hands it to the next."""
    routes = ex.services.routes
    virtual, key = routes.virtual[name], ex.req.key
    left = [m for m in virtual.models if m in routes.models and (
        key is None or key.may_use((name,)) or key.may_use(routes.known_as.get(m, (m,))))]
    refused: list[Refusal] = []

    def fall_back(refusal: Refusal) -> bool:
        if virtual.fallback and refusal.status == 503 and len(left) > 1:
            refused.append(refusal)
            return True
        return False

    tried = 0
    while left:
        refused.clear()
        among = tuple(left) if virtual.pick == "warm" and len(left) > 1 else ()
        await to_model(ex, name if among else left[0], autoload, among, fall_back,
                       again=bool(tried))  # a fallback: its key counted it once
        tried += 1
        if not refused:
            return
        gone = refused[0].model if refused[0].model in left else left[0]
        log.info("virtual model '%s': %s refused the request (%s); trying the next", name,
                 gone, refused[0].message)
        left.remove(gone)
    ex.answer(Answer(503, f"virtual model '{name}' has no model left to serve it"))


async def to_model(ex: Attempt, model: str, autoload: bool, among: tuple[str, ...] = (),
                   fall_back: Callable[[Refusal], bool] | None = None,
                   again: bool = False) -> None:
    """Serve `ex` with an instance of `model` (or of one of `among`, the Scheduler's
    pick), trying the next where it may; a refusal `fall_back` takes is not answered."""
    front = ex.services
    routes = front.routes
    gone: tuple[int, Pool] | None = None  # the child that went away before answering
    replays = 0  # instances that went away with the request sent to them
    cut: SharedGrant | None = None  # the grant it was cut from, to wait again with
    was_cut = False  # a request is cut at most once
    route = routes.models.get(model)
    near = affinity(ex.req.body, route.prefix_bytes) if route and route.prefix_bytes else 0
    for tries in range(MAX_INSTANCES):
        found: SharedGrant | Refusal | None = (
            await front.shares.requeue(cut) if cut is not None else
            front.shares.join(model, ex.req.key, near, among)  # no coroutine: the usual
            or await front.shares.acquire(model, autoload, ex.req.key,
                                          retry=tries > 0 or again,
                                          cuttable=not was_cut and ex.req.upload is None,
                                          affinity=near, among=among))
        cut = None
        if gone is not None:
            generation, pool = gone
            found = await front.shares.acquire_past(
                found, generation, autoload,
                pool if ex.broke_kind is Broke.GONE else None, ex.req.key, near)
        if found is None:
            ex.answer(Answer(502, f"{ex.what} is unreachable: {ex.broke} (its child is "
                             "still running and may have the request, so it is not sent "
                             "again)"))
            return
        if isinstance(found, Refusal):
            if fall_back is None or not fall_back(found):
                answer = refusal_answer(found)
                said = routes.said_to(ex.req.key, answer.message)
                ex.answer(answer if said is answer.message else
                          msgspec.structs.replace(answer, message=said))
            return
        share, grant = found, found.grant
        model, among = grant.model, ()  # (a virtual model's member: tried again if need be)
        if not grant.shareable:  # a grant of its own: the Scheduler may cut it
            if share.ticket.cut:  # before it was sent: nothing is lost
                cut, was_cut = share, True
                continue
            ex.ticket, share.ticket.on_cut = share.ticket, ex.cut_off
        sent = False
        try:
            route = routes.models.get(grant.model)
            pool = front.pools.get((grant.host, grant.port, f"{grant.model}#{grant.generation}"),
                                   route.pool_cap if route else None)
            late = route.first_byte_timeout_s if route else None
            ex.may_retry = tries < MAX_INSTANCES - 1
            ex.may_replay = (ex.may_retry and replays < MAX_REPLAYS
                             and ex.req.upload is None)  # an upload is sent once
            own = grant.upstream_key  # a node child's own (R8); the client's is dropped
            await ex.forward(pool, NOT_FORWARDED, late,
                             (b"Authorization: Bearer " + own.encode(),) if own else ())
            sent = True
        finally:  # a child that broke with a request is not kept for the next
            share.ticket.on_cut = ex.ticket = None
            if not sent:  # its client left, or a bug: no Requeue follows a cut
                ex.cut = False
            if not ex.cut:
                front.shares.release(share, route.lease_linger_s if route else 0.0,
                                     keep=ex.broke_kind is None,
                                     tokens=ex.meter.rest() if ex.meter else 0)
        if ex.cut:
            log.info("%s: a request was cut for a higher class before its answer began; it "
                     "waits again (priority_preempt)", ex.what)
            ex.cut, cut, was_cut = False, share, True
            ex.wait_again()
            continue
        if ex.late is not None:
            front.scheduler().tell(AnswerLate(model=grant.instance or grant.model,
                                              generation=grant.generation, detail=ex.late))
        if ex.finished:
            return
        # Nothing of the final answer was sent: the next instance gets the request,
        # unless its child is still there (Shares.acquire_past) or was stopped on
        # purpose (unloaded, unhealthy, corral stopping): an operator's stop is not
        # undone by a request that comes back for the model.
        if grant.serving <= front.stopped.get(grant.instance or model, (0, 0)):
            ex.answer(Answer(503, f"{ex.what} was stopped while it had this request "
                             f"({ex.broke}); not sent again", headers=(("Retry-After", "1"),)))
            return
        replays += ex.broke_kind is Broke.GONE
        log.warning("%s#%d went away before answering (%s); the request goes to its next "
                    "instance, unless that child is still there", ex.what, grant.generation,
                    ex.broke)
        gone = (grant.generation, pool)
        ex.wait_again()  # not when it failed as it connected
