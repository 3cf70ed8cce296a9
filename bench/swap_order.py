"""Swaps and waits on an alternating workload: `swap_order = "arrival"` against
`"batch"` (issue 41, actors/policy/turns.py), side by side.

    python -m bench swap-order [--rounds 3] [--seconds 20] [--clients 6]
                               [--load-s 0.5] [--tokens 10] [--delay-s 5] [--json FILE]

Two fake models behind one slot (models_max 1), each child loading in --load-s and
answering --tokens tokens at 40 tokens/s. --clients clients, started a little apart, one
request at a time, for --seconds: half of them ask a, the other half b, so requests for
the two arrive interleaved; with --alternate, each client asks a, then b, then a ... (an
agent that switches models every turn: the clients then fall into step whatever the
order). Each round runs a fresh corral of each order, one after the other (which goes
first alternates); per order the figures are loads per minute (each load past the first
is a swap), requests per second, and the p50 and p99 of a request's time (its wait for a
swap included).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import machine, pct, send, session, write_json
from bench.support import Corral, fake_cmd, toml_config

ORDERS = ("arrival", "batch")


def config(order: str, args: argparse.Namespace) -> str:
    cmd = fake_cmd("--load-delay", str(args.load_s), "--tokens-per-s", "40")
    return toml_config({m: {"cmd": cmd} for m in "ab"}, models_max=1, swap_order=order,
                       max_swap_delay_s=args.delay_s, queue_timeout_s=120)


async def one(order: str, args: argparse.Namespace) -> dict[str, float]:
    with Corral(config(order, args), log_level="WARNING") as corral:
        times: list[float] = []
        failed = 0
        end = time.monotonic() + args.seconds

        async def client(n: int) -> None:
            nonlocal failed
            await asyncio.sleep(n * 0.1)
            turn = n
            while time.monotonic() < end:
                result = await send(s, corral.url, "ab"[turn % 2], max_tokens=args.tokens)
                turn += args.switch
                if result.status == 200:
                    times.append(result.latency_s)
                else:
                    failed += 1
        async with session() as s:
            began = time.monotonic()
            await asyncio.gather(*(client(n) for n in range(args.clients)))
            took = time.monotonic() - began
        loads = sum(corral.models()[m]["loads"] for m in "ab")
    return {"loads_per_min": (loads - 1) / took * 60, "req_per_s": len(times) / took,
            "p50_s": statistics.median(times), "p99_s": pct(times, 99), "failed": failed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench swap-order", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--load-s", type=float, default=0.5)
    ap.add_argument("--tokens", type=int, default=10)
    ap.add_argument("--delay-s", type=float, default=5.0, help="max_swap_delay_s of batch")
    ap.add_argument("--alternate", dest="switch", action="store_const", const=1, default=2,
                    help="each client alternates between the models (default: half the "
                         "clients ask a, half b)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rounds: list[dict[str, dict[str, float]]] = []
    print(f"{'round':<6} {'order':<8} {'swaps/min':>10} {'req/s':>7} {'p50 s':>7} "
          f"{'p99 s':>7} {'failed':>7}")
    for r in range(args.rounds):
        figures: dict[str, dict[str, float]] = {}
        for order in ORDERS if r % 2 == 0 else reversed(ORDERS):
            f = figures[order] = asyncio.run(one(order, args))
            print(f"{r + 1:<6} {order:<8} {f['loads_per_min']:>10.1f} {f['req_per_s']:>7.2f} "
                  f"{f['p50_s']:>7.2f} {f['p99_s']:>7.2f} {f['failed']:>7.0f}", flush=True)
        rounds.append(figures)
    out: dict[str, Any] = {"machine": machine(), "args": vars(args) | {"json": None},
                           "rounds": rounds}
    for key in ("loads_per_min", "req_per_s", "p99_s"):
        ratios = [f["batch"][key] / f["arrival"][key] for f in rounds if f["arrival"][key]]
        if ratios:
            print(f"batch / arrival, {key}: {min(ratios):.2f} .. {max(ratios):.2f} "
                  f"(median {statistics.median(ratios):.2f})")
    write_json(args.json, out)
    return 0
