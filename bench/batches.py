"""A batch beside an interactive client (issue 44, part 1).

    python -m bench batches [--lines 1000] [--rounds 3] [--alone-s 10] [--load-s 1.0]
                            [--tokens-per-s 200] [--max-tokens 8] [--think-s 0.05]

Each round starts a fresh corral with three fake models (a, b, c; a cold load takes
--load-s) and models_max 2. One interactive client asks model a, one request at a time,
--think-s apart: first alone for --alone-s, then beside a batch of --lines lines over
a, b and c in turn (OpenAI's Files and Batch APIs, lines_at_once 4), until the batch
is done. Measured: the interactive client's p50 and p99 alone and beside the batch, the
batch's time, and each model's loads while it ran (a, which the client keeps using,
should not be evicted; b and c should load once each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from actors.runtime import loop
from bench.common import machine, pct, send, session, write_json
from bench.support import Corral, fake_cmd, toml_config

MODELS = ("a", "b", "c")


def config(args: argparse.Namespace) -> str:
    cmd = fake_cmd("--load-delay", str(args.load_s), "--tokens-per-s", str(args.tokens_per_s))
    return toml_config({m: {"cmd": cmd} for m in MODELS}, models_max=2,
                       batches={"lines_at_once": 4})


def batch_input(n: int, max_tokens: int) -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODELS[i % 3], "max_tokens": max_tokens,
                 "messages": [{"role": "user", "content": f"line {i}"}]}}).encode() + b"\n"
        for i in range(n))


async def interactive(url: str, args: argparse.Namespace, done: asyncio.Event,
                      at_least_s: float) -> list[float]:
    """Latencies (s) of one client asking model a until `done` is set (and at least
    `at_least_s`)."""
    out: list[float] = []
    start = time.monotonic()
    async with session() as s:
        while not done.is_set() or time.monotonic() - start < at_least_s:
            r = await send(s, url, "a", max_tokens=args.max_tokens)
            assert r.status == 200, r
            out.append(r.latency_s)
            await asyncio.sleep(args.think_s)
    return out


async def loads(s: aiohttp.ClientSession, url: str) -> dict[str, int]:
    async with s.get(url + "/models") as resp:
        body = await resp.json()
    return {m["id"]: m["loads"] for m in body["data"]}


async def run_batch(url: str, args: argparse.Namespace, done: asyncio.Event) -> dict[str, Any]:
    async with session() as s:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", batch_input(args.lines, args.max_tokens), filename="in.jsonl")
        async with s.post(url + "/v1/files", data=form) as resp:
            f = await resp.json()
        before = await loads(s, url)
        start = time.monotonic()
        async with s.post(url + "/v1/batches", json={
                "input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h"}) as resp:
            batch = await resp.json()
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            await asyncio.sleep(0.2)
            async with s.get(f"{url}/v1/batches/{batch['id']}") as resp:
                batch = await resp.json()
        took = time.monotonic() - start
        after = await loads(s, url)
    done.set()
    return {"status": batch["status"], "counts": batch["request_counts"], "s": took,
            "loads": {m: after.get(m, 0) - before.get(m, 0) for m in MODELS}}


async def one_round(args: argparse.Namespace, home: Path) -> dict[str, Any]:
    c = Corral(config(args), home=home)
    try:
        async with session() as s:
            assert (await send(s, c.url, "a")).status == 200  # a is up, as a user's is
        alone_done = asyncio.Event()
        alone_done.set()
        alone = await interactive(c.url, args, alone_done, args.alone_s)
        done = asyncio.Event()
        beside, batch = await asyncio.gather(interactive(c.url, args, done, 0.0),
                                             run_batch(c.url, args, done))
    finally:
        c.stop()
    row = {"alone_p50_ms": statistics.median(alone) * 1e3, "alone_p99_ms": pct(alone, 0.99) * 1e3,
           "beside_p50_ms": statistics.median(beside) * 1e3,
           "beside_p99_ms": pct(beside, 0.99) * 1e3, "alone_n": len(alone),
           "beside_n": len(beside), "batch": batch}
    row["p99_ratio"] = row["beside_p99_ms"] / row["alone_p99_ms"]
    print(f"interactive p50 {row['alone_p50_ms']:.1f} -> {row['beside_p50_ms']:.1f} ms, "
          f"p99 {row['alone_p99_ms']:.1f} -> {row['beside_p99_ms']:.1f} ms "
          f"({row['p99_ratio']:.2f}x; {len(alone)} and {len(beside)} requests); batch "
          f"{batch['status']} {batch['counts']['completed']}/{batch['counts']['total']} in "
          f"{batch['s']:.1f} s, loads {batch['loads']}")
    return row


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            (home := Path(tmp) / f"round{i}").mkdir()
            rows.append(await one_round(args, home))
    ratios = [r["p99_ratio"] for r in rows]
    print(f"p99 beside / alone over {len(rows)} rounds: {min(ratios):.2f}x .. "
          f"{max(ratios):.2f}x")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench batches", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--alone-s", type=float, default=10.0)
    ap.add_argument("--load-s", type=float, default=1.0)
    ap.add_argument("--tokens-per-s", type=float, default=200.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--think-s", type=float, default=0.05)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = loop.run(run(args))
    write_json(args.json, {"bench": "batches", "machine": machine(),
                           "params": vars(args) | {"json": None}, "rounds": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
