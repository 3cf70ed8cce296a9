"""Each named key's allowance of requests to corral's own API (`[keys.NAME]
plans_per_min`, issue 37 S7): plans, model listings, `/props`, `/keys` and the rest of
what the management API serves, counted in one place for every front (they all pass
through it) and refused before any of them reaches the Scheduler.

A key's model requests have their own `requests_per_min` in the Scheduler; these do not
count there, so a client that lists the models before each call does not halve its
budget, and a key with no `requests_per_min` is bounded here all the same. A plan copies
the policy's state in the Scheduler's thread (about 12 ms at 300 models), and a listing
snapshots every model: a key flooding them slowed another key's requests tenfold.

A refusal is a 429 with `Retry-After`, given after a pause of up to `HOLD_S` (never past
the time the next request would fit): a client that ignores Retry-After and asks again
at once can then cost corral no more than one cheap refusal a second per connection.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque

from aiohttp import web

from ..config.keys import KeyRule
from .manage import error

WINDOW_S = 60.0
HOLD_S = 1.0
"""Longest pause before a refusal is answered."""


class Allowances:
    """The times of each key's counted requests in the last WINDOW_S (pure: the time is
    an argument). Invariant: a key's deque never holds more than its limit."""

    def __init__(self) -> None:
        self.taken: dict[str, deque[float]] = {}

    def take(self, key: str, limit: int, now: float) -> float | None:
        """Count one request of `key` at `now` if it fits `limit` a minute (0: no limit)
        and return None; else return in how many seconds one more fits (not counted)."""
        if not limit:
            return None
        times = self.taken.setdefault(key, deque())
        since = now - WINDOW_S
        while times and times[0] <= since:
            times.popleft()
        while len(times) > limit:  # a reload lowered the limit
            times.popleft()
        if len(times) < limit:
            times.append(now)
            return None
        return times[0] + WINDOW_S - now


async def refuse(rule: KeyRule, wait_s: float) -> web.Response:
    """The 429 for a key over its allowance, after the pause (module docstring)."""
    await asyncio.sleep(min(wait_s, HOLD_S))
    wait_s = max(0.0, wait_s - HOLD_S)
    return error(429, f"key '{rule.name}' has made {rule.plans_per_min} requests of corral's "
                 f"own API (plans, listings, /keys) in the last {WINDOW_S:g} s "
                 f"(plans_per_min {rule.plans_per_min}); try again in {wait_s:.1f} s",
                 "rate_limit_error", {"Retry-After": str(max(1, math.ceil(wait_s)))})
