"""A higher class's request cuts a lower class's over real processes (`priority_preempt`,
policy/cuts.py): the child drops the cut request, which is sent again and answered in
full; a stream whose client has had a byte is never cut; through one front and through
front workers."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from actors.messages import Cut, Grant
from tests.helpers import ROOT as ROOT_DIR
from tests.helpers import chat, fake_cmd, request, toml_config, wait_until

ROOT = {"Authorization": "Bearer root-secret"}
INTER = {"Authorization": "Bearer inter-secret"}
BATCH = {"Authorization": "Bearer batch-secret"}


def config(tmp_path: Path, workers: int = 1, preempt: bool = True,
           knobs: tuple[str, ...] = ()) -> str:
    keys = {}
    for name, cls in (("root", None), ("inter", "interactive"), ("batch", "batch")):
        path = tmp_path / f"{name}.key"
        path.write_text(f"{name}-secret")
        keys[name] = {"key_file": str(path), "admin": name == "root",
                      **({"priority": cls} if cls else {})}
    return toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "10", *knobs),
                              "max_concurrency": 1}},
                       keys=keys, priorities={"interactive": 10, "batch": 1},
                       priority_preempt=preempt, http={"workers": workers})


class InThread:
    """A request on a thread of its own: its answer and when it came."""

    def __init__(self, call: Any) -> None:
        self.result: Any = None
        self.at = 0.0
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call: Any) -> None:
        self.result = call()
        self.at = time.monotonic()

    def join(self) -> Any:
        self.thread.join(60)
        assert not self.thread.is_alive(), "no answer within 60 s"
        return self.result


def child_stats(c: Any) -> dict[str, int]:
    return request(c.models()["a"]["port"], "GET", "/debug/stats")[1]  # type: ignore[no-any-return]


def start(corral: Any, text: str) -> Any:
    c = corral(text)
    c.key = "root-secret"
    assert chat(c.port, "a", headers=ROOT)[0] == 200  # loaded
    return c


@pytest.mark.parametrize("workers", [1, 2])
def test_a_batch_request_with_nothing_sent_is_cut_and_sent_again(corral, tmp_path: Path,
                                                                 workers: int) -> None:
    c = start(corral, config(tmp_path, workers))
    batch = InThread(lambda: chat(c.port, "a", max_tokens=30, headers=BATCH))  # 3 s
    wait_until(lambda: child_stats(c)["started"] == 2, what="the child to start the batch one")
    status, body = chat(c.port, "a", max_tokens=2, headers=INTER)
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert batch.thread.is_alive(), "the interactive answer came first: the batch one was cut"
    status, body = batch.join()
    assert status == 200 and body["usage"]["completion_tokens"] == 30, "answered in full"
    stats = child_stats(c)
    assert (stats["cancelled"], stats["completed"]) == (1, 3), stats
    _, keys, _ = request(c.port, "GET", "/keys", headers=ROOT)
    assert {k["name"]: k["cuts"] for k in keys["data"]} == {"root": 0, "inter": 0, "batch": 1}
    _, metrics, _ = request(c.port, "GET", "/metrics", headers=ROOT)
    assert 'corral_key_cuts_total{key="batch"} 1.0' in metrics
    assert "corral_requests_cut_total 1.0" in metrics
    keys_cli = subprocess.run(
        [sys.executable, str(ROOT_DIR / "supervisor.py"), "keys", "--url",
         f"http://127.0.0.1:{c.port}"], capture_output=True, text=True, timeout=30,
        env={**os.environ, "CORRAL_API_KEY": "root-secret"})
    rows = [line.split() for line in keys_cli.stdout.splitlines()]
    assert rows[0][-1] == "CUT" and rows[-1][0] == "batch" and rows[-1][-1] == "1", rows


def test_a_stream_whose_client_has_a_byte_runs_to_its_end(corral, tmp_path: Path) -> None:
    c = start(corral, config(tmp_path))
    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", headers=BATCH,
                 body=json.dumps({"model": "a", "stream": True, "max_tokens": 20,
                                  "messages": [{"role": "user", "content": "hi"}]}))
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")  # the client has a byte
    inter = InThread(lambda: chat(c.port, "a", max_tokens=2, headers=INTER))
    wait_until(lambda: c.models()["a"]["waiting"] == 1, what="the interactive to wait")
    rest = resp.read()
    ended = time.monotonic()
    conn.close()
    assert rest.count(b"data: ") == 20 and rest.rstrip().endswith(b"data: [DONE]")
    status, _ = inter.join()
    assert status == 200 and inter.at >= ended, "it waited for the stream's end"
    assert child_stats(c)["cancelled"] == 0


def test_without_priority_preempt_nothing_is_cut(corral, tmp_path: Path) -> None:
    c = start(corral, config(tmp_path, preempt=False))
    batch = InThread(lambda: chat(c.port, "a", max_tokens=10, headers=BATCH))
    wait_until(lambda: child_stats(c)["started"] == 2, what="the child to start the batch one")
    inter = InThread(lambda: chat(c.port, "a", max_tokens=2, headers=INTER))
    assert batch.join()[0] == 200 and inter.join()[0] == 200
    assert inter.at >= batch.at, "the interactive one waited for the batch one"
    assert child_stats(c)["cancelled"] == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_a_cut_request_whose_child_then_dies_with_it_is_answered(corral, tmp_path: Path,
                                                                 workers: int) -> None:
    """Review finding: after a cut, the request's next try went on asking to wait again on
    its released ticket when the child it was sent to then died with it: it hung."""
    # requests: 1 the load check, 2 the batch one (cut), 3 the interactive one, 4 the
    # batch one sent again: the child crashes as it arrives.
    c = start(corral, config(tmp_path, workers, knobs=("--crash-after-requests", "3")))
    batch = InThread(lambda: request(c.port, "POST", "/v1/chat/completions",
                                     {"model": "a", "max_tokens": 30,
                                      "messages": [{"role": "user", "content": "hi"}]},
                                     headers=BATCH, timeout_s=25)[:2])
    wait_until(lambda: child_stats(c)["started"] == 2, what="the child to start the batch one")
    status, _ = chat(c.port, "a", max_tokens=2, headers=INTER)
    assert status == 200
    batch.thread.join(30)
    assert batch.result is not None, "the cut request got no answer (its client timed out)"
    assert batch.result[0] == 200, batch.result
    wait_until(lambda: c.models()["a"]["in_flight"] == 0, 5, "nothing in flight")


def test_a_client_that_leaves_as_its_request_is_cut_leaks_the_grant() -> None:
    """Review finding: a client that closed in the loop turn its request was cut in
    (between Exchange.cut_off and the task's resuming) left its grant held for good: no
    Requeue, no Release. The real Exchange, Shares and tries on a loop, with a scheduler
    inbox and a pool that only record."""
    import asyncio
    from types import SimpleNamespace

    from actors.http.exchange import Exchange
    from actors.http.journaling import Trace, Work
    from actors.http.phase import Phase
    from actors.http.shares import Shares
    from actors.http.tries import to_model
    from actors.messages import Acquire, Cancel, Release, Requeue

    class Up:
        def send(self, sink: object, data: bytes, head_only: bool) -> None:
            pass

        def detach(self) -> None:
            pass

    class FakePool:
        key = ("127.0.0.1", 1, "a#1")
        host, prefix = b"127.0.0.1", b""

        def take(self) -> None:
            return None  # no idle connection: lease opens one

        async def lease(self, fresh: bool) -> Up:
            return Up()

    async def main() -> list[object]:
        loop = asyncio.get_running_loop()
        told: list[object] = []

        class Inbox:
            def tell(self, m: object) -> None:
                told.append(m)
                if isinstance(m, Acquire):
                    m.ticket.send(Grant(model="a", generation=1, host="127.0.0.1", port=1,
                                        shareable=False))

        inbox = Inbox()
        services = SimpleNamespace(
            routes=SimpleNamespace(models={}, remote={}, adapters={}, lora_bases=frozenset()),
            shares=Shares(lambda: inbox),
            pools=SimpleNamespace(get=lambda key, cap, far=None: FakePool()), stopped={},
            scheduler=lambda: inbox, draining=False)
        ex = Exchange.__new__(Exchange)
        for name, value in dict(
                services=services, client=None, loop=loop, phase=Phase.WAITING,
                req=SimpleNamespace(method=b"POST", url=b"/v1/chat/completions",
                                    headers=[], body=b"{}", key=None, http10=False,
                                    upload=None, upgrade=False, conversation=None,
                                    request_id=None, body_size=2, session=None),
                keep_alive=True, head_only=False, chunked=False, sse=False,
                what="model 'a'", upstream=None, out=[], done=None, status=0,
                first_at=None, late=None, broke=None, broke_kind=None, may_replay=False,
                may_retry=False, meter=None, ticket=None, cut=False, timer=None,
                kept=None, upgrade=False, loading=None, held=None,
                partial=None).items():
            setattr(ex, name, value)
        ex.trace, ex.work = Trace.of(ex.req), Work(loop.time(), True)
        for name, value in {}.items():
            setattr(ex, name, value)
        ex.task = loop.create_task(to_model(ex, "a", True))
        for _ in range(1000):  # loop turns until the request is sent
            if ex.phase is Phase.FORWARDING:
                break
            await asyncio.sleep(0)
        assert ex.phase is Phase.FORWARDING and ex.ticket is not None
        ticket = ex.ticket
        ticket.send(Cut())  # the Scheduler's Cut (call_soon_threadsafe) ...
        loop.call_soon(ex.client_gone)  # ... and the client's close, in the same turn
        try:
            await ex.task
        except asyncio.CancelledError:
            pass
        return [m for m in told if getattr(m, "ticket", None) is ticket]

    told = asyncio.run(main())
    kinds = [type(m).__name__ for m in told]
    assert any(isinstance(m, Release | Cancel | Requeue) for m in told), (
        f"the Scheduler got only {kinds} for the cut ticket: its grant is never given back")
