"""A model request as an OpenTelemetry trace (issue 40, part 4; `[tracing]`).

The front reads the client's W3C `traceparent` (its trace goes on: corral's spans join
it), sends its own on to the child (so vLLM's spans join the same trace, under the span
of the child's answer), and at the request's end hands its times to the exporter thread
(otlp.py), which makes the spans:

    METHOD PATH          the request, from its arrival to its end (SERVER)
      queue              from its ask to its grant
        load | wake      what it waited for, with the evictions that made room for it
      OPERATION MODEL    the child's answer, up to its first token (CLIENT)
      stream             a stream, from its first token to its end

With `[tracing]` off none of this runs, and otlp.py (the `otel` extra) is not imported.
"""

from __future__ import annotations

import copy
import os
import random
import re

from ..config.tracing import TracingConfig
from ..journal.record import Said
from .journaling import Spans, Trace, Work
from .request import Request

TRACEPARENT = b"traceparent"
_W3C = re.compile(rb"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE, _ZERO_SPAN = b"0" * 32, b"0" * 16


class Ended:
    """A traced request at its end: what the exporter makes its spans of."""

    __slots__ = ("key", "method", "path", "said", "spans", "status", "stream", "trace",
                 "until", "work")

    def __init__(self, spans: Spans, trace: Trace, work: Work, req: Request, status: int,
                 stream: bool, until: float) -> None:
        kept = copy.copy(trace)  # (its times, as they are at its end: not its bodies,
        self.work = copy.copy(work)  # which may be large)
        kept.answer = kept.asked = self.work.tail = None
        self.spans, self.trace, self.status, self.stream = spans, kept, status, stream
        self.method, self.path = req.method, req.url.partition(b"?")[0]
        self.key = req.key.name if req.key is not None else ""
        self.said: Said | None = trace.tokens
        self.until = until


class Tracer:
    """One front's: the spans of the requests it serves, handed to its exporter."""

    def __init__(self, config: TracingConfig) -> None:
        from .otlp import Exporter  # (the otel extra: imported only with [tracing] on)
        self.exporter = Exporter(config)
        self.sample = config.sample

    def begin(self, req: Request) -> Spans | None:
        """The request's ids, or None when it is not traced (the client's traceparent
        says it is not sampled, or, without one, the sample ratio)."""
        if req.traceparent is not None and (m := _W3C.fullmatch(req.traceparent)) \
                and m[1] != _ZERO_TRACE and m[2] != _ZERO_SPAN:
            if not int(m[3], 16) & 1:
                return None
            return Spans(bytes.fromhex(m[1].decode()), bytes.fromhex(m[2].decode()))
        if self.sample < 1 and random.random() >= self.sample:
            return None
        return Spans(os.urandom(16), b"")

    def end(self, ended: Ended) -> None:
        self.exporter.add(ended)

    def close(self) -> None:
        self.exporter.close()
