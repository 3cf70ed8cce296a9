"""WebSocket passthrough (issue 39, part 3), with the `websockets` client against the fake
child's echo: an upgrade on `/v1/realtime?model=` (or any path of a model with
`websocket = true`) is routed like a request, its grant held for the socket's life (TTL,
eviction and max_concurrency see it in flight), frames relayed both ways within the
edge's limits (frame size, idle, write timeout), keys checked on the upgrade."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.helpers import Corral, fake_cmd, key_files, request, serving, toml_config, wait_until

OPS = {"Authorization": "Bearer ops-secret"}
ALICE = {"Authorization": "Bearer alice-secret"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corral]:
    home = tmp_path_factory.mktemp("websocket")
    keys = key_files(home, "alice", "ops")
    with serving(home, toml_config(
            {"rt": {"cmd": fake_cmd(), "ttl_s": 1},
             "comfy": {"cmd": fake_cmd(), "websocket": True},
             "one": {"cmd": fake_cmd(), "max_concurrency": 1},
             "secret": {"cmd": fake_cmd()}},
            models_max=4,
            http={"websocket_max_frame_mib": 0.01, "websocket_idle_s": 60},
            keys={"alice": {"key_file": keys["alice"], "models": ["rt", "comfy", "one"]},
                  "ops": {"key_file": keys["ops"], "admin": True}}), "ops-secret") as c:
        yield c


def url(c: Corral, path: str) -> str:
    return f"ws://127.0.0.1:{c.port}{path}"


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def stats(c: Corral, model: str) -> dict[str, Any]:
    status, body, _ = request(c.port, "GET", f"/debug/stats?model={model}", headers=OPS)
    assert status == 200, body
    return body


def test_frames_go_both_ways_and_the_grant_is_held_for_the_sockets_life(
        served: Corral) -> None:
    async def go() -> None:
        async with websockets.connect(url(served, "/v1/realtime?model=rt&intent=x"),
                                      additional_headers={**ALICE, "X-Trace": "t-1"},
                                      subprotocols=["realtime"]) as ws:
            assert ws.subprotocol is None  # the child chose none: passed on as it said
            await ws.send("hello")
            assert await ws.recv() == "hello"
            await ws.send(b"\x00\xffbinary")
            assert await ws.recv() == b"\x00\xffbinary"
            await ws.send("path")
            assert await ws.recv() == "/v1/realtime?model=rt&intent=x"
            await ws.send("header X-Trace")
            assert await ws.recv() == "t-1"
            await ws.send("header Authorization")  # the key stays with corral
            assert await ws.recv() == ""
            # In flight the whole time: rt's ttl_s (1 s) does not stop it under the socket.
            assert served.models()["rt"]["in_flight"] == 1
            await asyncio.sleep(2.5)
            assert served.state("rt") == "loaded"
            await ws.send("still there")
            assert await ws.recv() == "still there"
    run(go())
    wait_until(lambda: served.models()["rt"]["in_flight"] == 0, 15, "the grant released")
    assert stats(served, "rt")["sockets_open"] == 0


def test_max_concurrency_counts_a_socket(served: Corral) -> None:
    async def go() -> None:
        async with websockets.connect(url(served, "/v1/realtime?model=one"),
                                      additional_headers=ALICE) as first:
            await first.send("a")
            assert await first.recv() == "a"
            second = asyncio.ensure_future(websockets.connect(
                url(served, "/v1/realtime?model=one"), additional_headers=ALICE))
            await asyncio.to_thread(wait_until, lambda: served.models()["one"]["waiting"] == 1,
                                    15, "the second socket queued")
            assert not second.done()
        ws = await second  # the first closed: the second gets the slot
        async with ws:
            await ws.send("b")
            assert await ws.recv() == "b"
    run(go())


def test_a_model_with_websocket_true_takes_any_path(served: Corral) -> None:
    async def go() -> None:
        async with websockets.connect(url(served, "/ws?model=comfy&clientId=7"),
                                      additional_headers=ALICE) as ws:
            await ws.send("path")
            assert await ws.recv() == "/ws?model=comfy&clientId=7"
            await ws.send("close")  # the child closes: its code reaches the client
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4000
    run(go())
    wait_until(lambda: served.models()["comfy"]["in_flight"] == 0, 15, "the grant released")


@pytest.mark.parametrize(("path", "headers", "status", "why"), [
    ("/ws?model=rt", ALICE, 400, "/v1/realtime only"),
    ("/v1/realtime", ALICE, 400, "?model="),
    ("/models?model=rt", ALICE, 400, "?model="),
    ("/v1/realtime?model=nope", ALICE, 400, "not found"),
    ("/v1/realtime?model=rt", {}, 401, "API key"),
    ("/v1/realtime?model=secret", ALICE, 403, "may not use"),
])
def test_an_upgrade_that_goes_nowhere_says_why(served: Corral, path: str,
                                               headers: dict[str, str], status: int,
                                               why: str) -> None:
    async def go() -> None:
        with pytest.raises(InvalidStatus) as refused:
            await websockets.connect(url(served, path), additional_headers=headers)
        assert refused.value.response.status_code == status
        assert why in refused.value.response.body.decode()
    run(go())


def handshake(path: str, extra: bytes = b"", method: bytes = b"GET") -> bytes:
    key = base64.b64encode(os.urandom(16))
    return (method + b" " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer alice-secret\r\n" + extra +
            b"Connection: Upgrade\r\nSec-WebSocket-Key: " + key +
            b"\r\nSec-WebSocket-Version: 13\r\n\r\n")


@pytest.mark.parametrize(("method", "extra"), [
    (b"POST", b"Upgrade: websocket\r\n"),
    (b"GET", b"Upgrade: h2c\r\n"),
    (b"GET", b"Upgrade: websocket\r\nContent-Length: 5\r\n"),
])
def test_other_upgrades_are_a_400(served: Corral, method: bytes, extra: bytes) -> None:
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as s:
        s.sendall(handshake("/v1/realtime?model=rt", extra, method))
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 400") and b"WebSocket" in answer


def masked(opcode: int, payload: bytes) -> bytes:
    """A client's frame (masked, RFC 6455 5.3)."""
    mask = os.urandom(4)
    n = len(payload)
    size = bytes([0x80 | n]) if n < 126 else (bytes([0x80 | 126]) + n.to_bytes(2, "big")
                                               if n < 65536 else
                                               bytes([0x80 | 127]) + n.to_bytes(8, "big"))
    return (bytes([0x80 | opcode]) + size + mask
            + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))


def opened(port: int, path: str = "/v1/realtime?model=rt") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(handshake(path, b"Upgrade: websocket\r\n"))
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return s


def read_frame(s: socket.socket) -> tuple[int, bytes]:
    def exactly(n: int) -> bytes:
        out = b""
        while len(out) < n:
            more = s.recv(n - len(out))
            assert more, "closed mid-frame"
            out += more
        return out
    b0, b1 = exactly(2)
    n = b1 & 0x7F
    if n == 126:
        n = int.from_bytes(exactly(2), "big")
    elif n == 127:
        n = int.from_bytes(exactly(8), "big")
    return b0 & 0x0F, exactly(n)


def test_frames_split_anywhere_arrive_whole(served: Corral) -> None:
    """A client that writes its frames a byte at a time (headers torn across reads)."""
    with opened(served.port) as s:
        frames = masked(0x1, b"one") + masked(0x2, b"\x00" * 300) + masked(0x1, b"three")
        for i in range(len(frames)):
            s.sendall(frames[i:i + 1])
        assert read_frame(s) == (0x1, b"one")
        assert read_frame(s) == (0x2, b"\x00" * 300)
        assert read_frame(s) == (0x1, b"three")


def test_a_frame_over_the_limit_closes_with_1009(served: Corral) -> None:
    before = stats(served, "rt")["sockets_closed"]
    with opened(served.port) as s:
        s.sendall(masked(0x1, b"fine"))
        assert read_frame(s) == (0x1, b"fine")
        s.sendall(masked(0x2, b"x" * 20_000))  # the limit: 10 KiB
        opcode, payload = read_frame(s)
        assert opcode == 0x8 and int.from_bytes(payload[:2], "big") == 1009
        assert b"20000 bytes from the client" in payload
        assert s.recv(1) == b""  # and the connection ends
    wait_until(lambda: stats(served, "rt")["sockets_closed"] == before + 1, 15,
               "the child's socket closed too")


def test_a_frame_over_the_limit_from_the_child_closes_too(served: Corral) -> None:
    async def go() -> None:
        async with websockets.connect(url(served, "/v1/realtime?model=rt"),
                                      additional_headers=ALICE, compression=None) as ws:
            await ws.send("big 100")
            assert await ws.recv() == b"x" * 100
            await ws.send("big 20000")
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
            assert "from the child" in closed.value.rcvd.reason
    run(go())


def test_a_client_that_leaves_frees_the_grant_and_the_childs_socket(served: Corral) -> None:
    before = stats(served, "rt")["sockets_closed"]
    s = opened(served.port)
    s.sendall(masked(0x1, b"hi"))
    assert read_frame(s) == (0x1, b"hi")
    s.shutdown(socket.SHUT_RDWR)
    s.close()
    wait_until(lambda: stats(served, "rt")["sockets_closed"] == before + 1, 15,
               "the child's socket closed")
    wait_until(lambda: served.models()["rt"]["in_flight"] == 0, 15, "the grant released")


def test_an_idle_socket_is_closed(tmp_path: Path) -> None:
    config = toml_config({"rt": {"cmd": fake_cmd()}}, http={"websocket_idle_s": 1})

    async def go(c: Corral) -> float:
        async with websockets.connect(url(c, "/v1/realtime?model=rt"),
                                      ping_interval=None) as ws:
            await ws.send("hi")
            assert await ws.recv() == "hi"
            quiet = time.monotonic()
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
            assert "websocket_idle_s" in closed.value.rcvd.reason
            return time.monotonic() - quiet
    with Corral(config, home=tmp_path) as c:
        assert run(go(c)) >= 0.9
        wait_until(lambda: c.models()["rt"]["in_flight"] == 0, 15, "the grant released")


def test_an_end_that_takes_nothing_is_cut_and_the_blame_is_right(tmp_path: Path) -> None:
    """The client reads nothing while the child floods it: the client is cut (the child,
    which filled because corral stopped reading it, is not to blame). Then a child that
    reads nothing while the client floods it: the child is cut."""
    config = toml_config({"rt": {"cmd": fake_cmd()}}, http={"write_timeout_s": 1})
    with Corral(config, home=tmp_path) as c:
        for asked, blamed in ((b"big 1000000", "client"), (None, "child")):
            s = opened(c.port)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(5)
            try:
                if asked is None:
                    s.sendall(masked(0x1, b"stall 60"))
                for _ in range(200):  # 200 MB either way, none taken
                    try:
                        s.sendall(masked(0x1, asked) if asked else masked(0x2, b"y" * 2**20))
                    except OSError:
                        break  # cut already
                wait_until(lambda: c.models()["rt"]["in_flight"] == 0, 30,
                           "the stalled socket cut and its grant released")
                assert f"its {blamed} took nothing for 1 s" in c.log()
            finally:
                s.close()


def test_sockets_through_front_workers(tmp_path: Path) -> None:
    config = toml_config({"rt": {"cmd": fake_cmd()}}, http={"workers": 2})

    async def go(c: Corral) -> None:
        sockets = [await websockets.connect(url(c, "/v1/realtime?model=rt"))
                   for _ in range(6)]  # connections of their own: both workers take some
        for i, ws in enumerate(sockets):
            await ws.send(f"m{i}")
        assert [await ws.recv() for ws in sockets] == [f"m{i}" for i in range(6)]
        await asyncio.to_thread(wait_until, lambda: c.models()["rt"]["in_flight"] == 6, 15,
                                "six in flight")
        for ws in sockets:
            await ws.close()
    with Corral(config, home=tmp_path) as c:
        run(go(c))
        wait_until(lambda: c.models()["rt"]["in_flight"] == 0, 15, "all released")


def test_a_model_with_an_open_socket_is_no_eviction_victim(tmp_path: Path) -> None:
    config = toml_config({"a": {"cmd": fake_cmd()}, "b": {"cmd": fake_cmd()}}, models_max=1)

    async def go(c: Corral) -> None:
        async with websockets.connect(url(c, "/v1/realtime?model=a")) as ws:
            await ws.send("x")
            assert await ws.recv() == "x"
            other = asyncio.create_task(asyncio.to_thread(
                request, c.port, "POST", "/v1/chat/completions",
                {"model": "b", "max_tokens": 1, "messages": []}))
            await asyncio.to_thread(wait_until, lambda: c.models()["b"]["waiting"] == 1, 15,
                                    "b waiting")
            await asyncio.sleep(0.5)
            assert c.state("a") == "loaded" and not other.done()  # a is busy: b waits
            await ws.send("y")
            assert await ws.recv() == "y"
        status, _, _ = await other  # the socket closed: a goes, b loads
        assert status == 200 and c.state("a") == "unloaded"
    with Corral(config, home=tmp_path) as c:
        run(go(c))


def test_a_childs_answer_other_than_101_never_reaches_the_client(served: Corral) -> None:
    """Review finding: an upgrade to a path a member key may not GET (/props, /slots)
    was answered by the child as a plain GET, and the answer was relayed."""
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as s:
        s.sendall(handshake("/props?model=comfy", b"Upgrade: websocket\r\n"))
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 502")
    assert b"answered 200 to a WebSocket's opening" in answer
    assert b"n_ctx" not in answer  # nothing of the child's page


def test_sigterm_closes_open_sockets_with_1001_at_once(tmp_path: Path) -> None:
    config = toml_config({"rt": {"cmd": fake_cmd()}}, http={"drain_timeout_s": 60})
    c = Corral(config, home=tmp_path)
    try:
        async def go() -> float:
            async with websockets.connect(url(c, "/v1/realtime?model=rt")) as ws:
                await ws.send("hi")
                assert await ws.recv() == "hi"
                began = time.monotonic()
                c.proc.send_signal(signal.SIGTERM)
                with pytest.raises(ConnectionClosed) as closed:
                    await ws.recv()
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
                assert "shutting down" in closed.value.rcvd.reason
                return time.monotonic() - began
        assert run(go()) < 30  # not the 60 s drain: it is closed, not waited for
        assert c.proc.wait(60) == 0
    finally:
        c.stop()
