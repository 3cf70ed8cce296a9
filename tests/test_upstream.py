"""The upstream pool on its own: a lease never waits for a connection that will not come."""

from __future__ import annotations

import asyncio

import pytest

from actors.childproc import pick_port
from actors.upstream import Pools


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
