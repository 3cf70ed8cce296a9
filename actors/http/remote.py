"""Remote models as the front sends to them (config/remote.py): where (`Far`: host, port,
TLS, base path, the headers that go with every request), and whether to try (`Breakers`).

A remote model has no child, so nothing tells the Scheduler it is down. The front keeps a
breaker per remote: after `TRIPS` failures in a row (no connection, no answer in time, or
a 5xx of the remote's own) it is *open*, and a request for it gets a 503 at once (a
virtual model's fallback then takes the next member) for 1 s, doubling up to
`OPEN_MAX_S` at each failure after. When that time is out one request goes through: its
success closes the breaker, its failure opens it again. Every front (worker) keeps its
own.
"""

from __future__ import annotations

import hashlib
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from ..config.model import Config
from ..config.remote import End, end_of

log = logging.getLogger("corral.front")

TRIPS = 3
OPEN_S = 1.0
OPEN_MAX_S = 60.0
TRIAL_S = 30.0
"""A trial whose outcome has not come by then is taken as lost: another may go."""


class Far(msgspec.Struct, frozen=True):
    """A remote model as the front sends to it."""

    end: End
    lines: tuple[bytes, ...]
    """Header lines sent with each request: its key, its `headers`."""
    drop: frozenset[bytes]
    """The client's headers not sent on beside a child's (a cookie, those `lines` set)."""
    connect_timeout_s: float
    ca_file: str
    sends_asked: bool
    """A `models = "*"` peer's: the body names the model as the client did."""
    tag: str = ""
    """Its pools' tag: a remote's connections are never a child's, and a reload that
    changes what is sent with them (a new key) or how they are made makes new ones."""

    @property
    def prefix(self) -> bytes:
        return self.end.path.encode()




def fars(config: Config) -> dict[str, Far]:
    """Each remote model of `config` -> how the front sends to it."""
    out, wildcard = {}, catch_all(config)
    for name, m in config.models.items():
        if not m.url:
            continue
        end = end_of(m.url)
        assert isinstance(end, End), end  # (checked as the config was read)
        lines = [b"Authorization: Bearer " + m.api_key.encode()] if m.api_key else []
        lines += [f"{n}: {v}".encode() for n, v in m.headers.items()]
        drop = {b"cookie"} | {n.lower().encode() for n in m.headers}
        how = repr((lines, m.ca_file, m.connect_timeout_s, end.tls, end.path)).encode()
        out[name] = Far(end, tuple(lines), frozenset(drop), m.connect_timeout_s, m.ca_file,
                        name == wildcard, "remote:" + hashlib.sha256(how).hexdigest()[:16])
    return out


def path_problem(url: bytes, model: str) -> str | None:
    """What keeps a request's target from going under a remote's base path (None:
    nothing): it must be a path (`/...`) with no `.` or `..` segment, `%2e` read as `.`."""
    path = url.partition(b"?")[0]
    parts = path.replace(b"%2e", b".").replace(b"%2E", b".").split(b"/")
    if path.startswith(b"/") and b"." not in parts and b".." not in parts:
        return None
    return (f"a request for remote model '{model}' names a path with '.' or '..' segments, "
            "or one that does not start with '/'")


def catch_all(config: Config) -> str:
    """The remote model that takes every name corral lacks (a `models = "*"` peer's)."""
    return next((n for n, p in config.peers.items() if p.models == "*"), "")


_contexts: dict[str, ssl.SSLContext] = {}


def tls_context(ca_file: str) -> ssl.SSLContext:
    """The context an https remote is checked with (its `ca_file`, or the system's)."""
    context = _contexts.get(ca_file)
    if context is None:
        context = _contexts[ca_file] = ssl.create_default_context(cafile=ca_file or None)
    return context


@dataclass(slots=True)
class Breaker:
    failures: int = 0
    open_until: float = 0.0
    open_s: float = 0.0
    trying: float = 0.0
    """One request goes through after an open spell; until then (or its outcome), no other."""
    last: str = ""


class Breakers:
    """A breaker per remote model, as the module's note says (per name asked, for the
    `models = "*"` peer's: one name that fails there does not shut out the others)."""

    def __init__(self) -> None:
        self.of: dict[str, Breaker] = {}

    def is_open(self, model: str, now: float) -> bool:
        """`model`'s requests get 503 now (`refuses`, without taking the trial)."""
        b = self.of.get(model)
        return b is not None and b.failures >= TRIPS and (now < b.open_until or now < b.trying)

    def settle(self, model: str) -> None:
        """A request for `model` ended with no outcome (its client left, it was cut): a
        trial it was is no longer out."""
        b = self.of.get(model)
        if b is not None:
            b.trying = 0.0

    def keep(self, same: Callable[[str], bool]) -> None:
        """A reload: the breakers of remotes it changed (or removed) start afresh."""
        for model in [m for m in self.of if not same(m)]:
            del self.of[model]

    def refuses(self, model: str, now: float) -> str | None:
        """Why a request for `model` gets a 503 now (None: it goes)."""
        b = self.of.get(model)
        if b is None or b.failures < TRIPS:
            return None
        if now < b.open_until or now < b.trying:
            wait = max(b.open_until - now, 0.0)
            return (f"remote model '{model}' failed {b.failures} times in a row (last: "
                    f"{b.last}); the next try in {wait:.1f} s")
        b.trying = now + TRIAL_S
        return None

    def went(self, model: str, ok: bool, why: str, now: float) -> None:
        """A request for `model` ended: `ok`, or failed for `why`."""
        b = self.of.get(model)
        if ok:
            if b is not None:
                if b.failures >= TRIPS:
                    log.info("remote model '%s' answers again; its breaker closes", model)
                del self.of[model]
            return
        if b is None:
            b = self.of[model] = Breaker()
        b.failures += 1
        b.last = why
        b.trying = 0.0
        if b.failures >= TRIPS:
            b.open_s = min(b.open_s * 2 if b.open_s else OPEN_S, OPEN_MAX_S)
            b.open_until = now + b.open_s
            log.warning("remote model '%s' failed %d times in a row (%s): its requests get "
                        "503 for %.0f s", model, b.failures, why, b.open_s)

    def ended(self, model: str, status: int, broke: str | None, unsent: bool,
              now: float) -> None:
        """What a request sent to `model` tells its breaker: its answer's `status`, or
        that it could not be sent (`unsent`); neither (its client left, it was cut): no
        outcome."""
        if status:
            self.went(model, status < 500, broke or f"status {status}", now)
        elif unsent:
            self.went(model, False, broke or "no connection", now)
        else:
            self.settle(model)

    def retry_after(self, model: str, now: float) -> float:
        b = self.of.get(model)
        return max(b.open_until - now, 1.0) if b is not None else 1.0
