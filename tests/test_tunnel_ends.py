"""How a tunnel ends (tunnel.py), on uvloop with loopback TCP for its two connections:
an EOF from either end, the idle close after one, corral's drain, and a reader that is
slow but takes something (not cut) against one that takes nothing (cut). Each ends with
both connections closed and the client's loss reported (which frees the grant)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

import uvloop

from actors.config.http import HttpConfig
from actors.http.tunnel import Tunnel


class Client:
    """The client connection as a tunnel sees it."""

    def __init__(self) -> None:
        self.tunnel: Tunnel | None = None
        self.lost = asyncio.Event()

    def write(self, data: bytes) -> None:
        raise AssertionError("the tunnel writes to the transport itself")

    def hand_over(self) -> asyncio.Transport | None:
        raise AssertionError("not asked here")

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set()


async def side(loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Transport, socket.socket]:
    """A transport, and the socket at its far end (non-blocking)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        far = socket.create_connection(server.getsockname())
        near, _ = server.accept()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, near)
    far.setblocking(False)
    return transport, far


def frame(payload: bytes) -> bytes:
    """A child's binary frame (unmasked)."""
    n = len(payload)
    return (b"\x82" + (bytes([n]) if n < 126 else bytes([126]) + n.to_bytes(2, "big"))
            + payload)


async def read_all(loop: asyncio.AbstractEventLoop, s: socket.socket,
                   timeout_s: float = 5) -> bytes:
    """What the far end reads until the other side closes."""
    out = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = await asyncio.wait_for(loop.sock_recv(s, 65536), deadline - time.monotonic())
        except ConnectionResetError:
            return out
        if not got:
            return out
        out += got
    raise AssertionError("the tunnel did not close this end")


def run(test: Callable[[asyncio.AbstractEventLoop], Awaitable[None]]) -> None:
    async def main() -> None:
        await asyncio.wait_for(test(asyncio.get_running_loop()), 30)
    uvloop.run(main())


async def tunnel(loop: asyncio.AbstractEventLoop, **http: float,
                 ) -> tuple[Client, Tunnel, socket.socket, socket.socket]:
    client = Client()
    client_side, client_far = await side(loop)
    child_side, child_far = await side(loop)
    client.tunnel = Tunnel(client, client_side, child_side, HttpConfig(**http), "model 't'")
    return client, client.tunnel, client_far, child_far


def test_the_childs_eof_then_the_idle_close_ends_both() -> None:
    """Review finding: a close frame written after the EOF raised, and the tunnel (with
    its grant) was never released."""
    async def go(loop: asyncio.AbstractEventLoop) -> None:
        client, _, client_far, child_far = await tunnel(loop, websocket_idle_s=0.3,
                                                         write_timeout_s=30)
        child_far.shutdown(socket.SHUT_WR)  # the child sends no more
        assert await read_all(loop, client_far) == b""  # given as EOF, then the close
        await asyncio.wait_for(client.lost.wait(), 5)
        to_child = await read_all(loop, child_far)  # it may still be written to: 1001
        assert to_child[0] == 0x88 and to_child[1] & 0x80  # a close, masked as a client's
    run(go)


def test_an_eof_that_the_other_end_never_follows_ends_it_after_the_write_timeout() -> None:
    async def go(loop: asyncio.AbstractEventLoop) -> None:
        client, _, client_far, child_far = await tunnel(loop, websocket_idle_s=0,
                                                         write_timeout_s=0.3)
        client_far.shutdown(socket.SHUT_WR)  # the client sends no more; the child is mute
        began = time.monotonic()
        await asyncio.wait_for(client.lost.wait(), 5)
        assert time.monotonic() - began >= 0.25
        assert await read_all(loop, child_far) == b""
    run(go)


def test_the_drain_closes_both_with_1001() -> None:
    async def go(loop: asyncio.AbstractEventLoop) -> None:
        client, t, client_far, child_far = await tunnel(loop)
        t.shut("corral is shutting down")
        to_client = await read_all(loop, client_far)
        to_child = await read_all(loop, child_far)
        assert to_client[:2] == bytes([0x88, 2 + len("corral is shutting down")])
        assert to_client[2:4] == (1001).to_bytes(2, "big")
        assert to_child[0] == 0x88 and to_child[1] & 0x80  # masked, as a client's
        await asyncio.wait_for(client.lost.wait(), 5)
    run(go)


def test_a_slow_reader_is_not_cut_but_one_that_takes_nothing_is() -> None:
    async def go(loop: asyncio.AbstractEventLoop) -> None:
        client, _, client_far, child_far = await tunnel(loop, write_timeout_s=1.5)
        chunk = frame(b"x" * 1000) * 64

        async def flood() -> None:
            while not client.lost.is_set():
                try:
                    await loop.sock_sendall(child_far, chunk)
                except OSError:
                    return
        flooding = asyncio.create_task(flood())
        began, taken = time.monotonic(), 0
        while time.monotonic() - began < 4.0:  # 4 KiB every 20 ms: slow, but steady
            taken += len(await loop.sock_recv(client_far, 4096))
            await asyncio.sleep(0.02)
        assert not client.lost.is_set() and taken > 300_000
        stopped = time.monotonic()  # now it takes nothing
        await asyncio.wait_for(client.lost.wait(), 10)
        assert time.monotonic() - stopped >= 1.4
        flooding.cancel()
    run(go)
