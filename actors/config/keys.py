"""Named API keys (`[keys.NAME]`, and `api_key` as one admin key): who is calling, which
models it may use, whether it may manage corral, and the rules the Scheduler keeps for
it (policy/tenants.py).

Only a key's SHA-256 is held (load.py reads the key and keeps its digest). A key a
client sends is hashed and compared with every known digest in constant time, all of
them every time, so neither the time taken nor where a match was found tells anything.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Iterable
from fnmatch import fnmatchcase

import msgspec

from .model import Config, KeyConfig

API_KEY_NAME = "api_key"
"""The name the single top-level `api_key` goes by (an admin key)."""
DEFAULT_CLASS = "default"
BATCH = "batch:"
"""A batch's lines ask as `batch:OWNER` (OWNER: the key that made it, "" none): a name no
key may have (load.py), whose class is BATCH_LEVEL (policy/tenants.py)."""
BATCH_LEVEL = -(1 << 40)
"""The batch class: below every class (their levels are within ±10**6), and it does not
age (priority_aging_s), so its lines never pass another's request."""
BATCH_IDLE_S = 60.0
"""[batches] idle_s's default: a batch's line makes room only with models no request of
a class has used for this long (policy/choice.py), in the others' idle windows."""
PLANS_PER_MIN = 120
"""A key without admin that sets no plans_per_min: two a second, as a dashboard polls."""
CHARGE_PARTS = 10
"""A stream is charged as it goes each time it has used a tenth of its key's
tokens_per_min more: at most that much of a stream goes unseen by the key's next request."""


class KeyRule(msgspec.Struct, frozen=True, kw_only=True):
    """One key as the edge sees it."""

    name: str
    digest: bytes
    models: tuple[str, ...] = ("*",)
    """Names, aliases or globs it may use."""
    admin: bool = False
    shares: bool = True
    """Its requests may join a grant the front holds (shares.py). False for a key with
    limits: the Scheduler must see each of its requests to count it."""
    charge_every: int = 0
    """A stream of this key's is charged to its tokens_per_min each time it has used this
    many tokens more (http/usage.py; 0: the key has no tokens_per_min)."""
    plans_per_min: int = 0
    """Most requests of corral's own API in any 60 s (http/allowance.py; 0: no limit)."""

    def may_use(self, names: tuple[str, ...]) -> bool:
        """Whether it may call the model known as `names` (its name and aliases)."""
        return any(fnmatchcase(name, p) for p in self.models for name in names)


ANOTHER = "another model"
"""What a text shown to a key says in place of a model the key may not use (S8)."""


def unnamed(text: str, names: Iterable[str], hides: Callable[[str], bool]) -> str:
    """`text` with each of `names` that `hides` and that stands in it as a name (not
    inside a longer word or name) said as ANOTHER. Only names found in the text are
    matched, so a thousand models cost a substring test each, not a pattern."""
    found = sorted((n for n in names if n and n in text and hides(n)), key=len, reverse=True)
    if not found:
        return text
    edge = r"[\w.@/:-]"  # what a model name may hold: a match must not be part of one
    return re.sub("|".join(rf"(?<!{edge}){re.escape(n)}(?!{edge})" for n in found),
                  ANOTHER, text)


class Keys(msgspec.Struct, frozen=True):
    """Every key of one config (replaced whole on reload)."""

    rules: tuple[KeyRule, ...]

    def find(self, given: bytes) -> KeyRule | None:
        """The key `given` is, or None."""
        digest = hashlib.sha256(given).digest()
        found = None
        for rule in self.rules:  # every one, whatever matched: no early exit to time
            if hmac.compare_digest(digest, rule.digest):
                found = rule
        return found

    def named(self, name: str) -> KeyRule | None:
        """The key called `name` (corral's own lookup, never a caller's secret)."""
        return next((r for r in self.rules if r.name == name), None)

    @classmethod
    def of(cls, config: Config) -> Keys | None:
        """The keys of `config`; None when it has none (then corral is open: R5)."""
        rules = [KeyRule(name=name, digest=bytes.fromhex(k.digest), models=tuple(k.models),
                         admin=k.admin,
                         shares=not (k.max_concurrency or k.requests_per_min
                                     or k.tokens_per_min),
                         charge_every=k.tokens_per_min and max(1, k.tokens_per_min
                                                               // CHARGE_PARTS),
                         plans_per_min=plans_per_min(k))
                 for name, k in config.keys.items()]
        if config.api_key is not None:
            rules.append(KeyRule(name=API_KEY_NAME,
                                 digest=hashlib.sha256(config.api_key.encode()).digest(),
                                 admin=True))
        return cls(tuple(rules)) if rules else None


def plans_per_min(key: KeyConfig) -> int:
    """A key's allowance of requests to corral's own API a minute (0: no limit)."""
    if key.plans_per_min is not None:
        return key.plans_per_min
    return 0 if key.admin else PLANS_PER_MIN


class Tenant(msgspec.Struct, frozen=True, kw_only=True):
    """One key as the Scheduler sees it: its class and its limits."""

    name: str
    level: int = 0
    """Its priority class's level (a higher one is served first)."""
    priority: str = DEFAULT_CLASS
    max_concurrency: int = 0
    requests_per_min: int = 0
    tokens_per_min: int = 0
    idle_s: float = 0.0
    """The batch class's ([batches] idle_s): its lines make room only with models no
    request of a class has used for this long."""


def batch_tenant(owner: Tenant, name: str, idle_s: float = BATCH_IDLE_S) -> Tenant:
    """The class of a batch's lines (`name`: BATCH + the owner's): the owner's limits,
    counted apart, below every class."""
    return msgspec.structs.replace(owner, name=name, level=BATCH_LEVEL, priority="batch",
                                   idle_s=idle_s)


def tenants_of(config: Config) -> dict[str, Tenant]:
    """Every key's class and limits, by name ("" is a request with no key)."""
    default = config.priorities.get(DEFAULT_CLASS, 0)
    out = {"": Tenant(name="", level=default),
           BATCH: batch_tenant(Tenant(name=""), BATCH, config.batches.idle_s)}
    if config.api_key is not None:
        out[API_KEY_NAME] = Tenant(name=API_KEY_NAME, level=default)
    for name, k in config.keys.items():
        out[name] = Tenant(
            name=name, priority=k.priority or DEFAULT_CLASS,
            level=config.priorities[k.priority] if k.priority is not None else default,
            max_concurrency=k.max_concurrency, requests_per_min=k.requests_per_min,
            tokens_per_min=k.tokens_per_min)
    return out
