"""The batch runner (actors/batches/runner.py) against a stand-in front on loopback: a
cancel that comes while it picks the next batch (its lines being read, or the Scheduler
asked which models are up) ends that batch cancelled and sends none of its lines after;
a line corral keeps refusing is sent four times, 1, 2 and 4 retry units apart, and then
rests at once."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

from aiohttp import web

from actors.batches.runner import Runner
from actors.batches.shapes import Batch, FileObject
from actors.batches.store import Store
from actors.config.batches import BatchesConfig


def _input(n: int) -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": []}}).encode() + b"\n" for i in range(n))


async def _front(hits: list[float]) -> tuple[web.AppRunner, str]:
    async def answer(request: web.Request) -> web.Response:
        hits.append(time.monotonic())
        return web.json_response({"ok": True}, headers={"Content-Security-Policy": "x"})
    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _setup(tmp: Path) -> tuple[Store, Batch]:
    store = Store(tmp / "batches")
    store.ready()
    data = tmp / "in.part"
    data.write_bytes(_input(3))
    f = store.add_file(FileObject(id="file-" + "0" * 24, bytes=data.stat().st_size,
                                  created_at=int(time.time()), filename="in.jsonl",
                                  purpose="batch"), data)
    batch = Batch(id="batch_x", endpoint="/v1/chat/completions", input_file_id=f.id,
                  created_at=int(time.time()), expires_at=int(time.time()) + 86400)
    return store, batch


async def _run(tmp: Path, block: str) -> tuple[str, list[float], float]:
    store, batch = _setup(tmp)
    hits: list[float] = []
    front, url = await _front(hits)
    gate = asyncio.Event()
    reading = threading.Event()
    asked = asyncio.Event()

    async def models() -> dict[str, float | None]:
        asked.set()
        if block == "models":
            await gate.wait()  # the Scheduler's answer takes a moment
        return {"m": 0.0}

    if block == "read":  # reading a big file's lines takes a moment
        done_ids = store.done_ids

        def slow(batch_id: str):  # type: ignore[no-untyped-def]
            reading.wait(5)
            return done_ids(batch_id)
        store.done_ids = slow  # type: ignore[method-assign]

    r = Runner(BatchesConfig(lines_at_once=1), store, lambda: url, "s", models)
    await r.start()
    await r.add(batch)
    if block == "models":
        await asyncio.wait_for(asked.wait(), 5)
    else:
        await asyncio.sleep(0.2)  # _load's thread is reading
    await r.cancel(batch)
    cancelled_at = time.monotonic()
    assert batch.status == "cancelling"  # (the loop ends it)
    gate.set()
    reading.set()
    await asyncio.sleep(1.0)
    await r.stop()
    await front.cleanup()
    return batch.status, hits, cancelled_at


def test_a_cancel_while_pick_awaits_the_models_ends_cancelled(tmp_path: Path) -> None:
    status, _, _ = asyncio.run(_run(tmp_path, "models"))
    assert status == "cancelled", f"the cancelled batch ended {status!r}"


def test_a_cancel_while_its_lines_are_read_sends_none_of_them(tmp_path: Path) -> None:
    status, hits, cancelled_at = asyncio.run(_run(tmp_path, "read"))
    after = [h for h in hits if h > cancelled_at]
    assert not after, f"{len(after)} lines sent after the cancel (status {status!r})"
    assert status == "cancelled"


def test_a_refused_line_is_sent_again_after_1_2_and_4_s(tmp_path: Path,
                                                        monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """README: "sent again after 1, 2 and 4 s; after that its model's lines rest": four
    sends, and no wait after the last."""
    import actors.batches.runner as runner_mod
    monkeypatch.setattr(runner_mod, "RETRY_S", 0.01)
    store, batch = _setup(tmp_path)

    async def go() -> tuple[int, float, object]:
        hits: list[float] = []

        async def refuse(request: web.Request) -> web.Response:
            hits.append(time.monotonic())
            return web.json_response({"error": "busy"}, status=503)  # corral's own
        app = web.Application()
        app.router.add_post("/v1/chat/completions", refuse)
        front = web.AppRunner(app)
        await front.setup()
        site = web.TCPSite(front, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        r = Runner(BatchesConfig(), store, lambda: f"http://127.0.0.1:{port}", "s",
                   lambda: None)  # type: ignore[arg-type,return-value]
        lines = await asyncio.to_thread(lambda: runner_mod.lines_of(
            store.data_of(batch.input_file_id).open("rb"), batch.endpoint, 10)[0])
        got = await r._send(batch, lines[0])
        after_last = time.monotonic() - hits[-1]
        await r.session.close()  # type: ignore[union-attr]
        await front.cleanup()
        return len(hits), after_last, got
    sends, after_last, got = asyncio.run(go())
    assert got is None
    assert sends == 4 and after_last < 0.035, \
        f"{sends} sends; {after_last:.3f} s slept after the last before resting (0.04 = '4 s')"
