"""The proxy's ceiling with real llama-server children: POST /tokenize (no model work) on a
tiny GGUF model, straight to corral's child, through llama-server's router, through
nginx in front of that same child (bench/nginx.py) and through corral, interleaved round
by round in one run; `floor` adds bench/floor.py, a relay in Python that only passes
bytes, to show how much of corral's cost is the language's.

    python -m bench tokenize --llama-server BIN [--rounds 3] [--seconds 3] [--baseline REV]
                             [--routers direct,llama-router,nginx,corral[,floor]]

Load comes from wrk when it is on PATH (C: it takes little of the CPU the servers share
with it on a small machine), else from bench's lean client. Reports, per target and
concurrency, req/s, the proxy's CPU per request (its own processes: corral's front and
workers, the router, nginx's master and workers; never the child's) and, with wrk, p50
and p99 latency added to direct's; then corral's ratios to nginx, the router and direct.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from bench.common import (
    baseline,
    cpu_seconds,
    get_json,
    lean_requests,
    llama_pair,
    machine,
    send,
    session,
)
from bench.common import write_json as write_json_file
from bench.floor import floor
from bench.nginx import available as nginx_available
from bench.nginx import nginx

BODY = {"model": "m0", "content": "hello world, how are you today?"}


UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def wrk_rate(url: str, concurrency: int, seconds: int, script: Path) -> Rate:
    out = subprocess.run(["wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s", "--latency",
                          "-s", str(script), url + "/tokenize"],
                         capture_output=True, text=True, timeout=seconds + 30).stdout
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if match is None or errors is not None:
        raise RuntimeError(f"wrk against {url} failed:\n{out}")
    latency = {int(p): float(v) * UNITS[u]
               for p, v, u in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)}
    return Rate(float(match.group(1)), latency.get(50), latency.get(99))


class Rate(NamedTuple):
    per_s: float
    p50_ms: float | None = None
    p99_ms: float | None = None


async def lean_rate(url: str, concurrency: int, seconds: float) -> Rate:
    n = max(concurrency * 20, int(seconds * 1000))
    start = asyncio.get_running_loop().time()
    results = await lean_requests(url, "m0", n, concurrency, path="/tokenize", body=BODY)
    took = asyncio.get_running_loop().time() - start
    if any(r.status != 200 for r in results):
        raise RuntimeError(f"{url}: {sum(r.status != 200 for r in results)} failed requests")
    return Rate(len(results) / took)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    use_wrk = shutil.which("wrk") is not None and not args.lean
    rates: dict[str, dict[int, list[Rate]]] = {}
    cpu_us: dict[str, dict[int, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        script = Path(tmp) / "post.lua"
        script.write_text(f"wrk.method = 'POST'\nwrk.body = '{json.dumps(BODY)}'\n"
                          "wrk.headers['Content-Type'] = 'application/json'\n")
        async with llama_pair(args.llama_server, models_max=1, n_models=1,
                              baseline_root=args.baseline_root) as (urls, pids), session() as s:
            for url in urls.values():
                await send(s, url, "m0")  # load
            listing = await get_json(s, urls["corral"] + "/models")
            port = next(m["port"] for m in listing["data"] if m["id"] == "m0")
            targets = {"direct": f"http://127.0.0.1:{port}", **urls}
            cpu_of = dict(pids)
            if "nginx" in args.routers:
                if nginx_available() is None:
                    print("nginx is not installed: no nginx side (apt install nginx-light)")
                else:  # as many workers as corral has fronts
                    front = stack.enter_context(nginx(f"127.0.0.1:{port}",
                                                      workers=args.nginx_workers,
                                                      keepalive=args.nginx_keepalive))
                    targets["nginx"], cpu_of["nginx"] = front.url, front.pids()
            if "floor" in args.routers:  # a relay in Python that does nothing else
                targets["floor"], pid = stack.enter_context(floor(f"127.0.0.1:{port}"))
                cpu_of["floor"] = (pid,)
            targets = {n: u for n, u in targets.items()
                       if n in args.routers or n == "corral-baseline"}
            for c in args.concurrency:
                for r in range(args.rounds):
                    names = list(targets)
                    names = names[r % len(names):] + names[:r % len(names)]  # rotate order
                    for name in names:
                        cpu0 = sum(map(cpu_seconds, cpu_of.get(name, ())))
                        rate = (await asyncio.to_thread(wrk_rate, targets[name], c,
                                                        args.seconds, script)
                                if use_wrk else await lean_rate(targets[name], c, args.seconds))
                        cpu = sum(map(cpu_seconds, cpu_of.get(name, ()))) - cpu0
                        rates.setdefault(name, {}).setdefault(c, []).append(rate)
                        if name in cpu_of:
                            cpu_us.setdefault(name, {}).setdefault(c, []).append(
                                cpu / (rate.per_s * args.seconds) * 1e6)
                print(summary(c, rates, cpu_us), flush=True)
    return {"client": "wrk" if use_wrk else "lean",
            "req_per_s": {n: {c: [r.per_s for r in rs] for c, rs in by.items()}
                          for n, by in rates.items()},
            "p50_ms": {n: {c: [r.p50_ms for r in rs] for c, rs in by.items()}
                       for n, by in rates.items()},
            "p99_ms": {n: {c: [r.p99_ms for r in rs] for c, rs in by.items()}
                       for n, by in rates.items()},
            "cpu_us_per_request": cpu_us}


def summary(c: int, rates: dict[str, dict[int, list[Rate]]],
            cpu_us: dict[str, dict[int, list[float]]]) -> str:
    """One concurrency's medians: each target's req/s, CPU and added latency, then
    corral's ratios (req/s, and CPU per request) to the others."""
    med = {n: statistics.median(r.per_s for r in by[c]) for n, by in rates.items()}
    cpu = {n: statistics.median(by[c]) for n, by in cpu_us.items()}

    def added(name: str, p: str) -> str:
        ours = [getattr(r, p) for r in rates[name][c]]
        theirs = [getattr(r, p) for r in rates.get("direct", {}).get(c, [])]
        if None in ours or not theirs or None in theirs:
            return ""
        return f" {statistics.median(ours) - statistics.median(theirs):+.2f}ms"
    parts = [f"{n} {v:,.0f}/s" + (f" {cpu[n]:.0f}us" if n in cpu else "")
             + (added(n, "p50_ms") + "/" + added(n, "p99_ms").strip()
                if n != "direct" and added(n, "p50_ms") else "") for n, v in med.items()]
    ratios = [f"corral/{n} {med['corral'] / v:.2f}"
              + (f" (cpu {cpu['corral'] / cpu[n]:.2f})" if n in cpu and "corral" in cpu
                 else "") for n, v in med.items() if n != "corral" and "corral" in med]
    return f"c={c:<3} " + "  ".join(parts) + "\n      " + "  ".join(ratios)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench tokenize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", metavar="BIN", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")],
                    default=[1, 16, 64])
    ap.add_argument("--lean", action="store_true", help="bench's lean client even with wrk")
    ap.add_argument("--routers", type=lambda v: v.split(","),
                    default=["direct", "llama-router", "nginx", "corral"],
                    help="the targets, of direct, llama-router, nginx, corral and floor "
                         "(bench/floor.py: the least a relay in Python does)")
    ap.add_argument("--nginx-workers", type=int, default=1,
                    help="nginx's worker processes: as many as corral's fronts (http.workers, "
                         "1 here)")
    ap.add_argument("--nginx-keepalive", type=int, default=64,
                    help="idle connections nginx keeps to the child (see bench/README.md)")
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
