"""One timer service for every actor: `after(delay_s, ref, message)` tells `message` later.

Timers are never cancelled: every timed message carries a generation (or spawn id) and
the recipient drops stale ones (R-1.4). One thread waits on a heap of deadlines.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from ..base import tell_or_drop
from ..messages import Inbox

M = TypeVar("M")


class Timers:
    """A single thread that tells messages to actors at their deadlines."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        """(deadline, sequence, the tell); the sequence breaks ties in order."""
        self._seq = itertools.count()
        self._cv = threading.Condition()
        # Not an actor: it is the runtime under the mailboxes (as pykka's own inbox is).
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="corral-timers", daemon=True)
        self._thread.start()

    def after(self, delay_s: float, ref: Inbox[M], message: M) -> None:
        """Tell `message` to `ref` once `delay_s` seconds have passed."""
        deadline = time.monotonic() + delay_s
        tell: Callable[[], None] = partial(tell_or_drop, ref, message)
        with self._cv:
            heapq.heappush(self._heap, (deadline, next(self._seq), tell))
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped:
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        break
                    self._cv.wait(self._heap[0][0] - now if self._heap else None)
                if self._stopped:
                    return
                _, _, tell = heapq.heappop(self._heap)
            tell()
