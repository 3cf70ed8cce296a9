"""The `hooks` tables (issue 25): commands corral runs around a model's child, as
llama-swap users asked for (llama-swap#156, #413, #1064). Run by actors/instance/hooks.py."""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

HookName = Literal["before_load", "after_ready", "before_stop", "after_exit"]
HOOK_PLACEHOLDER = re.compile(r"\{(model|port|pid|devices|reason)\}")
"""What a hook's argv may say: the model, its child's port and pid (after_ready and
before_stop), its devices, and why it stops or stopped (before_stop, after_exit)."""
Argv = Annotated[list[str], Meta(min_length=1)]


class Hooks(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A `[hooks]` table (every model's defaults) or a model's `hooks = { ... }` (its
    own, event by event). Each is an argv, never run through a shell."""

    before_load: Argv | None = None
    """Before the child is spawned; a failure (exit status not 0, or no end within
    hook_timeout_s) fails the load, with the hook's exit in the reason."""
    after_ready: Argv | None = None
    """Once the child answers, before its first request is granted (a warm-up request,
    a check); a failure fails the load."""
    before_stop: Argv | None = None
    """When corral stops a ready child, before it is told to go; a failure is logged."""
    after_exit: Argv | None = None
    """Once the child has exited, whyever; a failure is logged."""

    def over(self, defaults: Hooks) -> Hooks:
        """These hooks, each missing one taken from `defaults`."""
        return Hooks(**{name: getattr(self, name) or getattr(defaults, name)
                        for name in self.__struct_fields__})

    def __bool__(self) -> bool:
        return any(getattr(self, name) for name in self.__struct_fields__)
