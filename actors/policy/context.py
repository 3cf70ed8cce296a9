"""A model's context, chosen as it loads (issue 44, part 3: `ctx = "fit"`).

Its memory at any context is read off a line through its two measurements (the least
context and the most: `at_ctx`). As it loads, it gets the most context that fits beside
what is up, within ctx_min..ctx_max; only if not even ctx_min fits does it make room, as
any load does, for ctx_min, and it is chosen again as it spawns: once the room is made,
the most that fits in it. Nothing is evicted for context beyond ctx_min.
What it gave up is said (`ModelRecord.ctx_note`): "at 32768 it would evict A; at 8192 it
fits beside it".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from ..ledger import Breakdown
from .records import ModelRecord
from .weigh import Plan

STEP = 256
"""Contexts are chosen in steps of this many tokens."""


def at_ctx(low: Breakdown, high: Breakdown, n_ctx: int) -> Breakdown:
    """A model's memory at `n_ctx` (never less than `low`'s own context), from its
    measurements at two contexts: each row on the line through both, its weights as the
    larger measured them where both split them out, else its whole; a row only one has,
    as that one has it (never less than measured)."""
    span = high.n_ctx - low.n_ctx
    n_ctx = max(n_ctx, low.n_ctx)
    lows = {(r.kind, r.name): r for r in low.devices}
    highs = {(r.kind, r.name) for r in high.devices}
    rows = [r for r in low.devices if (r.kind, r.name) not in highs]
    for r in high.devices:
        lo = lows.get((r.kind, r.name))
        if lo is None or span <= 0:
            rows.append(r)
            continue

        def line(a: int, b: int) -> int:
            return max(0, a + (b - a) * (n_ctx - low.n_ctx) // span)
        if (r.context or r.compute) and (lo.context or lo.compute):  # (both split it out)
            rows.append(msgspec.structs.replace(
                r, context=line(lo.context, r.context), compute=line(lo.compute, r.compute)))
        else:
            rows.append(msgspec.structs.replace(
                r, model=max(lo.self_bytes, line(lo.self_bytes, r.self_bytes)), context=0,
                compute=0))
    return Breakdown(n_ctx, rows)


def from_slope(rec: ModelRecord, figures: Breakdown) -> tuple[Breakdown, Breakdown]:
    """`rec`'s figures at ctx_min and at ctx_max, from what its child uses at the context
    it loaded with (`figures`) and its context's cost per token (a context probe's),
    that cost put on its devices' rows (its host rows where it has none) as they hold
    the figures; `figures` twice if it has no such cost or is not fitted."""
    fit, per_token, at = rec.rules.ctx_fit, rec.ctx_per_token, rec.n_ctx
    if fit is None or not per_token or at is None:
        return figures, figures
    rows = [r for r in figures.devices if r.kind == "device"] or list(figures.devices)
    total = sum(r.self_bytes for r in rows) or 1

    def at_ctx_of(n_ctx: int) -> Breakdown:
        return Breakdown(n_ctx, [msgspec.structs.replace(
            r, model=max(0, r.self_bytes + per_token * (n_ctx - at) * r.self_bytes // total),
            context=0, compute=0) if r in rows else r for r in figures.devices])
    return at_ctx_of(fit[0]), at_ctx_of(fit[1])


def sized(rec: ModelRecord) -> Breakdown | None:
    """`rec`'s need at its chosen context (None: it is not sized so: its own figures)."""
    low, high = rec.mem_min, rec.mem_max
    if rec.rules.ctx_fit is None or rec.n_ctx is None or low is None or high is None \
            or high.n_ctx <= low.n_ctx:
        return None
    return at_ctx(low, high, rec.n_ctx)


def fits(plan: Plan) -> bool:
    """A plan that loads it beside what is up, not short of memory: a plan for a model
    alone on its device goes even if short ("loading anyway"), which no context chosen
    may be."""
    return plan.verdict == "go" and not plan.note


def choose(rec: ModelRecord, plan: Callable[[Sequence[ModelRecord]], Plan],
           victims: Sequence[ModelRecord], inputs: tuple[object, ...]) -> Plan:
    """The plan that loads `rec` (ctx = "fit") at the most context that fits beside what
    is up, else at ctx_min, evicting `victims` as needed; sets `rec.n_ctx` to it and says
    what was given up (`rec.ctx_note`). `plan(victims)`: the memory plan at `rec.n_ctx`;
    `inputs`: what the choice depends on besides `rec` (the same again: the same choice,
    planned once, not searched)."""
    assert rec.rules.ctx_fit is not None
    least, most = rec.rules.ctx_fit
    key = (inputs, rec.generation, rec.rules, rec.mem_min, rec.mem_max,
           tuple(id(v) for v in victims))
    if rec.ctx_memo is not None and rec.ctx_memo[0] == key:
        _, rec.n_ctx, rec.ctx_note, beside = rec.ctx_memo
        return plan([] if beside else victims)
    chosen, beside = _choose(rec, plan, victims, least, most)
    rec.ctx_memo = (key, rec.n_ctx, rec.ctx_note, beside)
    return chosen


def _choose(rec: ModelRecord, plan: Callable[[Sequence[ModelRecord]], Plan],
            victims: Sequence[ModelRecord], least: int, most: int) -> tuple[Plan, bool]:
    """`choose`'s search: its plan, and whether that plan was made with no victims."""
    rec.n_ctx, rec.ctx_note = most, ""
    if rec.mem_min is None and rec.mem_max is None:  # its first load measures it: the least
        rec.n_ctx, rec.ctx_note = least, f"its first load measures it, at {least} (ctx_min)"
        return plan(victims), False
    if sized(rec) is None:  # measured at one context: it loads with that one (or its most)
        one = (rec.mem_max or rec.mem_min or Breakdown(0, [])).n_ctx
        rec.n_ctx = min(max(one, least), most) if one else most
        return plan(victims), False
    if fits(beside := plan([])):
        return beside, True
    best, lo, hi = None, least // STEP, (most - 1) // STEP
    while lo <= hi:  # (the fit is monotone in the context: halve the steps)
        mid = (lo + hi) // 2
        rec.n_ctx = max(least, mid * STEP)
        if fits(plan([])):
            best, lo = rec.n_ctx, mid + 1
        else:
            hi = mid - 1
    rec.n_ctx = most
    at_most = plan(victims)
    gone = ", ".join(v.name for v, _ in at_most.evict)
    if best is not None:
        rec.ctx_note = (f"at {most} context it would evict {gone}; at {best} it fits beside "
                        "them" if gone and at_most.verdict != "refuse" else
                        f"at {best} context it fits beside what is up; at {most} it does not")
        rec.n_ctx = best
        return plan([]), True
    rec.n_ctx = least
    chosen = plan(victims)
    rec.ctx_note = f"not even {least} context (ctx_min) fits beside what is up: it loads " \
                   f"with {least}" + (f", evicting {gone}" if (gone := ", ".join(
                       v.name for v, _ in chosen.evict)) else "")
    return chosen, False
