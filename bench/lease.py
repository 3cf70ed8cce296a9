"""What keeping a grant after its last request (http.lease_linger_ms) buys and costs: the
same lone client through corrals that differ only in the linger, interleaved round by
round in one run.

    python -m bench lease [--lingers 0,10,100,1000] [--gaps 0,5,50,300] [--rounds 3]

For each pause between one client's requests (`--gaps`, ms: 0 is back to back), corral's
CPU per request and the latency it adds (p50 and p99, against the same requests straight
to the child). A request that comes within the linger joins the kept grant without asking
the Scheduler; later ones ask. Then the cost side: with models_max 1, a request for a
second model right after one for the first, whose grant is kept (or, at linger 0, is
already released): the time to the second model's answer, which must stop the first
(the Scheduler revokes the kept grant first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from actors.runtime import loop
from bench.common import cpu_seconds, get_json, machine, pct, send, session, write_json
from bench.support import Corral, fake_cmd, toml_config


async def lone_client(s: aiohttp.ClientSession, url: str, n: int,
                      gap_s: float) -> list[float]:
    """`n` requests one after another, `gap_s` apart: their latencies."""
    out = []
    for _ in range(n):
        result = await send(s, url, "a")
        if result.status != 200:
            raise RuntimeError(f"{url}: {result.status} {result.error}")
        out.append(result.latency_s)
        if gap_s:
            await asyncio.sleep(gap_s)
    return out


async def swap_once(s: aiohttp.ClientSession, url: str) -> float:
    """a, then b at once (models_max 1): b's latency, which stops a first; then back to a
    state where a is loaded and b is not."""
    assert (await send(s, url, "a")).status == 200
    start = time.perf_counter()
    result = await send(s, url, "b")
    took = time.perf_counter() - start
    if result.status != 200:
        raise RuntimeError(f"{url}: b answered {result.status} {result.error}")
    return took


async def run(args: argparse.Namespace) -> dict[str, Any]:
    gaps = [g / 1000 for g in args.gaps]
    toml = {linger: toml_config({"a": {"cmd": fake_cmd()}, "b": {"cmd": fake_cmd()}},
                                models_max=1, http={"lease_linger_ms": linger})
            for linger in args.lingers}
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        corrals = {linger: stack.enter_context(Corral(text, log_level="WARNING"))
                   for linger, text in toml.items()}
        async with session() as s:
            for c in corrals.values():
                assert (await send(s, c.url, "a")).status == 200
            first = next(iter(corrals.values()))
            listing = await get_json(s, first.url + "/models")
            port = next(m["port"] for m in listing["data"] if m["id"] == "a")
            direct = f"http://127.0.0.1:{port}"
            for gap in gaps:
                n = args.requests if not gap else max(20, int(args.seconds / gap))
                lat: dict[Any, list[float]] = {k: [] for k in ["direct", *corrals]}
                cpu: dict[float, list[float]] = {k: [] for k in corrals}
                for i in range(args.rounds):
                    order: list[Any] = ["direct", *corrals]
                    order = order[i % len(order):] + order[:i % len(order)]
                    for name in order:
                        if name == "direct":
                            lat[name] += await lone_client(s, direct, n, gap)
                            continue
                        c = corrals[name]
                        before = cpu_seconds(c.proc.pid)
                        lat[name] += await lone_client(s, c.url, n, gap)
                        cpu[name].append((cpu_seconds(c.proc.pid) - before) / n * 1e6)
                for linger in corrals:
                    rows.append({
                        "gap_ms": gap * 1000, "linger_ms": linger, "requests": n,
                        "cpu_us_per_request": [round(v, 1) for v in cpu[linger]],
                        "added_p50_ms": (pct(lat[linger], 0.5) - pct(lat["direct"], 0.5)) * 1e3,
                        "added_p99_ms": (pct(lat[linger], 0.99)
                                         - pct(lat["direct"], 0.99)) * 1e3})
                    r = rows[-1]
                    print(f"gap {r['gap_ms']:>5g} ms  linger {linger:>6g} ms  cpu/request "
                          f"{' '.join(f'{v:.0f}' for v in r['cpu_us_per_request'])} us  "
                          f"+p50 {r['added_p50_ms']:.3f} ms  +p99 {r['added_p99_ms']:.3f} ms")
            swaps: dict[float, list[float]] = {k: [] for k in corrals}
            for i in range(args.swaps):
                for linger in list(corrals)[i % len(corrals):] + list(corrals)[:i % len(corrals)]:
                    swaps[linger].append(await swap_once(s, corrals[linger].url))
            for linger, took in swaps.items():
                print(f"swap with a kept grant: linger {linger:>6g} ms  b's answer after "
                      f"median {statistics.median(took) * 1e3:.1f} ms "
                      f"(min {min(took) * 1e3:.1f}, max {max(took) * 1e3:.1f})")
    return {"rows": rows, "swap_ms": {str(k): [round(t * 1e3, 2) for t in v]
                                      for k, v in swaps.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench lease", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda v: [float(x) for x in v.split(",")]  # noqa: E731
    ap.add_argument("--lingers", type=ints, default=[0.0, 10.0, 100.0, 1000.0])
    ap.add_argument("--gaps", type=ints, default=[0.0, 5.0, 50.0, 300.0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=1000, help="back to back, per round")
    ap.add_argument("--seconds", type=float, default=2.0,
                    help="per round and corral, with a gap")
    ap.add_argument("--swaps", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    figures = loop.run(run(args))
    write_json(args.json, {"bench": "lease", "machine": machine(), "params": vars(args)
                           | {"json": None}, **figures})
    return 0
