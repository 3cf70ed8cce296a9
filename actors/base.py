"""BaseActor: Pykka has no supervision, so a crash is reported here (R-1.5)."""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

import pykka

from .messages import Inbox

if TYPE_CHECKING:
    from pykka._actor import ActorInbox

M = TypeVar("M")

CrashHandler = Callable[[str, BaseException], None]
"""Called from the crashing actor's thread with its name and the exception."""


class BaseActor(pykka.ThreadingActor):
    """An actor that reports an unhandled exception to the supervisor before it dies.

    A `tell`'d message that raises kills a Pykka actor with only a log line; corral
    treats that as fatal: the supervisor shuts everything down in order and exits
    non-zero.
    """

    use_daemon_thread = True
    """A program that embeds corral and forgets stop() still exits (children die with it)."""

    def __init__(self, name: str, on_crash: CrashHandler) -> None:
        super().__init__()
        self.name = name
        self.log = logging.getLogger(f"corral.{name}")
        self._on_crash = on_crash

    @staticmethod
    def _create_actor_inbox() -> ActorInbox:
        # Pykka's default inbox is a queue.Queue: a Condition and a new lock per wait,
        # in Python. The C SimpleQueue does the same put/get/empty for far less.
        return queue.SimpleQueue()

    def _handle_receive(self, message: object) -> object:
        # A tell to an actor that has stopped raises ActorDeadError in the sender. Actors
        # stop only when corral stops, or with a crash that stops corral (reported once,
        # by the actor that crashed): the message is moot, and the sender must not die
        # of it too (issue 37: the DeviceMonitor's next report to a crashed Scheduler
        # logged a second crash, with its traceback).
        try:
            return super()._handle_receive(message)
        except pykka.ActorDeadError as e:
            self.log.info("%s: a message to an actor that has stopped was dropped (%s)",
                          self.name, e)
            return None

    def on_failure(self, exception_type: type[BaseException] | None,
                   exception_value: BaseException | None,
                   traceback: TracebackType | None) -> None:
        self.log.critical("actor %s crashed", self.name,
                          exc_info=(exception_type, exception_value, traceback))  # type: ignore[arg-type]
        self._on_crash(self.name, exception_value or RuntimeError("unknown failure"))


def tell_or_drop(ref: Inbox[M], message: M) -> None:
    """Tell from a helper thread; a recipient that has stopped no longer cares."""
    try:
        ref.tell(message)
    except pykka.ActorDeadError:
        pass
