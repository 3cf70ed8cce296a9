"""How many streams one front holds (issue 43, part 3).

    python -m bench streams --max [--workers 1,2] [--tokens-per-s 20] [--seconds 5]
                            [--children 4] [--start 16] [--limit 4096] [--json FILE]

N streams at once, spread over `--children` fake children that stream at
`--tokens-per-s`, straight to the children and through corral (a corral per `--workers`
value, its `http.workers`), side by side, read by a lean client that notes when each
token comes. A front holds N while, through it, the tokens per second delivered are at
least 99% of direct's and the p99 of the gaps between a stream's tokens is at most 5 ms
more than direct's. A level that does not hold is measured once more, and holds if the two
together do (their means): a level's share moves by about 1% from one run to the next on a
small machine, as much as the bar leaves, and one unlucky run ended a search at a tenth
of what the others found. `--max` doubles N from `--start` until a level does not hold,
then bisects between the last that held and the first that did not, to within 10%;
without it, each N of `--streams` is measured (and, failing, measured again).

The client shares the machine with corral and the children: on a small machine it is the
client or the children that give out first, which is why direct's figures are the bar and
are measured at each N in the same run. Say which machine a figure comes from.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from pathlib import Path
from typing import Any

from bench.common import get_json, machine, send, session, write_json
from bench.support import Corral, fake_cmd, toml_config

RATE_SHARE = 0.99
"""Through corral, at least this share of direct's tokens per second..."""
ADDED_P99_MS = 5.0
"""... and at most this much more on the p99 of the gaps between a stream's tokens."""


class _TimedStream(asyncio.Protocol):
    """One streamed chat completion on its own connection: when each token came."""

    def __init__(self, done: asyncio.Future[list[float]]) -> None:
        self.done = done
        self.times: list[float] = []
        self.tail = b""

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        joined = self.tail + data
        events = joined.count(b"data: {") - self.tail.count(b"data: {")
        self.times += [now] * events
        self.tail = joined[-8:]
        if b"data: [DONE]" in joined and not self.done.done():
            self.done.set_result(self.times)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(self.times)


async def timed_stream(port: int, model: str, tokens: int) -> list[float]:
    body = json.dumps({"model": model, "stream": True, "max_tokens": tokens,
                       "messages": [{"role": "user", "content": "hi"}]})
    raw = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
           f"Connection: close\r\n\r\n{body}").encode()
    loop = asyncio.get_running_loop()
    done: asyncio.Future[list[float]] = loop.create_future()
    transport, _ = await loop.create_connection(lambda: _TimedStream(done), "127.0.0.1", port)
    transport.write(raw)
    try:
        return await done
    finally:
        transport.close()


def p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def level(ports: list[tuple[int, str]], n: int, tokens: int) -> dict[str, float]:
    """N streams at once over `ports` (port, model): tokens per second delivered, and the
    p99 gap between a stream's tokens (its first token's wait is not a gap)."""
    start = time.perf_counter()
    got = await asyncio.gather(*(timed_stream(*ports[i % len(ports)], tokens)
                                 for i in range(n)))
    wall = time.perf_counter() - start
    gaps = [b - a for times in got for a, b in itertools.pairwise(times)]
    return {"tok_s": sum(len(t) for t in got) / wall, "p99_gap_ms": p99(gaps) * 1e3,
            "tokens": sum(len(t) for t in got), "asked": n * tokens}


async def holds(corral: Corral, direct: list[tuple[int, str]], models: list[str], n: int,
                tokens: int) -> dict[str, Any]:
    """One level, direct then through corral: whether corral holds it; one that does not
    is measured again, and judged by the means of the two (`runs`: both)."""
    first = await once(corral, direct, models, n, tokens)
    if first["holds"]:
        return first
    second = await once(corral, direct, models, n, tokens)
    share = (first["share"] + second["share"]) / 2
    added = (first["added_p99_ms"] + second["added_p99_ms"]) / 2
    return {**first, "share": share, "added_p99_ms": added, "runs": [first, second],
            "holds": share >= RATE_SHARE and added <= ADDED_P99_MS}


async def once(corral: Corral, direct: list[tuple[int, str]], models: list[str], n: int,
               tokens: int) -> dict[str, Any]:
    """One level measured once, direct then through corral."""
    straight = await level(direct, n, tokens)
    through = await level([(corral.port, m) for m in models], n, tokens)
    share = through["tok_s"] / straight["tok_s"] if straight["tok_s"] else 0.0
    added = through["p99_gap_ms"] - straight["p99_gap_ms"]
    return {"streams": n, "direct": straight, "corral": through, "share": share,
            "added_p99_ms": added, "holds": share >= RATE_SHARE and added <= ADDED_P99_MS}


async def search(args: argparse.Namespace, w: int, corral: Corral,
                 direct: list[tuple[int, str]], models: list[str],
                 tokens: int) -> dict[str, Any]:
    """The levels one corral (http.workers `w`) is measured at, and the most it held."""
    rows: list[dict[str, Any]] = []

    async def measure(n: int) -> bool:
        row = await holds(corral, direct, models, n, tokens)
        rows.append(row)
        print(f"workers {w}  {n:>5} streams: corral {row['share']:.3f} of direct's "
              f"{row['direct']['tok_s']:,.0f} tok/s, p99 gap "
              f"{row['corral']['p99_gap_ms']:.1f} ms ({row['added_p99_ms']:+.1f} ms): "
              f"{'holds' if row['holds'] else 'does not hold'}", flush=True)
        return bool(row["holds"])

    best = 0
    if args.max:
        n = args.start
        while n <= args.limit and await measure(n):
            best, n = n, n * 2
        failed = n if n <= args.limit else None
        while failed is not None and failed - best > max(1, best // 10):
            mid = (best + failed) // 2
            if await measure(mid):
                best = mid
            else:
                failed = mid
    else:
        for n in args.streams:
            if await measure(n):
                best = max(best, n)
    print(f"workers {w}: holds {best} streams"
          + (f" (to {args.limit}, the limit)" if best >= args.limit else ""), flush=True)
    return {"max_streams": best, "levels": rows}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    models = [f"s{i}" for i in range(args.children)]
    table = {m: {"cmd": fake_cmd("--tokens-per-s", str(args.tokens_per_s))} for m in models}
    tokens = max(2, int(args.tokens_per_s * args.seconds))
    out: dict[str, Any] = {}
    for w in args.workers:
        with Corral(toml_config(table, models_max=len(table), http={"workers": w}),
                    log_level="WARNING") as corral:
            async with session() as s:
                for m in models:
                    assert (await send(s, corral.url, m)).status == 200
                listing = await get_json(s, corral.url + "/models")
            direct = [(m["port"], m["id"]) for m in listing["data"] if m["id"] in table]
            out[str(w)] = await search(args, w, corral, direct, models, tokens)
    first = out[str(args.workers[0])]["max_streams"]
    for w in args.workers[1:]:
        if first:
            print(f"workers {w} / workers {args.workers[0]}: "
                  f"{out[str(w)]['max_streams'] / first:.2f}x")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench streams", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max", action="store_true",
                    help="search for the most streams a front holds (else: --streams)")
    ap.add_argument("--streams", type=lambda v: [int(x) for x in v.split(",")],
                    default=[64, 256])
    ap.add_argument("--workers", type=lambda v: [int(x) for x in v.split(",")],
                    default=[1, 2])
    ap.add_argument("--tokens-per-s", type=float, default=20.0, help="per stream")
    ap.add_argument("--seconds", type=float, default=5.0, help="each stream's length")
    ap.add_argument("--children", type=int, default=4)
    ap.add_argument("--start", type=int, default=16)
    ap.add_argument("--limit", type=int, default=4096)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    write_json(args.json, {"bench": "streams", "machine": machine(),
                           "params": {k: v for k, v in vars(args).items() if k != "json"},
                           "workers": result})
    return 0
