"""An agent that alternates two models, with prefetch on against off (issue 44, part 2).

    python -m bench prefetch [--turns 12] [--load-s 1.0] [--think-s 2.5] [--idle-s 3.0]
                             [--skip-every K] [--reviewer]

Two corrals side by side, one with `prefetch = true`, each with a planner and a coder
(fake children whose cold load takes --load-s). The coder has `ttl_s` 2 s, so it stops
while the agent works on between turns. One agent per corral, at the same time: each
turn asks the planner, thinks --think-s (reads its answer), asks the coder, then works
--idle-s before the next turn. Measured: the time to first byte of the coder's turns
(after the first 3, which prefetch needs to learn from), and the prefetches the corral
counted as loaded, used and wasted. With --skip-every K every Kth turn asks no coder: a
prefetch wasted, if the odds still call for one.

With --reviewer each turn asks a third model after the coder (think --think-s, then the
reviewer), the coder has no ttl_s, and two slots hold three models: without prefetch, LRU
evicts the very model asked next at every request; with it, a prefetch evicts the model
idle longer than the next one's expected wait (the reviewer for the coder, the planner
for the reviewer), and the planner, asked --idle-s after the reviewer, is not prefetched
over a coder idle only --think-s.
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
    models: dict[str, Any] = {"planner": {"cmd": cmd}, "coder": {"cmd": cmd, "ttl_s": 2}}
    if args.reviewer:
        models = {"planner": {"cmd": cmd}, "coder": {"cmd": cmd}, "reviewer": {"cmd": cmd}}
    return toml_config(models, models_max=2, prefetch=prefetch)


async def agent(url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """The times to first byte of the turns of the models after the planner, in seconds."""
    after = ["coder", "reviewer"] if args.reviewer else ["coder"]
    times: dict[str, list[float]] = {name: [] for name in after}
    if args.reviewer:
        times["planner"] = []
    async with session() as s:
        for turn in range(args.turns):
            planned = await send(s, url, "planner")
            assert planned.status == 200, planned
            if args.reviewer:
                times["planner"].append(planned.ttfb_s)
            await asyncio.sleep(args.think_s)
            if args.skip_every and turn % args.skip_every == args.skip_every - 1:
                await asyncio.sleep(args.idle_s)  # (the planner was enough: no coder)
                continue
            for i, name in enumerate(after):
                if i:
                    await asyncio.sleep(args.think_s)
                answer = await send(s, url, name)
                assert answer.status == 200, answer
                times[name].append(answer.ttfb_s)
            await asyncio.sleep(args.idle_s)
    return times


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
    for (name, _), by_model in zip(corrals.items(), times, strict=True):
        out[name] = {"prefetches": counts[name]}
        for model, ttfb in by_model.items():
            after = ttfb[LEARN:]
            out[name][model] = {"ttfb_s": ttfb, "p50_after_learning_s": statistics.median(after),
                                "max_after_learning_s": max(after)}
            print(f"prefetch {name:>3}: the {model}'s first byte after its first {LEARN} "
                  f"turns: p50 {statistics.median(after) * 1e3:7.1f} ms, max "
                  f"{max(after) * 1e3:7.1f} ms")
        print(f"prefetch {name:>3}: prefetches {counts[name] or 'none'}")
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
    ap.add_argument("--reviewer", action="store_true",
                    help="a third model after the coder, two slots for three models")
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
