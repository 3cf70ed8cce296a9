"""A front worker: `python -m actors.http.worker`, started by corral (workers.py) with its
`Setup` on stdin. It serves corral's port beside corral's own front and the other workers
(SO_REUSEPORT) and asks corral's Scheduler for grants over stdin and stdout (control.py).
When corral goes away (its channel ends), the worker drains and ends too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys

import msgspec
import pykka

from .. import loop as loops
from ..bridge import LoopReply
from ..messages import (
    Acquire,
    AnswerLate,
    Cancel,
    Release,
    Releases,
    SchedulerMessage,
)
from .control import (
    Answered,
    Ask,
    CountAsk,
    Counted,
    Drain,
    Drop,
    Late,
    Let,
    LetAll,
    Listening,
    NewRoutes,
    Notice,
    Setup,
    ToWorker,
    frame,
    read_frame,
)
from .front import Front

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
            case Acquire(ticket=ticket, model=model, autoload=autoload):
                assert isinstance(ticket, LoopReply)
                id_ = next(self.ids)
                self.tickets[id_] = ticket
                self.id_of[ticket] = id_
                self._send(Ask(id=id_, model=model, autoload=autoload))
            case Release():
                self._send(self._let(message))
            case Releases(releases=releases):
                self._send(LetAll(lets=[self._let(r) for r in releases]))
            case Cancel(ticket=ticket):
                id_ = self.id_of.pop(ticket, None)  # type: ignore[call-overload]
                if id_ is not None:
                    del self.tickets[id_]
                    self._send(Drop(id=id_))
            case AnswerLate():
                self._send(Late(late=message))
            case _:
                raise TypeError(f"a front worker does not send {type(message).__name__}")

    def _let(self, release: Release) -> Let:
        id_ = self.id_of.pop(release.ticket, 0)  # type: ignore[call-overload]
        self.tickets.pop(id_, None)
        return Let(id=id_, shared=release.shared, idle_s=release.idle_s)

    def _send(self, message: msgspec.Struct) -> None:
        self.out.write(frame(message))

    def answered(self, id_: int, value: object) -> None:
        ticket = self.tickets.get(id_)
        if ticket is not None:
            ticket.send(value)


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
    front = Front(setup.routes, lambda: corral, setup.api_port, setup.api_key, setup.http,
                  setup.max_body_mib, setup.api_secret)
    port = await front.listen(setup.host, setup.port, reuse_port=True)
    corral._send(Listening(port=port))
    decoder = msgspec.msgpack.Decoder(ToWorker)
    drain_s = GONE_DRAIN_S
    while (data := await read_frame(reader)) is not None:
        match decoder.decode(data):
            case Answered(id=id_, value=value):
                corral.answered(id_, value)
            case Notice(notice=notice):
                front.grant_notice(notice)
            case NewRoutes(routes=routes):
                front.routes = routes
            case CountAsk(reply=reply):
                corral._send(Counted(reply=reply, counts=front.counts()))
            case Drain(timeout_s=timeout_s):
                drain_s = timeout_s
                break
    else:
        log.warning("front worker %d: corral's process is gone; draining", setup.index)
    await front.drain(drain_s)  # grants kept idle go back before the channel closes
    corral.closed = True
    out.close()
    return 0


def main() -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return loops.run(serve())


if __name__ == "__main__":
    sys.exit(main())
