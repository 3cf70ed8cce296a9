"""corral's end of one front worker's channel (workers.py starts the workers): the
worker's requests asked of the Scheduler, each as a `RemoteTicket`, so that the Scheduler
counts them exactly as it counts its own front's; their releases; its counts. A worker
that goes away has every ticket it held cancelled (a grant among them is released).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

import msgspec
import pykka

from ..messages import (
    Acquire,
    Cancel,
    Cut,
    Grant,
    NotCut,
    Refusal,
    Release,
    Releases,
    Requeue,
    Spend,
)
from ..runtime.bridge import SchedulerInbox
from .control import (
    Again,
    Answered,
    Ask,
    CountAsk,
    Counted,
    Drop,
    FromWorker,
    FrontCounts,
    Journaled,
    Late,
    Let,
    LetAll,
    Listening,
    LiveAsk,
    LiveNow,
    Revoked,
    Spent,
    StreamBytes,
    StreamEnd,
    StreamOpen,
    StreamStop,
    Uncut,
    frame,
    read_frame,
)
from .journaling import Recorder
from .resumable import Keeper, Tee

log = logging.getLogger("corral.workers")

COUNTS_TIMEOUT_S = 1.0
"""A worker that does not give its counts within this is left out of them (and logged)."""


class RemoteTicket:
    """A worker's request as the Scheduler sees it: its answer goes back over the channel.
    Hashable by identity, as every ticket is."""

    __slots__ = ("id", "link")

    def __init__(self, link: Link, id_: int) -> None:
        self.link = link
        self.id = id_

    def send(self, value: object) -> None:  # from the Scheduler's thread
        try:
            self.link.loop.call_soon_threadsafe(self.link.answer, self.id, value)
        except RuntimeError:
            pass  # the loop is closed: corral is gone


class RemoteProducer:
    """A worker's request whose answer is kept here: stopped over the channel."""

    __slots__ = ("link", "token")

    def __init__(self, link: Link, token: int) -> None:
        self.link = link
        self.token = token

    def stop(self, why: str) -> None:
        self.link.kept.pop(self.token, None)
        self.link.send(StreamStop(token=self.token, why=why))


class Link:
    """One worker process and its channel, on corral's loop."""

    def __init__(self, index: int, proc: asyncio.subprocess.Process,
                 scheduler: Callable[[], SchedulerInbox],
                 revoked: Callable[[int, int, tuple[Release, ...]], None],
                 keeper: Keeper, recorder: Recorder | None = None) -> None:
        self.index = index
        self.proc = proc
        self.scheduler = scheduler
        self.revoked = revoked
        """Called with (index, round, releases) when it answers a RevokeAsk."""
        self.ended = False
        """Its channel has ended: it answers nothing any more."""
        self.loop = asyncio.get_running_loop()
        self.tickets: dict[int, RemoteTicket] = {}
        """The worker's requests that corral has asked the Scheduler for and that are
        neither released nor cancelled."""
        self.listening: asyncio.Future[int] = self.loop.create_future()
        self.asked: dict[int, asyncio.Future[object]] = {}
        """What was asked of it (CountAsk, LiveAsk) and is not answered yet, by reply."""
        self.last_counts = FrontCounts()
        self.started_at: float | None = None
        """When it listened (loop time)."""
        self.answered_at = 0.0
        """When it last answered a CountAsk (loop time)."""
        self.keeper = keeper
        self.recorder = recorder
        self.kept: dict[int, Tee] = {}
        """The worker's resumable answers, by its token for each."""
        self._replies = itertools.count()
        self._decoder = msgspec.msgpack.Decoder(FromWorker)

    def send(self, message: msgspec.Struct) -> None:
        stdin = self.proc.stdin
        if stdin is not None and not stdin.is_closing():
            stdin.write(frame(message))

    def answer(self, id_: int, value: object) -> None:
        if id_ in self.tickets and isinstance(value, Grant | Refusal | Cut):
            self.send(Answered(id=id_, value=value))
            if isinstance(value, Refusal):
                del self.tickets[id_]  # nothing to release

    async def serve(self) -> None:
        """Carry out what the worker sends until its channel ends; then cancel every
        ticket it had."""
        assert self.proc.stdout is not None
        try:
            while (data := await read_frame(self.proc.stdout)) is not None:
                self._on(self._decoder.decode(data))
        except (msgspec.DecodeError, ValueError) as e:
            log.error("front worker %d sent what corral cannot read (%s); stopping it",
                      self.index, e)
            self.proc.kill()
        finally:
            self.gone()

    def _on(self, message: FromWorker) -> None:
        match message:
            case Ask(id=id_, model=model, autoload=autoload, key=key, retry=retry,
                     cuttable=cuttable, affinity=affinity, among=among, spill=spill):
                if id_ in self.tickets:
                    raise ValueError(f"request id {id_} asked for twice")
                asked = self.tickets[id_] = RemoteTicket(self, id_)
                self._tell(Acquire(ticket=asked, model=model, autoload=autoload, key=key,
                                   retry=retry, cuttable=cuttable, affinity=affinity,
                                   among=among, spill=spill))
            case Let():
                ticket = self.tickets.pop(message.id, None)
                if ticket is not None:
                    self._tell(Release(ticket=ticket, shared=message.shared,
                                       idle_s=message.idle_s, tokens=message.tokens))
            case Spent(id=id_, tokens=tokens):
                if (ticket := self.tickets.get(id_)) is not None:
                    self._tell(Spend(ticket=ticket, tokens=tokens))
            case LetAll(lets=lets):
                releases = self._releases(lets)
                if releases:
                    self._tell(Releases(releases=releases))
            case Revoked(round=round_, lets=lets):
                self.revoked(self.index, round_, self._releases(lets))
            case Again(id=id_):  # it waits again, for an answer on the same ticket
                if (ticket := self.tickets.get(id_)) is not None:
                    self._tell(Requeue(ticket=ticket))
            case Uncut(id=id_):
                if (ticket := self.tickets.get(id_)) is not None:
                    self._tell(NotCut(ticket=ticket))
            case Drop(id=id_):
                ticket = self.tickets.pop(id_, None)
                if ticket is not None:
                    self._tell(Cancel(ticket=ticket))
            case Late(late=late):
                self._tell(late)
            case Counted(reply=reply, counts=counts):
                self.last_counts, self.answered_at = counts, self.loop.time()
                self._answered(reply, counts)
            case LiveNow(reply=reply):
                self._answered(reply, message)
            case StreamOpen() | StreamBytes() | StreamEnd():
                self._kept(message)
            case Journaled(row=row):
                if self.recorder is not None:  # (a copy: not a view of the whole frame)
                    self.recorder.add_encoded(bytes(row))
            case Listening(port=port):
                if not self.listening.done():
                    self.listening.set_result(port)

    def _kept(self, message: StreamOpen | StreamBytes | StreamEnd) -> None:
        match message:
            case StreamOpen(token=token, conversation=id_, key=key, model=model):
                kept = self.keeper.keep(id_, key, model, RemoteProducer(self, token))
                if isinstance(kept, str):
                    self.send(StreamStop(token=token, why=kept))
                else:
                    self.kept[token] = kept.began()  # (sent as its answer began)
            case StreamBytes(token=token, data=data):
                if (tee := self.kept.get(token)) is not None:
                    tee.feed(data)
            case StreamEnd(token=token, why=why, drop=drop):
                if (tee := self.kept.pop(token, None)) is not None:
                    tee.drop() if drop else tee.end(why)

    def _releases(self, lets: list[Let]) -> tuple[Release, ...]:
        return tuple(Release(ticket=t, shared=let.shared, idle_s=let.idle_s, tokens=let.tokens)
                     for let in lets if (t := self.tickets.pop(let.id, None)) is not None)

    def _tell(self, message: Acquire | Release | Releases | Cancel | Late | object) -> None:
        tell(self.scheduler, message)

    def gone(self) -> None:
        self.ended = True
        if self.tickets:
            log.warning("front worker %d went away with %d requests; they are cancelled",
                        self.index, len(self.tickets))
        for ticket in self.tickets.values():
            self._tell(Cancel(ticket=ticket))
        self.tickets.clear()
        for tee in self.kept.values():
            tee.end(f"front worker {self.index} went away")
        self.kept.clear()
        if not self.listening.done():
            self.listening.set_exception(RuntimeError(
                f"front worker {self.index} exited before it listened"))

    async def ask_counts(self) -> FrontCounts | None:
        counts = await self._ask(lambda reply: CountAsk(reply=reply), "counts")
        return counts if isinstance(counts, FrontCounts) else None

    async def ask_live(self, cancel: str = "", key: str | None = None,
                       by: str = "") -> LiveNow | None:
        """Its requests now, after cancelling those with id `cancel` (of `key`)."""
        live = await self._ask(
            lambda reply: LiveAsk(reply=reply, cancel=cancel, key=key, by=by), "requests")
        return live if isinstance(live, LiveNow) else None

    async def _ask(self, question: Callable[[int], msgspec.Struct], what: str) -> object:
        reply = next(self._replies)
        future = self.asked[reply] = self.loop.create_future()
        self.send(question(reply))
        try:
            return await asyncio.wait_for(future, COUNTS_TIMEOUT_S)
        except TimeoutError:
            log.warning("front worker %d gave no %s within %g s; left out of them",
                        self.index, what, COUNTS_TIMEOUT_S)
            return None
        finally:
            self.asked.pop(reply, None)

    def _answered(self, reply: int, value: object) -> None:
        future = self.asked.pop(reply, None)
        if future is not None and not future.done():
            future.set_result(value)


def tell(scheduler: Callable[[], SchedulerInbox], message: object) -> None:
    try:
        scheduler().tell(message)  # type: ignore[arg-type]
    except pykka.ActorDeadError:
        pass  # corral is stopping
