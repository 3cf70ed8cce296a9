"""Leases (actors/http/shares.py): the front keeps a grant for http.lease_linger_ms after its
last request, so a lone client's next request skips the Scheduler; the Scheduler revokes
it when it needs the model idle, and withdraws it when the model stops serving.

The front's `Shares` runs here on a real event loop against the real `Policy`, with the
messages between them held in two queues that the tests (and a Hypothesis state machine)
deliver in any order: what a real Scheduler thread and loop can interleave.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections import deque
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from actors.config.rules import ModelRules
from actors.http.shares import SharedGrant, Shares
from actors.lifecycle import ModelState
from actors.messages import Acquire, Cancel, Refusal, Release, Releases, Revoke, TtlDue, Withdraw
from actors.policy import Policy
from actors.policy.records import Answer, Later, Stop
from actors.runtime.bridge import LoopReply
from tests.helpers import chat, fake_cmd, request, toml_config, wait_until
from tests.test_shares import metric

S = ModelState
LINGER_S = 0.5
EVICTIONS = ("lru", "memory", "ttl")


class World:
    """The real Policy as the Scheduler plays it, the real Shares as the front holds it,
    and the messages in flight between them, each way, in order."""

    def __init__(self, models_max: int = 1, rules: dict[str, ModelRules] | None = None,
                 linger_s: float = LINGER_S) -> None:
        self.loop = asyncio.new_event_loop()
        self.p = Policy(models_max)
        for name, r in (rules or {"a": ModelRules(), "b": ModelRules()}).items():
            self.p.add_model(name, 0.0, rules=r)
        self.now = 0.0
        self.to_sched: deque[Any] = deque()
        self.to_front: deque[Withdraw | Revoke] = deque()
        self.linger_s = linger_s
        self.shares = Shares(lambda: self)  # type: ignore[arg-type,return-value]
        self.acquires = 0
        self.evicted_while_held: list[str] = []

    # the Scheduler's inbox, as the front sees it
    def tell(self, message: Any) -> None:
        if isinstance(message, Acquire):
            self.acquires += 1
        self.to_sched.append(message)

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.loop.run_until_complete(coro)

    def release(self, share: SharedGrant, keep: bool = True) -> None:
        """A request on `share` ends (in the loop, as the front's requests do)."""
        async def on_loop() -> None:
            self.shares.release(share, self.linger_s, keep)
        self.run(on_loop())

    def spin(self) -> None:
        """Let the loop run what is ready (answers resolving, requests resuming)."""
        for _ in range(4):
            self.run(asyncio.sleep(0))

    def deliver_to_scheduler(self) -> None:
        message = self.to_sched.popleft()
        self.now += 0.01
        match message:
            case Acquire(ticket=t, model=m, autoload=al):
                effects = self.p.acquire(t, m, self.now, al)
            case Release(ticket=t, shared=sh, idle_s=idle):
                effects = self.p.release(t, self.now, sh, idle)
            case Releases(releases=rs):
                effects = self.p.release_all(((r.ticket, r.shared, r.idle_s, r.tokens) for r in rs),
                                             self.now)
            case Cancel(ticket=t):
                effects = self.p.cancel(t, self.now)
        self.carry_out(effects)

    def carry_out(self, effects: list[Any]) -> None:
        for e in effects:
            if isinstance(e, Answer) and isinstance(e.ticket, LoopReply):
                e.ticket.send(e.value)
            elif isinstance(e, Withdraw | Revoke):
                self.to_front.append(e)
            elif isinstance(e, Stop) and e.reason in EVICTIONS:
                # An eviction: the front must hold no grant of that child at this moment.
                for share in self.held():
                    if (share.grant.model, share.grant.generation) == (e.model, e.generation):
                        self.evicted_while_held.append(f"{e.model}#{e.generation} ({e.reason})")
        self.p.check_invariants()

    def deliver_to_front(self) -> None:
        """The next notice, as the front's loop runs it: after the callbacks queued before
        it (a grant's answer), before the requests those wake."""
        notice = self.to_front.popleft()

        async def on_loop() -> None:
            if isinstance(notice, Revoke):
                self.shares.revoke(notice)
            else:
                self.shares.withdraw(notice)
        self.run(on_loop())

    def held(self) -> list[SharedGrant]:
        """The grants the front holds: open ones and those a request runs on."""
        return list(self.shares.open.values())

    def ready(self, model: str) -> None:
        rec = self.p.state.models[model]
        if rec.state is S.LOADING:
            self.now += 0.01
            self.carry_out(self.p.children.instance_ready(model, rec.generation, 1, "h", 1,
                                                          self.now))

    def exited(self, model: str) -> None:
        rec = self.p.state.models[model]
        if rec.state.is_running:
            self.now += 0.01
            self.carry_out(self.p.children.instance_exited(model, rec.generation, 0, "exited",
                                                           self.now))

    def settle(self, *, children: bool = True, notices_first: bool = False) -> None:
        """Deliver every message both ways (and, with `children`, let loading children get
        ready and stopping ones exit) until nothing moves; no linger runs out meanwhile.
        `notices_first`: a Withdraw or Revoke reaches the front as soon as it is sent."""
        for _ in range(200):
            if self.to_front and notices_first:
                self.deliver_to_front()  # before the requests it concerns have resumed
                continue
            self.spin()
            if self.to_sched:
                self.deliver_to_scheduler()
            elif self.to_front:
                self.deliver_to_front()
            elif children and (moving := [r.name for r in self.p.state.models.values()
                                          if r.state in (S.LOADING, S.STOPPING)]):
                rec = self.p.state.models[moving[0]]
                (self.ready if rec.state is S.LOADING else self.exited)(rec.name)
            else:
                return
        raise AssertionError("messages never settled")

    def granted(self, model: str) -> SharedGrant:
        """A request for `model`, granted (its child loaded), still running."""
        task = self.start(model)
        self.settle()
        share = task.result()
        assert isinstance(share, SharedGrant)
        return share

    def start(self, model: str) -> asyncio.Task[SharedGrant | Refusal]:
        task = self.loop.create_task(self.shares.acquire(model, True))
        self.spin()
        return task

    def close(self) -> None:
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        self.spin()
        self.loop.close()


def test_a_lone_clients_next_request_joins_the_kept_grant_without_asking() -> None:
    w = World()
    share = w.granted("a")
    assert w.acquires == 1
    w.release(share)
    w.settle()
    assert not w.to_sched, "released at once: nothing was kept"
    again = w.start("a")
    assert again.done() and again.result() is share, "the next request asked the Scheduler"
    assert w.acquires == 1 and w.shares.joined_total == 1
    assert w.shares.extra.get("a", 0) == 0  # one request runs; the Scheduler counts one
    w.release(share)
    assert w.shares.extra["a"] == -1  # none runs; the Scheduler still counts one
    rec = w.p.state.models["a"]
    assert rec.in_flight == 1
    w.close()


def test_a_kept_grant_is_released_when_its_linger_runs_out_with_its_idle_time() -> None:
    w = World(linger_s=0.05)
    share = w.granted("a")
    w.release(share)

    async def swept() -> None:  # the linger runs out: the sweep releases it
        for _ in range(200):
            if w.to_sched:
                return
            await asyncio.sleep(0.005)
    w.run(swept())
    assert len(w.to_sched) == 1
    release = w.to_sched[0]
    assert isinstance(release, Release) and release.ticket is share.ticket
    assert 0.05 <= release.idle_s < 1.0
    w.settle()
    assert w.p.state.models["a"].in_flight == 0 and "a" not in w.shares.open
    assert w.shares.extra == {}
    w.close()


def test_a_request_for_another_model_revokes_the_kept_grant_at_once() -> None:
    """models_max 1: b's request needs a's slot. The linger (here an hour) is not waited
    out: the Scheduler revokes a's grant, the front gives it back, a is evicted."""
    w = World(linger_s=3600)
    share = w.granted("a")
    w.release(share)
    b = w.start("b")
    w.settle()
    assert isinstance(b.result(), SharedGrant) and b.result().grant.model == "b"
    a = w.p.state.models["a"]
    assert a.state is S.UNLOADED and a.last_eviction is not None
    assert a.last_eviction.reason == "lru"
    assert not w.evicted_while_held
    w.close()


def test_a_revoked_grant_with_a_request_on_it_is_released_when_that_ends_not_kept() -> None:
    w = World(linger_s=3600)
    share = w.granted("a")
    b = w.start("b")
    w.settle(children=False)
    assert not b.done() and w.p.state.models["a"].state is S.LOADED  # a is busy: b waits
    assert not share.keep, "revoked while busy: it must not be kept after its request"
    w.release(share)
    w.settle()
    assert isinstance(b.result(), SharedGrant)
    assert w.p.state.models["a"].last_eviction.reason == "lru"  # type: ignore[union-attr]
    assert not w.evicted_while_held
    w.close()


def test_an_unload_or_reload_releases_a_kept_grant_at_once() -> None:
    w = World(models_max=2, linger_s=3600)
    for model in "ab":
        w.release(w.granted(model))
    w.carry_out(w.p.unload("u", "a", w.now))
    effects, restarted = w.p.children.reconfigure({}, [], {"b": ModelRules(ttl_s=1)}, w.now)
    w.carry_out(effects)
    w.settle()
    assert restarted == ["b"]
    assert w.shares.open == {} and not w.p.state.leases
    assert w.p.state.models["a"].state is S.UNLOADED
    assert w.p.state.models["b"].last_eviction.reason == "reload"  # type: ignore[union-attr]
    w.close()


def test_a_max_concurrency_model_never_keeps_its_grant() -> None:
    w = World(rules={"a": ModelRules(max_concurrency=2), "b": ModelRules()})
    share = w.granted("a")
    assert not share.grant.shareable
    w.release(share)
    assert isinstance(w.to_sched[-1], Release)
    w.settle()
    assert w.p.state.models["a"].in_flight == 0 and w.shares.extra == {}
    w.close()


def test_a_grant_whose_child_broke_is_neither_kept_nor_joined() -> None:
    w = World(linger_s=3600)
    share = w.granted("a")
    w.release(share, keep=False)
    assert "a" not in w.shares.open and isinstance(w.to_sched[-1], Release)
    w.close()


def test_drain_releases_every_kept_grant() -> None:
    w = World(models_max=2, linger_s=3600)
    for model in "ab":
        w.release(w.granted(model))

    async def on_loop() -> None:
        w.shares.stop_keeping()
    w.run(on_loop())
    w.settle()
    assert not w.p.state.leases and w.shares.open == {} and w.shares.extra == {}
    w.close()


# ---------------------------------------------------------------- the state machine


class LeaseMachine(RuleBasedStateMachine):
    """Requests for two models (models_max 1, so each needs the other's slot) start and
    end at random; messages each way are delivered in random order against children that
    get ready, crash, are unloaded and reloaded, and lingers that run out. Invariants:
    the Scheduler never evicts a child the front holds a grant of; every grant the front
    holds is one the Scheduler counts; a request joins a kept grant only of a serving,
    current child (or one whose withdrawal is on its way, the window shares.py names);
    and revocation alone (no linger running out) frees a slot someone waits for."""

    def __init__(self) -> None:
        super().__init__()
        self.w = World(linger_s=3600)
        self.running: list[SharedGrant] = []
        self.waiting: list[asyncio.Task[SharedGrant | Refusal]] = []

    def _collect(self) -> None:
        for task in [t for t in self.waiting if t.done()]:
            self.waiting.remove(task)
            result = task.result()
            if isinstance(result, SharedGrant):
                self.running.append(result)

    @rule(model=st.sampled_from("ab"))
    def request(self, model: str) -> None:
        kept = self.w.shares.open.get(model)
        joins = kept is not None
        task = self.w.start(model)
        if joins:
            assert task.done() and task.result() is kept
            rec = self.w.p.state.models[model]
            g = kept.grant.generation  # type: ignore[union-attr]
            current = (rec.generation == g and rec.state.is_serving and not rec.retiring)
            withdrawing = any(isinstance(n, Withdraw) and n.model == model
                              and n.generation >= g for n in self.w.to_front)
            assert current or withdrawing, f"joined {model}#{g}, which is {rec.state.value}"
        self.waiting.append(task)
        self._collect()

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 20), broke=st.booleans())
    def end(self, i: int, broke: bool) -> None:
        share = self.running.pop(i % len(self.running))
        self.w.release(share, keep=not broke)

    @precondition(lambda self: self.w.to_sched)
    @rule()
    def to_scheduler(self) -> None:
        # No spin here: a Withdraw or Revoke it causes may reach the front before the
        # request whose grant it concerns has resumed, as on the real loop.
        self.w.deliver_to_scheduler()

    @rule()
    def loop_runs(self) -> None:
        self.w.spin()
        self._collect()

    @precondition(lambda self: self.w.to_front)
    @rule()
    def to_front(self) -> None:
        self.w.deliver_to_front()

    @rule(model=st.sampled_from("ab"))
    def ready(self, model: str) -> None:
        self.w.ready(model)

    @rule(model=st.sampled_from("ab"))
    def child_exits(self, model: str) -> None:
        self.w.exited(model)

    @rule(model=st.sampled_from("ab"), reload=st.booleans())
    def manage(self, model: str, reload: bool) -> None:
        if reload:
            effects, _ = self.w.p.children.reconfigure(
                {}, [], {model: ModelRules(ttl_s=self.w.now % 3)}, self.w.now)
            self.w.carry_out(effects)
        else:
            self.w.carry_out(self.w.p.unload(object(), model, self.w.now))

    @rule()
    def lingers_run_out(self) -> None:
        for share in self.w.shares.open.values():
            share.idle_since -= share.linger_s
        async def on_loop() -> None:
            self.w.shares.sweep()
        self.w.run(on_loop())

    @rule(notices_first=st.booleans())
    def settle(self, notices_first: bool) -> None:
        """Everything delivered, children moving: with no request running, nobody may
        wait for a slot that only a kept grant holds."""
        self.w.settle(notices_first=notices_first)
        self._collect()
        if self.running:
            return
        now = self.w.now
        stuck = [e.model for e in self.w.p.state.queue if self.w.p.state.needs_slot(e, now)]
        assert not stuck, (f"{stuck} wait for a slot that only a kept grant holds: "
                           f"{ {m: s.count for m, s in self.w.shares.open.items()} }")

    @invariant()
    def held_grants_are_counted_and_never_evicted(self) -> None:
        self._collect()  # requests that have resumed with their grant run from now on
        leases = self.w.p.state.leases
        for share in self.w.held() + self.running:
            assert share.ticket in leases, "the front holds a grant the Scheduler released"
        assert not self.w.evicted_while_held, self.w.evicted_while_held
        for model, rec in self.w.p.state.models.items():
            mine = [s for s in self.running if s.grant.model == model]
            on_the_way = sum(leases.get(r.ticket) == (model, rec.generation, "")
                             for m in self.w.to_sched
                             for r in (m.releases if isinstance(m, Releases) else [m])
                             if isinstance(r, Release))
            known = {s.ticket for s in self.w.held() + self.running}
            granted_on_the_way = sum(g == (model, rec.generation, "") and t not in known
                                     for t, g in leases.items()) - on_the_way
            if rec.state.is_serving and all(s.grant.generation == rec.generation for s in mine):
                shown = (rec.in_flight - on_the_way - granted_on_the_way
                         + self.w.shares.extra.get(model, 0))
                assert shown == len(mine), \
                    f"{model}: GET /models would show {shown} in flight, not {len(mine)}"

    def teardown(self) -> None:
        for share in self.running:
            self.w.release(share)
        self.running.clear()
        async def on_loop() -> None:
            self.w.shares.stop_keeping()
        self.w.run(on_loop())
        self.w.settle()
        self._collect()
        for share in self.running:
            self.w.release(share)
        self.w.settle()
        for task in self.waiting:
            task.cancel()
        self.w.spin()
        self.w.close()


LeaseMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("CORRAL_STATEFUL_EXAMPLES", "150")),
    stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_lease_state_machine = LeaseMachine.TestCase


# ---------------------------------------------------------------- over real processes


def test_a_lone_clients_requests_share_one_grant_and_are_all_counted(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}, http={"lease_linger_ms": 60_000}))
    for _ in range(5):
        assert chat(c.port, "a")[0] == 200
    assert metric(c.port, "corral_requests_granted_total") == 5
    assert metric(c.port, "corral_requests_joined_total") == 4
    assert c.models()["a"]["in_flight"] == 0  # kept, with no request on it


def test_a_kept_grant_does_not_delay_a_swap_or_an_unload(corral) -> None:
    """An hour's linger: b's request evicts a at once, and an unload stops b at once."""
    c = corral(toml_config({"a": {"cmd": fake_cmd()}, "b": {"cmd": fake_cmd()}},
                           models_max=1, http={"lease_linger_ms": 3_600_000}))
    assert chat(c.port, "a")[0] == 200
    assert chat(c.port, "b")[0] == 200
    assert c.state("a") == "unloaded" and c.models()["a"]["last_eviction"]["reason"] == "lru"
    pid = c.models()["b"]["pid"]
    status, _, _ = request(c.port, "POST", "/models/unload", {"model": "b"})
    assert status == 200
    wait_until(lambda: c.state("b") == "unloaded", 10, "b unloaded")
    assert chat(c.port, "b")[0] == 200 and c.models()["b"]["pid"] != pid


def test_a_model_whose_grant_is_kept_still_expires_by_ttl(corral) -> None:
    """An hour's linger is cut to the model's ttl_s: the TTL is not held up by it."""
    c = corral(toml_config({"a": {"cmd": fake_cmd(), "ttl_s": 0.5}},
                           http={"lease_linger_ms": 3_600_000}))
    assert chat(c.port, "a")[0] == 200
    wait_until(lambda: c.state("a") == "unloaded", 10, "the TTL")
    assert c.models()["a"]["last_eviction"]["reason"] == "ttl"


def test_a_kept_grant_does_not_delay_a_reload(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}, http={"lease_linger_ms": 3_600_000}))
    assert chat(c.port, "a")[0] == 200
    pid = c.models()["a"]["pid"]
    Path(c.log_path).parent.joinpath("corral.toml").write_text(toml_config(
        {"a": {"cmd": fake_cmd("--tokens-per-s", "101")}}, http={"lease_linger_ms": 3_600_000}))
    c.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: c.models()["a"]["last_eviction"] is not None, 10, "the restart")
    assert c.models()["a"]["last_eviction"]["reason"] == "reload"
    assert chat(c.port, "a")[0] == 200 and c.models()["a"]["pid"] != pid



# ---------------------------------------------------------------- found by review


def test_a_grant_made_while_another_model_waits_for_its_slot_is_not_kept() -> None:
    """models_max 1: a's waiter is granted when a is ready, while b waits for a's slot.
    That grant must not be kept after its request (a lease), or b would wait as long as
    a's lone client keeps coming: b has the turn (actors/policy/turns.py), so a's grant
    is one the front may not share or keep (it was a Revoke in the same flush, which
    could overtake the grant on the loop, before turns)."""
    w = World(linger_s=3600)
    a = w.start("a")
    b = w.start("b")
    w.deliver_to_scheduler()  # a: spawns
    w.deliver_to_scheduler()  # b: queued, needs a's slot
    w.ready("a")  # grants a's waiter, held for b's turn
    w.spin()
    share = a.result()
    assert isinstance(share, SharedGrant) and not share.grant.shareable
    w.release(share)
    w.settle()
    assert b.done() and isinstance(b.result(), SharedGrant)
    w.close()


def test_the_ttl_counts_from_the_end_of_a_request_not_its_start() -> None:
    """A request (not kept: max_concurrency) that ran longer than ttl_s must not be
    followed by the TTL at once."""
    p = Policy(2)
    p.add_model("a", 0.0, rules=ModelRules(ttl_s=60, max_concurrency=1))
    p.acquire("t1", "a", 1.0)
    rec = p.state.models["a"]
    p.children.instance_ready("a", rec.generation, 1, "h", 1, 2.0)
    effects = p.release("t1", 302.0)  # a five-minute request
    delays = [e.delay_s for e in effects if isinstance(e, Later)
              and isinstance(e.message, TtlDue)]
    assert delays and min(delays) >= 59.9, delays
    assert not [e for e in p.tiers.ttl_due("a", rec.generation, 303.0) if isinstance(e, Stop)]
    assert p.snapshot(303.0).models[0].expires_in_s == pytest.approx(59.0)


def test_no_revoke_for_a_pinned_model_or_for_one_waiting_for_its_own_stop() -> None:
    p = Policy(2)
    p.add_model("a", 0.0, rules=ModelRules(pinned=True))
    p.add_model("b", 0.0)
    p.acquire("t1", "a", 1.0)
    p.children.instance_ready("a", p.state.models["a"].generation, 1, "h", 1, 1.1)
    p.acquire("t2", "b", 1.2)
    p.children.instance_ready("b", p.state.models["b"].generation, 2, "h", 2, 1.3)
    p.release("t2", 1.4)
    p.unload("u", "b", 1.5)
    effects = p.acquire("t3", "b", 1.6)  # waits for b's own child to stop
    assert not [e for e in effects if isinstance(e, Revoke)]


def test_a_lone_client_does_not_starve_a_waiting_model(corral) -> None:
    """The default linger: a lone client asks for a every 0.2 s (always within the
    linger) while b, with models_max 1, waits for a's slot. b must be served while the
    lone client goes on."""
    c = corral(toml_config({"a": {"cmd": fake_cmd()}, "b": {"cmd": fake_cmd()}},
                           models_max=1))
    stop = threading.Event()
    lone_statuses: list[int] = []

    def lone() -> None:
        while not stop.is_set():
            lone_statuses.append(chat(c.port, "a")[0])
            stop.wait(0.2)  # the client's pause between requests

    t = threading.Thread(target=lone)
    t.start()
    try:
        wait_until(lambda: lone_statuses, 10, "the lone client's first answer")
        assert chat(c.port, "b")[0] == 200
        assert not stop.is_set() and t.is_alive()  # served while the client went on
    finally:
        stop.set()
        t.join(30)
    assert set(lone_statuses) == {200}


def test_a_long_request_is_not_followed_by_an_instant_ttl_stop(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "10"), "ttl_s": 1.5,
                                  "max_concurrency": 1}}))
    assert chat(c.port, "a", max_tokens=25)[0] == 200  # about 2.5 s
    a = c.models()["a"]
    assert a["status"]["value"] == "loaded" and a["status"]["expires_in_s"] > 0.75, a
