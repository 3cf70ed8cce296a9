"""An agent that alternates two models, with prefetch on against off (issue 44, part 2).

    python -m bench prefetch [--turns 12] [--load-s 1.0] [--think-s 2.5] [--idle-s 3.0]
                             [--skip-every K]

Two corrals side by side, one with `prefetch = true`, each with a planner and a coder
(fake children whose cold load takes --load-s). The coder has `ttl_s` 2 s, so it stops
while the agent works on between turns. One agent per corral, at the same time: each
turn asks the planner, thinks --think-s (reads its answer), asks the coder, then works
--idle-s before the next turn. Measured: the time to first byte of the coder's turns
(after the first 3, which prefetch needs to learn from), and the prefetches the corral
counted as loaded, used and wasted. With --skip-every K every Kth turn asks no coder: a
prefetch wasted, if the odds still call for one.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from actors.runtime import loop
from bench.common import machine, send, session, write_json
from bench.support import Corral, fake_cmd, toml_config

LEARN = 3
"""Turns a corral needs to see before it prefetches (policy/prefetch.py SEEN)."""


def config(args: argparse.Namespace, prefetch: bool) -> str:
    cmd = fake_cmd("--load-delay", str(args.load_s))
    return toml_config({"planner": {"cmd": cmd}, "coder": {"cmd": cmd, "ttl_s": 2}},
                       models_max=2, prefetch=prefetch)


async def agent(url: str, args: argparse.Namespace) -> list[float]:
    """The coder turns' times to first byte, in seconds."""
    coder: list[float] = []
    async with session() as s:
        for turn in range(args.turns):
            planned = await send(s, url, "planner")
            assert planned.status == 200, planned
            await asyncio.sleep(args.think_s)
            if args.skip_every and turn % args.skip_every == args.skip_every - 1:
                await asyncio.sleep(args.idle_s)  # (the planner was enough: no coder)
                continue
            coded = await send(s, url, "coder")
            assert coded.status == 200, coded
            coder.append(coded.ttfb_s)
            await asyncio.sleep(args.idle_s)
    return coder


async def prefetches(url: str) -> dict[str, float]:
    async with session() as s, s.get(url + "/metrics") as resp:
        text = await resp.text()
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("corral_prefetches_total{")}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        corrals: dict[str, Corral] = {}
        try:
            for name, on in (("off", False), ("on", True)):
                (Path(tmp) / name).mkdir()
                corrals[name] = Corral(config(args, on), home=Path(tmp) / name)
            times = await asyncio.gather(*(agent(c.url, args) for c in corrals.values()))
            counts = {name: await prefetches(c.url) for name, c in corrals.items()}
        finally:
            for c in corrals.values():
                c.stop()
    out: dict[str, Any] = {}
    for (name, _), ttfb in zip(corrals.items(), times, strict=True):
        after = ttfb[LEARN:]
        out[name] = {"coder_ttfb_s": ttfb, "p50_after_learning_s": statistics.median(after),
                     "max_after_learning_s": max(after), "prefetches": counts[name]}
        print(f"prefetch {name:>3}: the coder's first byte after its first {LEARN} turns: "
              f"p50 {statistics.median(after) * 1e3:7.1f} ms, max {max(after) * 1e3:7.1f} ms"
              f"; prefetches {counts[name] or 'none'}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench prefetch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--load-s", type=float, default=1.0)
    ap.add_argument("--think-s", type=float, default=2.5)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--skip-every", type=int, default=0, metavar="K",
                    help="every Kth turn asks no coder (a guess that is wasted)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.turns <= LEARN:
        ap.error(f"--turns must be more than the {LEARN} a corral learns from")
    result = loop.run(run(args))
    write_json(args.json, {"bench": "prefetch", "machine": machine(),
                           "params": vars(args) | {"json": None}, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
