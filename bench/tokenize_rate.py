"""The proxy's ceiling with real llama-server children: POST /tokenize (no model work) on a
tiny GGUF model, straight to corral's child, through llama-server's router and through
corral, interleaved round by round in one run.

    python -m bench tokenize --llama-server BIN [--rounds 3] [--seconds 3] [--baseline REV]

Load comes from wrk when it is on PATH (C: it takes little of the CPU the servers share
with it on a small machine), else from bench's lean client. Reports req/s per target and
concurrency, and corral's ratio to the router and to direct.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.common import baseline, get_json, lean_requests, llama_pair, machine, send, session
from bench.common import write_json as write_json_file

BODY = {"model": "m0", "content": "hello world, how are you today?"}


def wrk_rate(url: str, concurrency: int, seconds: int, script: Path) -> float:
    out = subprocess.run(["wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s", "-s",
                          str(script), url + "/tokenize"],
                         capture_output=True, text=True, timeout=seconds + 30).stdout
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if match is None or errors is not None:
        raise RuntimeError(f"wrk against {url} failed:\n{out}")
    return float(match.group(1))


async def lean_rate(url: str, concurrency: int, seconds: float) -> float:
    n = max(concurrency * 20, int(seconds * 1000))
    start = asyncio.get_running_loop().time()
    results = await lean_requests(url, "m0", n, concurrency, path="/tokenize", body=BODY)
    took = asyncio.get_running_loop().time() - start
    if any(r.status != 200 for r in results):
        raise RuntimeError(f"{url}: {sum(r.status != 200 for r in results)} failed requests")
    return len(results) / took


async def run(args: argparse.Namespace) -> dict[str, Any]:
    use_wrk = shutil.which("wrk") is not None and not args.lean
    rates: dict[str, dict[int, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(f"wrk.method = 'POST'\nwrk.body = '{json.dumps(BODY)}'\n"
                          "wrk.headers['Content-Type'] = 'application/json'\n")
        async with llama_pair(args.llama_server, models_max=1, n_models=1,
                              baseline_root=args.baseline_root) as (urls, _), session() as s:
            for url in urls.values():
                await send(s, url, "m0")  # load
            listing = await get_json(s, urls["corral"] + "/models")
            port = next(m["port"] for m in listing["data"] if m["id"] == "m0")
            targets = {"direct": f"http://127.0.0.1:{port}", **urls}
            for c in args.concurrency:
                for r in range(args.rounds):
                    names = list(targets)
                    names = names[r % len(names):] + names[:r % len(names)]  # rotate order
                    for name in names:
                        rate = (await asyncio.to_thread(wrk_rate, targets[name], c,
                                                        args.seconds, script)
                                if use_wrk else await lean_rate(targets[name], c, args.seconds))
                        rates.setdefault(name, {}).setdefault(c, []).append(rate)
                med = {name: statistics.median(rates[name][c]) for name in targets}
                print(f"c={c:<3} " + "  ".join(f"{n} {v:,.0f}/s" for n, v in med.items())
                      + f"  corral/router {med['corral'] / med['llama-router']:.2f}"
                      f"  corral/direct {med['corral'] / med['direct']:.2f}", flush=True)
    return {"client": "wrk" if use_wrk else "lean", "req_per_s": rates}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench tokenize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", metavar="BIN", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")],
                    default=[1, 16, 64])
    ap.add_argument("--lean", action="store_true", help="bench's lean client even with wrk")
    ap.add_argument("--baseline", metavar="REV",
                    help="also the corral of git revision REV (a worktree), side by side")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    with baseline(args.baseline) as args.baseline_root:
        result = asyncio.run(run(args))
    write_json_file(args.json, {"bench": "tokenize", "machine": machine(),
                                "params": {k: v for k, v in vars(args).items()
                                           if k not in ("json", "baseline_root")},
                                **result})
    return 0
