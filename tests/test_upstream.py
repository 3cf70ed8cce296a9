"""The upstream pool on its own: a lease never waits for a connection that will not come."""

from __future__ import annotations

import asyncio

import pytest

from actors.childproc import pick_port
from actors.http.pool import Pools
from actors.http.upstream import Broke


def test_at_the_cap_a_failed_open_wakes_the_next_lease() -> None:
    """Seen in a chaos run: with a child gone, the opener at a llama-server child's cap
    failed, and the leases queued behind it waited for good."""

    async def main() -> list[str]:
        pool = Pools(4.0).get(("127.0.0.1", pick_port(), "dead#1"), 1)  # nothing listens

        async def lease() -> str:
            try:
                await pool.lease()
            except OSError as e:
                return type(e).__name__
            return "leased"

        return await asyncio.wait_for(asyncio.gather(*(lease() for _ in range(3))), 5)

    assert asyncio.run(main()) == ["ConnectionRefusedError"] * 3


@pytest.mark.parametrize("n", [1, 4])
def test_leases_of_a_live_child_all_get_a_connection(n: int) -> None:
    async def main() -> int:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Pools(4.0).get(("127.0.0.1", port, "live#1"), n)
        ups = await asyncio.gather(*(pool.lease() for _ in range(n)))
        for up in ups:
            up.close()
        server.close()
        return len(set(map(id, ups)))

    assert asyncio.run(main()) == n


class Sink:
    """Records what an upstream reports (the exchange's side of the seam)."""

    upgrade = False  # (no WebSocket's opening)

    def __init__(self) -> None:
        self.heads: list[int] = []
        self.body = b""
        self.broke: list[tuple[str, Broke]] = []
        self.done = asyncio.get_running_loop().create_future()

    def response_interim(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        pass

    def response_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.heads.append(status)

    def response_body(self, body: bytes) -> None:
        self.body += body

    def flush(self) -> None:
        if self.heads and not self.done.done():
            self.done.set_result(None)

    def response_done(self) -> None:
        pass

    def upstream_broke(self, reason: str, kind: Broke) -> None:
        self.broke.append((reason, kind))


async def stalling_child() -> tuple[asyncio.Server, int]:
    """A child that answers a head and one chunk, then keeps the connection open, silent
    (as a child on a node that vanished: no FIN, no reset, ever)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await asyncio.sleep(3600)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_gone_childs_connections_end_at_once() -> None:
    """R7: Withdraw(gone) for a child (its node lost) ends the answers still open to it."""

    async def main() -> tuple[Sink, bool]:
        server, port = await stalling_child()
        pools = Pools(4.0)
        up = await pools.get(("127.0.0.1", port, "m#3"), None).lease()
        sink = Sink()
        up.send(sink, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", False)
        await asyncio.wait_for(sink.done, 5)
        pools.abort("m#2", "another generation")  # not this child's: nothing happens
        assert not sink.broke
        pools.abort("m#3", "the child is gone")
        server.close()
        return sink, not pools.pools

    sink, forgotten = asyncio.run(main())
    assert sink.heads == [200] and sink.body == b"hello"
    assert sink.broke == [("the child is gone", Broke.GONE)]
    assert forgotten  # no pool kept for a gone child


def test_a_child_silent_mid_answer_is_cut_after_the_timeout() -> None:
    async def main() -> list[tuple[str, Broke]]:
        server, port = await stalling_child()
        pools = Pools(4.0, silence_s=0.2)
        up = await pools.get(("127.0.0.1", port, "m#1"), None).lease()
        sink = Sink()
        up.send(sink, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", False)
        await asyncio.wait_for(sink.done, 5)
        loop = asyncio.get_running_loop()
        pools.sweep(loop.time())  # not yet
        assert not sink.broke
        up.pause_reading()  # a slow client's pause is not the child's silence
        pools.sweep(loop.time() + 1.0)
        assert not sink.broke
        up.resume_reading()
        pools.sweep(loop.time() + 1.0)
        server.close()
        return sink.broke

    [(why, kind)] = asyncio.run(main())
    assert kind is Broke.SILENT and "upstream_idle_timeout_s" in why


def test_at_the_cap_two_fresh_leases_get_connections_instead_of_passing_one_round() -> None:
    """Review of issue 25's uploads (finding 2): a fresh lease (an upload's) handed the
    connection given back at the cap passed it to the next waiter; two fresh waiters
    passed it between them for ever, at 100 % CPU."""

    async def main() -> tuple[int, int]:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Pools(4.0).get(("127.0.0.1", port, "capped#1"), 1)
        first = await pool.lease()
        waiting = [asyncio.ensure_future(pool.lease(fresh=True)) for _ in range(2)]
        await asyncio.sleep(0.05)  # both wait at the cap now
        pool.give_back(first)
        one = await asyncio.wait_for(waiting[0], 5)
        assert len(pool.leased) <= 1
        one.close()  # its place at the cap goes to the other
        two = await asyncio.wait_for(waiting[1], 5)
        two.close()
        server.close()
        return len(pool.leased), len({id(one), id(two), id(first)})

    assert asyncio.run(main()) == (0, 3)
