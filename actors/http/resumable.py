"""Resumable streams (llama.cpp's `X-Conversation-Id`): a streamed answer whose request
carried the header is kept, so that a client that left can read it again.

Such a request is not cancelled when its client leaves: its exchange keeps reading the
child to the end, and every byte of the answer goes to its `Resumable` here, a ring of
the answer's last bytes numbered from its start (offsets are llama.cpp's: bytes of the
answer as the child sent it). `GET /v1/stream/{id}` reads from an offset and follows the
rest (stream_api.py); `DELETE` stops the child's work.

One `Resumables` holds them all, in corral's process: the front beside it hands it its
answers directly, a front worker's come over its channel (link.py), so a client may
resume on any connection. Memory is bounded as a whole (`http.resumable_max_mib`,
each answer's bookkeeping counted with its bytes): past it, ended answers are forgotten
(the oldest first), then the biggest live one loses its oldest bytes, and a reader
behind them is told so. An ended answer is forgotten `http.resumable_ttl_s` after its
end. A kept request whose client left still holds its client's connection slot
(`http.max_connections`) until it ends, so their number is bounded too.

A conversation id belongs to the key that started it until then: another key's request
with it is refused, and its reads find nothing. A new request with an id its own key
has kept replaces that answer (whose request is stopped) once its own answer begins as
a stream, not before: one refused or failed leaves the old answer as it was.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import re
import time
from typing import Any, Protocol

log = logging.getLogger("corral.front")

ENTRY_BYTES = 1024
"""What an answer costs besides its bytes, counted against the budget (a flood of tiny
answers is bounded like a big one)."""
CHUNK_BYTES = 100
"""What each chunk kept costs besides its bytes (a token's chunk is often smaller)."""
READ_BYTES = 64 * 1024
"""The most one read gives a reader (which writes it before it reads more)."""
CONVERSATION_ID = re.compile(rb"[A-Za-z0-9._:~+/=@-]{1,128}")
"""What an id may be: a token, as a path segment can carry it."""


class Producer(Protocol):
    """The request that writes an answer, as the registry sees it."""

    def stop(self, why: str) -> None:
        """End the request and the child's work on it (its answer is forgotten)."""


class Tee(Protocol):
    """Where an exchange writes the answer it keeps (resumable or not: a worker's goes
    over its channel)."""

    def began(self) -> Tee:
        """The answer is a stream: kept from here (and itself)."""

    def feed(self, data: bytes) -> None: ...

    def end(self, why: str = "") -> None:
        """Its request ended (`why`: before the child's answer did)."""

    def drop(self) -> None:
        """The answer is not a stream (an error, or a whole one): nothing to keep."""


class Keeper(Protocol):
    """What a front keeps its resumable answers with."""

    def keep(self, id_: str, key: str, model: str, producer: Producer) -> Tee | str:
        """A tee for the answer of a request that begins; or why it may not begin."""


class Resumable:
    """One kept answer: its last bytes, from `dropped` to `total`."""

    __slots__ = ("chunks", "cost", "done", "dropped", "ended_at", "expiry", "first", "id",
                 "key", "model", "producer", "started_at", "starts", "total", "wake", "why")

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
        self.cost = 0
        """What its kept chunks count against the budget (CHUNK_BYTES each, and bytes)."""
        self.done = False
        self.why = ""
        """Why it ended before its child did ("": it did not)."""
        self.wake: asyncio.Future[None] | None = None
        self.expiry: asyncio.TimerHandle | None = None

    @property
    def kept(self) -> int:
        return self.total - self.dropped

    def append(self, data: bytes) -> int:
        """Keep `data`; what it costs."""
        self.chunks.append(data)
        self.starts.append(self.total)
        self.total += len(data)
        self.cost += len(data) + CHUNK_BYTES
        self._wake()
        return len(data) + CHUNK_BYTES

    def drop_oldest(self) -> int:
        """Forget its oldest chunk; what that frees."""
        size = len(self.chunks[self.first])
        self.chunks[self.first] = b""
        self.first += 1
        self.dropped += size
        self.cost -= size + CHUNK_BYTES
        if self.first > 64 and self.first * 2 > len(self.chunks):
            del self.chunks[:self.first], self.starts[:self.first]
            self.first = 0
        return size + CHUNK_BYTES

    def read(self, offset: int, most: int = READ_BYTES) -> bytes | None:
        """Up to about `most` bytes from `offset` on (b"": nothing yet); None when those
        bytes are no longer kept."""
        if offset < self.dropped:
            return None
        if offset >= self.total:
            return b""
        i = bisect.bisect_right(self.starts, offset, self.first) - 1
        out = [self.chunks[i][offset - self.starts[i]:offset - self.starts[i] + most]]
        size = len(out[0])
        for chunk in itertools.islice(self.chunks, i + 1, None):
            if size >= most:
                break
            out.append(chunk)
            size += len(chunk)
        return out[0] if len(out) == 1 else b"".join(out)

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
        """Their costs, and ENTRY_BYTES each."""

    def open(self, id_: str, key: str, model: str, producer: Producer) -> Resumable | str:
        """An answer to keep for a request that begins with `id_`; or why not. Kept at
        once unless its key has one with that id, which it replaces at `begin`."""
        old = self.by_id.get(id_)
        if old is not None and old.key != key:
            return (f"conversation id '{id_}' belongs to another key's stream; pick another "
                    "(X-Conversation-Id)")
        stream = Resumable(id_, key, model, producer)
        if old is None:
            self._install(stream)
        return stream

    def begin(self, stream: Resumable) -> None:
        """Its answer began as a stream: it replaces what its id kept (stopped)."""
        old = self.by_id.get(stream.id)
        if old is stream:
            return
        if old is not None and old.key != stream.key:  # (taken meanwhile, by a worker's)
            if stream.producer is not None:
                stream.producer.stop(f"conversation id '{stream.id}' belongs to another "
                                     "key's stream")
            return
        if old is not None:
            self.forget(old, "a new request came with the same conversation id")
        self._install(stream)

    def discard(self, stream: Resumable) -> None:
        """Its answer is not to be kept (an error, a whole answer)."""
        stream.producer = None
        self.forget(stream, "not a stream")

    def _install(self, stream: Resumable) -> None:
        self.by_id[stream.id] = stream
        self._charge(ENTRY_BYTES)

    def keep(self, id_: str, key: str, model: str, producer: Producer) -> Tee | str:
        stream = self.open(id_, key, model, producer)
        return stream if isinstance(stream, str) else Kept(self, stream)

    def get(self, id_: str, key: str) -> Resumable | None:
        stream = self.by_id.get(id_)
        return stream if stream is not None and stream.key == key else None

    def feed(self, stream: Resumable, data: bytes) -> None:
        if stream.done or self.by_id.get(stream.id) is not stream:
            return  # forgotten meanwhile (stopped, replaced, or out of room)
        self._charge(stream.append(data))

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
        self.used -= stream.cost + ENTRY_BYTES
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
            biggest = max((s for s in self.by_id.values() if s.cost),
                          key=lambda s: s.cost, default=None)
            if biggest is None:
                return  # only entries: bounded by the requests in flight
            self.used -= biggest.drop_oldest()


class Kept:
    """The tee of an answer kept in this process."""

    __slots__ = ("registry", "stream")

    def __init__(self, registry: Resumables, stream: Resumable) -> None:
        self.registry = registry
        self.stream = stream

    def began(self) -> Kept:
        self.registry.begin(self.stream)
        return self

    def feed(self, data: bytes) -> None:
        self.registry.feed(self.stream, data)

    def end(self, why: str = "") -> None:
        self.registry.end(self.stream, why)

    def drop(self) -> None:
        self.registry.discard(self.stream)
