"""Resumable streams (llama.cpp's `X-Conversation-Id`): a streamed answer whose request
carried the header is kept, so that a client that left can read it again.

Such a request is not cancelled when its client leaves: its exchange keeps reading the
child to the end, and every byte of the answer goes to its `Resumable` here, a ring of
the answer's last bytes numbered from its start (offsets are llama.cpp's: bytes of the
answer as the child sent it). `GET /v1/stream/{id}` reads from an offset and follows the
rest (stream_api.py); `DELETE` stops the child's work.

One `Resumables` holds them all, in corral's process: the front beside it hands it its
answers directly, a front worker's come over its channel (link.py), so a client may
resume on any connection. Memory is bounded as a whole (`http.resumable_max_mib`):
past it, ended answers are forgotten (the oldest first), then the biggest live one
loses its oldest bytes, and a reader behind them is told so. An ended answer is
forgotten `http.resumable_ttl_s` after its end. A conversation id belongs to the key
that started it until then: another key's request with it is refused, and its reads
find nothing.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import re
import time
from typing import Any, Protocol

log = logging.getLogger("corral.front")

ENTRY_BYTES = 1024
"""What an answer costs besides its bytes, counted against the budget (a flood of tiny
answers is bounded like a big one)."""
CONVERSATION_ID = re.compile(rb"[A-Za-z0-9._:~+/=@-]{1,128}")
"""What an id may be: a token, as a path segment can carry it."""


class Producer(Protocol):
    """The request that writes an answer, as the registry sees it."""

    def stop(self, why: str) -> None:
        """End the request and the child's work on it (its answer is forgotten)."""


class Tee(Protocol):
    """Where an exchange writes the answer it keeps (resumable or not: a worker's goes
    over its channel)."""

    def feed(self, data: bytes) -> None: ...

    def end(self, why: str = "") -> None:
        """Its request ended (`why`: before the child's answer did)."""

    def drop(self) -> None:
        """The answer is not a stream: nothing to keep."""


class Keeper(Protocol):
    """What a front keeps its resumable answers with."""

    def keep(self, id_: str, key: str, model: str, producer: Producer) -> Tee | str:
        """A tee for the answer of a request that begins; or why it may not begin."""


class Resumable:
    """One kept answer: its last bytes, from `dropped` to `total`."""

    __slots__ = ("chunks", "done", "dropped", "ended_at", "expiry", "first", "id", "key",
                 "model", "producer", "started_at", "starts", "total", "wake", "why")

    def __init__(self, id_: str, key: str, model: str, producer: Producer | None) -> None:
        self.id = id_
        self.key = key
        """The name of the key that started it ("" without keys)."""
        self.model = model
        self.producer = producer
        """Its request, while it runs."""
        self.started_at = time.time()
        self.ended_at = 0.0
        self.chunks: list[bytes] = []
        self.starts: list[int] = []
        """The offset of each chunk; those before `first` are dropped."""
        self.first = 0
        self.dropped = 0
        self.total = 0
        self.done = False
        self.why = ""
        """Why it ended before its child did ("": it did not)."""
        self.wake: asyncio.Future[None] | None = None
        self.expiry: asyncio.TimerHandle | None = None

    @property
    def kept(self) -> int:
        return self.total - self.dropped

    def append(self, data: bytes) -> None:
        self.chunks.append(data)
        self.starts.append(self.total)
        self.total += len(data)
        self._wake()

    def drop_oldest(self) -> int:
        """Forget its oldest chunk; the bytes freed."""
        size = len(self.chunks[self.first])
        self.chunks[self.first] = b""
        self.first += 1
        self.dropped += size
        if self.first > 64 and self.first * 2 > len(self.chunks):
            del self.chunks[:self.first], self.starts[:self.first]
            self.first = 0
        return size

    def read(self, offset: int) -> bytes | None:
        """What it holds from `offset` on (b"": nothing yet); None when those bytes are
        no longer kept."""
        if offset < self.dropped:
            return None
        if offset >= self.total:
            return b""
        i = bisect.bisect_right(self.starts, offset, self.first) - 1
        head = self.chunks[i][offset - self.starts[i]:]
        return head + b"".join(self.chunks[i + 1:]) if i + 1 < len(self.chunks) else head

    async def changed(self) -> None:
        """Until it has more bytes, or has ended."""
        if self.wake is None:
            self.wake = asyncio.get_running_loop().create_future()
        await asyncio.shield(self.wake)

    def _wake(self) -> None:
        if self.wake is not None:
            if not self.wake.done():
                self.wake.set_result(None)
            self.wake = None

    def finish(self, why: str) -> None:
        if not self.done:
            self.done, self.why, self.ended_at = True, why, time.time()
            self.producer = None
            self._wake()

    def view(self) -> dict[str, Any]:
        """Its entry in POST /v1/streams/lookup (llama.cpp's fields, and corral's)."""
        return {"conversation_id": self.id, "model": self.model, "is_done": self.done,
                "total_bytes": self.total, "kept_from": self.dropped,
                "started_at": int(self.started_at), "completed_at": int(self.ended_at),
                **({"stopped": self.why} if self.why else {})}


class Resumables:
    """Every kept answer, by conversation id."""

    def __init__(self, max_mib: float, ttl_s: float) -> None:
        self.max_bytes = int(max_mib * 1024 * 1024)
        self.ttl_s = ttl_s
        self.by_id: dict[str, Resumable] = {}
        self.ended: dict[str, Resumable] = {}
        """The ended ones, oldest end first."""
        self.used = 0
        """Their bytes, and ENTRY_BYTES each."""

    def open(self, id_: str, key: str, model: str, producer: Producer) -> Resumable | str:
        """Keep the answer of a request that begins with `id_`; or why not. A request with
        an id its key has running replaces that one (which is stopped), as in llama.cpp."""
        old = self.by_id.get(id_)
        if old is not None and old.key != key:
            return (f"conversation id '{id_}' belongs to another key's stream; pick another "
                    "(X-Conversation-Id)")
        if old is not None:
            self.forget(old, "a new request came with the same conversation id")
        stream = self.by_id[id_] = Resumable(id_, key, model, producer)
        self._charge(ENTRY_BYTES)
        return stream

    def keep(self, id_: str, key: str, model: str, producer: Producer) -> Tee | str:
        stream = self.open(id_, key, model, producer)
        return stream if isinstance(stream, str) else Kept(self, stream)

    def get(self, id_: str, key: str) -> Resumable | None:
        stream = self.by_id.get(id_)
        return stream if stream is not None and stream.key == key else None

    def feed(self, stream: Resumable, data: bytes) -> None:
        if stream.done or self.by_id.get(stream.id) is not stream:
            return  # forgotten meanwhile (stopped, replaced, or out of room)
        stream.append(data)
        self._charge(len(data))

    def end(self, stream: Resumable, why: str = "") -> None:
        """Its request has ended (`why`: before its child's answer did)."""
        if stream.done or self.by_id.get(stream.id) is not stream:
            return
        stream.finish(why)
        self.ended[stream.id] = stream
        stream.expiry = asyncio.get_running_loop().call_later(self.ttl_s, self.forget, stream)

    def stop(self, id_: str, key: str, why: str) -> bool:
        """DELETE: stop its request (the child's work) and forget it; False: no such."""
        stream = self.get(id_, key)
        if stream is None:
            return False
        self.forget(stream, why)
        return True

    def forget(self, stream: Resumable, why: str = "") -> None:
        """Drop it (a running request is stopped, with `why`)."""
        if self.by_id.get(stream.id) is not stream:
            return
        del self.by_id[stream.id]
        self.ended.pop(stream.id, None)
        if stream.expiry is not None:
            stream.expiry.cancel()
        self.used -= stream.kept + ENTRY_BYTES
        producer = stream.producer
        stream.finish(why or "forgotten")
        if producer is not None:
            producer.stop(why)

    def close(self) -> None:
        """corral stops: every reader's stream ends."""
        for stream in list(self.by_id.values()):
            stream.finish("corral is shutting down")

    def _charge(self, size: int) -> None:
        self.used += size
        if self.used <= self.max_bytes:
            return
        while self.ended and self.used > self.max_bytes:
            oldest = next(iter(self.ended.values()))
            log.info("resumable stream '%s' forgotten before its time: "
                     "http.resumable_max_mib is full", oldest.id)
            self.forget(oldest)
        while self.used > self.max_bytes:  # the biggest live answer loses its oldest
            biggest = max((s for s in self.by_id.values() if s.kept),
                          key=lambda s: s.kept, default=None)
            if biggest is None:
                return  # only entries: bounded by the requests in flight
            self.used -= biggest.drop_oldest()


class Kept:
    """The tee of an answer kept in this process."""

    __slots__ = ("registry", "stream")

    def __init__(self, registry: Resumables, stream: Resumable) -> None:
        self.registry = registry
        self.stream = stream

    def feed(self, data: bytes) -> None:
        self.registry.feed(self.stream, data)

    def end(self, why: str = "") -> None:
        self.registry.end(self.stream, why)

    def drop(self) -> None:
        self.stream.producer = None
        self.registry.forget(self.stream, "not a stream")
