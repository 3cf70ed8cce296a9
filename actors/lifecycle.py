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
    SUSPENDING = "suspending"
    SUSPENDED = "suspended"
    WAKING = "waking"
    REMOTE = "remote"
    """A remote model's (config/remote.py): it serves and never changes; no child, no
    slot. Shown as `loaded`.

    corral's suspended tier (issue 23): a child told to give its devices back (to host
    RAM, by its `suspend` method), kept asleep, and told to take them back. Shown as
    llama.cpp's words (`shown`): suspending and suspended are `sleeping`, waking is
    `loading`."""

    @property
    def is_running(self) -> bool:
        """A child process exists (R-4.1; stopping counts until reaped)."""
        return self in _RUNNING

    @property
    def holds_slot(self) -> bool:
        """Counts against models_max: a running child that is not suspended (suspended
        ones count against suspended_max)."""
        return self in _RUNNING and self is not ModelState.SUSPENDED

    @property
    def shown(self) -> str:
        """The state as GET /models, SSE and /metrics show it: llama.cpp's router's words,
        and corral's `stopping`."""
        return _SHOWN.get(self, self.value)

    @property
    def is_serving(self) -> bool:
        """A request may be proxied into the child right now."""
        return self in _SERVING


_RUNNING = frozenset({ModelState.LOADING, ModelState.LOADED, ModelState.SLEEPING,
                      ModelState.STOPPING, ModelState.SUSPENDING, ModelState.SUSPENDED,
                      ModelState.WAKING})
_SERVING = frozenset({ModelState.LOADED, ModelState.SLEEPING, ModelState.REMOTE})
_SHOWN = {ModelState.SUSPENDING: "sleeping", ModelState.SUSPENDED: "sleeping",
          ModelState.WAKING: "loading", ModelState.REMOTE: "loaded"}

S = ModelState
TRANSITIONS: dict[ModelState, frozenset[ModelState]] = {
    S.UNLOADED: frozenset({S.LOADING}),
    S.LOADING: frozenset({S.LOADED, S.STOPPING, S.UNLOADED}),  # unloaded: the load failed
    S.LOADED: frozenset({S.SLEEPING, S.SUSPENDING, S.STOPPING, S.UNLOADED}),  # unloaded: crashed
    S.SLEEPING: frozenset({S.LOADED, S.STOPPING, S.UNLOADED}),
    S.STOPPING: frozenset({S.UNLOADED}),
    S.SUSPENDING: frozenset({S.SUSPENDED, S.STOPPING, S.UNLOADED}),
    S.SUSPENDED: frozenset({S.WAKING, S.STOPPING, S.UNLOADED}),
    S.WAKING: frozenset({S.LOADED, S.STOPPING, S.UNLOADED}),
    S.REMOTE: frozenset(),
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
