"""Model states, the transition table, and how a child's exit is described to people."""

from __future__ import annotations

import enum
import signal


class State(enum.Enum):
    """A state or kind among a few: an Enum hashed by identity. Enum's own hash is a Python
    call (hash of the name), paid on every dict or set lookup: a handful per request on the
    front's path, and many per decision in the policy."""

    __hash__ = object.__hash__


class ModelState(State):
    """The state of one model as the Scheduler sees it (SPEC section 3)."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    SLEEPING = "sleeping"
    STOPPING = "stopping"

    @property
    def is_running(self) -> bool:
        """Holds a slot: a child process exists (R-4.1; stopping counts until reaped)."""
        return self in _RUNNING

    @property
    def is_serving(self) -> bool:
        """A request may be proxied into the child right now."""
        return self in _SERVING


_RUNNING = frozenset({ModelState.LOADING, ModelState.LOADED, ModelState.SLEEPING,
                      ModelState.STOPPING})
_SERVING = frozenset({ModelState.LOADED, ModelState.SLEEPING})

S = ModelState
TRANSITIONS: dict[ModelState, frozenset[ModelState]] = {
    S.UNLOADED: frozenset({S.LOADING}),
    S.LOADING: frozenset({S.LOADED, S.STOPPING, S.UNLOADED}),  # unloaded: the load failed
    S.LOADED: frozenset({S.SLEEPING, S.STOPPING, S.UNLOADED}),  # unloaded: it crashed
    S.SLEEPING: frozenset({S.LOADED, S.STOPPING, S.UNLOADED}),
    S.STOPPING: frozenset({S.UNLOADED}),
}
"""A crash or a failed load is `unloaded` with the record's `failed` flag, as llama.cpp's
router shows it."""


class IllegalTransition(RuntimeError):
    """A state change the table does not allow: always a bug in corral (R-3.1)."""


def check_transition(model: str, old: ModelState, new: ModelState) -> None:
    """Raise IllegalTransition unless `old -> new` is in the table."""
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(f"model {model!r}: illegal transition {old.value} -> {new.value}")


def describe_exit(returncode: int) -> str:
    """Say how a child ended, in words, from a Popen-style return code.

    >>> describe_exit(-9)
    'killed by SIGKILL (perhaps out of memory?)'
    """
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if returncode == -signal.SIGKILL:
        return f"killed by {name} (perhaps out of memory?)"
    return f"killed by {name}"
