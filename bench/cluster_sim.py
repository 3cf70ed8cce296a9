"""A cluster on paper: corral's real, pure policy on a fake clock, at a scale this machine
cannot host, beside a baseline with random placement and per-node LRU (as ModelMesh
places models), fed the same requests.

    python -m bench cluster-sim [--nodes 100] [--gpus 8] [--models 2000] [--rates 5,10,20,40]
                                [--concurrency 4 --replicas 4]

Each node has `--gpus` GPUs of `--gpu-gib` GiB (2 GiB margin each). Models are 4-140 GiB
(log-uniform, fixed seed); one over a GPU's room is spread over two GPUs of one node.
Loading takes 1 s per 2 GiB, a stop 1 s, an answer `--service-s`. Requests pick models by
a Zipf law (`--zipf`) and arrive as a Poisson process at each rate, for `--minutes`.

corral: the Policy's own decisions (placement by fit on any node, the least recently used
idle models evicted where that costs least), its effects played back as the Scheduler
would (spawns become ready after their load time, stops exit after 1 s, the devices are
reported after each), the CPU time of its calls measured. Baseline: a request for a model
that is not loaded picks a node at random and evicts that node's least recently used idle
models until it fits; freed memory is free at once (which flatters it).

With --concurrency C each child answers at most C requests at once (max_concurrency; the
baseline serves each model's requests first come, first served on C slots), and with
--replicas N a third run gives every model `replicas = { max = N, target_in_flight = C,
scale_up_after_s = 5, scale_up_wait_s = 2, scale_down_idle_s = 60 }`: popular models get
copies by demand, placed by fit like any load (issue 24).

Reported per rate: hit ratio (answered with no load waited for), loads and evictions per
minute, p50 and p99 queue wait (arrival to grant), refusals, and for corral decisions per
second (policy calls per second of its CPU time) and a digest of every effect it made, in
order: two trees that make the same choices print the same digest, whatever PYTHONHASHSEED.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import itertools
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.config.rules import ModelRules, Replicas, replica_name
from actors.ledger import Breakdown, DeviceSample, DeviceUse
from actors.messages import DeviceReport, Grant, Refusal, Repump, TtlDue, WaitDue
from actors.policy import Policy
from actors.policy.records import Answer, Later, Spawn, Stop
from bench.common import machine, pct, write_json

GiB = 1 << 30
MARGIN_GIB = 2
LOAD_GIB_PER_S = 2.0
STOP_S = 1.0


@dataclass
class World:
    nodes: int
    gpus: int
    gpu_gib: float
    sizes: dict[str, float]
    """Model -> GiB."""

    def devices(self) -> list[str]:
        return [f"n{i}/g{j}" for i in range(self.nodes) for j in range(self.gpus)]

    def per_instance(self, model: str) -> int:
        return math.ceil(self.sizes[model] / (self.gpu_gib - MARGIN_GIB))


def make_world(args: argparse.Namespace) -> World:
    rng = random.Random(args.seed)
    sizes = {f"m{i}": round(math.exp(rng.uniform(math.log(4), math.log(140))), 1)
             for i in range(args.models)}
    return World(args.nodes, args.gpus, args.gpu_gib, sizes)


def arrivals(args: argparse.Namespace, world: World, rate: float) -> list[tuple[float, str]]:
    """(time, model): Poisson at `rate`, models by a Zipf law over a shuffled ranking."""
    rng = random.Random(args.seed + 1)
    names = list(world.sizes)
    rng.shuffle(names)
    weights = [1 / (k + 1) ** args.zipf for k in range(len(names))]
    cumulative = list(itertools.accumulate(weights))
    out, t = [], 0.0
    end = args.minutes * 60
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            return out
        out.append((t, rng.choices(names, cum_weights=cumulative)[0]))


@dataclass
class Tally:
    waits: list[float] = field(default_factory=list)
    hits: int = 0
    loads: int = 0
    evictions: int = 0
    refused: int = 0

    def row(self, minutes: float, requests: int) -> dict[str, Any]:
        return {"requests": requests, "hit_ratio": self.hits / max(1, requests),
                "loads_per_min": self.loads / minutes,
                "evictions_per_min": self.evictions / minutes,
                "wait_p50_s": pct(self.waits, 0.5), "wait_p99_s": pct(self.waits, 0.99),
                "refused": self.refused}


# ------------------------------------------------------------------ corral's policy


class PolicySim:
    """The Scheduler's part, played by hand: the Policy decides, this plays the effects.
    `concurrency`: each child answers at most that many requests at once (max_concurrency;
    0: any number); `replicas`: each model may run as up to that many copies, added by
    demand (issue 24)."""

    def __init__(self, world: World, service_s: float, concurrency: int = 0,
                 replicas: int = 1) -> None:
        self.world = world
        self.service_s = service_s
        self.p = Policy(0, 3, 60.0, memory_margin=MARGIN_GIB * GiB)
        self.nodes = [f"n{i}" for i in range(world.nodes)]
        copies = (Replicas(max=replicas, target_in_flight=max(concurrency, 1),
                           scale_up_after_s=5.0, scale_up_wait_s=2.0, scale_down_idle_s=60.0)
                  if replicas > 1 else None)
        for name in world.sizes:
            for i in range(1, replicas + 1):
                self.p.add_model(replica_name(name, i), 0.0, rules=ModelRules(
                    nodes=self.nodes, devices_per_instance=world.per_instance(name),
                    max_concurrency=concurrency, replicas=copies,
                    group=name if i > 1 else ""))
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.used: dict[str, dict[str, int]] = {}
        """Model -> device -> bytes its (simulated) child uses."""
        self.ready: set[str] = set()
        self.arrived: dict[int, float] = {}
        self.tally = Tally()
        self.calls = 0
        self.cpu_s = 0.0
        self.digest = hashlib.sha256()
        """Of every effect the policy made, in order: the same choices, the same digest."""
        self.now = 0.0
        self._report()
        for name, gib in world.sizes.items():
            need = Breakdown(4096, [DeviceUse(kind="device", name="n0/g0", model=int(gib * GiB))])
            self._call(self.p.children.measured, name, True, need, need, 0.0)

    def _at(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def _call(self, method: Any, *args: Any) -> None:
        start = time.process_time()
        effects = method(*args)
        self.cpu_s += time.process_time() - start
        self.calls += 1
        for e in effects:
            self.digest.update(repr(e).encode())
            if isinstance(e, Answer):
                if isinstance(e.value, Grant):
                    wait = self.now - self.arrived.pop(e.ticket)
                    self.tally.waits.append(wait)
                    self.tally.hits += wait == 0.0
                    self._at(self.now + self.service_s, "release", e.ticket)
                elif isinstance(e.value, Refusal):
                    self.arrived.pop(e.ticket, None)
                    self.tally.refused += 1
            elif isinstance(e, Spawn):
                self.tally.loads += 1
                devices = e.devices or []
                gib = self.world.sizes[e.serves or e.model]
                share = int(gib * GiB) // max(1, len(devices))
                self.used[e.model] = {d: share for d in devices}
                self._at(self.now + gib / LOAD_GIB_PER_S, "ready", (e.model, e.generation))
            elif isinstance(e, Stop):
                self.tally.evictions += 1
                self._at(self.now + STOP_S, "exited", (e.model, e.generation))
            elif isinstance(e, Later):
                self._at(self.now + e.delay_s, "timer", e.message)

    def _report(self) -> None:
        used: dict[str, int] = {}
        for use in self.used.values():
            for d, b in use.items():
                used[d] = used.get(d, 0) + b
        total = int(self.world.gpu_gib * GiB)
        samples = [DeviceSample(d, "device", total, total - used.get(d, 0), "sim")
                   for d in self.world.devices()]
        # What a monitor with per-process figures (NVML's) says: every GPU's bytes used
        # by corral's children, 0 where none runs.
        used = {d: used.get(d, 0) for d in self.world.devices()}
        tracked = sorted(self.used)
        self._call(self.p.children.devices_reported, DeviceReport(
            devices=samples, managed=used, usage={m: dict(u) for m, u in self.used.items()},
            tracked=tracked, backends=["sim"], ready=sorted(self.ready)), self.now)

    def run(self, requests: list[tuple[float, str]]) -> Tally:
        for i, (t, model) in enumerate(requests):
            self._at(t, "arrival", (i, model))
        while self.events:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrival":
                ticket, model = payload
                self.arrived[ticket] = self.now
                self._call(self.p.acquire, ticket, model, self.now)
            elif kind == "release":
                self._call(self.p.release, payload, self.now)
            elif kind == "ready":
                model, generation = payload
                self.ready.add(model)
                self._call(self.p.children.instance_ready, model, generation, 1, "sim", 1,
                           self.now)
                self._report()
            elif kind == "exited":
                model, generation = payload
                self.used.pop(model, None)
                self.ready.discard(model)
                self._call(self.p.children.instance_exited, model, generation, 0, "stopped",
                           self.now)
                self._report()
            elif kind == "timer":
                match payload:
                    case TtlDue(model=model, generation=generation):
                        self._call(self.p.tiers.ttl_due, model, generation, self.now)
                    case WaitDue(ticket=ticket):
                        self._call(self.p.wait_due, ticket, self.now)
                    case Repump():
                        self._call(self.p.repump, self.now)
        return self.tally


# ------------------------------------------------------------------ the baseline


class Baseline:
    """Random node, per-node LRU, first fit on that node's GPUs."""

    def __init__(self, world: World, service_s: float, seed: int,
                 concurrency: int = 0) -> None:
        self.world = world
        self.service_s = service_s
        self.concurrency = concurrency
        self.slots: dict[str, list[float]] = {}
        """Model -> when each of its `concurrency` answering slots comes free."""
        self.rng = random.Random(seed)
        self.free = {d: (world.gpu_gib - MARGIN_GIB) * GiB for d in world.devices()}
        self.where: dict[str, list[str]] = {}
        """Model -> its devices, loading or loaded."""
        self.ready_at: dict[str, float] = {}
        self.in_flight: dict[str, int] = {}
        self.last_used: dict[str, float] = {}
        self.tally = Tally()

    def _fit(self, node: int, model: str) -> list[str] | None:
        k = self.world.per_instance(model)
        share = self.world.sizes[model] * GiB / k
        room = [d for d in (f"n{node}/g{j}" for j in range(self.world.gpus))
                if self.free[d] >= share]
        return room[:k] if len(room) >= k else None

    def _place(self, model: str, now: float) -> list[str] | None:
        node = self.rng.randrange(self.world.nodes)
        while (devices := self._fit(node, model)) is None:
            idle = [m for m, ds in self.where.items()
                    if ds[0].startswith(f"n{node}/") and not self.in_flight.get(m)
                    and self.ready_at[m] <= now]
            if not idle:
                return None
            victim = min(idle, key=lambda m: self.last_used[m])
            share = self.world.sizes[victim] * GiB / len(self.where[victim])
            for d in self.where.pop(victim):
                self.free[d] += share
            self.tally.evictions += 1
        return devices

    def run(self, requests: list[tuple[float, str]]) -> Tally:
        releases: list[tuple[float, str]] = []
        for t, model in requests:
            while releases and releases[0][0] <= t:
                _, done = heapq.heappop(releases)
                self.in_flight[done] -= 1
            if model not in self.where:
                devices = self._place(model, t)
                if devices is None:
                    self.tally.refused += 1
                    continue
                share = self.world.sizes[model] * GiB / len(devices)
                for d in devices:
                    self.free[d] -= share
                self.where[model] = devices
                self.ready_at[model] = t + self.world.sizes[model] / LOAD_GIB_PER_S
                self.tally.loads += 1
            start = max(t, self.ready_at[model])
            if self.concurrency:  # first come, first served on its slots
                slots = self.slots.setdefault(model, [0.0] * self.concurrency)
                start = max(start, heapq.heappop(slots))
                heapq.heappush(slots, start + self.service_s)
            self.tally.waits.append(start - t)
            self.tally.hits += start == t
            self.in_flight[model] = self.in_flight.get(model, 0) + 1
            self.last_used[model] = start + self.service_s
            heapq.heappush(releases, (start + self.service_s, model))
        return self.tally


def simulate(args: argparse.Namespace, world: World, requests: list[tuple[float, str]],
             replicas: int) -> dict[str, Any]:
    start = time.perf_counter()
    sim = PolicySim(world, args.service_s, args.concurrency, replicas)
    row = sim.run(requests).row(args.minutes, len(requests))
    row["decisions_per_s"] = sim.calls / sim.cpu_s if sim.cpu_s else 0.0
    row["wall_s"] = time.perf_counter() - start
    row["effects"] = sim.digest.hexdigest()[:16]
    return row


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench cluster-sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--gpus", type=int, default=8, help="per node (default 8)")
    ap.add_argument("--gpu-gib", type=float, default=80.0)
    ap.add_argument("--models", type=int, default=2000)
    ap.add_argument("--rates", default="5,10,20,40", help="requests per second, a run each")
    ap.add_argument("--minutes", type=float, default=10.0, help="simulated, per run")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--service-s", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=0,
                    help="requests a child answers at once (default 0: any number)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="above 1: a third run where each model may run as this many "
                    "copies, added by demand (target_in_flight = --concurrency)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    world = make_world(args)
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        requests = arrivals(args, world, rate)
        corral = simulate(args, world, requests, 1)
        base = Baseline(world, args.service_s, args.seed, args.concurrency).run(
            requests).row(args.minutes, len(requests))
        rows.append({"rate": rate, "corral": corral, "baseline": base})
        if args.replicas > 1:
            copies = rows[-1]["replicas"] = simulate(args, world, requests, args.replicas)
            print(f"rate {rate:g}/s with up to {args.replicas} copies a model: hit "
                  f"{copies['hit_ratio']:.3f} vs {corral['hit_ratio']:.3f} with one, "
                  f"loads/min {copies['loads_per_min']:.1f} vs "
                  f"{corral['loads_per_min']:.1f}, wait p50 {copies['wait_p50_s']:.2f} vs "
                  f"{corral['wait_p50_s']:.2f} s, p99 {copies['wait_p99_s']:.1f} vs "
                  f"{corral['wait_p99_s']:.1f} s, refused {copies['refused']} vs "
                  f"{corral['refused']}, {copies['decisions_per_s']:.0f} decisions/s, "
                  f"effects {copies['effects']}",
                  flush=True)
        print(f"rate {rate:g}/s, {len(requests)} requests: "
              f"hit {corral['hit_ratio']:.3f} vs {base['hit_ratio']:.3f}, "
              f"loads/min {corral['loads_per_min']:.1f} vs {base['loads_per_min']:.1f}, "
              f"evictions/min {corral['evictions_per_min']:.1f} vs "
              f"{base['evictions_per_min']:.1f}, wait p50 {corral['wait_p50_s']:.2f} vs "
              f"{base['wait_p50_s']:.2f} s, p99 {corral['wait_p99_s']:.1f} vs "
              f"{base['wait_p99_s']:.1f} s, refused {corral['refused']} vs "
              f"{base['refused']}, corral {corral['decisions_per_s']:.0f} decisions/s "
              f"({corral['wall_s']:.0f} s), effects {corral['effects']}", flush=True)
    result = {"bench": "cluster-sim", "machine": machine(), "args": vars(args) | {
        "json": None}, "rows": rows}
    write_json(args.json, result)
    print(json.dumps(rows, indent=2))
    return 0
