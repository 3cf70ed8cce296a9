"""The exporter of `[tracing]` (spans.py): a thread that makes the spans of the requests
that ended and posts them, in batches, to an OTLP/HTTP collector as protobuf
(`opentelemetry-proto`, the `otel` extra: imported only when traces are on).

The event loop only appends a request's `Ended` to a list (over MAX_PENDING, it is
dropped and counted); a collector that is down or slow costs lost spans and a warning a
minute, never a request.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Protocol

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from ..config.tracing import TracingConfig
from ..journal.record import Said
from .journaling import Spans, Trace, Work

log = logging.getLogger("corral.tracing")


class Ended(Protocol):
    """A traced request at its end (spans.py's `Ended`)."""

    spans: Spans
    trace: Trace
    work: Work
    method: bytes
    path: bytes
    key: str
    status: int
    said: Said | None
    stream: bool
    until: float

EXPORT_EVERY_S = 1.0
MAX_PENDING = 10_000
POST_TIMEOUT_S = 5.0
WARN_EVERY_S = 60.0
SERVER, CLIENT, INTERNAL = (Span.SpanKind.SPAN_KIND_SERVER, Span.SpanKind.SPAN_KIND_CLIENT,
                            Span.SpanKind.SPAN_KIND_INTERNAL)
_OPERATIONS = (("chat/completions", "chat"), ("/v1/messages", "chat"), ("/v1/responses", "chat"),
               ("embed", "embeddings"), ("completion", "text_completion"))
"""GenAI's gen_ai.operation.name, by what the path holds (the first that matches)."""


Attribute = AnyValue
"""(OTLP's name for an attribute's value.)"""


def _value(v: str | int | float | bool | list[str]) -> Attribute:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, list):
        return AnyValue(array_value=ArrayValue(values=[AnyValue(string_value=x) for x in v]))
    return AnyValue(string_value=v)


def _attributes(**pairs: str | int | float | bool | list[str] | None) -> list[KeyValue]:
    return [KeyValue(key=k.replace("__", "."), value=_value(v))
            for k, v in pairs.items() if v is not None and v != ""]


def spans_of(e: Ended) -> list[Span]:
    """A request's spans (spans.py says which)."""
    t, w, ids = e.trace, e.work, e.spans

    def ns(loop_time: float) -> int:  # a loop time as Unix nanoseconds
        return int((t.at + (loop_time - w.started)) * 1e9)

    path = e.path.decode("latin-1")
    operation = next((op for part, op in _OPERATIONS if part in path), "")
    said = e.said
    granted = w.granted_at if w.granted_at is not None else e.until
    failed = e.status >= 500 or e.status == 0 or bool(t.error)
    root = Span(
        trace_id=ids.trace_id, span_id=ids.root, parent_span_id=ids.parent,
        name=f"{e.method.decode('latin-1')} {path}", kind=SERVER,
        start_time_unix_nano=ns(w.started), end_time_unix_nano=ns(e.until),
        attributes=_attributes(
            http__request__method=e.method.decode("latin-1"), url__path=path,
            http__response__status_code=e.status or None,
            gen_ai__operation__name=operation, gen_ai__request__model=t.model,
            gen_ai__response__model=t.served,
            gen_ai__usage__input_tokens=said.prompt if said else None,
            gen_ai__usage__output_tokens=said.completion if said else None,
            corral__request_id=t.id, corral__key=e.key, corral__copy=t.copy,
            corral__queue_s=t.queue_s, corral__waited=t.waited, corral__cut=t.cut or None),
        status=Status(code=Status.StatusCode.STATUS_CODE_ERROR, message=t.error[:500])
        if failed else Status())
    queued = max(w.started, granted - t.queue_s)
    out = [root, Span(trace_id=ids.trace_id, span_id=_id(), parent_span_id=ids.root,
                      name="queue", kind=INTERNAL, start_time_unix_nano=ns(queued),
                      end_time_unix_nano=ns(granted),
                      attributes=_attributes(corral__waited=t.waited))]
    if t.waited:
        out.append(Span(trace_id=ids.trace_id, span_id=_id(), parent_span_id=out[1].span_id,
                        name=t.waited, kind=INTERNAL,
                        start_time_unix_nano=ns(max(queued, granted - w.waited_s)),
                        end_time_unix_nano=ns(granted),
                        attributes=_attributes(corral__room=list(t.room) or None,
                                               gen_ai__request__model=t.served)))
    if w.granted_at is not None:
        first = w.first_body if e.stream and w.first_body is not None else None
        out.append(Span(
            trace_id=ids.trace_id, span_id=ids.child, parent_span_id=ids.root,
            name=f"{operation or 'request'} {t.served or t.model}", kind=CLIENT,
            start_time_unix_nano=ns(granted), end_time_unix_nano=ns(first or e.until),
            attributes=_attributes(gen_ai__operation__name=operation,
                                   gen_ai__request__model=t.served or t.model)))
        if first is not None:
            out.append(Span(trace_id=ids.trace_id, span_id=_id(), parent_span_id=ids.root,
                            name="stream", kind=INTERNAL, start_time_unix_nano=ns(first),
                            end_time_unix_nano=ns(e.until),
                            attributes=_attributes(corral__bytes_out=t.bytes_out)))
    return out


def _id() -> bytes:
    return os.urandom(8)


class Exporter:
    """Spans, made and posted off the loop, every EXPORT_EVERY_S."""

    def __init__(self, config: TracingConfig) -> None:
        self.url = config.url
        self.headers = {"Content-Type": "application/x-protobuf", **config.headers}
        self.resource = Resource(attributes=_attributes(service__name=config.service_name))
        self.pending: collections.deque[Ended] = collections.deque()
        self.closing = threading.Event()
        self.dropped = 0
        self.sent = 0
        self.warned = 0.0
        self.thread = threading.Thread(target=self._run, name="otlp", daemon=True)
        self.thread.start()

    def add(self, ended: Ended) -> None:
        if len(self.pending) > MAX_PENDING:
            self.dropped += 1
        else:
            self.pending.append(ended)

    def close(self, timeout_s: float = POST_TIMEOUT_S + 1) -> None:
        """Post what is pending, then stop."""
        self.closing.set()
        self.thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            stop = self.closing.wait(EXPORT_EVERY_S)
            take = self.pending.popleft
            batch = [take() for _ in range(len(self.pending))]
            if batch:
                self._post(batch)
            if stop:
                return

    def _post(self, batch: list[Ended]) -> None:
        spans = [s for e in batch for s in spans_of(e)]
        body = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
            resource=self.resource, scope_spans=[ScopeSpans(
                scope=InstrumentationScope(name="corral"), spans=spans)])]).SerializeToString()
        try:
            with urllib.request.urlopen(urllib.request.Request(
                    self.url, data=body, headers=self.headers, method="POST"),
                    timeout=POST_TIMEOUT_S) as answer:
                answer.read()
            self.sent += len(batch)
        except Exception as e:  # (OSError, an HTTP error, an answer that is not HTTP)
            self.dropped += len(batch)
            if time.monotonic() - self.warned > WARN_EVERY_S:
                self.warned = time.monotonic()
                log.warning("traces could not be sent to %s (%s): %d requests' spans "
                            "lost so far; requests go on", self.url, e, self.dropped)
