"""One request and its answer: the front's unit of work.

An `Exchange` owns everything that belongs to one request — its grant, its upstream
connection, the flags of the answer being written — so that nothing of one request can
leak into the next on the same client connection (issue 10). Its phases are phase.py's;
which instance it goes to, and when it goes again, is tries.py's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Protocol

import msgspec
import pykka

from ..lifecycle import IllegalTransition
from ..messages import NotCut
from ..runtime.bridge import LoopReply
from .edge import TO_API_DROPPED, Answer, error_type, target
from .inflight import CANCELLED
from .journaling import Trace, Work, record
from .loading import Loading, Waiting, error_event
from .phase import API, TRANSITIONS, Phase
from .pool import Pool
from .relay import Relay
from .request import Request
from .resumable import Tee
from .services import Services
from .tries import to_any
from .tunnel import Client as TunnelClient
from .upstream import Broke, Upstream
from .usage import Meter

log = logging.getLogger("corral.front")
TRACED = frozenset({b"traceparent"})


class Client(TunnelClient, Protocol):
    """What an exchange writes its answer to: its client connection."""

    loop: asyncio.AbstractEventLoop

    def write(self, data: bytes) -> None: ...

    def exchange_done(self, exchange: Exchange) -> None: ...


class Exchange(Relay):
    """One request on one client connection, from its grant to the last byte of its answer."""

    __slots__ = ("broke", "broke_at", "broke_kind", "cut", "done", "may_replay", "may_retry",
                 "task", "timer", "trace", "upgrade", "work")

    client: Client  # (more of it than its answer's side uses)

    def __init__(self, services: Services, client: Client, req: Request) -> None:
        self.services = services
        self.client = client
        self.req = req
        self.phase = Phase.WAITING
        self.keep_alive = req.keep_alive
        """Whether the client connection stays open after this answer."""
        self.head_only = req.method == b"HEAD"
        self.upgrade = req.upgrade
        self.chunked = False
        """The answer is re-framed as chunks for the client (the child gave no length)."""
        self.sse = False
        self.what = API
        self.upstream: Upstream | None = None
        """The leased connection, while the answer is being read from it."""
        self.out: list[bytes] = []
        """Bytes for the client, written once per upstream read (`flush`)."""
        self.done: asyncio.Future[None] | None = None
        self.status = 0
        """The status of the answer the client got (0: none yet)."""
        self.first_at: float | None = None
        """When the answer's head went to the client (loop time)."""
        self.late: str | None = None
        """The child was late (no head within first_byte_timeout_s, or silent mid-answer):
        why, for the liveness check it fails."""
        self.broke: str | None = None
        """Why the child's connection broke before the final answer's head, when the
        request may be sent again (`broke_kind` says where)."""
        self.broke_kind: Broke | None = None
        self.broke_at = 0.0
        """When it broke (loop time)."""
        self.may_replay = False
        """Whether a child gone with it before answering hands it to the next instance."""
        self.may_retry = False
        """Whether a child that cannot be reached hands the request on (`Broke.REFUSED`)."""
        self.meter: Meter | None = None
        """The tokens of a model's answer to a request with a named key."""
        self.ticket: LoopReply | None = None
        """The ticket of its grant while the Scheduler may cut it (a grant of its own)."""
        self.cut = False
        """It was cut for a higher class before its answer began: it waits again."""
        self.timer: asyncio.TimerHandle | None = None
        """Its first-byte timeout (first_byte_timeout_s), while it runs."""
        self.kept: Tee | None = None
        """Where its answer is kept (X-Conversation-Id): it outlives its client."""
        self.trace = Trace.of(req)
        """What the journal keeps of it."""
        self.work = Work(client.loop.time(), req.request_id is None)
        """What it holds of its own only while it runs: its times, its answer's tail."""
        self.loading: Loading | None = None
        """Its waiting told in its stream (send_loading_state: loading.py)."""
        self.held: bytearray | None = None
        """A child's error answer after that stream's head: its end's error event."""
        self.partial: bytes | None = None
        """An event stream's unended event, held till its end comes (relay.py)."""
        self.loop = client.loop
        self.task = client.loop.create_task(self.run())

    def is_event_stream(self) -> bool:
        """An event stream of corral's own API (/models/sse, followed logs): endless."""
        return self.sse and self.what == API

    def _to(self, phase: Phase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"exchange: {self.phase.value} -> {phase.value}")
        self.phase = phase

    # ------------------------------------------------------------ the request

    async def run(self) -> None:
        try:
            await self._serve()
        except pykka.ActorDeadError:
            self.answer(Answer(503, "corral is shutting down (its scheduler has stopped)"))
        except Exception as e:  # a bug here must not take the server down
            log.exception("request %r %r failed", self.req.method, self.req.url)
            if self.phase in (Phase.WAITING, Phase.FORWARDING):
                self.answer(Answer(500, f"internal error: {e}"))
            else:
                self.keep_alive = False
        finally:
            if self.upstream is not None:
                self.upstream.detach()
                self.upstream = None
            if self.req.upload is not None:
                self.req.upload.close()
            if self.kept is not None:
                self.kept.end("its request ended before the child's answer did")
            self.services.live.exchanges.discard(self)
            if (recorder := self.services.recorder) is not None and not self.work.to_api:
                record(recorder, self.trace, self.work, self.req, self.status, self.first_at,
                       self.loop.time(), self.sse)
            self.phase = Phase.DONE
            self.client.exchange_done(self)

    async def _serve(self) -> None:
        front = self.services
        upload = self.req.upload
        to = target(self.req.method, self.req.url, self.req.body, front.routes, self.req.key,
                    upload.model if upload is not None and isinstance(upload.model, str)
                    else None, self.req.upgrade)
        if to is None:
            self.work.to_api = True  # (corral's own: not a request the journal keeps)
            await self.forward(front.api_pool(), TO_API_DROPPED, None, front.to_api)
            return
        if isinstance(to, Answer):
            self.answer(to)
            return
        await to_any(self, *to)

    async def forward(self, pool: Pool, drop: frozenset[bytes],
                      first_byte_timeout_s: float | None, extra: tuple[bytes, ...] = ()) -> None:
        """Send the request on a pooled connection, without the headers in `drop` and with
        the header lines in `extra`, and stream the answer back. Returns in phase DONE, or
        in WAITING or FORWARDING when the child went away before answering and
        `may_replay` (then `broke` says why)."""
        req = self.req
        if self.loading is not None:  # granted: nothing more is told (loading.py)
            self.loading.stop()
        head = [req.method + b" " + pool.prefix + req.url + b" HTTP/1.1", b"Host: " + pool.host]
        if (spans := self.work.spans) is not None:  # corral's traceparent, not theirs
            drop = drop | TRACED
        head += [n + b": " + v for n, v in req.headers if n.lower() not in drop]
        head += extra
        if self.work.made_id:  # (the client's own goes on with its headers)
            head.append(b"X-Request-Id: " + self.trace.id.encode())
        if spans is not None:
            head.append(spans.header())
        upload = req.upload
        head.append(b"Connection: Upgrade\r\nUpgrade: websocket" if req.upgrade
                    else b"Content-Length: %d" % len(req.body) if upload is None
                    else upload.framing())
        data = b"\r\n".join(head) + b"\r\n\r\n" + req.body
        loop = self.loop
        fresh = upload is not None  # sent once (upload.py): never on a reused connection
        while True:
            self.broke = self.broke_kind = None
            try:  # (an idle one without a coroutine: the lone request's path)
                up = (None if fresh else pool.take()) or await pool.lease(fresh)
            except OSError as e:
                self._unreachable(str(e), Broke.REFUSED)
                return
            self.upstream = up
            self.done = loop.create_future()
            if self.phase is Phase.WAITING:
                self._to(Phase.FORWARDING)
            up.send(self, data, self.head_only)
            if upload is not None:
                upload.attach(up)
            if first_byte_timeout_s:  # counted from the whole request's sending
                if upload is None or upload.complete:
                    self._wait_first_byte(first_byte_timeout_s)
                else:
                    upload.then = functools.partial(self._wait_first_byte,
                                                    first_byte_timeout_s)
            try:
                await self.done
            finally:
                if self.timer is not None:
                    self.timer.cancel()
                    self.timer = None
                if upload is not None:
                    upload.detach()
            if self.broke_kind is not Broke.UNSENT or fresh:
                return
            # The child closed a kept-alive connection as the request went in: it never
            # had it. Once more, on a connection of its own (R10: at once, not after 2 s).
            log.info("%s closed a kept-alive connection as a request went in (%s); sending "
                     "it again on a fresh connection", self.what, self.broke)
            fresh = True

    @property
    def finished(self) -> bool:
        return self.phase is Phase.DONE

    def wait_again(self) -> None:
        """The request goes again: for a grant (it was sent, or cut)."""
        if self.phase is Phase.FORWARDING:
            self._to(Phase.WAITING)

    def cut_off(self) -> None:
        """A higher class wants this request's slot (a Cut, policy/cuts.py): before its
        answer's head, drop the child's connection (the child drops the work) and wait
        again; after, it runs to its end (NotCut)."""
        if (self.phase is Phase.FORWARDING and self.upstream is not None
                and self.req.upload is None):  # an upload's body cannot be sent again
            self.cut = True
            self.upstream.detach()
            self.upstream = None
            self.out.clear()  # interim answers only
            self._resolve()
        elif self.ticket is not None:
            self.services.scheduler().tell(NotCut(ticket=self.ticket))

    def _unreachable(self, why: str, kind: Broke) -> None:
        """The request's connection broke before the final answer's head: send it again
        (`forward` and `_to_model` see `broke_kind`), or answer 502."""
        self.broke, self.broke_kind, self.broke_at = why, kind, self.loop.time()
        if (kind is Broke.UNSENT or (kind is Broke.GONE and self.may_replay)
                or (kind is Broke.REFUSED and self.may_retry)):
            return
        self.answer(Answer(502, f"{self.what} is unreachable: {why}"))

    def _wait_first_byte(self, timeout_s: float) -> None:
        self.timer = self.loop.call_later(timeout_s, self._first_byte_late, timeout_s)

    def _first_byte_late(self, timeout_s: float) -> None:
        if self.phase is not Phase.FORWARDING:
            return
        log.warning("%s sent no answer within %g s (first_byte_timeout_s): 504", self.what,
                    timeout_s)
        self.late = f"a request had no answer within {timeout_s:g} s (first_byte_timeout_s)"
        if self.upstream is not None:
            self.upstream.detach()
            self.upstream = None
        self.answer(Answer(504, f"{self.what} sent no answer within {timeout_s:g} s "
                           "(first_byte_timeout_s)", "timeout_error"))
        self._resolve()

    def upload_failed(self, answer: Answer) -> None:
        """Its upload broke off (too big, stalled, its client closed): `answer` if no
        answer has begun, and the end of the request and its child connection."""
        if self.upstream is not None:
            self.upstream.detach()
            self.upstream = None
        if self.phase in (Phase.WAITING, Phase.FORWARDING):
            self.answer(answer)
        self.keep_alive = False
        self.task.cancel()

    def answer(self, answer: Answer) -> None:
        """corral's own answer, in place of a child's (an error: nothing to keep); after a
        loading head (loading.py), the stream's last event."""
        if self.kept is not None:
            self.kept.drop()
            self.kept = None
        self.trace.error = answer.message[:1000]
        if self.loading is not None:
            self.loading.stop()
            if self.loading.sent:
                self.status = answer.status
                self.client.write(error_event(answer.status, answer.message, answer.type
                                              or error_type(answer.status)) + b"0\r\n\r\n")
                self._to(Phase.DONE)
                return
        answer = msgspec.structs.replace(answer, headers=(
            *answer.headers, ("X-Request-Id", self.trace.id)))
        self._head(answer.status)
        self.keep_alive = self._may_keep_alive()
        self.client.write(answer.encode(self.keep_alive, self.head_only))
        self._to(Phase.DONE)

    def _resolve(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    # ------------------------------------------------------------ the client

    def pause_upstream(self) -> None:
        if self.upstream is not None:  # the client takes nothing: neither does corral
            self.upstream.pause_reading()

    def resume_upstream(self) -> None:
        if self.upstream is not None:
            self.upstream.resume_reading()

    def client_gone(self) -> bool:
        """The client closed: leave the queue, or drop the request upstream; unless its
        answer is kept (resumable.py): then it runs on, for a reader to come (True)."""
        if self.kept is not None:
            log.info("%s: a resumable stream's client left; its answer is kept", self.what)
            self.resume_upstream()  # (paused for a client that took nothing)
            return True
        if self.upstream is not None:
            self.upstream.detach()  # mid-answer: it cannot be reused
            self.upstream = None
        self.task.cancel()
        return False

    def write(self, data: bytes) -> None:  # (loading.py's)
        self.client.write(data)

    def place(self) -> int:
        """Its place among this front's requests queued for its model (loading.py)."""
        return self.services.live.place(self, self.loop.time())

    def board(self) -> Waiting | None:
        return self.services.board.get(self.trace.model)

    def keeps_alive(self) -> bool:
        self.keep_alive = self._may_keep_alive()  # (what its loading head says holds)
        return self.keep_alive

    @property
    def key_name(self) -> str:
        return self.req.key.name if self.req.key is not None else ""

    @property
    def path(self) -> str:
        return self.req.url.partition(b"?")[0][:512].decode("latin-1")

    def cancel(self, why: str) -> None:
        """POST /requests/{id}/cancel (inflight.py): a queued request gets 499; a running
        one loses its child connection (the child stops its work) and its answer ends as
        if its client had left (a kept answer too; a WebSocket is shut)."""
        log.info("%s: request %s %s", self.what, self.trace.id, why)
        self.trace.error = why[:1000]
        if self.kept is not None:
            self.kept.end(why)
            self.kept = None
        if self.phase in (Phase.WAITING, Phase.FORWARDING):
            self.answer(Answer(499, why, CANCELLED))
        elif self.client.tunnel is not None:
            self.client.tunnel.shut(why)
        elif self.phase is Phase.STREAMING:
            self._break_off(why)
        self.client_gone()

    def stop(self, why: str) -> None:
        """Its kept answer was stopped (a DELETE, a refused id): ended as if its client left."""
        self.kept = None
        if self.phase in (Phase.WAITING, Phase.FORWARDING):
            self.answer(Answer(409, f"{self.what}: {why}"))
        elif self.phase is Phase.STREAMING:
            self._break_off(why)
        self.client_gone()
