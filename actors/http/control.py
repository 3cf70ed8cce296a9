"""What crosses between corral and its front workers (`http.workers`): msgspec Structs as
msgpack, each frame a 4-byte length and its bytes, over the worker's stdin and stdout.

A worker is a front in a process of its own, on corral's port (its listening sockets,
inherited), with no Scheduler: it asks corral's for grants over this channel, as the
front in corral's own process asks through the bridge. A request is named by an `id` the
worker chose; corral holds a ticket for each (workers.RemoteTicket) and cancels every
ticket of a worker that goes away, so none of its grants outlives it.
"""

from __future__ import annotations

import asyncio
import struct

import msgspec

from ..config.model import HttpConfig
from ..config.tracing import TracingConfig
from ..messages import AnswerLate, Cut, Grant, HistogramView, Refusal, Revoke, Withdraw
from .inflight import Running
from .loading import Waiting
from .routes import Routes
from .speeds import SpeedRow
from .speeds import merge as merge_speeds

MAX_FRAME = 64 << 20
"""A frame larger than this is a broken channel, not a message."""


class Setup(msgspec.Struct, frozen=True, kw_only=True):
    """Corral -> worker, first: what its front needs."""

    index: int
    log_level: int
    host: str
    port: int
    fds: list[int]
    """corral's listening sockets, inherited: the worker accepts on them."""
    api_port: int
    api_secret: str
    http: HttpConfig
    max_body_mib: float
    routes: Routes
    journal: bool = False
    """Its requests' records go to corral's journal (Journaled)."""
    tracing: TracingConfig = TracingConfig()
    """Where its requests' spans go (it sends them itself)."""
    capture: int = 0
    """[journal] capture: bytes of each body and answer its records keep."""


class TimeRow(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    status: str
    first_byte: HistogramView
    duration: HistogramView


class FrontCounts(msgspec.Struct, frozen=True, kw_only=True):
    """What a front knows that the Scheduler does not: requests that joined grants, and
    running beyond the one each grant counts (`extra`), how long it has kept a model's
    grant with no request on it (`kept_idle_s`), and its clock on what it proxied."""

    joined_total: int = 0
    extra: dict[str, int] = {}
    kept_idle_s: dict[str, float] = {}
    kept_idle: dict[str, int] = {}
    """Model -> how many fronts keep its grant with no request on it (one each at most)."""
    times: list[TimeRow] = []
    keys: dict[str, tuple[int, int, int, int]] = {}
    """Named key -> (requests, prompt, completion and cached tokens) through this front."""
    speeds: list[SpeedRow] = []


class Frame(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """A message on the channel, either way."""


# ---------------------------------------------------------------- worker -> corral


class Ask(Frame, frozen=True):
    """Serve one request for `model` (an Acquire)."""

    id: int
    model: str
    autoload: bool
    key: str = ""
    retry: bool = False
    cuttable: bool = False
    affinity: int = 0
    among: tuple[str, ...] = ()
    spill: bool = False


class Let(Frame, frozen=True):
    """The request `id` has finished (a Release)."""

    id: int
    shared: bool
    idle_s: float
    tokens: int = 0


class Spent(Frame, frozen=True):
    """The stream of request `id` has used `tokens` more so far (a Spend)."""

    id: int
    tokens: int


class LetAll(Frame, frozen=True):
    """Grants a Revoke found idle, given back together (a Releases)."""

    lets: list[Let]


class Revoked(Frame, frozen=True):
    """The answer to RevokeAsk `round`: the grants it found kept idle (maybe none)."""

    round: int
    lets: list[Let]


class Drop(Frame, frozen=True):
    """The client of request `id` went away (a Cancel)."""

    id: int


class Again(Frame, frozen=True):
    """The request `id` was cut and waits again (a Requeue)."""

    id: int


class Uncut(Frame, frozen=True):
    """The request `id` could not be cut: its answer had begun (a NotCut)."""

    id: int


class Late(Frame, frozen=True):
    late: AnswerLate


class Counted(Frame, frozen=True):
    """The answer to CountAsk `reply`."""

    reply: int
    counts: FrontCounts


class LiveNow(Frame, frozen=True):
    """The answer to LiveAsk `reply`: the worker's requests now (after the cancel)."""

    reply: int
    running: list[Running]
    cancelled: int = 0


class Listening(Frame, frozen=True):
    """The worker's front listens on `port`."""

    port: int


class StreamOpen(Frame, frozen=True):
    """Keep the answer of a request with X-Conversation-Id `conversation` (resumable.py);
    the worker calls it `token` from now on."""

    token: int
    conversation: str
    key: str
    model: str


class StreamBytes(Frame, frozen=True):
    token: int
    data: bytes


class StreamEnd(Frame, frozen=True):
    """Its request has ended (`why`: early); `drop`: its answer was not a stream."""

    token: int
    why: str = ""
    drop: bool = False


class Journaled(Frame, frozen=True):
    """A request's record, for corral's journal: its row as the journal keeps it
    (record.py `encode`), inline in the frame."""

    row: msgspec.Raw


FromWorker = (Ask | Let | Spent | LetAll | Revoked | Again | Uncut | Drop | Late | Counted
              | Listening | StreamOpen | StreamBytes | StreamEnd | Journaled | LiveNow)


# ---------------------------------------------------------------- corral -> worker


class Answered(Frame, frozen=True):
    id: int
    value: Grant | Refusal | Cut


class Notice(Frame, frozen=True):
    notice: Withdraw


class RevokeAsk(Frame, frozen=True):
    """Carry out `revoke` and answer (Revoked `round`), even with nothing kept idle:
    corral tells the Scheduler every front's releases together, once all have answered."""

    round: int
    revoke: Revoke


class NewRoutes(Frame, frozen=True):
    routes: Routes


class CountAsk(Frame, frozen=True):
    reply: int


class BoardNow(Frame, frozen=True):
    """What each model's requests wait for now (loading.py)."""

    board: dict[str, Waiting]


class LiveAsk(Frame, frozen=True):
    """Its requests now, after cancelling those with id `cancel` (of key `key`, if any)."""

    reply: int
    cancel: str = ""
    key: str | None = None
    by: str = ""


class Drain(Frame, frozen=True):
    timeout_s: float


class StreamStop(Frame, frozen=True):
    """Stop the request of `token` (DELETE /v1/stream/{id}, or its id is refused)."""

    token: int
    why: str


ToWorker = (Answered | Notice | RevokeAsk | NewRoutes | CountAsk | Drain | StreamStop
            | LiveAsk | BoardNow)

_encoder = msgspec.msgpack.Encoder()
_LENGTH = struct.Struct(">I")


def frame(message: msgspec.Struct) -> bytes:
    data = _encoder.encode(message)
    return _LENGTH.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's bytes; None at the channel's end (the other side is gone)."""
    try:
        head = await reader.readexactly(_LENGTH.size)
        (size,) = _LENGTH.unpack(head)
        if size > MAX_FRAME:
            raise ValueError(f"a control frame of {size} bytes")
        return await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def merge(counts: list[FrontCounts]) -> FrontCounts:
    """Several fronts' counts as one front's."""
    extra: dict[str, int] = {}
    kept: dict[str, float] = {}
    kept_by: dict[str, int] = {}
    keys: dict[str, tuple[int, int, int, int]] = {}
    times: dict[tuple[str, str], tuple[list[int], float, list[int], float]] = {}
    for c in counts:
        for model, n in c.extra.items():
            extra[model] = extra.get(model, 0) + n
        for name, (n, p, t, k) in c.keys.items():
            n0, p0, t0, k0 = keys.get(name, (0, 0, 0, 0))
            keys[name] = (n0 + n, p0 + p, t0 + t, k0 + k)
        for model, idle in c.kept_idle_s.items():  # the latest use counts
            kept[model] = min(idle, kept.get(model, idle))
        for model, n in c.kept_idle.items():
            kept_by[model] = kept_by.get(model, 0) + n
        for row in c.times:
            key = (row.model, row.status)
            first, first_sum, whole, whole_sum = times.get(
                key, ([0] * len(row.first_byte.counts), 0.0,
                      [0] * len(row.duration.counts), 0.0))
            times[key] = ([a + b for a, b in zip(first, row.first_byte.counts, strict=True)],
                          first_sum + row.first_byte.sum,
                          [a + b for a, b in zip(whole, row.duration.counts, strict=True)],
                          whole_sum + row.duration.sum)
    return FrontCounts(
        joined_total=sum(c.joined_total for c in counts),
        extra={m: n for m, n in extra.items() if n}, kept_idle_s=kept, kept_idle=kept_by,
        keys=keys, speeds=merge_speeds(c.speeds for c in counts),
        times=[TimeRow(model=m, status=s, first_byte=HistogramView(counts=f, sum=fs),
                       duration=HistogramView(counts=d, sum=ds))
               for (m, s), (f, fs, d, ds) in times.items()])
