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

from collections.abc import Callable

import msgspec

from ..ledger import Breakdown
from .records import ModelRecord
from .weigh import Plan

STEP = 256
"""Contexts are chosen in steps of this many tokens."""


def at_ctx(low: Breakdown, high: Breakdown, n_ctx: int) -> Breakdown:
    """A model's memory at `n_ctx`, from its measurements at two contexts: each row's
    context and compute bytes on the line through both (a row that splits nothing out, its
    whole), rows that only the larger has as they are."""
    span = high.n_ctx - low.n_ctx
    lows = {(r.kind, r.name): r for r in low.devices}
    rows = []
    for r in high.devices:
        lo = lows.get((r.kind, r.name))
        if lo is None or span <= 0:
            rows.append(r)
            continue

        def line(a: int, b: int) -> int:
            return max(0, a + (b - a) * (n_ctx - low.n_ctx) // span)
        split = r.context or lo.context or r.compute or lo.compute
        rows.append(msgspec.structs.replace(
            r, context=line(lo.context, r.context), compute=line(lo.compute, r.compute),
            model=r.model if split else line(lo.model, r.model)))
    return Breakdown(n_ctx, rows)


def sized(rec: ModelRecord) -> Breakdown | None:
    """`rec`'s need at its chosen context (None: it is not sized so: its own figures)."""
    low, high = rec.mem_min, rec.mem_max
    if rec.rules.ctx_fit is None or rec.n_ctx is None or low is None or high is None \
            or high.n_ctx <= low.n_ctx:
        return None
    return at_ctx(low, high, rec.n_ctx)


def choose(rec: ModelRecord, plan: Callable[[list[ModelRecord]], Plan],
           victims: list[ModelRecord]) -> Plan:
    """The plan that loads `rec` (ctx = "fit") at the most context that fits beside what
    is up, else at ctx_min, evicting `victims` as needed; sets `rec.n_ctx` to it and says
    what was given up (`rec.ctx_note`). `plan(victims)`: the memory plan at `rec.n_ctx`."""
    assert rec.rules.ctx_fit is not None
    least, most = rec.rules.ctx_fit
    rec.n_ctx, rec.ctx_note = most, ""
    if sized(rec) is None:  # (not measured at two contexts: it loads with its most)
        return plan(victims)
    if (beside := plan([])).verdict == "go":
        return beside
    best, lo, hi = None, least // STEP, most // STEP - 1
    while lo <= hi:  # (the fit is monotone in the context: halve the steps)
        mid = (lo + hi) // 2
        rec.n_ctx = max(least, mid * STEP)
        if plan([]).verdict == "go":
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
        return plan([])
    rec.n_ctx = least
    chosen = plan(victims)
    rec.ctx_note = f"not even {least} context (ctx_min) fits beside what is up: it loads " \
                   f"with {least}" + (f", evicting {gone}" if (gone := ", ".join(
                       v.name for v, _ in chosen.evict)) else "")
    return chosen
