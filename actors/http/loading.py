"""Progress inside the stream (issue 40, part 5; `send_loading_state`): a streamed chat
that has waited AFTER_S for its grant gets its answer's head at once (200, an event
stream) and, each TICK_S until its grant, an SSE comment that says why it waits — its
place among those waiting for its model here, what it waits for (a load, a wake, a
slot, its turn), the load's progress where the child reports it, and an ETA from the
model's measured loads or wakes — or, with "reasoning", the same as a
`reasoning_content` delta, as llama-swap does. Nothing is sent once its grant comes;
the child's events follow in the same stream. A client that ignores comments sees a
normal stream.

The head cannot be taken back: an error after it (a refused grant, a child's error
answer) ends the stream with an error event (`data: {"error": ...}`), as a child
that breaks off mid-answer does.

What each model waits for comes from the Scheduler's snapshot, asked once a TICK_S by
corral's process while any model sends its loading state (`Board`), and handed to its
front workers.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import msgspec

from ..messages import ModelsSnapshot
from .edge import CHILD_HEADERS, error_body
from .journaling import Trace, Work

AFTER_S = 0.25
"""A stream that waits longer than this is told so (a model already loaded answers
well within it, with its own head)."""
TICK_S = 1.0
CHAT_PATHS = frozenset({b"/v1/chat/completions", b"/chat/completions"})


class Waiting(msgspec.Struct, frozen=True, kw_only=True):
    """What requests for one model wait for now, on the board."""

    what: str
    """"a load", "a wake", "a slot" (it is busy) or "its turn" (others go first)."""
    progress: float | None = None
    """A load's progress, 0 to 1, where its child reports it."""
    eta_s: float | None = None
    """Seconds until the load or wake is done, from its measured ones (None: none yet)."""


def board_of(snap: ModelsSnapshot) -> dict[str, Waiting]:
    """Every model's Waiting, from the Scheduler's snapshot."""
    out = {}
    for v in snap.models:
        if v.state == "loading":
            waking = v.phase == "waking"
            took = v.wake_time if waking else v.load_time
            n = sum(took.counts) if took is not None else 0
            mean = took.sum / n if took is not None and n else None
            eta = max(0.0, mean - (v.state_for_s or 0.0)) if mean is not None else None
            out[v.name] = Waiting(what="a wake" if waking else "a load",
                                  progress=_progress(v.progress), eta_s=eta)
        elif v.state == "loaded":
            out[v.name] = Waiting(what="a slot")
        else:
            out[v.name] = Waiting(what="its turn")
    return out


def _progress(progress: dict[str, object] | None) -> float | None:
    """A llama child's load progress (its state line's `value`, 0 to 1)."""
    value = progress.get("value") if progress else None
    return min(max(float(value), 0.0), 1.0) if isinstance(value, int | float) else None


def wants(method: bytes, url: bytes, body: bytes) -> bool:
    """A streamed chat (only a model's with send_loading_state is asked)."""
    if method != b"POST" or url.partition(b"?")[0] not in CHAT_PATHS:
        return False
    try:
        return msgspec.json.decode(body, type=_Streamed).stream is True
    except msgspec.DecodeError:
        return False


class _Streamed(msgspec.Struct):
    stream: object = False


class Shown(Protocol):
    """What the loading state uses of its exchange."""

    trace: Trace
    work: Work

    def write(self, data: bytes) -> None: ...

    def place(self) -> int: ...

    def board(self) -> Waiting | None: ...

    def keeps_alive(self) -> bool:
        """Whether its connection may serve another request after this answer."""


class Loading:
    """One waiting stream's: armed when it asks, stopped at its grant."""

    __slots__ = ("ex", "handle", "model", "reasoning", "sent")

    def __init__(self, ex: Shown, model: str, mode: str) -> None:
        self.ex, self.model, self.reasoning = ex, model, mode == "reasoning"
        self.sent = False
        """The head went: what follows is this stream's, whatever comes."""
        self.handle: asyncio.TimerHandle | None = None

    def arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.handle is None:
            self.handle = loop.call_later(AFTER_S, self._tick, loop)

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self.sent:
            self.sent = True
            self.ex.write(b"\r\n".join((
                b"HTTP/1.1 200 OK", b"Content-Type: text/event-stream",
                b"Cache-Control: no-cache", *CHILD_HEADERS,
                b"X-Request-Id: " + self.ex.trace.id.encode(),
                b"Transfer-Encoding: chunked", b"Connection: keep-alive"
                if self.ex.keeps_alive() else b"Connection: close")) + b"\r\n\r\n")
        self.ex.write(chunk(self._event(self.text(loop.time()))))
        self.handle = loop.call_later(TICK_S, self._tick, loop)

    def text(self, now: float) -> str:
        waiting = self.ex.board()
        parts = [f"waiting for {waiting.what if waiting else 'its turn'} of '{self.model}'",
                 f"place {self.ex.place()} here"]
        if waiting is not None and waiting.progress is not None:
            parts.append(f"{waiting.progress:.0%} loaded")
        if waiting is not None and waiting.eta_s is not None:
            parts.append(f"about {waiting.eta_s:.0f} s left")
        parts.append(f"{now - self.ex.work.started:.0f} s so far")
        return "corral: " + ", ".join(parts)

    def _event(self, text: str) -> bytes:
        if not self.reasoning:
            return b": " + text.encode() + b"\n\n"
        return b"data: " + msgspec.json.encode({
            "id": "corral-" + self.ex.trace.id, "object": "chat.completion.chunk",
            "created": int(time.time()), "model": self.model, "choices": [{
                "index": 0, "delta": {"reasoning_content": text + "\n"},
                "finish_reason": None}]}) + b"\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def error_event(status: int, message: str, type_: str = "server_error") -> bytes:
    """The last event of a stream whose head went before its error came (a chunk)."""
    return chunk(b"data: " + msgspec.json.encode(error_body(status, message, type_))
                 + b"\n\n")
