"""Chaos against real llama-server children: corral and llama-server's router, same preset.

    python -m bench chaos --llama-server BIN [--requests 4000] [--clients 32] [--models 3]
                          [--models-max 2] [--kill-every 0.2 0.6] [--seed 1]

For each router in turn: `--clients` clients send `--requests` small chat completions to
random models while a random child of the router is SIGKILLed every `--kill-every` s;
then the kills stop and each model gets one request. Reports per router: requests that
succeeded, the statuses, requests with no HTTP answer (connection errors), requests still
unanswered after 60 s (a wedged queue), and how long the first request per model took
after the chaos. Default settings on both sides (issue 11's acceptance run).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import time
from collections import Counter
from typing import Any

import aiohttp
import psutil

from bench.common import baseline, llama_pair, machine, send, session, write_json

ANSWER_TIMEOUT_S = 60.0


def kill_random_child(pid: int, rng: random.Random) -> bool:
    """SIGKILL a random child process of `pid`; False if it had none."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return False
    if not children:
        return False
    try:
        os.kill(rng.choice(children).pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def kind_of(error: str | None) -> str:
    """An error message with its numbers, names and ports blanked, to count alike ones."""
    return re.sub(r"'[^']*'|\d+", "_", error or "no HTTP answer")[:100]


async def chaos(url: str, pid: int, models: list[str], args: argparse.Namespace,
                ) -> dict[str, Any]:
    rng = random.Random(args.seed)
    left = args.requests
    statuses: Counter[int] = Counter()
    errors: Counter[str] = Counter()
    wedged = 0
    kills = 0
    done = asyncio.Event()

    async def client(s: aiohttp.ClientSession, crng: random.Random) -> None:
        nonlocal left, wedged
        while left > 0:
            left -= 1
            try:
                r = await asyncio.wait_for(send(s, url, crng.choice(models), max_tokens=4),
                                           ANSWER_TIMEOUT_S)
                statuses[r.status] += 1
                if r.status != 200:
                    errors[f"{r.status} {kind_of(r.error)}"] += 1
            except TimeoutError:
                wedged += 1

    async def killer() -> None:
        nonlocal kills
        while not done.is_set():
            try:
                await asyncio.wait_for(done.wait(), rng.uniform(*args.kill_every))
            except TimeoutError:
                kills += kill_random_child(pid, rng)

    start = time.monotonic()
    async with session(limit=args.clients) as s:
        kill_task = asyncio.create_task(killer())
        await asyncio.gather(*(client(s, random.Random(args.seed * 1000 + i))
                               for i in range(args.clients)))
        took = time.monotonic() - start
        done.set()
        await kill_task
        after = {}
        for model in models:
            t0 = time.monotonic()
            r = await send(s, url, model, max_tokens=4)
            after[model] = {"status": r.status, "s": round(time.monotonic() - t0, 3)}
    ok = statuses.get(200, 0)
    return {"requests": args.requests, "ok": ok, "ok_share": ok / args.requests,
            "statuses": dict(sorted(statuses.items())), "no_http_answer": statuses.get(0, 0),
            "wedged": wedged, "kills": kills, "seconds": round(took, 1),
            "errors": dict(errors.most_common()),
            "first_after_chaos": after}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    models = [f"m{i}" for i in range(args.models)]
    out: dict[str, Any] = {}
    with baseline(args.baseline) as root:
        async with llama_pair(args.llama_server, models_max=args.models_max,
                              n_models=args.models, baseline_root=root) as (urls, pids):
            for name in [n for n in ("corral", "corral-baseline", "llama-router")
                         if n in urls and n in args.routers]:
                out[name] = await one_router(name, urls, pids, models, args)
    return out


async def one_router(name: str, urls: dict[str, str], pids: dict[str, int], models: list[str],
                     args: argparse.Namespace) -> dict[str, Any]:
    r = await chaos(urls[name], pids[name], models, args)
    firsts = ", ".join(f"{m} {v['status']} in {v['s']:.2f} s"
                       for m, v in r["first_after_chaos"].items())
    print(f"{name:<15} {r['ok']:>5}/{r['requests']} ok ({r['ok_share']:.1%})  "
          f"statuses {r['statuses']}  wedged {r['wedged']}  kills {r['kills']}  "
          f"{r['seconds']} s; after: {firsts}", flush=True)
    for error, n in list(r["errors"].items())[:6]:
        print(f"{'':<15} {n:>5} x {error}", flush=True)
    return r


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", required=True, metavar="BIN")
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--models", type=int, default=3)
    p.add_argument("--models-max", type=int, default=2)
    p.add_argument("--kill-every", type=float, nargs=2, default=(0.2, 0.6), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=str, default=None)
    p.add_argument("--baseline", metavar="REV",
                   help="also the corral of git revision REV, after this one, same seed")
    p.add_argument("--routers", type=lambda v: v.split(","),
                   default=["corral", "corral-baseline", "llama-router"],
                   help="which of corral, corral-baseline, llama-router to run (all)")
    args = p.parse_args(argv)
    results = asyncio.run(run(args))
    if args.json:
        from pathlib import Path
        write_json(Path(args.json), {"machine": machine(), "args": vars(args),
                                     "results": results})
    return 0
