"""Context sized by the ledger against a fixed one (issue 44, part 3).

    python -m bench context [--turns 10] [--load-s 1.0]

Two corrals side by side, each with a simulated 10 GiB device (1 GiB margin), a 3 GiB
model `a` and a model `b` of 1 GiB whose KV cache takes 256 MiB per 1,024 tokens: in
one, b has `ctx = 32768` (9 GiB: it cannot stay beside a); in the other `ctx = "fit"`
(ctx_min 2048, ctx_max 32768). One agent per corral at the same time asks a, then b, in
turn. Measured: each turn's time to the answer of b and of a, the loads, and the
context b ran with.
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

GPU = [{"name": "gpu0", "kind": "simulated", "total_mib": 10240}]


def config(args: argparse.Namespace, home: Path, ctx: int | str) -> str:
    delay = ("--load-delay", str(args.load_s))
    b: dict[str, Any] = {"cmd": fake_cmd("--device-mib", "1024", "--ctx-mib-per-1k", "256",
                                         "--n-ctx", "{ctx}", *delay), "ctx": ctx}
    if ctx == "fit":
        b |= {"ctx_min": 2048, "ctx_max": 32768}
    return toml_config({"a": {"cmd": fake_cmd("--device-mib", "3072", *delay)}, "b": b},
                       devices=GPU, models_max=0, memory_margin_mib=1024,
                       state_dir=str(home / "state"), device_poll_s=0.2,
                       http={"lease_linger_ms": 0})


async def agent(url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    took: dict[str, list[float]] = {"a": [], "b": []}
    async with session() as s:
        for _ in range(args.turns):
            for model in ("a", "b"):
                r = await send(s, url, model)
                assert r.status == 200, r
                took[model].append(r.latency_s)
        async with s.get(url + "/models") as resp:
            models = {m["id"]: m for m in (await resp.json())["data"]}
    return took | {"loads": [models[m]["loads"] for m in ("a", "b")],
                   "ctx": [models["b"].get("ctx") or 0]}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        corrals: dict[str, Corral] = {}
        try:
            for name, ctx in (("fixed 32768", 32768), ("fit", "fit")):
                (home := Path(tmp) / name.split()[0]).mkdir()
                corrals[name] = Corral(config(args, home, ctx), home=home)
            results = await asyncio.gather(*(agent(c.url, args) for c in corrals.values()))
        finally:
            for c in corrals.values():
                c.stop()
    out = {}
    for name, r in zip(corrals, results, strict=True):
        out[name] = r
        print(f"ctx {name:>11}: b's answer p50 {statistics.median(r['b']) * 1e3:7.1f} ms, "
              f"a's {statistics.median(r['a']) * 1e3:7.1f} ms; loads a {r['loads'][0]}, "
              f"b {r['loads'][1]}; b's context {r['ctx'][0] or name.split()[-1]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench context", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--load-s", type=float, default=1.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    result = loop.run(run(args))
    write_json(args.json, {"bench": "context", "machine": machine(),
                           "params": vars(args) | {"json": None}, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
