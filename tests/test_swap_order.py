"""Whose turn a slot is (issue 41, `swap_order`; actors/policy/turns.py): a model that
waits for the place a busy model holds gets it, however busy that model stays. In
"arrival" order the loaded model takes only what came before the waiter (ABAB); in
"batch" order it goes on taking its own for `max_swap_delay_s` more (AABB), and no
longer."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.config.load import parse_config
from actors.config.model import ConfigError
from actors.config.rules import ModelRules
from actors.ledger import Breakdown, DeviceSample, DeviceUse
from actors.messages import DeviceReport, Grant, Repump, Revoke, Withdraw
from actors.policy import Policy
from actors.policy.records import Answer, Effect, Later, Spawn, Stop
from actors.policy.turns import REVOKED_S
from tests.helpers import Corral, chat, fake_cmd, toml_config, wait_until
from tests.test_policy import World


def world(delay_s: float = 0.0, **rules: object) -> World:
    return World(models_max=1, names="ab", rules={
        n: ModelRules(swap_delay_s=delay_s, **rules) for n in "ab"})  # type: ignore[arg-type]


def test_under_a_steady_stream_for_a_b_gets_the_slot_after_what_came_before_it() -> None:
    w = world()
    w.load_idle("a")
    w.acquire("a0", "a")
    w.acquire("b0", "b")  # needs a's slot: from now on, b has the turn
    assert w.p.state.turn is not None and w.p.state.turn.model == "b"
    assert w.acquire("a1", "a") is None  # came after b0: it waits behind it
    plan = w.p.plan("a", w.now)
    assert plan.decision == "queue" and "model 'b', asked for first" in (plan.waiting_for or "")
    assert "a to end the requests that came before it" in (w.p.plan("b", w.now).waiting_for
                                                             or "")
    w.release("a0")  # a drains: it is the victim
    assert w.stops[-1] == ("a", "lru") and w.state("a") == "stopping"
    w.exited("a")
    w.ready("b")
    assert isinstance(w.answers["b0"], Grant)
    assert w.p.state.turn is not None and w.p.state.turn.model == "a"  # a1's turn now
    assert w.acquire("b1", "b") is None  # ABAB: b takes nothing that came after a1
    w.release("b0")
    w.exited("b")
    w.ready("a")
    assert isinstance(w.answers["a1"], Grant)
    assert w.spawns == [("a", 1), ("b", 1), ("a", 2)]


def test_in_batch_order_the_loaded_model_serves_its_own_for_the_delay_then_gives_way() -> None:
    w = world(delay_s=10.0)
    w.load_idle("a")
    w.acquire("a0", "a")
    w.acquire("b0", "b")
    since = w.now
    for i in range(1, 20):  # a steady stream, each overlapping the one before
        w.acquire(f"a{i}", "a")
        w.release(f"a{i - 1}")
        if not isinstance(w.answers.get(f"a{i}"), Grant):
            break
    assert w.now - since > 10.0  # (AABB: a served its own past b's arrival ...)
    assert w.now - since <= 10.0 + 2 * 2  # (... for the delay and no more)
    last = i - 1
    w.release(f"a{last}")
    assert w.state("a") == "stopping"
    w.exited("a")
    w.ready("b")
    assert isinstance(w.answers["b0"], Grant)


def test_the_fronts_stop_sharing_a_held_models_grants_at_its_cutoff() -> None:
    """A front joins requests to a grant it holds without asking, and keeps it a while
    after its last request (shares.py): in its batch a held model's grants are shared and
    kept as ever (not revoked: its own clients' next requests are its batch); at its
    cutoff (a Repump) what the fronts keep idle is revoked, then its grants are
    withdrawn, and later grants are not shared."""
    p = Policy(1)
    for n in "ab":
        p.add_model(n, 0.0, rules=ModelRules(swap_delay_s=5.0))
    p.acquire("a0", "a", 1.0)
    effects = p.children.instance_ready("a", 1, 100, "x", 1, 2.0)
    grant = next(e.value for e in effects if getattr(e, "ticket", None) == "a0")
    assert isinstance(grant, Grant) and grant.shareable
    effects = p.acquire("b0", "b", 3.0)
    assert [e for e in effects if isinstance(e, Later) and isinstance(e.message, Repump)
            and e.delay_s == pytest.approx(5.0)]
    assert not [e for e in effects if isinstance(e, Withdraw | Revoke)]
    effects = p.acquire("a1", "a", 4.0)  # in its batch: at once, and shared
    early = next(e.value for e in effects if getattr(e, "ticket", None) == "a1")
    assert isinstance(early, Grant) and early.shareable
    effects = p.repump(8.0)  # its cutoff: what the fronts keep idle is given back first
    assert [e for e in effects if isinstance(e, Revoke) and ("a", 1) in e.grants]
    assert [e for e in effects if isinstance(e, Later) and isinstance(e.message, Repump)
            and e.delay_s == pytest.approx(REVOKED_S)]
    effects = p.repump(8.0 + REVOKED_S)  # then no request may join its grants
    turned = [e for e in effects if isinstance(e, Withdraw) and e.model == "a"]
    # ... though a is not being stopped: a request of its that breaks now is sent again
    # (chaos found 503s "stopped while it had this request" for a child a test killed)
    assert turned and not any(e.stopping for e in turned)
    assert not [e for e in p.acquire("a2", "a", 8.5) if getattr(e, "ticket", None) == "a2"]
    p.release("a0", 9.0)
    effects = p.release("a1", 9.5)  # a drains: it goes, for b
    assert [e for e in effects if isinstance(e, Stop) and e.model == "a"]


def test_a_pinned_model_is_never_held() -> None:
    w = World(models_max=1, names="ab", pinned="a")
    w.load_idle("a")
    w.acquire("a0", "a")
    w.acquire("b0", "b")  # refused or waiting: a never goes
    assert isinstance(w.acquire("a1", "a"), Grant)


# ---------------------------------------------------------------- the bound, as a property


class Stream:
    """models_max 1, a loaded first; then a request for a every `gap_s`, each `hold_s`
    long, until `until`; one for b at `b_at` (past a's load). Loads take `load_s`, stops
    `stop_s`. Events in time order, the policy answering each (a heap of due times)."""

    def __init__(self, delay_s: float, gap_s: float, hold_s: float, load_s: float,
                 stop_s: float, b_at: float, until: float = 400.0) -> None:
        self.p = Policy(1)
        for n in "ab":
            self.p.add_model(n, 0.0, rules=ModelRules(swap_delay_s=delay_s))
        self.hold_s, self.load_s, self.stop_s = hold_s, load_s, stop_s
        self.due: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.granted: dict[object, float] = {}
        self.swaps = 0
        self.at(0.0, "acquire", ("warm", "a"))
        self.start = load_s + 0.5  # (a is loaded by then)
        n = 0
        while (t := self.start + n * gap_s) < until:
            self.at(t, "acquire", (f"a{n}", "a"))
            n += 1
        self.n = n
        self.at(b_at, "acquire", ("b", "b"))

    def at(self, t: float, what: str, arg: object) -> None:
        heapq.heappush(self.due, (t, next(self.seq), what, arg))

    def run(self, end: float) -> None:
        while self.due and self.due[0][0] <= end:
            now, _, what, arg = heapq.heappop(self.due)
            if what == "acquire":
                ticket, model = arg  # type: ignore[misc]
                effects = self.p.acquire(ticket, model, now)
            elif what == "release":
                effects = self.p.release(arg, now)
            elif what == "ready":
                model, gen = arg  # type: ignore[misc]
                effects = self.p.children.instance_ready(model, gen, 100, "x", 1, now)
            elif what == "exit":
                model, gen = arg  # type: ignore[misc]
                effects = self.p.children.instance_exited(model, gen, 0, "rc 0", now)
            else:
                effects = self.p.repump(now)
            self.p.check_invariants()
            for e in effects:
                if isinstance(e, Spawn):
                    self.swaps += 1
                    self.at(now + self.load_s, "ready", (e.model, e.generation))
                elif isinstance(e, Stop):
                    self.at(now + self.stop_s, "exit", (e.model, e.generation))
                elif isinstance(e, Later) and isinstance(e.message, Repump):
                    self.at(now + e.delay_s, "repump", None)
                elif isinstance(getattr(e, "value", None), Grant):
                    ticket = e.ticket  # type: ignore[union-attr]
                    self.granted[ticket] = now
                    self.at(now + (0.0 if ticket == "warm" else self.hold_s), "release",
                            ticket)


@settings(max_examples=150, deadline=None)
@given(delay_s=st.sampled_from([0.0, 2.0, 10.0, 30.0]), gap_s=st.floats(0.2, 3.0),
       hold_s=st.floats(0.5, 8.0), load_s=st.floats(0.5, 10.0), stop_s=st.floats(0.1, 3.0),
       b_at=st.floats(5.0, 60.0))
def test_under_a_continuous_stream_for_a_b_waits_at_most_the_delay_and_one_swap(
        delay_s: float, gap_s: float, hold_s: float, load_s: float, stop_s: float,
        b_at: float) -> None:
    """However busy a stays, b is granted within max_swap_delay_s, the longest request of
    a's then running, a's stop and b's load; and a's requests are all served in the end."""
    s = Stream(delay_s, gap_s, hold_s, load_s, stop_s, b_at + load_s + 0.5)
    b_at = b_at + load_s + 0.5
    s.run(b_at + delay_s + hold_s + stop_s + load_s + 1e-6)
    assert "b" in s.granted, "b waited past its bound"
    assert s.granted["b"] - b_at <= delay_s + hold_s + stop_s + load_s + 1e-6
    s.run(float("inf"))
    assert not s.p.state.queue.waiters
    assert all(f"a{n}" in s.granted for n in range(s.n))


def test_arrival_order_swaps_more_than_batch_order_on_an_alternating_stream() -> None:
    """The point of batch: fewer swaps for the same requests (bench: `python -m bench
    swap-order`)."""
    def swaps(delay_s: float) -> int:
        s = Stream(delay_s, gap_s=1.0, hold_s=2.0, load_s=3.0, stop_s=0.5, b_at=1e9,
                   until=300.0)
        for n in range(60):  # b every 5 s too
            s.at(2.75 + 5 * n, "acquire", (f"b{n}", "b"))
        s.run(float("inf"))
        assert not s.p.state.queue.waiters
        return s.swaps
    assert swaps(30.0) < swaps(0.0)


# ---------------------------------------------------------------- through corral serve


def test_config_keys_are_checked() -> None:
    config = parse_config({"swap_order": "batch", "max_swap_delay_s": 3,
                           "models": {"m": {"cmd": ["x"]}}})
    assert config.rules_of(config.models["m"]).swap_delay_s == 3.0
    arrival = parse_config({"models": {"m": {"cmd": ["x"]}}})
    assert arrival.rules_of(arrival.models["m"]).swap_delay_s == 0.0
    with pytest.raises(ConfigError, match="swap_order"):
        parse_config({"swap_order": "fifo", "models": {}})
    with pytest.raises(ConfigError, match="max_swap_delay_s"):
        parse_config({"max_swap_delay_s": -1, "models": {}})


@pytest.mark.parametrize("order", ["arrival", "batch"])
def test_a_model_waiting_for_a_busy_models_slot_is_served_while_that_model_stays_busy(
        tmp_path: Path, order: str) -> None:
    """Four clients keep a busy without a gap (their requests of about a second each
    overlap, started a quarter of a second apart, and join each other's grants on the
    front); b's request is answered while they go on (before turns, it waited for its
    queue_timeout_s: a never had no request), and then a's clients are served again (a
    is loaded anew)."""
    config = toml_config({n: {"cmd": fake_cmd("--tokens-per-s", "40")} for n in "ab"},
                         models_max=1, swap_order=order, max_swap_delay_s=1.0,
                         queue_timeout_s=25)
    with Corral(config) as c:
        assert chat(c.port, "a")[0] == 200
        stop = threading.Event()
        answers: list[tuple[float, int]] = []

        def client(n: int) -> None:
            stop.wait(n * 0.25)
            while not stop.is_set():
                answers.append((time.monotonic(), chat(c.port, "a", max_tokens=40)[0]))
        clients = [threading.Thread(target=client, args=(n,)) for n in range(4)]
        for t in clients:
            t.start()
        try:
            wait_until(lambda: len(answers) >= 8, 30, "a's clients to be served")
            asked = time.monotonic()
            status, _ = chat(c.port, "b")
            answered = time.monotonic()
            assert status == 200
            wait_until(lambda: any(at > answered and s == 200 for at, s in answers), 60,
                       "a's clients to be served after b")
        finally:
            stop.set()
            for t in clients:
                t.join(60)
        assert all(s == 200 for _, s in answers)
        assert answered - asked < 30  # (before turns: as long as a's clients went on)
        evicted = c.models()["b"]["last_eviction"]  # (b made way for a's clients again)
        assert evicted["reason"] == "lru" and evicted["for_model"] == "a"
        assert c.models()["a"]["loads"] >= 2


def used_once(names: str) -> Policy:
    """A policy with a slot for each of `names`, each loaded and used once, in order."""
    p = Policy(len(names))
    for m in names:
        p.add_model(m, 0.0)
    for at, m in enumerate(names, 1):
        p.acquire(m, m, float(at))
        p.children.instance_ready(m, p.state.models[m].generation, 1, "h", 1, at + 0.1)
        p.release(m, at + 0.2)
    return p


def gpu_need(size: int) -> Breakdown:
    return Breakdown(n_ctx=512, devices=[DeviceUse(kind="device", name="gpu0", model=size)])


def test_a_spent_turn_ends_and_its_held_model_takes_requests_again() -> None:
    """A turn is spent when every model it holds is idle and old enough to go and its
    waiter still cannot load (here a, whose own child is still stopping: its slot is
    counted free, so nothing is evicted for it). Its held model should then take
    requests again, as the log line says."""
    p = used_once("ab")
    p.unload("ua", "a", 4.0)  # (a stops; its exit is slow)
    p.acquire("w1", "a", 5.0)  # waits for a's exit, b held for it, idle at once: spent
    assert p.state.spent is not None and p.state.spent.model == "a"
    out = p.acquire("b1", "b", 6.0)
    assert any(isinstance(e, Answer) and e.ticket == "b1" and isinstance(e.value, Grant)
               for e in out), out


def test_a_turn_spent_while_its_waiter_waits_for_the_device_comes_back() -> None:
    """A review's case against ending a spent turn for good: a asks while c loads on the
    one device (one load per device at a time), so its turn, holding b (idle), is spent
    at once. Once c is up, a needs b's memory, and b takes overlapping requests from then
    on: a's turn must come back, or a waits for ever."""
    gib = 1024**3
    p = Policy(0, memory_margin=gib)
    for m in "abc":
        p.add_model(m, 0.0)
        p.children.measured(m, True, gpu_need(4 * gib), gpu_need(4 * gib), 0.0)

    def report(now: float) -> list[Effect]:
        up = sorted(r.name for r in p.state.models.values() if r.state.is_running)
        return p.children.devices_reported(DeviceReport(
            devices=[DeviceSample("gpu0", "device", 10 * gib, 10 * gib - 4 * gib * len(up),
                                  "sim")],
            managed={"gpu0": 4 * gib * len(up)}, usage={m: {"gpu0": 4 * gib} for m in up},
            tracked=up, backends=["sim"]), now)

    def settle(out: list[Effect], t: float) -> list[Effect]:  # (every stop ends at once)
        for e in list(out):
            if isinstance(e, Stop):
                out += p.children.instance_exited(e.model, e.generation, 0, "stopped", t)
                out += report(t)
        return out

    def ready(m: str, t: float) -> list[Effect]:
        return p.children.instance_ready(m, p.state.models[m].generation, 1, "h", 1, t)

    report(0.0)
    p.acquire("b0", "b", 1.0)
    ready("b", 1.5)
    report(1.5)
    p.release("b0", 2.0)
    p.acquire("c0", "c", 3.0)  # c loads (its request stays in flight)
    p.acquire("w1", "a", 4.0)  # waits for the device; b held, idle: spent
    out = settle(p.acquire("b1", "b", 5.0), 5.0)
    out += settle(ready("c", 5.5) + report(5.5), 5.7)
    t, prev = 5.0, "b1"
    for i in range(2, 30):  # b: overlapping requests, never idle
        t += 1.0
        out += settle(p.acquire(f"b{i}", "b", t), t)
        out += settle(p.release(prev, t + 0.5), t + 0.5)
        out += settle(p.repump(t + 0.6), t + 0.7)
        prev = f"b{i}"
    assert any(isinstance(e, Spawn) and e.model == "a" for e in out), (p.state.turn,
                                                                        p.state.spent)


def test_two_waiting_models_do_not_spend_each_other_s_turn_at_every_run(
        caplog: pytest.LogCaptureFixture) -> None:
    """A review's case against skipping only the last turn spent: a and b both wait for
    their own child's exit, and c, idle, is what each turn holds. A run that changed
    nothing must say and do nothing (it used to spend a's turn, find b's, spend it, find
    a's again, ... four times a run, withdrawing c's grants each time)."""
    p = used_once("abc")
    p.unload("ua", "a", 4.0)
    p.unload("ub", "b", 4.0)
    p.acquire("w1", "a", 5.0)
    p.acquire("w2", "b", 6.0)
    p.repump(7.0)
    with caplog.at_level(logging.INFO, logger="corral.scheduler"):
        assert p.repump(8.0) == []  # nothing changed since the last run
    assert not [r for r in caplog.records if "turn is spent" in r.getMessage()]
