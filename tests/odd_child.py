"""A child that speaks HTTP oddly on purpose, on raw sockets: the edge's hostile tests.

    python -m tests.odd_child --port 9000

Every answer carries the request's `x-request-id` (header and body), so a test can tell
whose answer a client got. The `x-odd` request header picks a behaviour:

    (none)        200 with Content-Length, keep-alive
    early-hints   103 Early Hints and 100 Continue, then the answer
    extra         the answer and a second, unasked-for one in the same write
    extra-later   the answer, then an unasked-for one 50 ms later
    http10        an HTTP/1.0 answer with no length, ended by closing
    http10-sse    an SSE stream as HTTP/1.0 (ends with [DONE], then the close)
    switch        101 Switching Protocols and bytes after it
    silent        never answers
    big           a chunked answer of `x-size` bytes (default 8 MiB)
    slow          `x-events` SSE events (default 5), 50 ms apart
    stream-close  a chunked SSE stream that says keep-alive, then closes (llama-server does)
    close-next    the answer; the next request on this connection is met by a close
    garbage       bytes that are not HTTP, then a close
    huge-head     an answer head of `x-size` bytes (default 64 MiB) in one header
    stall         an SSE head and one event, then silence with the socket open
    no-content    204 with a Content-Length (which a 204 must not have)
    html          a text/html page
    close-late    nothing for 0.3 s (it has the request), then a close without a byte
    big-cut       `x-size` bytes promised (default 8 MiB), half of them sent, then a close
    sse-cut       a chunked SSE stream: one event, half of the next, then a close
    sse-split     a chunked SSE stream whose events are cut across writes, one of them
                  ended by CRLFs, then [DONE] and its end

Each request is printed (`request RID on connection N`) before it is answered, so a test
can count how often the child received it.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import httptools

CONNECTIONS = 0


class Child(asyncio.Protocol):
    def __init__(self) -> None:
        global CONNECTIONS
        CONNECTIONS += 1
        self.number = CONNECTIONS
        self.parser = httptools.HttpRequestParser(self)
        self.headers: dict[str, str] = {}
        self.url = b""
        self.transport: asyncio.Transport | None = None
        self.close_next = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.headers = {}
        self.url = b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode()

    def on_message_complete(self) -> None:
        asyncio.get_running_loop().create_task(self.answer(dict(self.headers), self.url))

    async def answer(self, headers: dict[str, str], url: bytes) -> None:
        t = self.transport
        assert t is not None
        rid = headers.get("x-request-id", "")
        odd = headers.get("x-odd", "")
        if self.close_next:  # as a child whose keep-alive ran out: never read it
            t.close()
            return
        print(f"request {rid} on connection {self.number}", flush=True)
        body = json.dumps({"id": rid, "url": url.decode(), "headers": headers}).encode()
        plain = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nx-request-id: "
                 + rid.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        if odd == "early-hints":
            t.write(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n")
            await asyncio.sleep(0.01)
            t.write(b"HTTP/1.1 100 Continue\r\n\r\n" + plain)
        elif odd == "extra":
            t.write(plain + plain.replace(rid.encode(), b"EXTRA"))
        elif odd == "extra-later":
            t.write(plain)
            await asyncio.sleep(0.05)
            t.write(plain.replace(rid.encode(), b"EXTRA"))
        elif odd == "http10":
            t.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n")
            await asyncio.sleep(0.01)
            t.write(body)
            t.close()
        elif odd == "http10-sse":
            t.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
            for i in range(3):
                t.write(b'data: {"n": %d, "id": "%s"}\n\n' % (i, rid.encode()))
                await asyncio.sleep(0.01)
            t.write(b"data: [DONE]\n\n")
            t.close()
        elif odd == "switch":
            t.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade"
                    b"\r\n\r\nnot http any more")
        elif odd == "silent":
            return
        elif odd == "stream-close":
            await stream(t, rid, int(headers.get("x-events", "3")), 0.0)
            await asyncio.sleep(0.005)
            t.close()
        elif odd == "close-next":
            t.write(plain)
            self.close_next = True
        elif odd == "garbage":
            t.write(b"NOT HTTP\r\n\r\n")
            t.close()
        elif odd == "huge-head":
            size = int(headers.get("x-size", str(64 * 2**20)))
            t.write(b"HTTP/1.1 200 OK\r\nX-Big: ")
            block = b"a" * 65536
            for _ in range(size // len(block)):
                if t.is_closing():  # cut at corral's limit: each write to a closed
                    return          # socket logs a warning, flooding the log ring
                t.write(block)
                await asyncio.sleep(0)
            t.write(b"\r\nContent-Length: 2\r\n\r\nok")
        elif odd == "stall":
            t.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")
            event = b'data: {"n": 0, "id": "%s"}\n\n' % rid.encode()
            t.write(b"%x\r\n%s\r\n" % (len(event), event))
        elif odd == "no-content":
            t.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 10\r\nx-request-id: "
                    + rid.encode() + b"\r\n\r\n")
        elif odd == "close-late":
            await asyncio.sleep(0.3)
            t.close()
        elif odd == "big-cut":
            size = int(headers.get("x-size", str(8 * 2**20)))
            t.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                    b"Content-Length: %d\r\n\r\n" % size)
            t.write(b"x" * (size // 2))
            await asyncio.sleep(0.05)
            t.close()
        elif odd == "sse-cut":
            chunks = [b'data: {"n": 0, "id": "%s"}\n\n' % rid.encode(),
                      b'data: {"n": 1, "id": "%s", "text": "hal' % rid.encode()]
            await chunked_sse(t, chunks, 0.05)
            t.close()
        elif odd == "sse-split":
            chunks = [b'data: {"n": 0, ', b'"id": "%s"}\n' % rid.encode(),
                      b'\ndata: {"n": 1, "id": "%s"}\r\n\r\ndata: {"n": 2, ' % rid.encode(),
                      b'"id": "%s"}\n\ndata: [DONE]\n\n' % rid.encode()]
            await chunked_sse(t, chunks, 0.05)
            t.write(b"0\r\n\r\n")
        elif odd == "html":
            page = b"<html><script>alert(1)</script></html>"
            t.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d"
                    b"\r\n\r\n" % len(page) + page)
        elif odd == "big":
            size = int(headers.get("x-size", str(8 * 2**20)))
            t.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                    b"x-request-id: " + rid.encode() + b"\r\nContent-Length: %d\r\n\r\n" % size)
            block = b"x" * 65536
            for _ in range(size // len(block)):
                t.write(block)
            t.write(b"x" * (size % len(block)))
        elif odd == "slow":
            await stream(t, rid, int(headers.get("x-events", "5")), 0.05)
        else:
            t.write(plain)


async def chunked_sse(t: asyncio.Transport, chunks: list[bytes], gap_s: float) -> None:
    """A chunked SSE head, then `chunks` as they are, one write each, `gap_s` apart."""
    t.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    for chunk in chunks:
        t.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await asyncio.sleep(gap_s)


async def stream(t: asyncio.Transport, rid: str, events: int, gap_s: float) -> None:
    """A chunked SSE answer of `events` events carrying `rid`, `gap_s` apart."""
    t.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    for i in range(events):
        event = b'data: {"n": %d, "id": "%s"}\n\n' % (i, rid.encode())
        t.write(b"%x\r\n%s\r\n" % (len(event), event))
        if gap_s:
            await asyncio.sleep(gap_s)
    t.write(b"0\r\n\r\n")


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args, _ = p.parse_known_args()
    server = await asyncio.get_running_loop().create_server(Child, args.host, args.port)
    print(f"odd child listening on {args.port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
