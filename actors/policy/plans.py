"""What one more request would get now, without it happening (GET /models/plan).

The plan is the policy's own decision, made on a copy of its state: a copy of the
`Policy` is asked `acquire` for a probe ticket, and what that returns is read back. Made
at the same instant on the same state, a real request gets the same decision, because
it is the same code on the same data (the stateful tests check it at every step). The
copy logs nothing: its decisions are not carried out.

The tickets held in the state (requests queued or granted) are kept, not copied: the
policy never looks inside one, and a front's ticket holds its event loop.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Collection, Hashable, Iterable, Mapping
from typing import Literal, Protocol

import msgspec

from ..config.keys import ANOTHER, unnamed
from ..ledger import MiB
from ..lifecycle import ModelState
from ..messages import Evicted, Grant, Refusal, Revoke
from .records import Answer, Effect, ModelRecord, Preempt, Publish, Spawn, Wake, shortfall_text
from .state import State

Decision = Literal["grant", "queue", "load", "refuse"]


class Policy(Protocol):
    """What a plan uses of core.Policy (which calls this module: no import back)."""

    state: State

    def acquire(self, ticket: Hashable, model: str, now: float, autoload: bool = True,
                key: str = "", retry: bool = False, cuttable: bool = False,
                affinity: int = 0) -> list[Effect]: ...

    def release_all(self, releases: Iterable[tuple[Hashable, bool, float, int]],
                    now: float) -> list[Effect]: ...


class PlannedEviction(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    reason: str
    why: str
    """What the newcomer lacked, device by device (memory), or the slot it needs."""
    action: str = "stop"
    """`suspend`: it would be suspended, not stopped (issue 23)."""
    because: str | None = None
    """Why it would be suspended or stopped (host memory, or what each costs: costs.py)."""


class PlannedMemory(msgspec.Struct, frozen=True, kw_only=True):
    device: str
    free_mib_now: float
    free_mib_after: float
    """Once the evictions are done and the model holds what it is expected to need."""


class RequestPlan(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The answer of GET /models/plan."""

    decision: Decision
    model: str
    key: str = ""
    generation: int | None = None
    host: str | None = None
    port: int | None = None
    """grant: the instance that would serve it."""
    copy: str = ""
    """grant: the copy that would serve it (`NAME@2`; "" for the model's own); a session
    (`?session=`) is given the copy it is pinned to."""
    position: int | None = None
    """queue or load: its place among the requests waiting for the model (1: next)."""
    ahead: dict[str, int] = {}
    """Requests served before it, by priority class."""
    waiting_for: str | None = None
    """queue: what the model waits for, when the policy knows."""
    cut: list[str] = []
    """queue: the classes of the running requests that would be cut for it
    (priority_preempt)."""
    devices: list[str] | None = None
    node: str | None = None
    revoke: list[str] = []
    """load: the models whose grants the fronts keep idle, given back first (revoked),
    so that they may be evicted (http.lease_linger_ms)."""
    evict: list[PlannedEviction] = []
    memory: list[PlannedMemory] = []
    """load: where it would start, what would be stopped for it, the memory around it."""
    wake: bool = False
    """load: the load is a wake of the model's suspended child (issue 23)."""
    ctx: int | None = None
    """load, ctx = "fit": the context it would load with (context.py) ..."""
    ctx_note: str = ""
    """... and what that gives up: "at 32768 context it would evict A; at 8192 it fits
    beside them"."""
    prefetch: str | None = None
    """With `prefetch`: the model its answer would have loaded next, where it fits."""
    status: int | None = None
    message: str | None = None
    retry_after_s: float | None = None
    """refuse: the answer it would get."""


class _Quiet(logging.Filter):
    """Drops the policy's log lines on the thread that is planning."""

    def __init__(self) -> None:
        super().__init__()
        self.planning = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.planning, "on", False)


_quiet = _Quiet()
logging.getLogger("corral.scheduler").addFilter(_quiet)


class _Probe:
    """The ticket of the request that is only planned."""

    __slots__ = ()


def twin(policy: Policy) -> Policy:
    """A copy of `policy` that shares nothing mutable with it but the tickets."""
    state = policy.state
    tickets: list[Hashable] = [*state.leases, *state.queue.waiters]
    memo: dict[int, object] = {id(t): t for t in tickets}
    return copy.deepcopy(policy, memo)


def decide(effects: list[Effect], ticket: Hashable, model: str) -> Decision:
    """What `acquire`'s effects mean for the request `ticket` (for `model`)."""
    for e in effects:
        if isinstance(e, Answer) and e.ticket is ticket:
            return "grant" if isinstance(e.value, Grant) else "refuse"
    for e in effects:
        if isinstance(e, Spawn | Wake) and e.model == model:
            return "load"
        if isinstance(e, Publish) and isinstance(e.event, Evicted) and e.event.for_model == model:
            return "load"
    return "queue"


def plan(policy: Policy, model: str, now: float, key: str = "", autoload: bool = True,
         kept: Mapping[str, tuple[int, float]] | None = None,
         shown: Collection[str] | None = None, affinity: int = 0) -> RequestPlan:
    """What a request for `model` with `key` would get at `now`: the story to its end.

    `kept`: the models whose grants the fronts keep with no request on them (how many
    fronts keep one, and for how long): a request that waits only for those to be given
    back is planned past it, as a `load` that revokes them and evicts (issue 37: it read
    as `queue`, "waiting for the fronts", though nothing in flight holds it). `shown`:
    the model names the asking key may see (None: all); the others are not named (S8).
    `affinity`: its session's (a copy it is pinned to is the one it gets)."""
    copy_ = twin(policy)
    probe = _Probe()
    _quiet.planning.on = True
    try:
        effects = copy_.acquire(probe, model, now, autoload, key, affinity=affinity)
        decision = decide(effects, probe, model)
        revoked: list[str] = []
        if decision == "queue" and kept:
            revoked, more = _give_back(copy_, effects, kept, now)
            effects = [*effects, *more]
            decision = decide(effects, probe, model)
    finally:
        _quiet.planning.on = False
    planned = _plan(policy, copy_, probe, effects, decision, model, now, key, revoked)
    if shown is None:
        return planned
    return _unnamed(planned, {n for n in policy.state.models if n not in shown
                              and policy.state.models[n].group not in shown})


def _give_back(copy_: Policy, effects: list[Effect], kept: Mapping[str, tuple[int, float]],
               now: float) -> tuple[list[str], list[Effect]]:
    """What the copy does once the fronts give back the grants revoked in `effects` that
    they keep idle (a front keeps one grant of a model: as many as fronts keep one):
    their models named, and the effects."""
    wanted = {(m, g): kept[m][0] for e in effects if isinstance(e, Revoke)
              for m, g in e.grants if m in kept}
    releases: list[tuple[Hashable, bool, float, int]] = []
    given: dict[str, None] = {}
    for ticket, (name, generation, _) in copy_.state.leases.items():
        rec = copy_.state.models.get(name)
        group = rec.group if rec is not None else name
        if wanted.get((group, generation), 0) > 0:
            wanted[(group, generation)] -= 1
            releases.append((ticket, False, kept[group][1], 0))
            given[group] = None
    return list(given), copy_.release_all(releases, now) if releases else []


def _unnamed(planned: RequestPlan, hidden: set[str]) -> RequestPlan:
    """`planned` without the names in `hidden`: each is "another model"."""
    if not hidden:
        return planned

    def text(value: str | None) -> str | None:
        return None if value is None else unnamed(value, hidden, hidden.__contains__)

    return msgspec.structs.replace(
        planned, waiting_for=text(planned.waiting_for), message=text(planned.message),
        ctx_note=text(planned.ctx_note) or "",
        revoke=[m if m not in hidden else ANOTHER for m in planned.revoke],
        evict=[e if e.model not in hidden else msgspec.structs.replace(
            e, model=ANOTHER, why=text(e.why) or "") for e in planned.evict])


def _plan(policy: Policy, copy_: Policy, probe: _Probe, effects: list[Effect],
          decision: Decision, model: str, now: float, key: str,
          revoked: list[str]) -> RequestPlan:
    name = policy.state.models[model].name if model in policy.state.models else model
    if decision in ("grant", "refuse"):
        answer = next(e.value for e in effects if isinstance(e, Answer) and e.ticket is probe)
        if isinstance(answer, Grant):
            return RequestPlan(decision="grant", model=name, key=key,
                               generation=answer.generation, host=answer.host,
                               port=answer.port, copy=answer.instance)
        assert isinstance(answer, Refusal)
        return RequestPlan(decision="refuse", model=name, key=key, status=answer.status,
                           message=answer.message, retry_after_s=answer.retry_after_s)
    position, ahead = _place(copy_, probe, model, now)
    rec = copy_.state.models[model]
    if decision == "queue":
        cut = [copy_.state.tenants.of(copy_.state.cuts.of[e.ticket].key).priority
               for e in effects if isinstance(e, Preempt)]
        return RequestPlan(decision="queue", model=name, key=key, position=position,
                           ahead=ahead, waiting_for=_waiting_for(copy_, rec, effects, cut),
                           cut=cut)
    spawn = next((e for e in effects if isinstance(e, Spawn) and e.model == model), None)
    woken = rec.state in (ModelState.SUSPENDED, ModelState.WAKING)  # a wake, now or later
    evictions = [e.event for e in effects if isinstance(e, Publish)
                 and isinstance(e.event, Evicted) and e.event.for_model == model]
    # not started yet (it waits for its victims to stop): where it lacked memory
    devices = (spawn.devices if spawn is not None else rec.placement if woken and rec.placement
               else sorted({s.device for e in evictions for s in e.devices}) or None)
    return RequestPlan(
        decision="load", model=name, key=key, position=position, ahead=ahead,
        revoke=revoked, devices=devices, node=spawn.node if spawn is not None else rec.node,
        evict=[PlannedEviction(model=e.model, reason=e.reason, why=_why(e), action=e.action,
                               because=e.why) for e in evictions],
        memory=_memory(policy, copy_, rec, devices or [], [e.model for e in evictions],
                       reserved=spawn is not None or rec.state is ModelState.WAKING),
        wake=woken, ctx=rec.n_ctx if rec.rules.ctx_fit and not woken else None,
        ctx_note=rec.ctx_note if rec.rules.ctx_fit and not woken else "")


def _place(copy_: Policy, probe: _Probe, model: str, now: float) -> tuple[int, dict[str, int]]:
    """The probe's place in its model's entry: the waiters the copy would serve first,
    picked as serve_waiters picks them (its queue is a copy: it may be used up)."""
    queue, tenants = copy_.state.queue, copy_.state.tenants
    entry = queue.entry(model)
    ahead: dict[str, int] = {}
    if entry is None:
        return 1, ahead
    position = 1
    blocked = {key for key in entry.lanes if tenants.at_limit(key)}
    while entry.waiters:
        ticket = queue.next_of(entry, now, blocked)
        if ticket is None or ticket is probe:
            break
        waiter = queue.take(ticket)
        queue.served(model, waiter.key, 1.0)
        cls = tenants.of(waiter.key).priority
        ahead[cls] = ahead.get(cls, 0) + 1
        position += 1
    return position, ahead


def _waiting_for(copy_: Policy, rec: ModelRecord, effects: list[Effect],
                 cut: list[str]) -> str | None:
    if cut:
        return (f"a running request of class {', '.join(cut)} to give back its slot: it is "
                "cut for a higher class (priority_preempt)")
    revoked = [m for e in effects if isinstance(e, Revoke) for m, _ in e.grants]
    if revoked:
        return (f"the fronts to give back the grants they keep idle ({', '.join(revoked)}: "
                "http.lease_linger_ms), then a slot")
    if rec.waiting_for:
        return rec.waiting_for
    state = copy_.state
    if (turn := state.turn) is not None and state.held(rec):
        return (f"model '{turn.model}', asked for first, to have its place (swap_order): "
                f"{rec.name} ends what came before, then gives way")
    if turn is not None and turn.model == rec.group and turn.held:
        return (f"{', '.join(sorted(turn.held))} to end the requests that came before it "
                "(its turn, swap_order), then a slot")
    if rec.state in (ModelState.UNLOADED, ModelState.SUSPENDED) and not state.has_capacity():
        busy = [r.name for r in state.models.values() if r.state.is_running]
        return (f"a free slot (models_max {state.models_max}; running, none of them idle: "
                f"{', '.join(busy)})")
    if rec.state is ModelState.LOADING:
        return "its child to be ready"
    if rec.state is ModelState.SUSPENDING:
        return "its child's suspend to end, then its wake"
    if rec.state is ModelState.WAKING:
        return "its child to wake"
    if rec.state.is_serving:
        return "a request of its own to end (max_concurrency)"
    return None


def _why(event: Evicted) -> str:
    if event.devices:
        return ", ".join(map(shortfall_text, event.devices))
    return f"a slot (models_max), least recently used ({event.reason})"


def _memory(before: Policy, after: Policy, rec: ModelRecord, devices: list[str],
            leaving: list[str], reserved: bool) -> list[PlannedMemory]:
    """Free memory on `devices` now, and once `leaving` have stopped and `rec` holds what
    it is expected to need (the copy's ledger holds it already if it was `reserved`)."""
    out = []
    held = before.state.ledger.held
    need = None if reserved else after.state.memory.placed_need(rec, devices)
    for device in devices:
        now = before.state.ledger.available(device)
        then = after.state.ledger.available(device)
        if now is None or then is None:
            continue
        freed = sum(held.get(m, {}).get(device, 0) for m in leaving)
        if need is not None:
            freed -= sum(r.self_bytes for r in need.devices if r.name == device)
        out.append(PlannedMemory(device=device, free_mib_now=round(now / MiB, 1),
                                 free_mib_after=round((then + freed) / MiB, 1)))
    return out
