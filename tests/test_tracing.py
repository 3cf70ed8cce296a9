"""OpenTelemetry traces (issue 40, part 4): with `[tracing] endpoint`, every model
request is a trace of spans (the request; its queue wait and the load it waited for,
with the eviction that made room; the child's answer to its first token; the stream)
sent over OTLP/HTTP, here to a receiver in the test that decodes them with
opentelemetry-proto. The client's W3C traceparent is joined, and the child is sent
corral's, so that its own spans join the same trace. Off, nothing of it is imported."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, Call, chat, fake_cmd, request, serving, toml_config, wait_until

trace_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2",
                                reason="the otel extra: pip install -e '.[otel]'")

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP collector on loopback: POST /v1/traces, protobuf, kept decoded."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.resources: list[Any] = []
        self.tokens: set[str | None] = set()
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                ok = (self.path == "/v1/traces"
                      and self.headers["Content-Type"] == "application/x-protobuf")
                if ok:
                    got = trace_pb2.ExportTraceServiceRequest.FromString(body)
                    with receiver.lock:
                        receiver.tokens.add(self.headers["x-collector-token"])
                        for rs in got.resource_spans:
                            receiver.resources.append(rs.resource)
                            receiver.spans += [s for ss in rs.scope_spans for s in ss.spans]
                self.send_response(200 if ok else 400)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def of_trace(self, trace_id: str) -> list[Any]:
        with self.lock:
            return [s for s in self.spans if s.trace_id.hex() == trace_id]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.shutdown()
    r.server_close()


def attrs(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = ([x.string_value for x in v.array_value.values]
                       if kind == "array_value" else getattr(v, kind))
    return out


def test_a_request_that_waited_for_a_load_is_one_trace(tmp_path: Path,
                                                       receiver: Receiver) -> None:
    with serving(tmp_path, toml_config(
            {"a": {"cmd": fake_cmd()}, "b": {"cmd": fake_cmd("--tokens-per-s", "100")}},
            models_max=1, tracing={"endpoint": f"http://127.0.0.1:{receiver.server_port}",
                                   "service_name": "corral-test", "sample": 1.0,
                                   "headers": {"x-collector-token": "t"}})) as c:
        assert chat(c.port, "a")[0] == 200
        streamed = Call(c.port, "b", "traced-1", {
            "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}, stream=True, max_tokens=10)
        streamed.join(30)
        assert streamed.status == 200 and streamed.lines
        b_port = c.models()["b"]["port"]
        child_saw = request(b_port, "GET", "/debug/stats")[1]["traceparent"]
        spans = wait_until(lambda: (s := receiver.of_trace(CLIENT_TRACE)) and len(s) >= 5
                           and s, 15, "the trace's spans")

        by_name = {s.name: s for s in spans}
        root = by_name["POST /v1/chat/completions"]
        assert root.parent_span_id.hex() == CLIENT_SPAN  # the client's trace, joined
        assert root.kind == root.SPAN_KIND_SERVER
        a = attrs(root)
        assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "b"
        assert a["gen_ai.operation.name"] == "chat" and a["corral.request_id"] == "traced-1"
        assert a["http.response.status_code"] == 200 and a["corral.waited"] == "load"
        queue, load = by_name["queue"], by_name["load"]
        assert queue.parent_span_id == root.span_id and load.parent_span_id == queue.span_id
        assert attrs(load)["corral.room"] == ["stop a"]  # the eviction that made room
        answer, stream = by_name["chat b"], by_name["stream"]
        assert answer.kind == answer.SPAN_KIND_CLIENT
        # The child was told corral's span of its answer, in the client's trace.
        assert child_saw == f"00-{CLIENT_TRACE}-{answer.span_id.hex()}-01"
        times = [root.start_time_unix_nano, queue.start_time_unix_nano,
                 load.end_time_unix_nano, answer.start_time_unix_nano,
                 answer.end_time_unix_nano, stream.end_time_unix_nano]
        assert times == sorted(times) and stream.end_time_unix_nano <= root.end_time_unix_nano
        assert load.end_time_unix_nano - load.start_time_unix_nano > 0

        # Not sampled by its client: no spans, and its traceparent goes on as it came.
        unsampled = f"00-{'1' * 32}-{'2' * 16}-00"
        assert chat(c.port, "b", headers={"traceparent": unsampled})[0] == 200
        assert request(b_port, "GET", "/debug/stats")[1]["traceparent"] == unsampled
        # Without one: a trace of its own.
        assert chat(c.port, "b", headers={"X-Request-Id": "own-1"})[0] == 200
        wait_until(lambda: any(attrs(s).get("corral.request_id") == "own-1"
                               for s in receiver.spans), 15, "its own trace")
    assert receiver.of_trace("1" * 32) == []
    service = attrs(receiver.resources[0])["service.name"]
    assert service == "corral-test" and receiver.tokens == {"t"}


def test_a_collector_that_is_down_loses_spans_not_requests(tmp_path: Path) -> None:
    with serving(tmp_path, toml_config({"a": {"cmd": fake_cmd()}},
                                       tracing={"endpoint": "http://127.0.0.1:9/v1/traces"})) as c:
        for _ in range(3):
            assert chat(c.port, "a")[0] == 200
        wait_until(lambda: "traces could not be sent" in c.log(), 15, "the warning")


def test_off_nothing_of_it_is_imported() -> None:
    code = ("import sys, supervisor, actors.http.api, actors.http.worker, actors.http.front;"
            "sys.exit(any(m.startswith('opentelemetry') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


def test_a_bad_endpoint_is_named(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[tracing]\nendpoint = "grpc://collector:4317"\n')
    out = subprocess.run([sys.executable, str(ROOT / "supervisor.py"), "check-config",
                          str(config)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "tracing: endpoint must be an http:// or https:// URL" in out.stderr


def test_a_collector_that_answers_garbage_once_gets_the_next_batches(tmp_path: Path) -> None:
    """Review of issue 40: an answer that is not HTTP killed the exporter's thread."""
    import socket as sock

    server = sock.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def collector() -> None:
        for n in range(2):
            conn, _ = server.accept()
            with conn:
                data = conn.recv(1 << 20)
                got.append(data)
                conn.sendall(b"garbage\r\n\r\n" if n == 0 else
                             b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    threading.Thread(target=collector, daemon=True).start()
    try:
        with serving(tmp_path, toml_config({"a": {"cmd": fake_cmd()}}, tracing={
                "endpoint": f"http://127.0.0.1:{server.getsockname()[1]}"})) as c:
            assert chat(c.port, "a")[0] == 200
            wait_until(lambda: len(got) == 1, 15, "the first batch")
            assert chat(c.port, "a")[0] == 200
            wait_until(lambda: len(got) == 2, 15, "the next batch, after the garbage")
            assert "traces could not be sent" in c.log()
    finally:
        server.close()
