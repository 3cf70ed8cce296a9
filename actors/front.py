"""The hot path: proxied POSTs on raw asyncio protocols with httptools (as uvicorn does).

corral's port is served here. A proxied POST (`/v1/chat/completions` and the rest of
R-6.1) is parsed with httptools, its model read with msgspec, granted by the Scheduler
and streamed to and from the child over pooled keep-alive connections (a new one per
request for llama-server children: router.unpooled), with no framework in between.
Every other request (the management API, GET with ?model=) is passed, bytes in and
bytes out, to the aiohttp application on an internal loopback port. Measured with
`python -m bench overhead`: see bench/README.md.

Per client connection one request is handled at a time (pipelined ones wait their
turn). A client that goes away cancels its place in the queue or its upstream request;
a child that breaks off a streamed answer ends it with an error event (SSE) or a closed
connection (anything else), never with a truncated body that looks complete.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
from collections.abc import Callable, Sequence
from typing import Any

import httptools
import msgspec
import pykka

from .bridge import acquire
from .messages import Refusal, Release

log = logging.getLogger("corral.front")

HOP_BY_HOP_NAMES = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "trailers", "transfer-encoding", "upgrade", "content-length",
})
"""Headers that belong to one connection, never passed on (both proxy paths use them)."""
HOP_BY_HOP = frozenset(name.encode() for name in HOP_BY_HOP_NAMES)
NOT_FORWARDED = HOP_BY_HOP | {b"authorization", b"x-api-key", b"host", b"expect"}
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           413: "Payload Too Large", 500: "Internal Server Error", 502: "Bad Gateway",
           503: "Service Unavailable"}


class RequestHead(msgspec.Struct):
    """The one field of a proxied body corral reads; the rest passes through."""

    model: str | None = None


_decode_head = msgspec.json.Decoder(RequestHead).decode


class Request:
    __slots__ = ("body", "headers", "keep_alive", "method", "path", "too_big", "url")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = bytearray()
        self.method = b""
        self.path = b""
        self.keep_alive = True
        self.too_big = False
        """Its body went over max_body: the rest was not kept, and the answer is 413."""


def json_response(status: int, body: dict[str, Any], keep_alive: bool,
                  extra: Sequence[tuple[str, str]] = ()) -> bytes:
    data = msgspec.json.encode(body)
    head = [f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}",
            "Content-Type: application/json", f"Content-Length: {len(data)}",
            f"Connection: {'keep-alive' if keep_alive else 'close'}",
            *(f"{k}: {v}" for k, v in extra)]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


def error_body(status: int, message: str, type_: str) -> dict[str, Any]:
    """An OpenAI-shaped error (R-6.4)."""
    return {"error": {"code": status, "message": message, "type": type_}}


def retry_after(refusal: Refusal) -> list[tuple[str, str]]:
    """The Retry-After header a refusal asks for, if any."""
    if refusal.retry_after_s is None:
        return []
    return [("Retry-After", str(max(1, round(refusal.retry_after_s))))]


class Front:
    """Everything the connections share: the names, the scheduler, the upstream pool."""

    def __init__(self, names: Callable[[], dict[str, str]],
                 unpooled: Callable[[], frozenset[str]], scheduler: Callable[[], Any],
                 internal_port: Callable[[], int], api_key: str | None, autoload: bool,
                 max_body: int, proxied: frozenset[bytes]) -> None:
        self.names = names
        self.unpooled = unpooled
        """Models whose requests each get a new upstream connection (router.unpooled)."""
        self.scheduler = scheduler
        self.internal_port = internal_port
        self.api_key = api_key.encode() if api_key else None
        self.autoload = autoload
        self.max_body = max_body
        self.proxied = proxied
        self.idle: dict[tuple[str, int, str], list[Upstream]] = collections.defaultdict(list)
        """Keep-alive connections to children (and the internal app), by address."""
        self.connections: set[Connection] = set()

    async def upstream(self, host: str, port: int, tag: str) -> Upstream:
        """A connection to host:port, reused if one is idle. `tag` names the process
        behind the port (model#generation): a new child that happens to get a dead
        one's port never receives the dead one's connections."""
        pool = self.idle[(host, port, tag)]
        while pool:
            up = pool.pop()
            if not up.closed:
                return up
        loop = asyncio.get_running_loop()
        _, up = await loop.create_connection(lambda: Upstream(self, (host, port, tag)),
                                             host, port)
        return up

    def close(self) -> None:
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        for pool in self.idle.values():
            for up in pool:
                up.close()
        self.idle.clear()


class Upstream(asyncio.Protocol):
    """One keep-alive connection to a child; parses its responses for the Connection
    that currently uses it."""

    def __init__(self, front: Front, address: tuple[str, int, str]) -> None:
        self.front = front
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.sink: Connection | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        pool = self.front.idle.get(self.address)
        if pool is not None and self in pool:
            pool.remove(self)
            if not pool:  # the child is gone: so is its key
                del self.front.idle[self.address]
        if self.sink is not None:
            sink, self.sink = self.sink, None
            sink.upstream_broke(exc or ConnectionResetError("the child closed the connection"))

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.close()
            if self.sink is not None:
                sink, self.sink = self.sink, None
                sink.upstream_broke(e)
        if sink is not None:
            sink.flush()  # what this read produced goes out in one write

    def start(self, sink: Connection, head: bytes, body: bytes) -> None:
        self.sink = sink
        self.headers = []
        self.parser = httptools.HttpResponseParser(self)
        assert self.transport is not None
        self.transport.write(head + body)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.sink is None:
            return
        self.sink.response_head(self.parser.get_status_code(), self.headers)
        if self.sink.head_only:  # a HEAD answer has no body, whatever its headers say
            sink, self.sink = self.sink, None
            self.close()  # the parser would wait for that body: never reuse this one
            sink.response_done()

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            self.sink.response_body(body)

    def on_message_complete(self) -> None:
        sink, self.sink = self.sink, None
        if not self.parser.should_keep_alive():
            self.close()
        elif not self.closed:
            self.front.idle[self.address].append(self)
        if sink is not None:
            sink.response_done()


class Connection(asyncio.Protocol):
    """One client connection."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.current: Request | None = None
        self.pending: collections.deque[Request] = collections.deque()
        self.busy = False
        self.task: asyncio.Task[None] | None = None
        self.upstream: Upstream | None = None
        self.chunked = False
        self.streaming_sse = False
        self.response_started = False
        self.keep_alive = True
        self.done: asyncio.Future[None] | None = None
        self.model: str | None = None
        self.head_only = False
        self.out: list[bytes] = []
        """Response bytes for the client, written once per upstream read (`flush`)."""

    # ------------------------------------------------------------ client side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.front.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.front.connections.discard(self)
        self.transport = None
        if self.task is not None and not self.task.done():
            self.task.cancel()  # leaves the queue, or drops the upstream request
        if self.upstream is not None:
            self.upstream.sink = None
            self.upstream.close()  # mid-response: it cannot be reused
            self.upstream = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.reply(400, error_body(400, "upgrades are not supported", "invalid_request_error"))
        except httptools.HttpParserError as e:
            if self.transport is not None:
                self.transport.write(json_response(400, error_body(
                    400, f"malformed HTTP request: {e}", "invalid_request_error"), False))
                self.transport.close()

    def pause_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.current = Request()

    def on_url(self, url: bytes) -> None:
        assert self.current is not None
        self.current.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.current is not None
        self.current.headers.append((name, value))

    def on_headers_complete(self) -> None:
        req = self.current
        assert req is not None
        req.method = self.parser.get_method()
        req.path = req.url.split(b"?", 1)[0]
        req.keep_alive = self.parser.should_keep_alive()
        if self.transport is not None and any(
                n.lower() == b"expect" and v.lower() == b"100-continue" for n, v in req.headers):
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        req = self.current
        assert req is not None
        if req.too_big or len(req.body) + len(body) > self.front.max_body:
            req.too_big = True
            req.body = bytearray()
            return
        req.body += body

    def on_message_complete(self) -> None:
        req = self.current
        assert req is not None
        self.current = None
        self.pending.append(req)
        if not self.busy:
            self.next_request()

    # ------------------------------------------------------------ one request

    def next_request(self) -> None:
        if not self.pending or self.transport is None:
            self.busy = False
            return
        self.busy = True
        req = self.pending.popleft()
        self.keep_alive = req.keep_alive
        self.response_started = False
        self.chunked = False
        self.streaming_sse = False
        self.task = asyncio.get_running_loop().create_task(self.handle(req))

    def finish(self) -> None:
        """The response is complete: go on with the next request, or close."""
        self.upstream = None
        if self.transport is None:
            return
        if not self.keep_alive:
            self.transport.close()
            return
        self.next_request()

    def reply(self, status: int, body: dict[str, Any],
              extra: Sequence[tuple[str, str]] = ()) -> None:
        if self.transport is not None:
            self.transport.write(json_response(status, body, self.keep_alive, extra))
        self.finish()

    async def handle(self, req: Request) -> None:
        try:
            if req.too_big:
                self.reply(413, error_body(413, f"request body over the "
                                           f"{self.front.max_body / 2**20:g} MiB limit",
                                           "invalid_request_error"))
            elif req.method == b"POST" and req.path in self.front.proxied:
                await self.proxy(req)
            else:
                await self.pass_through(req)
        except asyncio.CancelledError:
            raise
        except pykka.ActorDeadError:
            self.reply(503, error_body(503, "corral is shutting down (its scheduler has "
                                       "stopped)", "unavailable_error"))
        except Exception as e:  # a bug here must not take the server down
            log.exception("request %s %s failed", req.method, req.url)
            if not self.response_started:
                self.reply(500, error_body(500, f"internal error: {e}", "server_error"))
            elif self.transport is not None:
                self.transport.close()

    def authorized(self, req: Request) -> bool:
        key = self.front.api_key
        if key is None:
            return True
        given = b""
        for name, value in req.headers:
            lname = name.lower()
            if lname == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
            elif lname == b"x-api-key" and not given:
                given = value.strip()
        return hmac.compare_digest(given, key)

    async def proxy(self, req: Request) -> None:
        if not self.authorized(req):
            self.reply(401, error_body(401, "invalid or missing API key (send "
                                       "Authorization: Bearer KEY)", "authentication_error"))
            return
        try:
            head = _decode_head(req.body) if req.body else RequestHead()
        except msgspec.DecodeError as e:
            self.reply(400, error_body(400, f"invalid JSON body: {e}", "invalid_request_error"))
            return
        if not head.model:
            self.reply(400, error_body(400, 'model name is missing from the request (set '
                                       '"model")', "invalid_request_error"))
            return
        model = self.front.names().get(head.model)
        if model is None:
            self.reply(400, error_body(400, f"model '{head.model}' not found",
                                       "invalid_request_error"))
            return
        autoload = self.front.autoload
        query = req.url.split(b"?", 1)[1] if b"?" in req.url else b""
        for pair in query.split(b"&"):
            if pair.startswith(b"autoload="):
                autoload = pair[9:] in (b"1", b"true")
        scheduler = self.front.scheduler()
        ticket, answer = await acquire(scheduler, model, autoload)
        if isinstance(answer, Refusal):
            self.reply(answer.status, error_body(answer.status, answer.message,
                                                 answer.error_type), retry_after(answer))
            return
        try:
            host, _, port = answer.base_url.rpartition("/")[2].partition(":")
            await self.forward(req, host, int(port), answer.model, drop=NOT_FORWARDED,
                               tag=f"{answer.model}#{answer.generation}")
        finally:
            scheduler.tell(Release(ticket))

    async def pass_through(self, req: Request) -> None:
        """Everything but a proxied POST: to the aiohttp app, with the client's headers."""
        await self.forward(req, "127.0.0.1", self.front.internal_port(), None,
                           drop=HOP_BY_HOP | {b"host"}, tag="api")

    async def forward(self, req: Request, host: str, port: int, model: str | None,
                      drop: frozenset[bytes], tag: str) -> None:
        head = [req.method + b" " + req.url + b" HTTP/1.1", b"Host: " + host.encode()]
        head += [name + b": " + value for name, value in req.headers
                 if name.lower() not in drop]
        head.append(b"Content-Length: " + str(len(req.body)).encode())
        if model in self.front.unpooled():
            head.append(b"Connection: close")  # the answer closes it: never pooled
        data = b"\r\n".join(head) + b"\r\n\r\n"
        try:
            up = await self.front.upstream(host, port, tag)
        except OSError as e:
            what = f"model '{model}'" if model else "corral's API"
            self.reply(502, error_body(502, f"{what} is unreachable: {e}", "server_error"))
            return
        self.model = model
        self.head_only = req.method == b"HEAD"
        self.done = asyncio.get_running_loop().create_future()
        self.upstream = up
        up.start(self, data, bytes(req.body))
        await self.done

    # ------------------------------------------------------------ upstream side

    def response_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        if self.transport is None:
            return
        self.response_started = True
        length = None
        out = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}".encode()]
        for name, value in headers:
            lname = name.lower()
            if lname == b"content-length":
                length = value
            elif lname == b"content-type" and value.startswith(b"text/event-stream"):
                self.streaming_sse = True
            if lname not in HOP_BY_HOP:
                out.append(name + b": " + value)
        if length is not None:
            out.append(b"Content-Length: " + length)
        elif self.head_only:
            pass
        else:
            self.chunked = True
            out.append(b"Transfer-Encoding: chunked")
        out.append(b"Connection: keep-alive" if self.keep_alive else b"Connection: close")
        self.out.append(b"\r\n".join(out) + b"\r\n\r\n")

    def response_body(self, body: bytes) -> None:
        if self.chunked:
            self.out += (f"{len(body):x}\r\n".encode(), body, b"\r\n")
        else:
            self.out.append(body)

    def flush(self) -> None:
        if self.out:
            if self.transport is not None:
                self.transport.write(b"".join(self.out))
            self.out.clear()

    def response_done(self) -> None:
        if self.chunked:
            self.out.append(b"0\r\n\r\n")
        self.flush()
        self._resolve()
        self.finish()

    def upstream_broke(self, exc: BaseException) -> None:
        what = f"model '{self.model}'" if self.model else "corral's API"
        if not self.response_started:
            self._resolve()
            self.reply(502, error_body(502, f"{what} is unreachable: {exc}", "server_error"))
            return
        log.warning("%s broke off a response: %s", what, exc)
        if self.transport is not None:
            if self.streaming_sse and self.chunked:
                event = b"data: " + msgspec.json.encode(error_body(
                    502, f"{what} stopped mid-response: {exc}", "server_error")) + b"\n\n"
                self.response_body(event)
                self.out.append(b"0\r\n\r\n")
                self.flush()
                self.keep_alive = False
            else:  # no way to say it in-band: cut the connection so it is not mistaken
                self.flush()
                self.transport.close()
        self._resolve()
        self.finish()

    def _resolve(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)
