"""A node agent's mailbox for the head (the Outbox, long-polled across Ray) and the ring
that passes a child's output on to it."""

from __future__ import annotations

import collections
import threading

from ..childproc import LogRing, clip_line, line_cost
from ..messages import DevicesReported, FromNode
from .wire import FORWARDED_BYTES, OUTBOX_BYTES, OUTBOX_LINES, Batch


class Outbox:
    """What an agent's actors say (the `scheduler` of its DeviceMonitor and MeasureWorker,
    and, through the Tap, of its ModelInstances), kept for the head.
    Child output is bounded in lines (`max_lines`) and in bytes (`max_bytes`): the oldest
    lines go first, counted as dropped (issue 19, R4)."""

    def __init__(self, max_lines: int = OUTBOX_LINES, max_bytes: int = OUTBOX_BYTES) -> None:
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self._cv = threading.Condition()
        # Not an actor: it is a mailbox itself, at the Ray boundary (long-polled by `take`).
        self._messages: list[FromNode] = []
        self._lines: collections.deque[tuple[str, str]] = collections.deque()
        self._bytes = 0
        """Invariant: the `line_cost` of the lines kept, at most `max_bytes`."""
        self._dropped = 0
        self._skipped: list[int] = []
        self._nudged = False
        """A poll under way is to return now, with what there is."""

    def tell(self, message: FromNode) -> None:
        with self._cv:
            if isinstance(message, DevicesReported):  # only the latest one matters
                self._messages = [m for m in self._messages
                                  if not isinstance(m, DevicesReported)]
            self._messages.append(message)
            self._cv.notify_all()

    def clear(self) -> None:
        """A new head: what was kept for the last one is no news to it."""
        with self._cv:
            self._messages, self._dropped, self._skipped = [], 0, []
            self._lines.clear()
            self._bytes = 0

    def line(self, model: str, line: str) -> None:
        line = clip_line(line)
        cost = line_cost(line) + line_cost(model)
        with self._cv:
            self._lines.append((model, line))
            self._bytes += cost
            while len(self._lines) > self.max_lines or self._bytes > self.max_bytes:
                gone_model, gone = self._lines.popleft()
                self._bytes -= line_cost(gone) + line_cost(gone_model)
                self._dropped += 1
            self._cv.notify_all()

    def nudge(self) -> None:
        with self._cv:
            self._nudged = True
            self._cv.notify_all()

    def skipped(self, seqs: list[int]) -> None:
        """Messages from the head that never arrived (R11): the head is told."""
        with self._cv:
            self._skipped += seqs
            self._cv.notify_all()

    def take(self, timeout_s: float) -> Batch:
        with self._cv:
            self._cv.wait_for(lambda: self._messages or self._lines or self._skipped
                              or self._nudged, timeout_s)
            self._nudged = False
            batch = Batch(messages=self._messages, lines=list(self._lines),
                          dropped_lines=self._dropped, skipped=self._skipped)
            self._messages, self._dropped, self._skipped = [], 0, []
            self._lines.clear()
            self._bytes = 0
            return batch


class ForwardedRing(LogRing):
    """A child's output on its node: kept a little, and passed on to the head; each line
    clipped as the head's ring would clip it, so the Outbox holds no more."""

    def __init__(self, model: str, outbox: Outbox) -> None:
        super().__init__(capacity=200, backlog_bytes=0, max_bytes=FORWARDED_BYTES)
        self.model = model
        self.outbox = outbox

    def append(self, line: str) -> None:
        line = clip_line(line)
        super().append(line)
        self.outbox.line(self.model, line)
