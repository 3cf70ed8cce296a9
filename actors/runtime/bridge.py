"""The one seam between actor threads and the asyncio loop (R-1.3).

Actors answer by calling `reply.send(value)` from their own thread. A `LoopReply` carries
the value into the event loop with `call_soon_threadsafe`; the loop never blocks on an
actor and never awaits a Pykka future. A `ThreadReply` wakes a waiting thread (the
synchronous embedding API).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from ..messages import Acquire, Cancel, Cut, Grant, Inbox, Refusal, Requeue, SchedulerMessage

SchedulerInbox = Inbox[SchedulerMessage]
"""The Scheduler's ref, as the loop side holds it."""


def _resolve(future: asyncio.Future[object], value: object) -> None:
    if not future.done():  # the awaiting request may have been cancelled meanwhile
        future.set_result(value)


class LoopReply:
    """An answer slot that resolves an asyncio future on its loop, from any thread.

    Hashable by identity, so the instance itself serves as the request's ticket. A `Cut`
    sent after its grant sets `cut` and calls `on_cut`, on the loop.
    """

    __slots__ = ("_loop", "cut", "future", "on_cut")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.future: asyncio.Future[object] = loop.create_future()
        self.cut = False
        """A Cut came for its grant (policy/cuts.py), not yet acted on."""
        self.on_cut: Callable[[], None] | None = None

    def send(self, value: object) -> None:
        try:
            if isinstance(value, Cut):
                self._loop.call_soon_threadsafe(self._cut)
            else:
                self._loop.call_soon_threadsafe(_resolve, self.future, value)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting any more

    def rearm(self) -> None:
        """A fresh future for the ticket's next answer (it waits again after a cut)."""
        self.future = self._loop.create_future()
        self.cut = False

    def _cut(self) -> None:
        self.cut = True
        if self.on_cut is not None:
            self.on_cut()


class ThreadReply:
    """An answer slot a plain thread waits on."""

    __slots__ = ("_event", "_value")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value: object = None

    def send(self, value: object) -> None:
        if isinstance(value, Cut):
            return  # a thread's request cannot be cut: it runs to its end
        self._value = value
        self._event.set()

    def wait(self, timeout_s: float | None) -> object:
        """The value sent, or None if none came within `timeout_s`."""
        if not self._event.wait(timeout_s):
            return None
        return self._value


class Fanout:
    """Hands each published event to a callback on the given loop (SSE, subscribers)."""

    __slots__ = ("_callback", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: object) -> None:
        self._loop = loop
        self._callback = callback

    def __call__(self, event: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._callback, event)  # type: ignore[arg-type]
        except RuntimeError:
            pass


async def acquire(scheduler: SchedulerInbox, model: str, autoload: bool = True,
                  key: str = "", retry: bool = False, cuttable: bool = False,
                  affinity: int = 0, among: tuple[str, ...] = (), spill: bool = False,
                  ) -> tuple[LoopReply, Grant | Refusal]:
    """Ask the Scheduler for `model` and wait for the answer, without blocking the loop.

    Returns the ticket (to Release after a Grant) and the answer. If the wait is
    cancelled (the client left), the request leaves the queue, or, if its grant crossed
    the cancel, is released.
    """
    ticket = LoopReply(asyncio.get_running_loop())
    return ticket, await _ask(scheduler, ticket, Acquire(
        ticket=ticket, model=model, autoload=autoload, key=key, retry=retry,
        cuttable=cuttable, affinity=affinity, among=among, spill=spill))


async def requeue(scheduler: SchedulerInbox, ticket: LoopReply) -> Grant | Refusal:
    """Give back the slot of `ticket`, cut for a higher class with nothing sent to its
    client, and wait for its next answer (on a fresh future of the same ticket); a
    cancelled wait leaves the queue, as in `acquire`."""
    ticket.rearm()
    return await _ask(scheduler, ticket, Requeue(ticket=ticket))


async def _ask(scheduler: SchedulerInbox, ticket: LoopReply,
               message: Acquire | Requeue) -> Grant | Refusal:
    scheduler.tell(message)
    try:
        answer = await ticket.future
    except BaseException:
        scheduler.tell(Cancel(ticket=ticket))
        raise
    assert isinstance(answer, Grant | Refusal)
    return answer
