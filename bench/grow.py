"""A fitted context growing beside itself (issue 44, part 3: `ctx = "fit"`).

    python -m bench grow [--rounds 3] [--load-s 1.0] [--every-s 0.02]

Per round, a fresh corral with a simulated 10 GiB device (1 GiB margin), a 6 GiB model
`a` and a model `b` (1 GiB, its KV cache 256 MiB per 1,024 tokens, ctx_min 2048,
ctx_max 32768; a fake child that refuses a prompt past its context as llama-server does,
and whose load takes --load-s). a and b are loaded: b gets 8,192 context beside a. a is
unloaded. A client asks b a short question every --every-s while one prompt of 10,000
tokens comes: b's child refuses it, and b grows beside itself to 20,480 (what fits with
the old child still up). Measured: how long from the refusal until the grown child
serves that prompt, and the short requests meanwhile (their answers, any that failed,
their latency against the same client's before the prompt came).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from actors.runtime import loop
from bench.common import machine, send, session, write_json
from bench.support import Corral, fake_cmd, toml_config

GPU = [{"name": "gpu0", "kind": "simulated", "total_mib": 10240}]
LONG = {"messages": [{"role": "user", "content": "word " * 10000}]}


def config(args: argparse.Namespace, home: Path) -> str:
    b = {"cmd": fake_cmd("--device-mib", "1024", "--ctx-mib-per-1k", "256", "--n-ctx",
                         "{ctx}", "--llama-protocol", "--load-delay", str(args.load_s)),
         "health": "llama", "measure": "command", "ctx": "fit", "ctx_min": 2048,
         "ctx_max": 32768}
    return toml_config({"a": {"cmd": fake_cmd("--device-mib", "6144")}, "b": b},
                       devices=GPU, models_max=0, memory_margin_mib=1024,
                       state_dir=str(home / "state"), device_poll_s=0.2,
                       http={"lease_linger_ms": 0})


async def ctx_of(s: aiohttp.ClientSession, url: str) -> int:
    async with s.get(url + "/models") as resp:
        models = {m["id"]: m for m in (await resp.json())["data"]}
    return int(models["b"].get("ctx") or 0)


async def client(s: aiohttp.ClientSession, url: str, every_s: float,
                 stop: asyncio.Event) -> list[tuple[float, int, float]]:
    """(when, status, latency) of each short request until `stop`."""
    out = []
    while not stop.is_set():
        r = await send(s, url, "b")
        out.append((time.perf_counter(), r.status, r.latency_s))
        await asyncio.sleep(every_s)
    return out


async def one_round(args: argparse.Namespace, home: Path) -> dict[str, Any]:
    c = Corral(config(args, home), home=home)
    try:
        async with session() as s:
            for model in ("a", "b"):
                assert (r := await send(s, c.url, model)).status == 200, r
            assert await ctx_of(s, c.url) == 8192
            async with s.post(c.url + "/models/unload", json={"model": "a"}) as resp:
                assert resp.status == 200, await resp.text()
            stop = asyncio.Event()
            shorts = asyncio.create_task(client(s, c.url, args.every_s, stop))
            await asyncio.sleep(1.0)  # (the client's latency before the prompt)
            came = time.perf_counter()
            refused = await send(s, c.url, "b", extra=LONG)
            assert refused.status == 400, refused
            while await ctx_of(s, c.url) != 20480:
                await asyncio.sleep(0.01)
            served = await send(s, c.url, "b", extra=LONG)
            grown = time.perf_counter() - came
            assert served.status == 200, served
            await asyncio.sleep(0.5)
            stop.set()
            answers = await shorts
    finally:
        c.stop()
    before = [lat for when, st, lat in answers if when < came and st == 200]
    during = [lat for when, st, lat in answers if came <= when <= came + grown and st == 200]
    failed = sum(st != 200 for _, st, _ in answers)
    return {"grown_s": grown, "shorts": len(answers), "failed": failed,
            "before_p50_s": statistics.median(before), "during_p50_s": statistics.median(during),
            "during_max_s": max(during), "during_n": len(during)}


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            (home := Path(tmp) / str(i)).mkdir()
            r = await one_round(args, home)
            rounds.append(r)
            print(f"round {i + 1}: the long prompt served {r['grown_s'] * 1e3:7.1f} ms after "
                  f"it came; {r['shorts']} short requests, {r['failed']} failed; during the "
                  f"growth p50 {r['during_p50_s'] * 1e3:5.1f} ms (max "
                  f"{r['during_max_s'] * 1e3:5.1f}, {r['during_n']} answers), before "
                  f"{r['before_p50_s'] * 1e3:5.1f} ms")
    return rounds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench grow", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load-s", type=float, default=1.0)
    ap.add_argument("--every-s", type=float, default=0.02)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rounds = loop.run(run(args))
    write_json(args.json, {"bench": "grow", "machine": machine(),
                           "params": vars(args) | {"json": None}, "rounds": rounds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
