"""The queue's claim order with classes, kept sorted as the queue changes
(actors/policy/order.py), against the sort of every entry at each call that it replaced:
random queues of several class levels, batch lines and aging, changed every way the
queue changes, must come out in the same order at every moment."""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Hashable

import pytest

from actors.config.keys import BATCH_LEVEL
from actors.policy.queue import QueueEntry, RequestQueue

MODELS = [f"m{i}" for i in range(12)]
LEVELS = [0, 0, 1, 2, -1, BATCH_LEVEL]
KEYS = ["", "a", "b", "batch:a"]


def sorted_as_before(q: RequestQueue, now: float) -> list[QueueEntry]:
    """What `ordered` was: arrival order with one class level waiting, else every entry
    sorted by its best lane head's rank at `now`."""
    if len(q.levels) <= 1:
        return list(q.entries.values())

    def best(entry: QueueEntry) -> float:
        return max((q.rank(q.waiters[next(iter(lane))], now) for lane in entry.lanes.values()),
                   default=float("-inf"))
    return sorted(q.entries.values(), key=best, reverse=True)


def step(q: RequestQueue, rng: random.Random, now: float, tickets: list[Hashable],
         n: int) -> None:
    op = rng.choice(["add"] * 5 + ["remove", "remove", "take", "behind", "drop", "open",
                                   "close", "retries", "aging"] + ["clear"] * (rng.random() < 0.1))
    model = rng.choice(MODELS)
    if op == "add":
        tickets.append(n)  # (queued a moment ago, at a time off any grid: no exact ties)
        q.add(n, model, now - rng.random() * 3, None, rng.choice(KEYS), rng.choice(LEVELS),
              again=rng.random() < 0.1)
    elif op in ("remove", "take") and tickets:
        t = tickets.pop(rng.randrange(len(tickets)))
        if op == "remove":
            q.remove(t)
        elif len(q.entries[q.waiters[t].model].waiters) > 1:
            q.take(t)
        else:
            q.remove(t)
    elif op == "behind" and model in q.entries:
        q.behind(model)
    elif op == "drop":
        for t, _ in q.drop(model):
            tickets.remove(t)
    elif op == "open":
        q.open(model).explicit = True
    elif op == "close" and model in q.entries:
        q.entries[model].explicit = False
        q.close_if_empty(model)
    elif op == "retries":
        for t, _ in q.keep_for_retries(model):
            tickets.remove(t)
        q.close_if_empty(model)
    elif op == "aging":
        q.aging_s = rng.choice([0.0, 5.0, 60.0])
    elif op == "clear":  # (shutdown)
        q.clear()
        tickets.clear()


@pytest.mark.parametrize("block", range(4))
def test_the_kept_order_is_the_sorted_order_at_every_moment(block: int) -> None:
    compared = 0
    for seed in range(block * 50, (block + 1) * 50):
        rng = random.Random(seed)
        q = RequestQueue(aging_s=rng.choice([0.0, 5.0, 60.0]))
        tickets: list[Hashable] = []
        now = 10.0
        for n in range(150):
            now += rng.choice([0.0, 0.01, 0.5, 3.0])
            step(q, rng, now, tickets, n)
            q.check()
            if rng.random() < 0.5:
                ordered = list(q.ordered(now))
                assert [e.model for e in ordered] == [
                    e.model for e in sorted_as_before(q, now)], (seed, n)
                compared += len(q.levels) > 1
        plan = copy.deepcopy(q)  # (a plan's copy: plans.py) orders as its queue does
        assert [e.model for e in plan.ordered(now)] == [e.model for e in q.ordered(now)]
    assert compared > 500, compared  # (the kept order was compared, not only arrival order)


def test_on_round_times_the_kept_order_is_sorted_but_for_rounding() -> None:
    """Arrival times on a grid (a review's find): ranks that tie exactly may round apart,
    so the sort at each moment and the kept order may differ there, by the last bit; the
    kept order is still sorted by rank at every moment, to within that."""
    for seed in range(100):
        rng = random.Random(seed)
        q = RequestQueue(aging_s=rng.choice([1.0, 5.0]))
        for n in range(60):
            now = 10.0 + n * 0.2
            q.add(n, rng.choice(MODELS), now - rng.choice([0.0, 0.2, 1.0, 5.0]), None,
                  rng.choice(["", "a"]), rng.choice([0, 1, 2]))
            if rng.random() < 0.3:
                q.remove(rng.choice(list(q.waiters)))
            ranks = [q.best(e, now) for e in q.ordered(now)]
            if len(q.levels) > 1:
                assert all(a >= b - 1e-9 for a, b in itertools.pairwise(ranks)), (seed, n)
                assert sorted(e.model for e in q.ordered(now)) == sorted(q.entries)
