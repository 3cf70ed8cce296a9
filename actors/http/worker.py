"""A front worker: `python -m actors.http.worker`, started by corral (workers.py) with its
`Setup` on stdin. It serves corral's port beside corral's own front and the other workers
(it accepts on corral's listening sockets, inherited) and asks corral's Scheduler for
grants over stdin and stdout (control.py).
When corral goes away (its channel ends), the worker drains and ends too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import sys

import msgspec
import pykka

from ..journal.record import Row, encode
from ..messages import (
    Acquire,
    AnswerLate,
    Cancel,
    NotCut,
    Refusal,
    Release,
    Releases,
    Requeue,
    SchedulerMessage,
    Spend,
)
from ..runtime import loop as loops
from ..runtime.bridge import LoopReply
from .control import (
    Again,
    Answered,
    Ask,
    BoardNow,
    CountAsk,
    Counted,
    Drain,
    Drop,
    Journaled,
    Late,
    Let,
    LetAll,
    Listening,
    LiveAsk,
    LiveNow,
    NewRoutes,
    Notice,
    RevokeAsk,
    Revoked,
    Setup,
    Spent,
    StreamBytes,
    StreamEnd,
    StreamOpen,
    StreamStop,
    ToWorker,
    Uncut,
    frame,
    read_frame,
)
from .front import Front
from .resumable import Producer, Tee

log = logging.getLogger("corral.worker")

GONE_DRAIN_S = 5.0
"""When corral goes away, how long running answers may take to finish."""


class Corral:
    """corral's Scheduler as this worker's front sees it: an inbox whose messages go over
    the channel, each request named by an id."""

    def __init__(self, out: asyncio.WriteTransport) -> None:
        self.out = out
        self.ids = itertools.count(1)
        self.tickets: dict[int, LoopReply] = {}
        self.id_of: dict[LoopReply, int] = {}
        self.closed = False

    def tell(self, message: SchedulerMessage) -> None:
        if self.closed:
            raise pykka.ActorDeadError("corral's process is gone")
        match message:
            case Acquire(ticket=ticket, model=model, autoload=autoload, key=key, retry=retry,
                         cuttable=cuttable, affinity=affinity, among=among, spill=spill):
                assert isinstance(ticket, LoopReply)
                id_ = next(self.ids)
                self.tickets[id_] = ticket
                self.id_of[ticket] = id_
                self._send(Ask(id=id_, model=model, autoload=autoload, key=key, retry=retry,
                               cuttable=cuttable, affinity=affinity, among=among,
                               spill=spill))
            case Release():
                self._send(self._let(message))
            case Spend(ticket=ticket, tokens=tokens):
                self._send(Spent(id=self.id_of.get(ticket, 0),  # type: ignore[call-overload]
                                 tokens=tokens))
            case Releases(releases=releases):
                self._send(LetAll(lets=[self._let(r) for r in releases]))
            case Cancel(ticket=ticket):
                id_ = self.id_of.pop(ticket, None)  # type: ignore[call-overload]
                if id_ is not None:
                    del self.tickets[id_]
                    self._send(Drop(id=id_))
            case Requeue(ticket=ticket):
                self._send(Again(id=self.id_of.get(ticket, 0)))  # type: ignore[call-overload]
            case NotCut(ticket=ticket):
                self._send(Uncut(id=self.id_of.get(ticket, 0)))  # type: ignore[call-overload]
            case AnswerLate():
                self._send(Late(late=message))
            case _:
                raise TypeError(f"a front worker does not send {type(message).__name__}")

    def _let(self, release: Release) -> Let:
        id_ = self.id_of.pop(release.ticket, 0)  # type: ignore[call-overload]
        self.tickets.pop(id_, None)
        return Let(id=id_, shared=release.shared, idle_s=release.idle_s,
                   tokens=release.tokens)

    def _send(self, message: msgspec.Struct) -> None:
        if not self.closed and not self.out.is_closing():
            self.out.write(frame(message))

    def answered(self, id_: int, value: object) -> None:
        ticket = self.tickets.get(id_)
        if ticket is None:
            return  # its client left: corral has its Drop
        if isinstance(value, Refusal):  # nothing to release: forgotten here as in corral
            del self.tickets[id_]
            self.id_of.pop(ticket, None)
        ticket.send(value)


class RemoteKept:
    """This worker's resumable answers, kept in corral's process (resumable.py): each
    request's bytes go over the channel, named by a token."""

    def __init__(self, corral: Corral) -> None:
        self.corral = corral
        self.tokens = itertools.count(1)
        self.producers: dict[int, Producer] = {}

    def keep(self, id_: str, key: str, model: str, producer: Producer) -> Tee | str:
        token = next(self.tokens)
        self.producers[token] = producer
        return RemoteTee(self, token, StreamOpen(token=token, conversation=id_, key=key,
                                                 model=model))

    def stopped(self, token: int, why: str) -> None:
        producer = self.producers.pop(token, None)
        if producer is not None:
            producer.stop(why)


class RemoteRecorder:
    """This worker's requests' records, sent to corral's journal."""

    def __init__(self, corral: Corral, capture: int) -> None:
        self.corral = corral
        self.capture = capture

    def add(self, row: Row) -> None:
        self.corral._send(Journaled(row=msgspec.Raw(encode(row))))

    def add_encoded(self, row: bytes) -> None:
        self.corral._send(Journaled(row=msgspec.Raw(row)))


class RemoteTee:
    """A request's answer, kept in corral's process from its first byte (corral may
    refuse its id then: a StreamStop comes back)."""

    __slots__ = ("kept", "opening", "token")

    def __init__(self, kept: RemoteKept, token: int, opening: StreamOpen) -> None:
        self.kept = kept
        self.token = token
        self.opening: StreamOpen | None = opening
        """Sent when its answer begins as a stream (None: sent)."""

    def began(self) -> RemoteTee:
        if self.opening is not None:
            self.kept.corral._send(self.opening)
            self.opening = None
        return self

    def feed(self, data: bytes) -> None:
        self.kept.corral._send(StreamBytes(token=self.token, data=data))

    def end(self, why: str = "") -> None:
        self.kept.producers.pop(self.token, None)
        if self.opening is None:
            self.kept.corral._send(StreamEnd(token=self.token, why=why))

    def drop(self) -> None:
        self.kept.producers.pop(self.token, None)
        if self.opening is None:
            self.kept.corral._send(StreamEnd(token=self.token, drop=True))


async def serve() -> int:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(1, "wb"))
    data = await read_frame(reader)
    if data is None:
        return 1
    setup = msgspec.msgpack.decode(data, type=Setup)
    logging.getLogger().setLevel(setup.log_level)
    corral = Corral(out)
    front = Front(setup.routes, lambda: corral, setup.api_port, setup.http,
                  setup.max_body_mib, setup.api_secret, kept := RemoteKept(corral),
                  RemoteRecorder(corral, setup.capture) if setup.journal else None,
                  setup.tracing)
    port = await front.listen(setup.host, setup.port, fds=setup.fds)
    corral._send(Listening(port=port))
    loops.freeze_startup_heap()
    decoder = msgspec.msgpack.Decoder(ToWorker)
    ending: list[asyncio.Task[None]] = []

    async def end(timeout_s: float) -> None:
        """Drain, with the channel still read: a request waiting for its grant gets it,
        and what runs is released; grants kept idle go back; then the channel closes."""
        await front.drain(timeout_s)
        out.close()
        reader.feed_eof()

    def drain(timeout_s: float, why: str) -> None:
        if not ending:
            log.info("front worker %d: %s; draining", setup.index, why)
            ending.append(loop.create_task(end(timeout_s)))

    # Ctrl-C reaches the whole process group: corral drains its workers itself. A SIGTERM
    # for the worker alone (or its cgroup's) drains it as corral would.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    loop.add_signal_handler(signal.SIGTERM, drain, setup.http.drain_timeout_s, "SIGTERM")
    while (data := await read_frame(reader)) is not None:
        if isinstance(message := decoder.decode(data), Drain):
            drain(message.timeout_s, "told to by corral")
        else:
            carry_out(message, front, corral, kept)
    if not ending:  # the channel ended: corral's process is gone
        log.warning("front worker %d: corral's process is gone; draining", setup.index)
        corral.closed = True  # a request now gets 503
        await front.drain(GONE_DRAIN_S)
    else:
        await ending[0]
    return 0


def carry_out(message: ToWorker, front: Front, corral: Corral, kept: RemoteKept) -> None:
    """What corral's process tells or asks this worker (but Drain)."""
    match message:
        case Answered(id=id_, value=value):
            corral.answered(id_, value)
        case Notice(notice=notice):
            front.grant_notice(notice)
        case RevokeAsk(round=round_, revoke=revoke):
            idle = front.shares.revoked_idle(revoke)
            corral._send(Revoked(round=round_, lets=[corral._let(r) for r in idle]))
        case NewRoutes(routes=routes):
            front.reroute(routes)
        case CountAsk(reply=reply):
            corral._send(Counted(reply=reply, counts=front.counts()))
        case LiveAsk(reply=reply, cancel=id_, key=key, by=by):
            n = front.live.cancel(id_, key, by) if id_ else 0
            corral._send(LiveNow(reply=reply, cancelled=n, running=front.live.running(
                asyncio.get_running_loop().time())))
        case StreamStop(token=token, why=why):
            kept.stopped(token, why)
        case BoardNow(board=board):
            front.board = board


def main() -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return loops.run(serve())


if __name__ == "__main__":
    sys.exit(main())
