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

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

import msgspec

from ..messages import AnswerLate, Grant, Refusal
from ..runtime.bridge import LoopReply
from .affinity import placement
from .edge import NOT_FORWARDED, NOT_KEPT, Answer, refusal_answer, rewritten
from .inflight import Cancellable
from .journaling import Trace
from .loading import Loading, Shown, wants
from .loras import applied
from .pool import Pool, Pools
from .remote import Far, path_problem
from .request import Request
from .resumable import Tee
from .routes import ModelRoute, Routes
from .services import Services
from .shares import SharedGrant, Shares
from .spans import Ended
from .upstream import Broke
from .usage import Meter

log = logging.getLogger("corral.front")

MAX_REPLAYS = 2
"""How many next instances a request whose child went away with it may be sent to."""
MAX_INSTANCES = 6
"""How many instances a request may try in all: those that could not be reached (they
never had it) do not count as replays, but a limit there must be."""


class Attempt(Cancellable, Shown, Protocol):
    """What a request's tries use of its exchange (exchange.py); what inflight.py does."""

    services: Services
    req: Request
    what: str
    meter: Meter | None
    broke: str | None
    broke_kind: Broke | None
    broke_at: float
    late: str | None
    cut: bool
    ticket: LoopReply | None
    may_retry: bool
    may_replay: bool
    kept: Tee | None
    trace: Trace
    loading: Loading | None
    status: int
    first_at: float | None
    sse: bool
    loop: asyncio.AbstractEventLoop

    def stop(self, why: str) -> None: ...

    @property
    def finished(self) -> bool: ...

    def answer(self, answer: Answer) -> None: ...

    async def forward(self, pool: Pool, drop: frozenset[bytes],
                      first_byte_timeout_s: float | None, extra: tuple[bytes, ...] = ()
                      ) -> None: ...

    def cut_off(self) -> None: ...

    def wait_again(self) -> None: ...


async def to_any(ex: Attempt, model: str, autoload: bool, asked: str = "") -> None:
    """Serve `ex` with `model`, virtual or not (`asked`: a variant of it, params.py); then
    count how long it took, how fast its model answered and what it and its key used
    (/metrics, the journal). Its answer is kept when it asks (X-Conversation-Id)."""
    front, key, trace = ex.services, ex.req.key, ex.trace
    named = asked if asked in front.routes.variants or (  # (a peer's unknown name: itself)
        model == front.routes.catch_all and asked) else model
    if (rw := front.routes.rewrites.get(named)) is not None and (body := rewritten(
            ex.req.method, ex.req.url, ex.req.body, rw)) is not None:
        if isinstance(body, Answer):
            ex.answer(body)
            return
        ex.req.body = body
    ex.what = f"model '{named}'"
    ex.meter = Meter(ex.req, key.charge_every) if key is not None else None
    if ex.meter is None:
        ex.work.tail = bytearray()  # (where its tokens are read at its end)
    trace.model = named
    front.live.exchanges.add(ex)
    if front.tracer is not None:
        ex.work.spans = front.tracer.begin(ex.req)
    if front.capture:
        trace.captures(ex.req, ex.work, front.capture)
    if (route := front.routes.models.get(model)) is not None and route.loading \
            and not ex.req.http10 and wants(ex.req.method, ex.req.url, ex.req.body):
        ex.loading = Loading(ex, model, route.loading)  # (told as it waits: loading.py)
        ex.loading.arm(ex.loop)
    if ex.req.conversation is not None and ex.req.method == b"POST":
        kept = front.keeper.keep(ex.req.conversation, key.name if key else "", model, ex)
        if isinstance(kept, str):
            ex.answer(Answer(409, kept))
            return
        ex.kept = kept
    started = ex.loop.time()
    try:
        if model in front.routes.virtual:
            await to_virtual(ex, model, autoload)
        else:
            await to_model(ex, model, autoload)
    finally:  # an answer begun or given
        if ex.loading is not None:
            ex.loading.stop()
        if ex.status:
            end = ex.loop.time()
            front.times.observe(model, ex.status, (ex.first_at or end) - started,
                                end - started)
            said = trace.read(ex.meter, ex.work, ex.sse)
            if ex.status < 400:
                front.speeds.observe(trace.served or model, said, ex.meter.events if ex.meter
                                     else ex.work.events, ex.sse, ex.work.started,
                                     ex.work.first_body, end)
        if ex.meter is not None and ex.meter.answered and key is not None:
            front.key_uses.add(key.name, *ex.meter.used(), ex.meter.cached or 0)
        if ex.work.spans is not None and front.tracer is not None:
            front.tracer.end(Ended(ex.work.spans, trace, ex.work, ex.req, ex.status, ex.sse,
                                   ex.loop.time()))


async def to_virtual(ex: Attempt, name: str, autoload: bool) -> None:
    """Serve `ex` with a member of virtual model `name` (issue 25) its key may use: the
    warmest (`pick = "warm"`: the Scheduler knows which serves) or the first; with
    `fallback`, a member that refuses it (503: it cannot load, its queue is full, it
    backs off) hands it to the next. With `fallback` and a remote member after a local
    one, the local ones *spill*: what would wait for them (a load, a busy child) goes to
    the remote at once, their load begun (config/remote.py); and come back, to wait, if
    the remote refuses it (or its breaker is open: then they do not spill)."""
    routes, breakers = ex.services.routes, ex.services.breakers
    virtual, key, asked = routes.virtual[name], ex.req.key, ex.req.body
    left = [m for m in virtual.models if m in routes.models and (
        key is None or key.may_use((name,)) or key.may_use(routes.known_as.get(m, (m,))))]
    refused: list[Refusal] = []
    spilled: list[str] = []  # (locals that would have kept it waiting, while a remote tries)

    def fall_back(refusal: Refusal) -> bool:
        if virtual.fallback and refusal.status == 503 and (len(left) > 1 or spilled):
            refused.append(refusal)
            return True
        return False

    counted, may_spill = False, virtual.fallback
    while left:
        refused.clear()
        spill = may_spill and left[0] not in routes.remote and any(
            m in routes.remote and not breakers.is_open(m, ex.loop.time()) for m in left)
        members = [m for m in left if m not in routes.remote] if spill else left
        among = tuple(members) if virtual.pick == "warm" and len(members) > 1 else ()
        await to_model(ex, name if among else members[0], autoload, among, fall_back,
                       again=counted, asked=asked, spill=spill)  # (its key counts it once)
        if not refused:
            return
        refusal = refused[0]
        counted = counted or not refusal.spill  # (one that would wait was not counted)
        gone = [m for m in left if m not in routes.remote] if refusal.spill else [
            refusal.model if refusal.model in left else left[0]]
        log.info("virtual model '%s': %s %s (%s); trying the next", name, " and ".join(gone),
                 "spilled the request" if refusal.spill else "refused the request",
                 refusal.message)
        left = [m for m in left if m not in gone]
        if refusal.spill:
            spilled = gone
        elif spilled and gone[0] in routes.remote:  # back to wait for the local ones
            left, spilled, may_spill = spilled + left, [], False
    ex.answer(Answer(503, f"virtual model '{name}' has no model left to serve it"))


async def to_model(ex: Attempt, model: str, autoload: bool, among: tuple[str, ...] = (),
                   fall_back: Callable[[Refusal], bool] | None = None,
                   again: bool = False, asked: bytes | None = None, spill: bool = False
                   ) -> None:
    """Serve `ex` with an instance of `model` (or of one of `among`, the Scheduler's
    pick), trying the next where it may; a refusal `fall_back` takes is not answered;
    `spill`: one that would wait is refused (for a remote member to take)."""
    routes, shares = (services := ex.services).routes, services.shares
    gone: tuple[int, Pool] | None = None  # the child that went away before answering
    cut: SharedGrant | None = None  # the grant it was cut from, to wait again with
    replays, was_cut = 0, False  # instances gone with the request; it is cut at most once
    adapter = routes.adapters.get(ex.trace.model)  # (its copy: one that has it: loras.py)
    near = placement(b"lora:" + ex.trace.model.encode() if adapter and adapter.loaded
                     else ex.req.session,
                     ex.req.body, *((route.prefix_bytes, route.prefix_first)
                                    if (route := routes.models.get(model)) else ()))
    for tries in range(MAX_INSTANCES):
        # 1. A grant: the one it was cut from again, an open one joined, or the Scheduler's.
        ex.work.asked_at = ex.loop.time()
        joined = None if cut is not None else shares.join(model, ex.req.key, near, among)
        found: SharedGrant | Refusal | None = (  # joined: no coroutine, the usual
            await shares.requeue(cut) if cut is not None else joined or await shares.acquire(
                model, autoload, ex.req.key, retry=tries > 0 or again, affinity=near,
                cuttable=not was_cut and ex.req.upload is None, among=among,
                spill=spill and tries == 0))
        cut = None
        if gone is not None:  # one past the child that went away with it
            generation, pool = gone
            found = await shares.acquire_past(
                found, generation, autoload,
                pool if ex.broke_kind is Broke.GONE else None, ex.req.key, near)
        # 2. None, or a refusal: answered here (unless `fall_back` takes the refusal).
        if found is None or isinstance(found, Refusal):
            _refuse(ex, routes, found, fall_back)
            return
        grant = ex.trace.granted(found.grant, ex.work, ex.loop.time(), found is joined)
        model, among = grant.model, ()  # (a virtual model's member: tried again if need be)
        _as_member(ex, routes, model, asked)  # (a virtual model's member: its filters)
        # 3. A grant of its own the Scheduler may cut; cut before it was sent, it waits again.
        if not grant.shareable:
            if found.ticket.cut:
                cut, was_cut = found, True
                continue
            ex.ticket, found.ticket.on_cut = found.ticket, ex.cut_off
        # 4. Sent to its child (or its remote, unless its breaker is open: remote.py);
        #    then its slot is given back, unless it was cut.
        sent_on = await _send(ex, found, tries, replays, fall_back)
        if sent_on is None:
            return
        # 5. Cut before its answer began: it waits again, with the grant it was cut from.
        if ex.cut:
            cut, was_cut = found, True
            _wait_again_cut(ex)
            continue
        # 6. Answered, or its child was stopped on purpose: done. Else its next instance.
        if _ends_here(ex, services, grant, model):
            return
        replays += ex.broke_kind is Broke.GONE  # (the journal counts every next instance)
        ex.trace.replays += 1
        gone = (grant.generation, sent_on)


async def _send(ex: Attempt, share: SharedGrant, tries: int, replays: int,
                fall_back: Callable[[Refusal], bool] | None) -> Pool | None:
    """Step 4 of `to_model`: `ex` sent on `share`'s grant, and the grant let go; None:
    its remote's breaker is open (the 503 answered, or taken by `fall_back`)."""
    services, grant = ex.services, share.grant
    routes, shares, model = services.routes, services.shares, grant.model
    sent, route, far = False, routes.models.get(model), routes.remote.get(model)
    named = ex.trace.model if far is not None and far.sends_asked else model  # (its breaker)
    if far is not None and (refused := _far_refusal(ex, model, named)) is not None:
        _let_go(ex, shares, share, route, sent)
        if isinstance(refused, Answer):
            ex.answer(refused)
        else:
            _refuse(ex, routes, refused, fall_back)
        return None
    try:
        pool = _pool_for(ex, services.pools, grant, route, tries, replays, far,
                         fall_back is not None)
        own = grant.upstream_key  # a node child's own (R8); the client's is dropped
        adapter = routes.adapters.get(ex.trace.model)  # (or its base's own: none applies)
        if (adapter is not None or model in routes.lora_bases) and (
                refused := await applied(services.loras, ex.req, pool, ex.trace.model,
                                         adapter, own, route.first_byte_timeout_s
                                         if route else None)) is not None:
            ex.answer(refused)
            return None
        drop = NOT_KEPT if ex.kept is not None else NOT_FORWARDED
        await ex.forward(pool, drop | far.drop if far else drop,
                         route.first_byte_timeout_s if route else None,
                         far.lines if far else (b"Authorization: Bearer " + own.encode(),)
                         if own else ())
        sent = True
    finally:
        _let_go(ex, shares, share, route, sent)
        if far is not None:
            services.breakers.ended(named, ex.status, ex.broke, ex.broke_kind is Broke.REFUSED,
                                    ex.loop.time())
    if far is not None and not ex.finished and ex.broke_kind is Broke.REFUSED:
        refusal = Refusal(status=503, message=f"{ex.what} is unreachable: {ex.broke}",
                          model=model)  # (not sent: a fallback may take it)
        if fall_back is None or not fall_back(refusal):
            ex.answer(Answer(502, refusal.message))
        return None
    return pool


def _far_refusal(ex: Attempt, model: str, named: str) -> Refusal | Answer | None:
    """Why a request is not sent to remote `model` (its breaker's name `named`): a path
    that would leave its base path (400), or its breaker open (503); None: it goes."""
    if (wrong := path_problem(ex.req.url, model)) is not None:
        return Answer(400, wrong)
    breakers, now = ex.services.breakers, ex.loop.time()
    why = breakers.refuses(named, now)
    return None if why is None else Refusal(
        status=503, message=why, model=model, retry_after_s=breakers.retry_after(named, now))


def _as_member(ex: Attempt, routes: Routes, member: str, asked: bytes | None) -> None:
    """A virtual model's request's body (`asked`: as it came; None: not a virtual model's)
    as `member` takes it: its filters (params.py) on the body as it came (a fallback's
    next member does not see the last one's)."""
    if asked is None:
        return
    rw = routes.rewrites.get(member)
    body = rewritten(ex.req.method, ex.req.url, asked, rw) if rw is not None else asked
    ex.req.body = body if isinstance(body, bytes) else asked


def _refuse(ex: Attempt, routes: Routes, found: Refusal | None,
            fall_back: Callable[[Refusal], bool] | None) -> None:
    """Answer a request no instance took: a 502, or the refusal `fall_back` does not take."""
    if found is None:
        ex.answer(Answer(502, f"{ex.what} is unreachable: {ex.broke} (its child is "
                         "still running and may have the request, so it is not sent "
                         "again)"))
    elif fall_back is None or not fall_back(found):
        answer = refusal_answer(found)
        said = routes.said_to(ex.req.key, answer.message)
        ex.answer(answer if said is answer.message else
                  msgspec.structs.replace(answer, message=said))


def _pool_for(ex: Attempt, pools: Pools, grant: Grant, route: ModelRoute | None, tries: int,
              replays: int, far: Far | None, next_: bool = False) -> Pool:
    """The pool of `grant`'s child (or remote), `ex` told whether it may go again if that
    breaks (a remote's request never goes again once sent: it may have it; one that
    could not be sent goes to a virtual model's next member, `next_`)."""
    if far is not None:
        ex.may_retry, ex.may_replay = next_, False
        return pools.get((far.end.host, far.end.port, far.tag), None, far)
    pool = pools.get((grant.host, grant.port, f"{grant.model}#{grant.generation}"),
                     route.pool_cap if route else None)
    ex.may_retry = tries < MAX_INSTANCES - 1
    ex.may_replay = (ex.may_retry and replays < MAX_REPLAYS
                     and ex.req.upload is None)  # an upload is sent once
    return pool


def _let_go(ex: Attempt, shares: Shares, share: SharedGrant, route: ModelRoute | None,
            sent: bool) -> None:
    """After a try: the cut unhooked, and the slot released unless it was cut (kept)."""
    share.ticket.on_cut = ex.ticket = None
    if not sent:  # its client left, or a bug: no Requeue follows a cut
        ex.cut = False
    if not ex.cut:  # a child that broke with a request is not kept for the next
        shares.release(share, route.lease_linger_s if route else 0.0,
                       keep=ex.broke_kind is None,
                       tokens=ex.meter.rest() if ex.meter and ex.req.key else 0)


def _wait_again_cut(ex: Attempt) -> None:
    """`ex` was cut before its answer began: it waits for its slot again."""
    log.info("%s: a request was cut for a higher class before its answer began; it "
             "waits again (priority_preempt)", ex.what)
    ex.cut, ex.trace.cut = False, True
    ex.wait_again()


def _ends_here(ex: Attempt, services: Services, grant: Grant, model: str) -> bool:
    """Whether `ex` ends with `grant`'s child (answered, or a 503); else it waits for the next."""
    if ex.late is not None:
        services.scheduler().tell(AnswerLate(model=grant.instance or grant.model,
                                             generation=grant.generation, detail=ex.late))
    if ex.finished:
        return True
    # Nothing of the final answer was sent: the next instance gets the request,
    # unless its child is still there (Shares.acquire_past) or was stopped on
    # purpose (unloaded, unhealthy, corral stopping): an operator's stop is not
    # undone by a request that comes back for the model.
    serving, since = services.stopped.get(grant.instance or model, ((0, 0), 0.0))
    if grant.serving <= serving and since <= ex.broke_at:
        log.warning("%s#%d was stopped while it had a request (%s; stopped %.3f s before "
                    "it broke): answered 503, not sent again", ex.what, grant.generation,
                    ex.broke, ex.broke_at - since)
        ex.answer(Answer(503, f"{ex.what} was stopped while it had this request "
                         f"({ex.broke}); not sent again", headers=(("Retry-After", "1"),)))
        return True
    log.warning("%s#%d went away before answering (%s); the request goes to its next "
                "instance, unless that child is still there", ex.what, grant.generation,
                ex.broke)
    ex.wait_again()  # not when it failed as it connected
    return False
