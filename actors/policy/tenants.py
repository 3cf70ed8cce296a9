"""Keys as the policy sees them (`[keys.NAME]`): each key's class and limits, and what it
has used, so that a request over its rate or token budget is refused (429) before it is
queued, and one over its `max_concurrency` waits.

The windows are exact, not buckets: the times of the requests taken in the last
`WINDOW_S`, and the tokens used in it with the time of each use. A request is counted
when it is taken (granted or queued); tokens when its grant is released.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import msgspec

from ..keys import Tenant

log = logging.getLogger("corral.scheduler")

WINDOW_S = 60.0


@dataclass(slots=True)
class Usage:
    """What one key has used."""

    in_flight: int = 0
    taken: deque[float] = field(default_factory=deque)
    """When each request of the window was taken, oldest first."""
    spent: deque[tuple[float, int]] = field(default_factory=deque)
    """(when, tokens) of each release in the window, oldest first."""
    spent_sum: int = 0

    def expire(self, now: float) -> None:
        since = now - WINDOW_S
        while self.taken and self.taken[0] <= since:
            self.taken.popleft()
        while self.spent and self.spent[0][0] <= since:
            self.spent_sum -= self.spent.popleft()[1]


@dataclass(frozen=True, slots=True)
class OverQuota:
    """Why a key may not have one more request now, and when it may."""

    message: str
    retry_after_s: float
    reason: str
    """requests_per_min or tokens_per_min (the refusal's count in /metrics)."""


class Tenants:
    """Every key's rules and usage. Usage outlives a reload for the keys that stay."""

    def __init__(self, tenants: dict[str, Tenant] | None = None) -> None:
        self.rules: dict[str, Tenant] = tenants or {"": Tenant(name="")}
        self.level = self.of("").level
        """The class level of a request with no key (corral has none: only one class)."""
        self.usage: dict[str, Usage] = {}
        self.changes = 0
        """Bumped when a window changes (what the budgets file keeps)."""

    def replace(self, tenants: dict[str, Tenant]) -> None:
        """A reload: new rules; the usage of keys that are gone is forgotten once they
        have no request running (until then, theirs count as requests with no key's)."""
        self.rules = tenants
        self.level = self.of("").level
        self.usage = {k: u for k, u in self.usage.items() if k in tenants or u.in_flight}

    def of(self, key: str) -> Tenant:
        """A key's rules; one that is not known any more (removed by a reload while its
        request was on its way) gets those of a request with no key."""
        return self.rules.get(key) or self.rules.get("") or Tenant(name="")

    def _usage(self, key: str) -> Usage:
        usage = self.usage.get(key)
        if usage is None:
            usage = self.usage[key] = Usage()
        return usage

    def over_quota(self, key: str, now: float) -> OverQuota | None:
        """Whether one more request of `key` now is over its rate or token budget."""
        rules = self.of(key)
        if not (rules.requests_per_min or rules.tokens_per_min):
            return None
        usage = self._usage(key)
        usage.expire(now)
        if rules.requests_per_min and len(usage.taken) >= rules.requests_per_min:
            # the oldest of the window must leave it before one more fits
            wait = usage.taken[len(usage.taken) - rules.requests_per_min] + WINDOW_S - now
            return OverQuota(f"key '{key}' has made {len(usage.taken)} requests in the last "
                             f"{WINDOW_S:g} s (requests_per_min {rules.requests_per_min})",
                             max(wait, 0.0), "requests_per_min")
        if rules.tokens_per_min and usage.spent_sum >= rules.tokens_per_min:
            left, wait = usage.spent_sum, 0.0
            for when, tokens in usage.spent:  # until enough of them are older than the window
                left -= tokens
                wait = when + WINDOW_S - now
                if left < rules.tokens_per_min:
                    break
            return OverQuota(f"key '{key}' has used {usage.spent_sum} tokens in the last "
                             f"{WINDOW_S:g} s (tokens_per_min {rules.tokens_per_min})",
                             max(wait, 0.0), "tokens_per_min")
        return None

    def take(self, key: str, now: float) -> None:
        """A request of `key` was taken (granted or queued)."""
        if self.of(key).requests_per_min:
            self._usage(key).taken.append(now)
            self.changes += 1

    def untake(self, key: str) -> None:
        """The request last taken for `key` was refused in the same event (its queue
        entry was: no slot will ever come for it): it does not count."""
        usage = self.usage.get(key)
        if usage is not None and usage.taken and self.of(key).requests_per_min:
            usage.taken.pop()
            self.changes += 1

    def at_limit(self, key: str) -> bool:
        """Whether `key` has as many requests running as its max_concurrency allows."""
        limit = self.of(key).max_concurrency
        usage = self.usage.get(key)
        return bool(limit) and usage is not None and usage.in_flight >= limit

    def granted(self, key: str) -> None:
        self._usage(key).in_flight += 1

    def released(self, key: str, tokens: int, now: float) -> bool:
        """A grant of `key` ended, having used `tokens`; True if the key was at its
        max_concurrency and is not any more (its waiters may go)."""
        usage = self._usage(key)
        was_at_limit = self.at_limit(key)
        usage.in_flight -= 1
        if tokens > 0 and self.of(key).tokens_per_min:
            usage.spent.append((now, tokens))
            usage.spent_sum += tokens
            self.changes += 1
        return was_at_limit and not self.at_limit(key)

    def limited(self, key: str) -> bool:
        """Whether the Scheduler must see each request of `key` (it has limits): its
        grants are not shared by the front."""
        rules = self.of(key)
        return bool(rules.max_concurrency or rules.requests_per_min or rules.tokens_per_min)

    # ------------------------------------------------------------ across restarts

    def export(self, now: float) -> dict[str, KeptUsage]:
        """The windows of the keys with a quota, as ages (seconds before `now`)."""
        out = {}
        for key, usage in self.usage.items():
            rules = self.rules.get(key)
            if rules is None or not (rules.requests_per_min or rules.tokens_per_min):
                continue
            usage.expire(now)
            out[key] = KeptUsage(taken_ago=[now - t for t in usage.taken],
                                 spent_ago=[(now - t, n) for t, n in usage.spent])
        return out

    def restore(self, kept: dict[str, KeptUsage], now: float, away_s: float) -> None:
        """Windows exported `away_s` ago (wall time), for the keys that still have a quota.
        What no export makes (a damaged or hand-edited file: issue 37, S9, where negative
        tokens gave a key more budget and an age of -1e12 s locked one out for 31,000
        years) is dropped, in one warning: ages outside [0, WINDOW_S], negative tokens."""
        dropped = 0
        for key, k in kept.items():
            rules = self.rules.get(key)
            if rules is None:
                continue
            taken = [ago for ago in k.taken_ago if 0 <= ago <= WINDOW_S]
            spent = [(ago, n) for ago, n in k.spent_ago if 0 <= ago <= WINDOW_S and n >= 0]
            dropped += len(k.taken_ago) - len(taken) + len(k.spent_ago) - len(spent)
            usage = self._usage(key)
            if rules.requests_per_min:
                usage.taken.extend(now - ago - away_s for ago in sorted(taken, reverse=True))
            if rules.tokens_per_min:
                for ago, n in sorted(spent, reverse=True):
                    usage.spent.append((now - ago - away_s, n))
                    usage.spent_sum += n
            usage.expire(now)
        if dropped:
            log.warning("key budgets: dropped %d saved value(s) out of range (ages outside "
                        "[0, %g] s, negative token counts): the file was damaged or edited",
                        dropped, WINDOW_S)


class KeptUsage(msgspec.Struct, frozen=True):
    """One key's windows as the budgets file keeps them."""

    taken_ago: list[float] = []
    spent_ago: list[tuple[float, int]] = []
