"""What the request journal costs a request: corral with its journal against corral
without it, and against a second corral without it (the control), each set of three
processes started anew `--pairs` times.

    python -m bench overhead --journal-off [--pairs 9] [--rounds 20] [--requests 300]
                                           [--concurrency 1,16] [--streams 64]

Why sets of processes, not rounds: two identical corrals, started one after the other
and measured side by side over many rounds, differ by -7 % to +13 % in CPU per request
(where each lands, its hash seed, its memory), and that lasts as long as they do; more
rounds of the same processes do not shrink it. So each set is new, its start order
rotated, and the figure is the median over sets of each set's ratio, beside the same
median for the control (what the method cannot tell apart from nothing).

Each case runs `--rounds` short rounds per process, their order rotating, of the small
requests (or, a tenth as many rounds, the streams) of `python -m bench overhead`. A
process's CPU is its own and its journal writer's (once it has started: its start is
not charged), from before the case to a settle after it that lets the writer finish,
per request; the writer's is shown apart too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
from typing import Any

from actors.journal.store import BATCH_WAIT_S
from bench.common import cpu_seconds, lean_requests, pct, send, session
from bench.support import Corral

SIDES = ("on", "off", "control")
"""The journal on; off; off again (the control)."""
SETTLE_S = BATCH_WAIT_S + 1.0
"""After a case: the writer is sent the case's last rows and writes them."""


async def one_set(args: argparse.Namespace, k: int, config: Any) -> dict[str, dict[str, Any]]:
    """One set of three processes: each case's CPU per request and p50 for each side."""
    order = SIDES[k % 3:] + SIDES[:k % 3]
    with contextlib.ExitStack() as stack:
        corrals = {side: stack.enter_context(Corral(config(args, journal={
            "enabled": side == "on"}), log_level="WARNING")) for side in order}
        async with session() as s:
            for corral in corrals.values():
                for model in ("small", "stream"):
                    await send(s, corral.url, model)
            pids = {side: c.pids(journal=side == "on") for side, c in corrals.items()}
            cases: dict[str, dict[str, Any]] = {}
            for c in args.concurrency:
                cases[f"small c={c}"] = await case(
                    lambda url, c=c: lean_requests(url, "small", max(args.requests, c), c, 1),
                    corrals, pids, order, "latency_s", args.rounds)
            n_tokens = int(args.tokens_per_s * args.stream_seconds)
            for n in args.streams:
                async def streams(url: str, n: int = n) -> list[Any]:
                    return list(await asyncio.gather(*(
                        send(s, url, "stream", stream=True, max_tokens=n_tokens)
                        for _ in range(n))))
                cases[f"streams n={n}"] = await case(streams, corrals, pids, order, "ttfb_s",
                                                     max(1, args.rounds // 10))
    return cases


async def case(run: Any, corrals: dict[str, Corral], pids: dict[str, tuple[int, ...]],
               order: tuple[str, ...], lat: str, rounds: int) -> dict[str, Any]:
    """`rounds` rounds of each side, their order rotating: the host's noise, which comes
    and goes over seconds, falls on each side alike."""
    before = {side: sum(map(cpu_seconds, pids[side])) for side in order}
    writer = sum(map(cpu_seconds, pids["on"][1:]))
    results: dict[str, list[Any]] = {side: [] for side in order}
    for i in range(rounds):
        for side in order[i % 3:] + order[:i % 3]:
            results[side] += await run(corrals[side].url)
    await asyncio.sleep(SETTLE_S)
    writer = sum(map(cpu_seconds, pids["on"][1:])) - writer
    out: dict[str, Any] = {}
    for side in order:
        ok = [r for r in results[side] if r.status == 200]
        out[side] = {"cpu_us": (sum(map(cpu_seconds, pids[side])) - before[side])
                     / max(len(ok), 1) * 1e6,
                     "p50_ms": pct([getattr(r, lat) for r in ok], 0.5) * 1e3,
                     "errors": len(results[side]) - len(ok)}
    out["on"]["writer_cpu_us"] = writer / max(len(results["on"]), 1) * 1e6
    return out


def summarize(sets: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for name in sets[0]:
        each = [s[name] for s in sets]
        on = [e["on"]["cpu_us"] / e["off"]["cpu_us"] - 1 for e in each]
        control = [e["control"]["cpu_us"] / e["off"]["cpu_us"] - 1 for e in each]
        p50 = [e["on"]["p50_ms"] - e["off"]["p50_ms"] for e in each]
        rows.append({"case": name, "sets": len(each),
                     "cpu_us": {side: statistics.median(e[side]["cpu_us"] for e in each)
                                for side in SIDES},
                     "journal": statistics.median(on), "journal_spread": (min(on), max(on)),
                     "control": statistics.median(control),
                     "control_spread": (min(control), max(control)),
                     "added_p50_ms": statistics.median(p50),
                     "journal_cpu_us": {"writer": statistics.median(
                         e["on"]["writer_cpu_us"] for e in each)},
                     "errors": sum(e[side]["errors"] for e in each for side in SIDES)})
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'case':<16} {'sets':>4} {'cpu us off/on':>15} {'journal':>8} {'spread':>17} "
          f"{'control':>8} {'spread':>17} {'+p50 ms':>8} {'writer us':>9}")
    for r in rows:
        print(f"{r['case']:<16} {r['sets']:>4} "
              f"{r['cpu_us']['off']:>7.1f}/{r['cpu_us']['on']:<7.1f} {r['journal']:>+8.1%} "
              f"{_spread(r['journal_spread']):>17} {r['control']:>+8.1%} "
              f"{_spread(r['control_spread']):>17} {r['added_p50_ms']:>8.2f}"
              f" {r['journal_cpu_us']['writer']:>9.1f}"
              + (f"  ({r['errors']} errors)" if r["errors"] else ""))


def _spread(lo_hi: tuple[float, float]) -> str:
    return f"{lo_hi[0]:+.1%}..{lo_hi[1]:+.1%}"


async def run(args: argparse.Namespace, config: Any) -> list[dict[str, Any]]:
    sets = []
    for k in range(args.pairs):
        sets.append(await one_set(args, k, config))
        print(f"set {k + 1}/{args.pairs}: " + ", ".join(
            f"{name} {c['on']['cpu_us'] / c['off']['cpu_us'] - 1:+.1%}"
            for name, c in sets[-1].items()), flush=True)
    rows = summarize(sets)
    print_rows(rows)
    return rows
