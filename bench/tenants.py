"""One box, many people (issue 22): an interactive key beside a batch key that floods it,
and two equal batch keys flooding together, through corral with keys and classes and,
side by side, through corral without keys (everyone in one FIFO queue).

    python -m bench tenants [--seconds 10] [--rounds 3] [--slots 4] [--service-ms 100]
                            [--batch-tokens 5 | 1-9]

One fake model with `max_concurrency = --slots`, each request taking --service-ms: the
box serves slots / service requests a second (its capacity). The interactive client sends
2 requests a second, each on its own timer (an open loop); a flooding key keeps ten times
the slots in flight (a closed loop: as soon as one answer comes, the next request goes),
so its queue never empties. Every request is 5 tokens (--service-ms), unless
--batch-tokens gives the flood's a range (uniform, seeded): with all alike, the slots
the flood holds end together, and a request that finds them all busy waits for the whole
of one; lengths that differ, as real ones do, spread the ends out. Cases, each --seconds
long, every round in this order:

    quiet      interactive alone (its wait with no flood)
    flood      interactive beside one flooding batch key
    cut        the same through corral with `priority_preempt`: an interactive request
               cuts a batch request that has sent nothing yet, which is sent again
    fair       two batch keys flooding together
    plain      the flood and the interactive client through corral without keys

Reported: the interactive p99 latency and queue wait (the latency less the fastest
answer of the quiet case: the service itself), Jain's fairness index of the requests
served to the two batch keys (and their throughput), and the box's throughput under the
same load (interactive beside one flood) with keys (the flood case), with cuts (the work
a cut request had done is lost: counted as the child's cancelled requests) and without
keys (plain).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from actors.runtime import loop
from bench.common import machine, pct, session, write_json
from bench.support import Corral, fake_cmd, toml_config

KEYS = {"inter": "inter-secret", "batch1": "batch1-secret", "batch2": "batch2-secret",
        "root": "root-secret"}


def config(home: Path, slots: int, service_ms: float, keys: bool, cuts: bool = False) -> str:
    tokens_per_s = 5 / (service_ms / 1000)  # a request is 5 tokens
    models = {"m": {"cmd": fake_cmd("--tokens-per-s", str(tokens_per_s)),
                    "max_concurrency": slots}}
    if not keys:
        return toml_config(models, http={"lease_linger_ms": 0})
    tables = {}
    for name, secret in KEYS.items():
        path = home / f"{name}.key"
        path.write_text(secret)
        tables[name] = ({"key_file": str(path), "admin": True} if name == "root" else
                        {"key_file": str(path),
                         "priority": "interactive" if name == "inter" else "batch"})
    return toml_config(models, keys=tables, priorities={"interactive": 10, "batch": 1},
                       priority_preempt=cuts, http={"lease_linger_ms": 0})


async def cancelled(s: aiohttp.ClientSession, url: str) -> int:
    """The requests the child of model m saw cancelled (cut, with priority_preempt)."""
    auth = {"Authorization": f"Bearer {KEYS['root']}"}
    async with s.get(url + "/models", headers=auth) as resp:
        port = next(m for m in (await resp.json())["data"] if m["id"] == "m")["port"]
    async with s.get(f"http://127.0.0.1:{port}/debug/stats") as resp:
        return int((await resp.json())["cancelled"])


async def one(s: aiohttp.ClientSession, url: str, key: str,
              tokens: int = 5) -> tuple[int, float]:
    start = time.perf_counter()
    async with s.post(url + "/v1/chat/completions",
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "m", "max_tokens": tokens,
                            "messages": [{"role": "user", "content": "hi"}]}) as resp:
        await resp.read()
        return resp.status, time.perf_counter() - start


async def interactive(s: aiohttp.ClientSession, url: str, key: str, seconds: float,
                      rate: float = 2.0) -> list[float]:
    """An open loop: a request every 1/rate s, whatever the answers do; their latencies."""
    tasks = []
    start = time.perf_counter()
    i = 0
    while (due := start + i / rate) < start + seconds:
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tasks.append(asyncio.ensure_future(one(s, url, key)))
        i += 1
    results = await asyncio.gather(*tasks)
    bad = [status for status, _ in results if status != 200]
    if bad:
        raise RuntimeError(f"interactive requests failed: {bad[:5]}")
    return [took for _, took in results]


async def flood(s: aiohttp.ClientSession, url: str, key: str, in_flight: int,
                until: asyncio.Event, tokens: tuple[int, int]) -> list[float]:
    """A closed loop of `in_flight` clients until `until` is set, each request of a length
    drawn from `tokens` (lo, hi), client i's from the same seeded sequence in every case
    (so that corral with and without keys get the same lengths): when each answer came."""
    done: list[float] = []

    async def client(i: int) -> None:
        rng = random.Random(i)
        while not until.is_set():
            status, _ = await one(s, url, key, rng.randint(*tokens))
            if status != 200:
                raise RuntimeError(f"a flooding request failed: {status}")
            done.append(time.perf_counter())
    await asyncio.gather(*(client(i) for i in range(in_flight)))
    return done


async def case(url: str, seconds: float, slots: int, inter_key: str | None,
               floods: list[str], tokens: tuple[int, int]) -> dict[str, Any]:
    async with session() as s:
        stop = asyncio.Event()
        flooding = [asyncio.ensure_future(flood(s, url, key, 10 * slots, stop, tokens))
                    for key in floods]
        await asyncio.sleep(0.5 if floods else 0.0)  # the flood's queue builds up first
        start = time.perf_counter()
        if inter_key is not None:
            latencies = await interactive(s, url, inter_key, seconds)
        else:
            await asyncio.sleep(seconds)
            latencies = []
        end = time.perf_counter()
        stop.set()
        done = await asyncio.gather(*flooding)
    # served within the case's own window: not while the queue built up, nor its drain
    served = [sum(1 for t in times if start <= t <= end) for times in done]
    return {"latencies": latencies, "served": served, "wall_s": end - start}


def jain(xs: list[int]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    capacity = args.slots / (args.service_ms / 1000)
    for r in range(args.rounds):
        out: dict[str, Any] = {}
        with tempfile.TemporaryDirectory() as tmp:
            keyed = config(Path(tmp), args.slots, args.service_ms, keys=True)
            cutting = config(Path(tmp), args.slots, args.service_ms, keys=True, cuts=True)
            plain = config(Path(tmp), args.slots, args.service_ms, keys=False)
            with Corral(keyed, log_level="WARNING") as c, \
                    Corral(cutting, log_level="WARNING") as k, \
                    Corral(plain, log_level="WARNING") as p:
                async with session() as s:
                    for url, key in ((c.url, KEYS["inter"]), (k.url, KEYS["inter"]),
                                     (p.url, "x")):
                        assert (await one(s, url, key))[0] == 200  # loaded
                t = args.batch_tokens
                out["quiet"] = await case(c.url, args.seconds, args.slots, KEYS["inter"],
                                          [], t)
                out["flood"] = await case(c.url, args.seconds, args.slots, KEYS["inter"],
                                          [KEYS["batch1"]], t)
                out["cut"] = await case(k.url, args.seconds, args.slots, KEYS["inter"],
                                        [KEYS["batch1"]], t)
                async with session() as s:
                    out["cut"]["cancelled"] = await cancelled(s, k.url)
                out["fair"] = await case(c.url, args.seconds, args.slots, None,
                                         [KEYS["batch1"], KEYS["batch2"]], t)
                out["plain"] = await case(p.url, args.seconds, args.slots, "x", ["x"], t)
        rounds.append(out)
        print(summary_line(r, out, capacity), flush=True)
    return {"rounds": rounds, "capacity_rps": capacity, "summary": summarize(rounds)}


def waits(latencies: list[float], service_s: float) -> dict[str, float]:
    return {"p50_ms": (pct(latencies, 0.5) - service_s) * 1e3,
            "p99_ms": (pct(latencies, 0.99) - service_s) * 1e3}


def figures(out: dict[str, Any]) -> dict[str, float]:
    service = min(out["quiet"]["latencies"])
    quiet, flooded = out["quiet"]["latencies"], out["flood"]["latencies"]
    cut = out["cut"]["latencies"]
    fair = out["fair"]
    return {
        "quiet_p99_ms": pct(quiet, 0.99) * 1e3,
        "flood_p99_ms": pct(flooded, 0.99) * 1e3,
        "cut_p99_ms": pct(cut, 0.99) * 1e3,
        "cut_ratio": pct(cut, 0.99) / pct(quiet, 0.99),
        "cut_wait_p99_ms": waits(cut, service)["p99_ms"],
        "cuts": out["cut"]["cancelled"],
        "cut_rps": served_rps(out["cut"]),
        "plain_p99_ms": pct(out["plain"]["latencies"], 0.99) * 1e3,
        "p99_ratio": pct(flooded, 0.99) / pct(quiet, 0.99),
        "quiet_wait_p99_ms": waits(quiet, service)["p99_ms"],
        "flood_wait_p99_ms": waits(flooded, service)["p99_ms"],
        "jain": jain(fair["served"]),
        "fair_rps": sum(fair["served"]) / fair["wall_s"],
        "keyed_rps": served_rps(out["flood"]),
        "plain_rps": served_rps(out["plain"]),
    }


def served_rps(case_: dict[str, Any]) -> float:
    """Requests the box served a second in a case: the flood's and the interactive's."""
    return (sum(case_["served"]) + len(case_["latencies"])) / case_["wall_s"]


def summary_line(r: int, out: dict[str, Any], capacity: float) -> str:
    f = figures(out)
    return (f"round {r + 1}: interactive p99 {f['quiet_p99_ms']:.0f} ms alone, "
            f"{f['flood_p99_ms']:.0f} ms beside the flood ({f['p99_ratio']:.2f}x), "
            f"{f['cut_p99_ms']:.0f} ms with cuts ({f['cut_ratio']:.2f}x, {f['cuts']:.0f} cut), "
            f"{f['plain_p99_ms']:.0f} ms without keys; Jain {f['jain']:.3f}; throughput "
            f"{f['keyed_rps']:.1f} req/s with keys, {f['cut_rps']:.1f} with cuts, "
            f"{f['plain_rps']:.1f} without "
            f"(capacity {capacity:.0f})")


def summarize(rounds: list[dict[str, Any]]) -> dict[str, list[float]]:
    per = [figures(r) for r in rounds]
    return {k: [round(f[k], 3) for f in per] for k in per[0]} if per else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench tenants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="per case")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--slots", type=int, default=4, help="the model's max_concurrency")
    ap.add_argument("--service-ms", type=float, default=100.0, help="one request's time")
    ap.add_argument("--batch-tokens", type=lambda v: tuple(int(x) for x in
                                                           (v.split("-") * 2)[:2]),
                    default=(5, 5), help="the flood's request lengths: N or LO-HI")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    data = loop.run(run(args))
    s = data["summary"]
    print("spread over rounds (min - max): interactive p99 ratio "
          f"{min(s['p99_ratio']):.2f} - {max(s['p99_ratio']):.2f}, with cuts "
          f"{min(s['cut_ratio']):.2f} - {max(s['cut_ratio']):.2f}, Jain "
          f"{min(s['jain']):.3f} - {max(s['jain']):.3f}, throughput with / without keys "
          f"{min(a / b for a, b in zip(s['keyed_rps'], s['plain_rps'], strict=True)):.3f} - "
          f"{max(a / b for a, b in zip(s['keyed_rps'], s['plain_rps'], strict=True)):.3f}, "
          "with cuts / without keys "
          f"{min(a / b for a, b in zip(s['cut_rps'], s['plain_rps'], strict=True)):.3f} - "
          f"{max(a / b for a, b in zip(s['cut_rps'], s['plain_rps'], strict=True)):.3f}")
    write_json(args.json, {"bench": "tenants", "machine": machine(),
                           "params": vars(args) | {"json": None},
                           "summary": s, "capacity_rps": data["capacity_rps"]})
    return 0

