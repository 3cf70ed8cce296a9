"""What a person asks of the policy: load a model (POST /models/load), unload it (POST
/models/unload), and stop everything (corral stopping)."""

from __future__ import annotations

from collections.abc import Hashable

from ..lifecycle import ModelState
from ..messages import Done
from .records import Answer, Effect
from .rules import Rules
from .state import State

S = ModelState


class Commands:
    """The management commands, each an event method like `Policy`'s."""

    def __init__(self, state: State, rules: Rules) -> None:
        self.state = state
        self.rules = rules
        self.moves = rules.moves

    def load(self, ticket: Hashable, model: str, now: float) -> list[Effect]:
        """POST /models/load: queue a load with no request behind it; ends a backoff."""
        rec = self.state.find(model)
        if rec is None:
            self.moves.refuse(ticket, 404, f"model '{model}' not found", "not_found_error")
        elif rec.rules.remote:
            self.moves.refuse(ticket, 400, f"model '{model}' is a remote model: it has no "
                              "child to load", "invalid_request_error")
        elif any(r.state.is_running and r.state not in (S.STOPPING, S.SUSPENDED)
                 for r in self.state.groups.of(rec)):
            self.moves.refuse(ticket, 400, f"model '{model}' is already running",
                         "invalid_request_error")
        elif self.state.shutting_down:
            self.moves.refuse(ticket, 503, "corral is shutting down", retry_after_s=1.0)
        else:
            rec.breaker.reset()
            self.state.queue.open(model).explicit = True
            self.state.out.append(Answer(ticket, Done()))
            self.rules.pump(now)
        return self.moves.flush()

    def unload(self, ticket: Hashable, model: str, now: float) -> list[Effect]:
        """POST /models/unload: stop the child now (busy or not); clears a failure."""
        rec = self.state.find(model)
        if rec is None:
            self.moves.refuse(ticket, 404, f"model '{model}' not found", "not_found_error")
            return self.moves.flush()
        if rec.rules.remote:
            self.moves.refuse(ticket, 400, f"model '{model}' is a remote model: it has no "
                              "child to unload", "invalid_request_error")
            return self.moves.flush()
        entry = self.state.queue.entry(model)
        if entry is not None and entry.explicit:
            entry.explicit = False
            if self.state.queue.close_if_empty(model):
                self.moves.idle(rec)
        absent = self.state.absent(rec)
        if absent and rec.failed:
            rec.failed = False
            rec.breaker.reset()
            self.moves.publish_state(rec, "failure cleared by unload", now)
        elif absent:
            self.moves.refuse(ticket, 400, f"model '{model}' is not running",
                         "invalid_request_error")
            self.rules.pump(now)  # a queued load it dropped may have held others up
            return self.moves.flush()
        else:  # every child of it, a reload's old or new one too
            for copy in self.state.groups.all_of(rec):
                if copy.state.is_running and copy.state is not S.STOPPING:
                    self.moves.stop(copy, "manual", None, now)
        self.state.out.append(Answer(ticket, Done()))
        self.rules.pump(now)
        return self.moves.flush()

    def shutdown(self, now: float) -> list[Effect]:
        """Refuse every waiter, stop every child; `all_stopped` tells when it is over."""
        self.state.shutting_down = True
        for ticket in self.state.queue.clear():
            self.moves.refuse(ticket, 503, "corral is shutting down", retry_after_s=1.0)
        for rec in self.state.models.values():
            if rec.state.is_running and rec.state is not S.STOPPING:
                self.moves.stop(rec, "shutdown", None, now)
        return self.moves.flush()
