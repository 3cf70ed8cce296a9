"""An exchange's phases (exchange.py).

    waiting ──> forwarding ──> streaming ──> done
       └───────────┴──────────────┴────────────^

waiting: for the Scheduler's grant and a pooled connection; forwarding: the request is
sent, no answer head yet (a 502/504 can still be given); streaming: the child's head has
gone to the client (from here a failure can only end the stream); done.
"""

from __future__ import annotations

from ..lifecycle import State


class Phase(State):
    WAITING = "waiting"
    FORWARDING = "forwarding"
    STREAMING = "streaming"
    DONE = "done"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.WAITING: frozenset({Phase.FORWARDING, Phase.DONE}),
    Phase.FORWARDING: frozenset({Phase.STREAMING, Phase.DONE, Phase.WAITING}),  # a retry
    Phase.STREAMING: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}
API = "corral's API"
"""What an exchange forwards to until it is given to a model."""
