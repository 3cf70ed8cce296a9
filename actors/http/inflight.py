"""What the fronts are serving now (issue 40, part 2): every model request from its
arrival to its end, for `GET /requests?state=running`, and its cancel
(`POST /requests/{id}/cancel`).

A front keeps its model requests' exchanges in a set (`Live`); a front worker answers
for its own over its channel (link.py). A queued request that is cancelled gets 499
`cancelled`; a running one has its child connection dropped (the child stops its work)
and its answer broken off as a client's leaving would, an error event ending a stream.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from .journaling import Trace, Work
from .phase import Phase

CANCELLED = "cancelled"
PLACES_EVERY_S = 0.5


class Running(msgspec.Struct, kw_only=True):
    """One request the fronts serve now, as `GET /requests?state=running` shows it."""

    id: str
    at: float
    """When its head arrived (Unix seconds)."""
    key: str = ""
    model: str
    served: str = ""
    copy: str = ""
    path: str
    state: str
    """"queued" (waiting for its grant) or "running" (its child has it)."""
    position: int | None = None
    """Queued: 1 + how many queued for the same model came before it (the Scheduler
    serves a key's class first: an estimate, by arrival)."""
    waited_s: float
    """In the queue so far (running: all it waited)."""
    elapsed_s: float
    bytes_out: int
    """Its answer's body so far."""
    waited: str = ""
    """What its grant waited for: "load" or "wake"."""


class Cancellable(Protocol):
    """What inflight.py uses of an exchange."""

    trace: Trace
    work: Work
    phase: Phase

    @property
    def key_name(self) -> str: ...

    @property
    def path(self) -> str: ...

    def cancel(self, why: str) -> None: ...


class Live:
    """One front's model requests, from their arrival to their end."""

    def __init__(self) -> None:
        self.exchanges: set[Cancellable] = set()
        self.places: dict[Cancellable, int] = {}
        self.placed_at = -1.0

    def place(self, ex: Cancellable, now: float) -> int:
        """`ex`'s place among the requests queued here for its model, by arrival (all of
        them placed at once, at most once each PLACES_EVERY_S: every waiting stream asks
        each second, loading.py)."""
        if now - self.placed_at > PLACES_EVERY_S:
            self.placed_at, self.places = now, {}
            counts: dict[str, int] = {}
            for w in sorted((w for w in self.exchanges if w.phase is Phase.WAITING),
                            key=lambda w: w.work.started):
                self.places[w] = counts[w.trace.model] = counts.get(w.trace.model, 0) + 1
        return self.places.get(ex, 1)

    def running(self, now: float) -> list[Running]:
        """Every one, `now` the loop's time."""
        return [_shown(ex, now) for ex in self.exchanges]

    def cancel(self, id_: str, key: str | None, by: str) -> int:
        """Cancel the requests with id `id_` (of key `key`, when given); how many."""
        found = [ex for ex in self.exchanges
                 if ex.trace.id == id_ and (key is None or ex.key_name == key)]
        for ex in found:
            ex.cancel(f"{CANCELLED} by {by}")
        return len(found)


def _shown(ex: Cancellable, now: float) -> Running:
    t = ex.trace
    queued = ex.phase is Phase.WAITING
    return Running(id=t.id, at=t.at, key=ex.key_name, model=t.model, served=t.served,
                   copy=t.copy, path=ex.path, state="queued" if queued else "running",
                   waited_s=round(t.queue_s + (now - ex.work.asked_at if queued else 0.0), 3),
                   elapsed_s=round(now - ex.work.started, 3), bytes_out=t.bytes_out,
                   waited=t.waited)


def ranked(running: list[Running]) -> list[Running]:
    """Every front's together: the queued first, each with its place among those queued
    for its model, longest waiting first; then the running, longest first."""
    queued = sorted((r for r in running if r.state == "queued"), key=lambda r: -r.waited_s)
    places: dict[str, int] = {}
    for r in queued:
        r.position = places[r.model] = places.get(r.model, 0) + 1
    return queued + sorted((r for r in running if r.state != "queued"),
                           key=lambda r: -r.elapsed_s)

