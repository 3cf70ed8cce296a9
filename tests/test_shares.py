"""Shared grants (actors/shares.py): overlapping requests for a busy model join one grant
instead of each asking the Scheduler; the Scheduler withdraws it when the model must stop
taking requests, and that must hold under continuous load."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path
from typing import Any

from actors.config.rules import ModelRules
from actors.http.shares import Shares
from actors.messages import Acquire, Cancel, Release, Releases, Withdraw
from actors.policy import Policy
from actors.policy.records import Answer
from actors.runtime.bridge import Fanout
from tests.helpers import chat, fake_cmd, request, toml_config, wait_until


def metric(port: int, name: str) -> float:
    status, text, _ = request(port, "GET", "/metrics")
    assert status == 200
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


class Load:
    """`n` threads sending slow requests to `model` back to back until stopped."""

    def __init__(self, port: int, model: str, n: int, max_tokens: int,
                 stagger_s: float) -> None:
        self.statuses: list[int] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(port, model, max_tokens))
                        for _ in range(n)]
        for t in self.threads:  # staggered, so that their requests overlap
            t.start()
            self.stop.wait(stagger_s)

    def _run(self, port: int, model: str, max_tokens: int) -> None:
        while not self.stop.is_set():
            self.statuses.append(chat(port, model, max_tokens=max_tokens)[0])

    def join(self) -> list[int]:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        return self.statuses


def test_overlapping_requests_join_one_grant_and_are_all_counted(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "40")}},
                           http={"lease_linger_ms": 0}))  # no lease: the first is released
    assert chat(c.port, "a")[0] == 200
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(chat(c.port, "a", 40)[0]))
               for _ in range(3)]
    threads[0].start()
    wait_until(lambda: c.models()["a"]["in_flight"] == 1, 5, "the first request granted")
    for t in threads[1:]:
        t.start()
    wait_until(lambda: c.models()["a"]["in_flight"] == 3, 5, "three requests in flight")
    for t in threads:
        t.join(10)
    assert results == [200, 200, 200]
    assert c.models()["a"]["in_flight"] == 0
    assert metric(c.port, "corral_requests_granted_total") == 4
    assert metric(c.port, "corral_requests_joined_total") == 2  # 2 joined the first's grant


def test_a_reload_restarts_a_model_that_is_never_idle(corral) -> None:
    """Without the withdrawal, requests would keep joining the old grant and the changed
    model would never drain."""
    c = corral(toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "100")}}, models_max=3))
    assert chat(c.port, "a")[0] == 200
    pid = c.models()["a"]["pid"]
    load = Load(c.port, "a", 3, 20, 0.07)  # 0.2 s requests, 3 clients: always one running
    try:
        wait_until(lambda: metric(c.port, "corral_requests_joined_total") > 3, 10,
                   "requests joining grants")
        Path(c.log_path).parent.joinpath("corral.toml").write_text(toml_config(
            {"a": {"cmd": fake_cmd("--tokens-per-s", "101")}}, models_max=3))
        c.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: c.models()["a"]["pid"] not in (None, pid), 15,
                   "the changed model to restart while its load goes on")
    finally:
        statuses = load.join()
    assert statuses and set(statuses) == {200}
    assert c.models()["a"]["last_eviction"]["reason"] == "reload"


def test_a_request_after_a_manual_unload_goes_to_the_next_instance(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "20")}}))
    assert chat(c.port, "a")[0] == 200
    pid = c.models()["a"]["pid"]
    slow: list[Any] = []
    busy = threading.Thread(target=lambda: slow.append(chat(c.port, "a", 100)))
    busy.start()
    wait_until(lambda: c.models()["a"]["in_flight"] == 1, 5, "the slow request to run")
    status, _, _ = request(c.port, "POST", "/models/unload", {"model": "a"})
    assert status == 200
    # The grant of the stopping child was withdrawn before the unload was answered,
    # so this request queues for the next child instead of joining the old one.
    assert chat(c.port, "a")[0] == 200
    new_pid = c.models()["a"]["pid"]
    assert new_pid is not None and new_pid != pid
    busy.join(10)
    assert slow  # answered one way or the other (the fake child finishes it on SIGTERM)


# ---------------------------------------------------------------- a grant that arrives late
#
# The Scheduler's Grant and its Withdraw both reach the loop through call_soon_threadsafe,
# in that order; but the request the Grant wakes resumes after the Withdraw's callback has
# run in the same loop turn. These play the Scheduler with the real Policy (as
# Scheduler._carry_out dispatches its effects), the event right after the model got ready.


class Sched:
    def __init__(self, loop: asyncio.AbstractEventLoop, shares: Shares) -> None:
        self.p = Policy(3)
        self.p.add_model("a", 0.0)
        self.now = 0.0
        self.watch = Fanout(loop, shares.withdraw)

    def t(self) -> float:
        self.now += 1
        return self.now

    def run(self, effects) -> None:  # Scheduler._carry_out
        for e in effects:
            if isinstance(e, Answer) and hasattr(e.ticket, "send"):
                e.ticket.send(e.value)
            elif isinstance(e, Withdraw):
                self.watch(e)
        self.p.check_invariants()

    def tell(self, m) -> None:
        match m:
            case Acquire(ticket=tk, model=model, autoload=al):
                self.run(self.p.acquire(tk, model, self.t(), al))
            case Release(ticket=tk, shared=sh, idle_s=idle):
                self.run(self.p.release(tk, self.t(), sh, idle))
            case Releases(releases=rs):
                self.run(self.p.release_all(((r.ticket, r.shared, r.idle_s, r.tokens) for r in rs),
                                            self.t()))
            case Cancel(ticket=tk):
                self.run(self.p.cancel(tk, self.t()))

    def ready(self) -> None:
        g = self.p.state.models["a"].generation
        self.run(self.p.children.instance_ready("a", g, 1, "127.0.0.1", 1, self.t()))


async def _try_acquire(shares: Shares) -> object:
    """A new request for a: its share if it got one at once, else None (it queued)."""
    task = asyncio.ensure_future(shares.acquire("a", True))
    await asyncio.sleep(0.02)
    if task.done():
        return task.result()
    task.cancel()
    return None


async def _first_grant_then(event) -> tuple[Shares, Sched, object]:
    """One request waits for a's load; the child becomes ready and, in the Scheduler's
    very next message, `event` happens - before the loop has woken the request."""
    s: Sched | None = None
    shares = Shares(lambda: s)
    s = Sched(asyncio.get_running_loop(), shares)
    first = asyncio.ensure_future(shares.acquire("a", True))
    await asyncio.sleep(0)  # queued; a is loading
    s.ready()               # Answer(Grant a#1) -> loop
    event(s)                # ... and Withdraw(a, 1) -> loop, same batch
    share1 = await first
    return shares, s, share1


def test_unload_right_after_ready_leaves_a_withdrawn_grant_open() -> None:
    async def main() -> None:
        shares, s, share1 = await _first_grant_then(
            lambda s: s.run(s.p.unload("u", "a", s.t())))
        assert s.p.state.models["a"].state.value == "stopping"
        late = await _try_acquire(shares)  # arrives after the unload was answered
        assert late is not share1, (
            f"joined withdrawn grant a#{late.grant.generation}: proxied into a stopping "
            f"child (R-4.6); shares.open={shares.open}")
    asyncio.run(main())


def test_crash_right_after_ready_leaves_a_withdrawn_grant_open() -> None:
    async def main() -> None:
        shares, s, share1 = await _first_grant_then(
            lambda s: s.run(s.p.children.instance_exited("a", 1, -9, "killed", s.t())))
        assert s.p.state.models["a"].state.value in ("unloaded", "loading")
        late = await _try_acquire(shares)
        assert late is not share1, "joined the grant of a dead child"
    asyncio.run(main())


def test_reload_right_after_ready_never_drains_under_overlapping_load() -> None:
    async def main() -> None:
        shares, s, share1 = await _first_grant_then(
            lambda s: s.run(s.p.children.reconfigure(
                {}, [], {"a": ModelRules(make_before_break=False)}, s.t())[0]))
        rec = s.p.state.models["a"]
        assert rec.retiring
        # Overlapping requests: each new one arrives before the previous one ends.
        running = [share1]
        for _ in range(50):
            nxt = await _try_acquire(shares)
            shares.release(running.pop(0))
            if nxt is None:
                break  # queued for the next instance: correct
            running.append(nxt)
            await asyncio.sleep(0)
        assert rec.state.value != "loaded" or not rec.retiring, (
            f"a#{rec.generation} still stale and serving after 50 overlapping requests "
            f"(in_flight {rec.in_flight}); the reload never restarts it")
    asyncio.run(main())


def test_real_scheduler_busy_loop_unload_after_ready_joins_stopping_child() -> None:
    """The real Scheduler actor on its own thread; the loop is busy for 50 ms in one
    iteration (a burst of work) while the child becomes ready and is unloaded."""
    import threading
    import time

    from actors.config.load import parse_config
    from actors.messages import InstanceReady, InstancesAttached, UnloadModel, WatchGrants
    from actors.runtime.bridge import ThreadReply
    from actors.scheduler import Scheduler

    class Nobody:
        def tell(self, _m) -> None:
            pass

    config = parse_config({"models": {"a": {"cmd": ["true", "{port}"]}}})
    sched = Scheduler.start(config, lambda *a: None)
    try:
        async def main() -> None:
            loop = asyncio.get_running_loop()
            shares = Shares(lambda: sched)
            sched.tell(WatchGrants(sink=Fanout(loop, shares.withdraw)))
            sched.tell(InstancesAttached(instances={"a": Nobody()}))
            first = asyncio.ensure_future(shares.acquire("a", True))
            await asyncio.sleep(0.05)  # queued, a#1 loading

            def scheduler_side() -> None:
                sched.tell(InstanceReady(model="a", generation=1, pid=4242, port=1))
                done = ThreadReply()
                sched.tell(UnloadModel(model="a", reply=done))
                assert done.wait(5) is not None

            def busy() -> None:  # one long loop iteration
                threading.Thread(target=scheduler_side).start()
                time.sleep(0.05)
            loop.call_soon(busy)
            share1 = await first
            late = await _try_acquire(shares)
            assert late is not share1, (
                "after the unload was answered, a new request joined a#1 "
                f"(open: {shares.open})")
        asyncio.run(main())
    finally:
        sched.stop()
