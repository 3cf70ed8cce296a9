"""Fire concurrent requests at a running corral (or any router with the same API).

    python -m bench load --url http://127.0.0.1:8080 [--concurrency 16]
        [--requests 1000 | --duration 30] [--models a,b,c] [--mix uniform|zipf|round-robin]
        [--stream] [--max-tokens 16] [--api-key KEY] [--json FILE]

Models default to every model the router lists. Reports throughput, p50/p90/p99 latency
and time to first byte, errors by status, and, from corral's /metrics before and after,
queue waits, loads and evictions (a router without corral's /metrics shows none). A
progress line runs on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from actors.runtime import loop
from bench.common import Result, machine, send, session, summary_ms, write_json


def model_picker(models: list[str], mix: str, seed: int = 0) -> Any:
    """An endless iterator of model names: uniform, zipf (s=1.1) or round-robin."""
    rng = random.Random(seed)
    if mix == "round-robin":
        return itertools.cycle(models)
    if mix == "zipf":
        weights = [1 / (rank ** 1.1) for rank in range(1, len(models) + 1)]
        return iter(lambda: rng.choices(models, weights)[0], None)
    return iter(lambda: rng.choice(models), None)


async def metrics(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Corral's counters that the report uses, summed over models; {} elsewhere."""
    try:
        async with s.get(url + "/metrics") as resp:
            if resp.status != 200:
                return {}
            text = await resp.text()
    except aiohttp.ClientError:
        return {}
    out: dict[str, float] = {}
    for name in ("corral_model_loads_total", "corral_evictions_total",
                 "corral_queue_wait_seconds_sum", "corral_queue_wait_seconds_count",
                 "corral_requests_granted_total"):
        values = re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
        if values:
            out[name] = sum(float(v) for v in values)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with session() as s:
        s.headers.update(headers)
        models = args.models
        if not models:
            async with s.get(args.url + "/v1/models") as resp:
                models = [m["id"] for m in (await resp.json())["data"]]
        pick = model_picker(models, args.mix)
        before = await metrics(s, args.url)
        results: list[Result] = []
        sent = 0
        deadline = time.monotonic() + args.duration if args.duration else None
        start = time.perf_counter()

        def more() -> bool:
            if deadline is not None:
                return time.monotonic() < deadline
            return sent < args.requests

        async def worker() -> None:
            nonlocal sent
            while more():
                sent += 1
                results.append(await send(s, args.url, next(pick), stream=args.stream,
                                          max_tokens=args.max_tokens))

        async def progress() -> None:
            tty = sys.stderr.isatty()  # a log gets a line every 5 s, not a carriage return
            while True:
                await asyncio.sleep(0.5 if tty else 5.0)
                ok = sum(r.status == 200 for r in results)
                took = time.perf_counter() - start
                print(f"{chr(13) if tty else ''}{len(results)} done, {ok} ok, "
                      f"{len(results) - ok} errors, {len(results) / took:,.0f} req/s",
                      end="" if tty else "\n", file=sys.stderr)

        ticker = asyncio.create_task(progress())
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - start
        ticker.cancel()
        print(file=sys.stderr)
        after = await metrics(s, args.url)
    ok = [r for r in results if r.status == 200]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    waits = delta.get("corral_queue_wait_seconds_count", 0.0)
    return {
        "requests": len(results), "ok": len(ok), "wall_s": wall,
        "requests_per_s": len(ok) / wall, "tokens_per_s": sum(r.tokens for r in ok) / wall,
        "latency_ms": summary_ms([r.latency_s for r in ok]),
        "ttfb_ms": summary_ms([r.ttfb_s for r in ok]),
        "errors": dict(Counter(str(r.status or r.error) for r in results if r.status != 200)),
        "corral": {"loads": delta.get("corral_model_loads_total"),
                   "evictions": delta.get("corral_evictions_total"),
                   "queue_waits": waits,
                   "queue_wait_mean_ms": (delta["corral_queue_wait_seconds_sum"] / waits * 1e3
                                          if waits else None)} if after else None,
        "models": models,
    }


def print_report(r: dict[str, Any]) -> None:
    lat, ttfb = r["latency_ms"], r["ttfb_ms"]
    print(f"{r['ok']}/{r['requests']} ok in {r['wall_s']:.2f} s: "
          f"{r['requests_per_s']:,.1f} req/s, {r['tokens_per_s']:,.1f} tokens/s")
    print(f"{'':<10} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9}")
    for name, row in (("latency", lat), ("ttfb", ttfb)):
        print(f"{name:<10} {row['p50']:>9.2f} {row['p90']:>9.2f} {row['p99']:>9.2f}")
    if r["errors"]:
        print("errors: " + ", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items())))
    c = r["corral"]
    if c:
        wait = f", mean wait {c['queue_wait_mean_ms']:.1f} ms" if c["queue_wait_mean_ms"] else ""
        print(f"corral: {c['loads']:.0f} loads, {c['evictions']:.0f} evictions, "
              f"{c['queue_waits']:.0f} requests waited in the queue{wait}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench load", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--duration", type=float, default=None, metavar="S",
                    help="run for S seconds instead of --requests")
    ap.add_argument("--models", type=lambda v: [m for m in v.split(",") if m], default=None)
    ap.add_argument("--mix", choices=["uniform", "zipf", "round-robin"], default="uniform")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--api-key")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    result = loop.run(run(args))
    print_report(result)
    params = {k: v for k, v in vars(args).items() if k not in ("json", "api_key")}
    write_json(args.json, {"bench": "load", "machine": machine(), "params": params,
                           **result})
    return 0
