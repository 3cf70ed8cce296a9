"""The floor of a reverse proxy written in Python (issue 43): the least a relay on corral's
own parts (uvloop, httptools) can do for a request, so that a reader sees how much of
corral's cost against nginx is the language and how much is corral.

    python -m bench.floor --port PORT --upstream HOST:PORT

It parses each request and each answer with httptools, only to know where they end, and
passes their bytes through unchanged: no routing, no model field, no grant, no limits, no
headers rewritten, no journal, no metrics. Upstream connections are kept idle in a stack
(the most recent first, as nginx's `keepalive`) and any number may be open. A request
whose upstream connection fails gets a 502 and its client connection closes. Nobody
should serve with it; `python -m bench tokenize --routers ...,floor` starts it beside
nginx and corral.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import cast

import httptools
import uvloop

BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class Upstream(asyncio.Protocol):
    """One connection to the child; passes an answer's bytes to the client it serves."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.client: Client | None = None
        self.parser = httptools.HttpResponseParser(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None or client.transport.is_closing():  # nobody asking any more
            assert self.transport is not None
            self.transport.close()
            return
        client.transport.write(data)
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        if self.parser.should_keep_alive():
            self.relay.idle.append(self)
        elif self.transport is not None:
            self.transport.close()
        if client is not None:
            client.answered()

    def connection_lost(self, exc: Exception | None) -> None:
        with contextlib.suppress(ValueError):
            self.relay.idle.remove(self)
        if self.client is not None:
            self.client.failed()
            self.client = None


class Client(asyncio.Protocol):
    """One client connection: requests one at a time, each relayed as it arrives."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport
        self.upstream: Upstream | None = None
        self.pending: list[bytes] = []
        self.connecting = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        if self.upstream is None:
            self.pending.append(data)
            if not self.connecting:
                self.start()
        else:
            up = self.upstream.transport
            assert up is not None
            up.write(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def start(self) -> None:
        idle = self.relay.idle
        if idle:
            self.bind(idle.pop())
        else:
            self.connecting = True
            self.relay.connecting.add(task := asyncio.ensure_future(self.connect()))
            task.add_done_callback(self.relay.connecting.discard)

    async def connect(self) -> None:
        try:
            _, up = await asyncio.get_running_loop().create_connection(
                lambda: Upstream(self.relay), *self.relay.upstream)
        except OSError:
            self.failed()
            return
        self.bind(up)

    def bind(self, up: Upstream) -> None:
        self.upstream, up.client, self.connecting = up, self, False
        assert up.transport is not None
        up.transport.write(b"".join(self.pending))
        self.pending.clear()

    def answered(self) -> None:
        self.upstream = None

    def failed(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(BAD_GATEWAY)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        up, self.upstream = self.upstream, None
        if up is not None and up.transport is not None:
            up.client = None
            up.transport.close()


class Relay:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.idle: list[Upstream] = []
        self.connecting: set[asyncio.Future[None]] = set()


async def serve(port: int, upstream: tuple[str, int]) -> None:
    relay = Relay(upstream)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client(relay), "127.0.0.1", port, backlog=1024)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print("listening", flush=True)
    async with server:
        await stop.wait()


@contextlib.contextmanager
def floor(upstream: str, timeout_s: float = 20.0) -> Iterator[tuple[str, int]]:
    """The floor relay in front of `upstream` (`host:port`) until the block ends: yields
    (its URL, its pid); stopped even when the block raises."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-m", "bench.floor", "--port", str(port),
                             "--upstream", upstream], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline() != b"listening\n":
            raise RuntimeError(f"the floor relay did not start (status {proc.wait(5)})")
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port),
                                                                        timeout=0.5):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the floor relay did not listen on {port}")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="host:port of the child")
    args = ap.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    uvloop.run(serve(args.port, (host, int(port))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
