"""Two policies on one random world, one that skips the rules after quiet decisions
(actors/policy/quiet.py) and takes the plain paths where no feature applies
(actors/policy/plain.py), and one that never does either, driven by the same calls, each timer
delivered when it comes due: they must decide the same, effect for effect, and hold the
same grants and waiters after every step (a review's differential search, kept: it
found a waiter leaving the last of its class level, a warm retry set with no effect,
and warm loads given up in an order that was the records' addresses')."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from actors.config.keys import BATCH, Tenant, batch_tenant
from actors.config.rules import SESSION, ModelGroup, ModelRules, Replicas
from actors.ledger import DeviceSample
from actors.messages import DeviceReport, Repump, TtlDue, WaitDue
from actors.policy import Policy
from actors.policy.records import Effect, Later, Spawn, Stop
from tests.test_policy_memory import GiB, need

NAMES = "abcd"
SEEDS, STEPS = 240, 80


def tenants(level: int) -> dict[str, Tenant]:
    return {"": Tenant(name="", level=level), "k": Tenant(name="k", max_concurrency=1),
            "h": Tenant(name="h", level=5), BATCH: batch_tenant(Tenant(name=""), BATCH, 3.0)}


class World:
    """A random configuration: models' rules, groups, memory, classes."""

    def __init__(self, rng: random.Random, plain: bool = False) -> None:
        """`plain`: no model has a max_concurrency or copies, and there are no groups
        (where plain.py's paths decide most)."""
        limits = [0] if plain else rng.choice([[0, 0, 0, 1, 2], [4, 4, 1, 2], [0, 4, 8]])
        self.rules = {m: ModelRules(
            pinned=rng.random() < 0.1, max_concurrency=rng.choice(limits),
            min_resident_s=rng.choice([0.0, 0.0, 2.0]),
            queue_timeout_s=rng.choice([0.0, 5.0, 30.0]), ttl_s=rng.choice([0.0, 0.0, 4.0]),
            swap_delay_s=rng.choice([0.0, 0.0, 1.0]), permanent=rng.random() < 0.05,
            warm=rng.random() < 0.1,
            replicas=(Replicas(min=1, max=2, target_in_flight=1, scale_up_after_s=1.0)
                      if rng.random() < 0.1 and not plain else None)) for m in NAMES}
        self.groups = {} if plain else ({"g": ModelGroup(models=["a", "b"], persistent=True)}
                       if rng.random() < 0.3 else
                       {"t": ModelGroup(models=["c", "d"], together=True)}
                       if rng.random() < 0.15 else {})
        self.memory = rng.random() < 0.3
        self.models_max = rng.choice([1, 2, 2, 3, 0 if self.memory else 2])
        self.aging = rng.choice([0.0, 0.0, 5.0])
        self.preempt = rng.random() < 0.3
        self.sizes = {m: rng.choice([2.0, 3.0, 5.0]) for m in NAMES}

    def policy(self, quiet: bool) -> Policy:
        p = Policy(self.models_max, tenants=tenants(0), aging_s=self.aging,
                   preempt=self.preempt, memory_margin=GiB if self.memory else 0)
        for m, rules in self.rules.items():
            p.add_model(m, 0.0, rules=rules)
        if self.memory:
            for m in NAMES:
                p.children.measured(m, True, need(self.sizes[m]), need(self.sizes[m]), 0.0)
            self.report(p, 0.0)
        if self.groups:
            p.set_groups(self.groups, 0.0)
        p.quiet.on = quiet
        p.quiet.check = False  # (as it runs: the tests' check runs the rules more)
        return p

    def report(self, p: Policy, now: float) -> list[Effect] | None:
        if not self.memory:
            return None
        up = sorted(r.name for r in p.state.models.values() if r.state.is_running)
        used = sum(int(self.sizes[m] * GiB) for m in up
                   if p.state.models[m].state.name != "SUSPENDED")
        total = 10 * GiB
        return p.children.devices_reported(DeviceReport(
            devices=[DeviceSample("gpu0", "device", total, max(0, total - used), "simulated")],
            managed={"gpu0": used}, usage={m: {"gpu0": int(self.sizes[m] * GiB)} for m in up},
            tracked=up, backends=["simulated"]), now)


def records(p: Policy) -> tuple[object, ...]:
    """What a decision may change of the records beside its effects (plain.py's steps)."""
    return (tuple((r.name, r.state, r.in_flight, r.generation, r.last_used, r.asked_at,
                   r.ended_at, r.ttl_armed, r.retiring) for r in p.state.models.values()),
            tuple(p.state.revocable), p.state.stats.granted)


def waiters(p: Policy) -> list[tuple[object, ...]]:
    """Every waiter, all of its fields, in the queue's order."""
    return [(t, *msgspec.structs.astuple(w)) for t, w in p.state.queue.waiters.items()]


def counted(p: Policy) -> dict[str, int]:
    """How often `p`'s plain paths decided (plain.py): wrapped, counted."""
    taken = {"grant": 0, "queue": 0, "release": 0}
    for name in taken:
        made = getattr(p.plain, name)

        def count(*args: Any, made: Any = made, name: str = name) -> Any:
            effects = made(*args)
            taken[name] += effects is not None
            return effects
        setattr(p.plain, name, count)
    return taken


class Twins:
    """The two policies, the calls made to both, and what they asked for."""

    def __init__(self, seed: int, plain: bool = False) -> None:
        self.rng = rng = random.Random(seed)
        self.world = World(rng, plain)
        self.on, self.off = self.world.policy(True), self.world.policy(False)
        self.plain = counted(self.on)
        self.now, self.seq = 0.0, 0
        self.timers: list[tuple[float, int, Any]] = []
        self.tickets: list[int] = []
        self.spawned: list[tuple[str, int]] = []
        self.stopping: list[tuple[str, int]] = []
        self.log: list[str] = [f"seed {seed}"]

    def both(self, what: str, call: Callable[[Policy], list[Effect] | None]) -> None:
        self.log.append(f"t={self.now:.2f} {what}")
        a, b = call(self.on), call(self.off)
        self.on.check_invariants()
        assert a == b, "\n".join([*self.log[-8:], f"skipping: {a}", f"not: {b}"])
        assert self.on.state.leases == self.off.state.leases
        assert waiters(self.on) == waiters(self.off)
        assert records(self.on) == records(self.off), "\n".join(self.log[-8:])
        for e in b or ():
            if isinstance(e, Later):
                self.seq += 1
                self.timers.append((self.now + e.delay_s, self.seq, e.message))
            elif isinstance(e, Spawn):
                self.spawned.append((e.model, e.generation))
            elif isinstance(e, Stop):
                self.stopping.append((e.model, e.generation))

    def timers_due(self) -> None:
        self.timers.sort()
        while self.timers and self.timers[0][0] <= self.now:
            self.fire(self.timers.pop(0)[2], self.now)

    def fire(self, msg: Any, t: float) -> None:
        if isinstance(msg, Repump):
            self.both("repump", lambda p: p.repump(t))
        elif isinstance(msg, WaitDue):
            self.both(f"wait_due {msg.ticket}", lambda p: p.wait_due(msg.ticket, t))
        elif isinstance(msg, TtlDue):
            self.both(f"ttl_due {msg.model}",
                      lambda p: p.tiers.ttl_due(msg.model, msg.generation, t))

    def step(self, i: int) -> None:
        rng, t = self.rng, self.now
        op = rng.choice(["acquire"] * 6 + ["cancel"] * 2 + ["release"] * 3 + [
            "ready", "ready", "crash", "stopped", "unload", "tenants", "load", "report",
            "requeue"])
        m = rng.choice(NAMES)
        if op == "acquire":
            key = rng.choice([""] * 8 + ["k", "h", BATCH + "k"])
            affinity, cut = rng.choice([0, 0, 0, SESSION + 1, SESSION + 2]), rng.random() < 0.5
            self.tickets.append(i)
            self.both(f"acquire {i} {m} {key!r}", lambda p: p.acquire(
                i, m, t, True, key, cuttable=cut, affinity=affinity))
        elif op in ("cancel", "release", "requeue") and self.tickets:
            tk, idle = rng.choice(self.tickets), rng.choice([0.0, 0.0, 0.5])
            shared = rng.random() < 0.3  # (others joined its grant: its model was used)
            self.both(f"{op} {tk}", lambda p: (
                p.cancel(tk, t) if op == "cancel" else p.cuts.requeue(tk, t)
                if op == "requeue" else p.release(tk, t, shared=shared, idle_s=idle)))
            if tk not in self.on.state.leases and tk not in self.on.state.queue:
                self.tickets.remove(tk)
        elif op in ("ready", "crash") and self.spawned:
            m, g = self.spawned.pop(rng.randrange(len(self.spawned)))
            self.both(f"{op} {m}#{g}", lambda p: p.children.instance_ready(m, g, 1, "h", 1, t)
                      if op == "ready" else p.children.instance_exited(m, g, 1, "x", t))
        elif op == "stopped" and self.stopping:
            m, g = self.stopping.pop(rng.randrange(len(self.stopping)))
            self.both(f"stopped {m}#{g}", lambda p: p.children.instance_exited(m, g, 0, "x", t))
        elif op in ("unload", "load"):
            self.both(f"{op} {m}", lambda p: (p.unload if op == "unload" else p.load)(
                (op, i), m, t))
        elif op == "report":
            self.both("report", lambda p: self.world.report(p, t))
        elif op == "tenants":
            level = rng.choice([0, 1])
            self.both(f"tenants {level}", lambda p: p.set_tenants(
                tenants(level), self.world.aging, t))


@pytest.mark.parametrize("block", range(6))
def test_a_policy_that_skips_decides_what_one_that_never_skips_does(block: int) -> None:
    """Blocks 4 and 5: worlds with no max_concurrency, copies or groups."""
    skipped, plain = 0, {"grant": 0, "queue": 0, "release": 0}
    for seed in range(block * SEEDS // 4, (block + 1) * SEEDS // 4):
        twins = Twins(seed, plain=block >= 4)
        for i in range(STEPS):
            twins.now += twins.rng.choice([0.0, 0.01, 0.2, 0.5, 1.0, 3.0])
            twins.timers_due()
            twins.step(i)
        skipped += twins.on.quiet.skipped
        assert twins.off.quiet.skipped == 0
        for name, n in twins.plain.items():
            plain[name] += n
    assert skipped > 50, skipped  # (the skip was exercised, not only the rules)
    assert min(plain.values()) > (30 if block >= 4 else 10), plain  # (and the plain paths)
