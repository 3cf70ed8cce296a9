"""How fast the pure scheduler decides, and how fast an actor message comes back.

    python -m bench scheduler [--ops 20000] [--json FILE]
    python -m bench scheduler --instructions [--sizes 1000x10000]
    python -m bench scheduler --kinds [--sizes 1000x10000]
    python -m bench scheduler --configured [--kinds] [--sizes 1000x10000]

1. Decisions per second of `actors.policy.Policy` (no threads, no I/O) at 1,000 models with
   10,000 waiting requests, and at other sizes to show how the cost grows. A decision is
   one call: a request that queues, a cancel, a request granted at once, a release. Set
   up so that every running model is busy (no eviction is possible), models_max is a
   tenth of the models, and the waiters are spread over the models that are not running.
   `--instructions`: the same decisions counted in instructions under valgrind's
   callgrind (which the machine's noise does not move): run at two lengths, the
   difference over the difference in decisions (the world's build and the interpreter's
   start cancel out). `--kinds`: each kind of decision timed apart (µs each).
   `--configured`: the same with every feature configured (`configured_policy`: keys in
   two classes with aging, cuts, prefetch, suspends, copies, groups), the requests' keys
   in turn: none, one of the higher class, one with a limit it never reaches.
2. Actor round trip: a Ping told to the live Scheduler actor, answered into the asyncio
   loop through the bridge (LoopReply), one at a time and 64 at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from actors import Config, Supervisor
from actors.config.keys import Tenant
from actors.config.rules import ModelGroup, ModelRules, Replicas, replica_name
from actors.messages import Ping
from actors.policy import Policy
from actors.runtime import loop
from actors.runtime.bridge import LoopReply
from bench.common import machine, summary_ms, write_json
from bench.support import ROOT

SIZES = [(100, 1_000), (1_000, 1_000), (1_000, 10_000), (1_000, 50_000), (5_000, 10_000),
         (10_000, 10_000)]


KEYS = ("", "gold", "free")
"""`--configured`: the keys a request comes with, in turn (a keyless one, two classes)."""


def configured_policy(running: int, names: list[str]) -> Policy:
    """`--configured`: every feature the policy has configured, none of them able to make
    a decision of the bench's four kinds impossible: keys in two classes with aging and
    limits no request reaches, cuts, prefetch, suspends (a tier), copies of every tenth
    model that waits, and persistent groups of the others, two by two."""
    p = Policy(models_max=running, tenants={
        "": Tenant(name=""), "gold": Tenant(name="gold", level=1, requests_per_min=10**9),
        "free": Tenant(name="free", max_concurrency=10**6)},
        aging_s=60.0, preempt=True, prefetch=True, suspended_max=2)
    tier = {"suspend": True, "ttl_suspend_s": 600.0, "ttl_s": 3600.0}
    for i, name in enumerate(names):
        if i >= running and i % 10 == 0:  # (a model with copies: its own record and one more)
            copies = Replicas(min=1, max=2)
            p.add_model(name, 0.0, rules=ModelRules(replicas=copies, **tier))
            p.add_model(replica_name(name, 2), 0.0,
                        rules=ModelRules(replicas=copies, group=name, **tier))
        else:
            p.add_model(name, 0.0, rules=ModelRules(**tier))
    paired = [n for i, n in enumerate(names) if i >= running and i % 10]
    p.set_groups({f"g{i}": ModelGroup(models=paired[i:i + 2], persistent=True)
                  for i in range(0, len(paired) - 1, 2)}, 0.0)
    return p


def build(n_models: int, n_waiters: int, seed: int = 0, configured: bool = False,
          ) -> tuple[Policy, list[str], list[str], list[object]]:
    """A policy with a tenth of the models running and busy, and `n_waiters` queued
    (`configured`: with every feature configured, and the waiters' keys in turn)."""
    rng = random.Random(seed)
    running = max(1, n_models // 10)
    names = [f"m{i}" for i in range(n_models)]
    if configured:
        p = configured_policy(running, names)
    else:
        p = Policy(models_max=running)
        for name in names:
            p.add_model(name, 0.0)
    for i, name in enumerate(names[:running]):
        p.acquire(("hold", name), name, float(i))
        p.children.instance_ready(name, 1, 1000 + i, "127.0.0.1", 10000 + i, float(i))
    idle = names[running:]
    waiting: list[object] = []
    for i in range(n_waiters):
        ticket = ("w", i)
        p.acquire(ticket, rng.choice(idle), 1.0, key=KEYS[i % 3] if configured else "")
        waiting.append(ticket)
    assert len(p.state.queue) == n_waiters, "every waiter must still be waiting"
    return p, names[:running], idle, waiting


PUMPS: dict[str, Callable[[Policy], Callable[[float], None]] | None] = {
    "as is": None,
    "tick+claim only": lambda p: lambda now: (p.rules.tick(now), p.rules.claim(now))[0],
    "no run at all": lambda p: lambda now: None,
}
"""`--parts`: what a decision costs with the run of the rules (Rules.run, what `pump` runs
and skips after a quiet decision) cut down, once the world is built. Not a policy anyone
runs: a ceiling, to show where the time goes."""


def decisions_per_s(n_models: int, n_waiters: int, ops: int, seed: int = 0,
                    pump: str = "as is", configured: bool = False) -> float:
    p, loaded, idle, waiting = build(n_models, n_waiters, seed, configured)
    if (cut := PUMPS[pump]) is not None:
        p.rules.run = cut(p)  # type: ignore[method-assign]
    rng = random.Random(seed + 1)
    keys = KEYS if configured else ("",)
    now = 2.0
    done = 0
    start = time.perf_counter()
    while done < ops:
        now += 1e-3
        key = keys[done % len(keys)]
        if rng.random() < 0.5:  # a request joins the queue, another leaves it
            ticket = ("n", done)
            p.acquire(ticket, rng.choice(idle), now, key=key)
            i = rng.randrange(len(waiting))  # swap-remove: the harness stays O(1)
            victim, waiting[i] = waiting[i], ticket
            p.cancel(victim, now)
        else:  # a request to a loaded model, granted at once, and its release
            ticket = ("g", done)
            p.acquire(ticket, rng.choice(loaded), now, key=key)
            p.release(ticket, now)
        done += 2
    took = time.perf_counter() - start
    assert len(p.state.queue) == n_waiters
    return done / took


KINDS = ("queued", "cancel", "granted", "release")


def by_kind(n_models: int, n_waiters: int, ops: int, seed: int = 0,
            configured: bool = False) -> dict[str, float]:
    """`decisions_per_s`'s loop with each call timed on its own: µs a decision of each
    kind (the clock's and the call's own cost, about 0.15 µs, included)."""
    p, loaded, idle, waiting = build(n_models, n_waiters, seed, configured)
    rng, clock = random.Random(seed + 1), time.perf_counter
    keys = KEYS if configured else ("",)
    spent = dict.fromkeys(KINDS, 0.0)
    count = dict.fromkeys(KINDS, 0)
    now, done = 2.0, 0
    while done < ops:
        now += 1e-3
        if rng.random() < 0.5:
            ticket = ("n", done)
            model = rng.choice(idle)
            i = rng.randrange(len(waiting))
            victim, waiting[i] = waiting[i], ticket
            key = keys[done % len(keys)]
            calls = (("queued", partial(p.acquire, ticket, model, now, key=key)),
                     ("cancel", partial(p.cancel, victim, now)))
        else:
            ticket, model, key = ("g", done), rng.choice(loaded), keys[done % len(keys)]
            calls = (("granted", partial(p.acquire, ticket, model, now, key=key)),
                     ("release", partial(p.release, ticket, now)))
        for kind, call in calls:
            start = clock()
            call()
            spent[kind] += clock() - start
            count[kind] += 1
        done += 2
    return {kind: spent[kind] / count[kind] * 1e6 for kind in KINDS if count[kind]}


def kinds(size: tuple[int, ...], ops: int, json_path: Path | None,
          configured: bool = False) -> int:
    """`--kinds`: µs a decision of each kind, at the first size."""
    n_models, n_waiters = size
    us = by_kind(n_models, n_waiters, ops, configured=configured)
    print(f"{n_models} models, {n_waiters} waiters, µs a decision: "
          + ", ".join(f"{kind} {v:.2f}" for kind, v in us.items()))
    write_json(json_path, {"bench": "scheduler-kinds", "machine": machine(),
                           "params": {"ops": ops, "size": size, "configured": configured},
                           "us": us})
    return 0


COUNTED = (2_000, 12_000)
"""The two lengths `--instructions` runs, in decisions."""


def instructions(n_models: int, n_waiters: int) -> float:
    """Instructions a decision at this size (callgrind; see the module's note)."""
    from bench.journal_instructions import totals  # (here: `--decide` runs in an older
    counts = []  # checkout too, this file copied into it, to count that one)
    for ops in COUNTED:
        with tempfile.TemporaryDirectory(prefix="corral-cg-") as folder:
            out = Path(folder) / "callgrind.out"
            subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                            sys.executable, "-m", "bench", "scheduler", "--decide",
                            f"{n_models}x{n_waiters}x{ops}"], cwd=ROOT, check=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
            counts.append(totals(out.read_text()))
    return (counts[1] - counts[0]) / (COUNTED[1] - COUNTED[0])


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give 1 or more")
    return value


async def round_trips(n: int, concurrency: int) -> dict[str, Any]:
    sup = Supervisor(Config(models={}))
    sup.start()
    loop = asyncio.get_running_loop()
    try:
        async def one() -> float:
            reply = LoopReply(loop)
            start = time.perf_counter()
            sup.scheduler.tell(Ping(reply=reply))
            await reply.future
            return time.perf_counter() - start

        cpu = time.process_time()
        samples = [await one() for _ in range(n)]
        cpu_us = (time.process_time() - cpu) / n * 1e6
        start = time.perf_counter()
        done = 0
        while done < n:
            batch = min(concurrency, n - done)
            await asyncio.gather(*(one() for _ in range(batch)))
            done += batch
        per_s = n / (time.perf_counter() - start)
    finally:
        await asyncio.to_thread(sup.stop)
    return {"sequential_ms": summary_ms(samples), "sequential_cpu_us": cpu_us,
            "concurrent": concurrency,
            "replies_per_s": per_s}


def scrape_cost(n_models: int, scrapes: int = 20) -> float:
    """CPU ms to render GET /metrics from a snapshot of `n_models` models, each loaded,
    with queue-wait and load-time histograms, evictions and refusals."""
    from actors.histogram import Histogram, observe
    from actors.http.control import FrontCounts
    from actors.http.metrics import render
    from actors.messages import DevicesSnapshot, DeviceView

    p, _, _, _ = build(n_models, 0)
    rng = random.Random(3)
    for name in p.state.models:
        for table in (p.state.stats.queue_wait, p.state.stats.load_time):
            for _ in range(5):
                observe(table, name, rng.uniform(0.001, 30))
        p.state.stats.refusals[(name, "queue_full")] = 1
        p.state.stats.evictions[(name, "lru")] = 2
    assert isinstance(p.state.stats.queue_wait[next(iter(p.state.models))], Histogram)
    snap = p.snapshot(10.0)
    views = [DeviceView(name=f"gpu{i}", kind="device", total=80 << 30, free=40 << 30,
                        external=0, held={m: 1 << 30 for m in list(p.state.models)[i::8]},
                        available=40 << 30) for i in range(8)]
    devices = DevicesSnapshot(memory_accounting=True, margin=1 << 30, account_host=False,
                              backends=["simulated"], devices=views)
    start = time.process_time()
    for _ in range(scrapes):
        render(snap, devices, FrontCounts(), None)
    return (time.process_time() - start) / scrapes * 1e3


def count_instructions(sizes: list[tuple[int, ...]], json: Path | None) -> int:
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt install valgrind): nothing counted")
        return 0
    counted = {f"{m}x{w}": instructions(m, w) for m, w in sizes}
    for size, count in counted.items():
        print(f"{size}: {count:,.0f} instructions a decision")
    write_json(json, {"bench": "scheduler-instructions", "machine": machine(),
                      "counted": COUNTED, "instructions": counted})
    return 0


def parts(size: tuple[int, ...], ops: int, rounds: int, json: Path | None) -> int:
    n_models, n_waiters = size
    print(f"{n_models} models, {n_waiters} waiters: decisions/s, best of 2 per round")
    rows = {name: [max(decisions_per_s(n_models, n_waiters, ops, pump=name)
                       for _ in range(2)) for _ in range(rounds)] for name in PUMPS}
    for name, rates in rows.items():
        print(f"  {name:>16}: " + " / ".join(f"{r:,.0f}" for r in rates))
    write_json(json, {"bench": "scheduler-parts", "machine": machine(),
                      "sizes": [size], "ops": ops, "rates": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench scheduler", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=20_000, help="decisions timed per size")
    ap.add_argument("--sizes", default=",".join(f"{m}x{w}" for m, w in SIZES),
                    help="MODELSxWAITERS,... (default: %(default)s)")
    ap.add_argument("--round-trips", type=positive, default=2_000)
    ap.add_argument("--scrape-models", type=int, default=1_000,
                    help="models in the /metrics scrape timed (default: %(default)s)")
    ap.add_argument("--parts", type=positive, default=0, metavar="ROUNDS",
                    help="only the first size, with the run of the rules as is, cut to "
                         "tick and claim, and left out, ROUNDS times side by side")
    ap.add_argument("--configured", action="store_true",
                    help="every feature configured, requests with keys in turn (not with "
                         "--instructions or --parts)")
    ap.add_argument("--kinds", action="store_true",
                    help="only the first size: µs a decision of each kind")
    ap.add_argument("--instructions", action="store_true",
                    help="count the decisions' instructions under valgrind instead")
    ap.add_argument("--decide", help=argparse.SUPPRESS)  # (MODELSxWAITERSxOPS: one run)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.decide:
        decisions_per_s(*(int(x) for x in args.decide.split("x")))
        return 0
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    if args.configured and (args.instructions or args.parts):
        ap.error("--configured times the decisions (and --kinds), not --instructions or --parts")
    if args.instructions:
        return count_instructions(sizes, args.json)
    if args.parts or args.kinds:
        return (parts(sizes[0], args.ops, args.parts, args.json) if args.parts
                else kinds(sizes[0], args.ops, args.json, args.configured))
    curve = []
    print(f"{'models':>7} {'waiters':>8} {'decisions/s':>12} {'us/decision':>12}")
    for n_models, n_waiters in sizes:
        rate = decisions_per_s(n_models, n_waiters, args.ops, configured=args.configured)
        curve.append({"models": n_models, "waiters": n_waiters, "decisions_per_s": rate,
                      "us_per_decision": 1e6 / rate})
        print(f"{n_models:>7} {n_waiters:>8} {rate:>12,.0f} {1e6 / rate:>12.1f}")
    rt = loop.run(round_trips(args.round_trips, 64))
    seq = rt["sequential_ms"]
    print(f"actor round trip (Ping -> Scheduler -> LoopReply): p50 {seq['p50'] * 1e3:.0f} us, "
          f"p99 {seq['p99'] * 1e3:.0f} us, CPU {rt['sequential_cpu_us']:.0f} us each; "
          f"{rt['replies_per_s']:,.0f} replies/s at 64 "
          "concurrent")
    scrape_ms = scrape_cost(args.scrape_models)
    print(f"/metrics at {args.scrape_models:,} models (each with histograms): "
          f"{scrape_ms:.1f} ms of CPU per scrape")
    write_json(args.json, {"bench": "scheduler", "machine": machine(),
                           "params": {"ops": args.ops, "sizes": sizes,
                                      "configured": args.configured,
                                      "round_trips": args.round_trips,
                                      "scrape_models": args.scrape_models},
                           "decisions": curve, "round_trip": rt, "scrape_ms": scrape_ms})
    return 0
