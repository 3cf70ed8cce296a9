"""Keys as the policy sees them (`[keys.NAME]`): each key's class and limits, and what it
has used, so that a request over its rate or token budget is refused (429) before it is
queued, and one over its `max_concurrency` waits.

The windows are exact, not buckets: the times of the requests taken in the last
`WINDOW_S`, and the tokens used in it with the time of each use. A request is counted
when it is taken (granted or queued); tokens as a stream goes (`charge`) and when its
grant is released.

A key's token window never holds more than its `tokens_per_min`. What a long answer uses
past that is *carried*: it enters the window as room appears there, dated when it does,
so the key is refused until it has been paid for a minute's worth at a time (issue 37,
S5: 2000 tokens at 100 a minute keep the key waiting 20 minutes, not one). As if each
token entered the window in turn, at the earliest when the one `tokens_per_min` before
it left.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import msgspec

from ..config.keys import BATCH, BATCH_IDLE_S, Tenant, batch_tenant

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
    carried: int = 0
    """Tokens used that the window had no room for yet. Invariant: while there are any,
    the window is full (`spent_sum` is the key's tokens_per_min or more)."""

    def expire(self, now: float, tokens_per_min: int = 0) -> None:
        """Forget what left the window by `now`; with the key's `tokens_per_min`, what is
        carried takes the room each departure leaves, dated when it left."""
        since = now - WINDOW_S
        while self.taken and self.taken[0] <= since:
            self.taken.popleft()
        while self.spent and self.spent[0][0] <= since:
            when, tokens = self.spent.popleft()
            self.spent_sum -= tokens
            if self.carried and tokens_per_min:
                self.post(when + WINDOW_S, tokens_per_min)
        if self.carried and tokens_per_min:  # room left by a window read without its limit
            self.post(now, tokens_per_min)

    def post(self, at: float, tokens_per_min: int) -> None:
        """Move as much of the carry into the window, at `at`, as there is room for."""
        tokens = min(self.carried, tokens_per_min - self.spent_sum)
        if tokens > 0:
            self.spent.append((at, tokens))
            self.spent_sum += tokens
            self.carried -= tokens

    def refund(self, tokens: int) -> None:
        """Take back `tokens` charged too many: from the carry first, then the newest."""
        back = min(tokens, self.carried)
        self.carried -= back
        tokens -= back
        while tokens and self.spent:
            when, spent = self.spent.pop()
            back = min(tokens, spent)
            tokens -= back
            self.spent_sum -= back
            if spent > back:
                self.spent.append((when, spent - back))

    def free_at(self, tokens_per_min: int) -> float:
        """When the window (full, maybe with a carry) first holds fewer than
        `tokens_per_min` tokens, if nothing more is charged."""
        total, carried = self.spent_sum, self.carried
        posted: list[tuple[float, int]] = []
        for when, tokens in self.spent:  # what is in the window leaves, the carry enters
            left_at = when + WINDOW_S
            total -= tokens
            moved = max(0, min(carried, tokens_per_min - total))
            if moved:
                posted.append((left_at, moved))
                total, carried = total + moved, carried - moved
            if total < tokens_per_min:
                return left_at
        # The window now holds only what entered from the carry, a full minute's worth;
        # each later minute repeats it, until the carry left is less than a minute's.
        rounds, left = divmod(carried, tokens_per_min)
        freed = 0
        for when, tokens in posted:
            freed += tokens
            if freed > left:
                return when + WINDOW_S * (rounds + 1)
        raise AssertionError(f"a carry of {self.carried} tokens never repaid")


@dataclass(frozen=True, slots=True)
class OverQuota:
    """Why a key may not have one more request now, and when it may."""

    message: str
    retry_after_s: float
    reason: str
    """requests_per_min or tokens_per_min (the refusal's count in /metrics)."""


CARRY_MAX_MIN = 24 * 60
"""The longest debt a saved file may hold, in minutes of the key's token budget: a day
(a longer one is no answer's, but a damaged file's)."""


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
        self.usage = {k: u for k, u in self.usage.items() if k.removeprefix(BATCH) in tenants
                      or u.in_flight}  # (a batch's lines: while their key stays)

    def of(self, key: str) -> Tenant:
        """A key's rules; one that is not known any more (removed by a reload while its
        request was on its way) gets those of a request with no key."""
        if (rule := self.rules.get(key)) is not None:
            return rule
        if key.startswith(BATCH):  # a batch's lines: its owner's, below every class
            rule = self.rules[key] = batch_tenant(  # ([batches] idle_s: tenants_of)
                self.of(key.removeprefix(BATCH)), key, self.rules[BATCH].idle_s
                if BATCH in self.rules else BATCH_IDLE_S)
            return rule
        return self.rules.get("") or Tenant(name="")

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
        usage.expire(now, rules.tokens_per_min)
        if rules.requests_per_min and len(usage.taken) >= rules.requests_per_min:
            # the oldest of the window must leave it before one more fits
            wait = usage.taken[len(usage.taken) - rules.requests_per_min] + WINDOW_S - now
            return OverQuota(f"key '{key}' has made {len(usage.taken)} requests in the last "
                             f"{WINDOW_S:g} s (requests_per_min {rules.requests_per_min})",
                             max(wait, 0.0), "requests_per_min")
        if rules.tokens_per_min and usage.spent_sum >= rules.tokens_per_min:
            wait = usage.free_at(rules.tokens_per_min) - now
            owed = (f" and owes {usage.carried} more, carried over from long answers"
                    if usage.carried else "")
            return OverQuota(f"key '{key}' has used {usage.spent_sum} tokens in the last "
                             f"{WINDOW_S:g} s{owed} (tokens_per_min {rules.tokens_per_min})",
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
        self.charge(key, tokens, now)
        return was_at_limit and not self.at_limit(key)

    def charge(self, key: str, tokens: int, now: float) -> None:
        """A request of `key` used `tokens` more (as its stream went, or at its release);
        negative at a release when the answer's own `usage` said less than was charged
        as it streamed. What the window has no room for is carried."""
        limit = self.of(key).tokens_per_min
        if not tokens or not limit:
            return
        usage = self._usage(key)
        usage.expire(now, limit)
        if tokens > 0:
            usage.carried += tokens
            usage.post(now, limit)
        else:
            usage.refund(-tokens)
        self.changes += 1

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
            usage.expire(now, rules.tokens_per_min)
            out[key] = KeptUsage(taken_ago=[now - t for t in usage.taken],
                                 spent_ago=[(now - t, n) for t, n in usage.spent],
                                 carried=usage.carried)
        return out

    def restore(self, kept: dict[str, KeptUsage], now: float, away_s: float) -> None:
        """Windows exported `away_s` ago (wall time), for the keys that still have a quota.
        What no export makes (a damaged or hand-edited file: issue 37, S9, where negative
        tokens gave a key more budget and an age of -1e12 s locked one out for 31,000
        years) is dropped, in one warning: ages outside [0, WINDOW_S], token counts below 0
        or above what the key's window holds, and a carry of more than CARRY_MAX_MIN
        minutes of its budget (a carry of 2**63 said Retry-After: 5.5e18)."""
        dropped = 0
        for key, k in kept.items():
            rules = self.rules.get(key)
            if rules is None:
                continue
            taken = [ago for ago in k.taken_ago if 0 <= ago <= WINDOW_S]
            most = rules.tokens_per_min  # (a limit lowered since: what is over it is cut)
            spent = [(ago, min(n, most)) for ago, n in k.spent_ago
                     if 0 <= ago <= WINDOW_S and n >= 0]
            carried = min(max(0, k.carried), most * CARRY_MAX_MIN)
            dropped += len(k.taken_ago) - len(taken) + len(k.spent_ago) - len(spent)
            dropped += sum(n > most for _, n in k.spent_ago) + int(carried != k.carried)
            usage = self._usage(key)
            if rules.requests_per_min:
                usage.taken.extend(now - ago - away_s for ago in sorted(taken, reverse=True))
            if rules.tokens_per_min:
                for ago, n in sorted(spent, reverse=True):
                    usage.spent.append((now - ago - away_s, n))
                    usage.spent_sum += n
                usage.carried += carried
            usage.expire(now, rules.tokens_per_min)
        if dropped:
            log.warning("key budgets: dropped %d saved value(s) out of range (ages outside "
                        "[0, %g] s, token counts below 0 or past the limit, a carry over %d "
                        "minutes of budget): the file was damaged or edited", dropped,
                        WINDOW_S, CARRY_MAX_MIN)


class KeptUsage(msgspec.Struct, frozen=True):
    """One key's windows as the budgets file keeps them."""

    taken_ago: list[float] = []
    spent_ago: list[tuple[float, int]] = []
    carried: int = 0
    """Tokens used past the window's room (Usage.carried)."""
