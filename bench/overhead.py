"""What corral's proxy costs: the same requests straight to a child and through corral,
interleaved round by round in one run.

    python -m bench overhead [--rounds 3] [--requests 600] [--json FILE]
    python -m bench overhead --llama-server BIN     # also: corral vs llama-server's router
    python -m bench overhead --routers direct,corral  # without nginx (bench/nginx.py)
    python -m bench overhead --baseline REV         # also: the corral of git revision REV
    python -m bench overhead --journal-off          # instead: the journal's cost, on
                                                    # against off (bench/journal_cost.py)
    python -m bench overhead --journal-off --instructions   # the same in instructions,
                                                    # under valgrind (journal_instructions.py)

Small non-streaming requests (max_tokens 1) at concurrency 1, 16 and 64, and streams at
1, 64 and 256 at once from a child that streams at --tokens-per-s (a realistic rate).
Each round runs the direct and the corral case back to back, alternating which goes
first. Reports throughput ratios (through corral / direct), added p50/p99 latency and
time to first byte, and corral's CPU time per proxied request (from its process's CPU
time over its rounds). nginx, where it is installed, runs in front of the same children
(bench/nginx.py) as a third side, and a row puts corral against it. With --llama-server,
real llama-server children on tiny GGUF models answer the same requests through corral,
through nginx and through llama-server's own router.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from actors.runtime import loop
from bench import journal_cost, journal_instructions
from bench.common import (
    Result,
    baseline,
    cpu_seconds,
    get_json,
    lean_requests,
    llama_pair,
    machine,
    pct,
    send,
    session,
    summary_ms,
    write_json,
)
from bench.nginx import available as nginx_available
from bench.nginx import nginx
from bench.support import Corral, fake_cmd, toml_config


@dataclass
class Round:
    wall_s: float
    results: list[Result]
    cpu_s: float = 0.0

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.status == 200]


@dataclass
class Side:
    """Every round of one way of sending the requests."""

    rounds: list[Round] = field(default_factory=list)

    def rate(self, per: str = "requests") -> float:
        """The median over rounds of requests (or tokens) per second."""
        if per == "tokens":
            return statistics.median(sum(r.tokens for r in rd.ok) / rd.wall_s
                                     for rd in self.rounds)
        return statistics.median(len(rd.ok) / rd.wall_s for rd in self.rounds)

    def samples(self, what: str) -> list[float]:
        return [getattr(r, what) for rd in self.rounds for r in rd.ok]

    def errors(self) -> int:
        return sum(len(rd.results) - len(rd.ok) for rd in self.rounds)


async def run_round(s: aiohttp.ClientSession, url: str, model: str, n: int,
                    concurrency: int, *, stream: bool, max_tokens: int,
                    extra: dict[str, Any] | None = None,
                    cpu_of: tuple[int, ...] = ()) -> Round:
    """One round: streams through aiohttp (the token rate is the child's), small
    requests through `lean_requests` (the client's own CPU matters there)."""
    queue = list(range(n))
    results: list[Result] = []

    async def worker() -> None:
        while queue:
            queue.pop()
            results.append(await send(s, url, model, stream=stream, max_tokens=max_tokens,
                                      extra=extra))

    cpu0 = sum(map(cpu_seconds, cpu_of))
    start = time.perf_counter()
    if stream:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    else:
        results = await lean_requests(url, model, n, concurrency, max_tokens, extra)
    wall = time.perf_counter() - start
    cpu = sum(map(cpu_seconds, cpu_of)) - cpu0
    return Round(wall, results, cpu)


async def compare(s: aiohttp.ClientSession, targets: dict[str, tuple[str, str]],
                  rounds: int, n: int, concurrency: int, *, stream: bool, max_tokens: int,
                  extra: dict[str, Any] | None = None,
                  cpu: dict[str, tuple[int, ...]] | None = None) -> dict[str, Side]:
    """Interleaved rounds over `targets` (name -> (base URL, model)), order rotating;
    `cpu` names the processes (by pid) whose CPU time each side's rounds are charged."""
    sides = {name: Side() for name in targets}
    names = list(targets)
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            url, model = targets[name]
            sides[name].rounds.append(await run_round(
                s, url, model, n, concurrency, stream=stream, max_tokens=max_tokens,
                extra=extra, cpu_of=(cpu or {}).get(name, ())))
    return sides


def row(case: str, sides: dict[str, Side], base: str, other: str, per: str) -> dict[str, Any]:
    b, o = sides[base], sides[other]
    case = (f"{case} [{other} vs {base}]" if base not in ("direct", "llama-router")
            else case if other in ("corral", "llama-router") else f"{case} [{other}]")
    lat = "ttfb_s" if per == "tokens" else "latency_s"
    out: dict[str, Any] = {"case": case, "per": per, "base": base, "other": other,
                           base: b.rate(per), other: o.rate(per),
                           "ratio": o.rate(per) / b.rate(per) if b.rate(per) else 0.0}
    for q in (0.5, 0.99):
        key = f"added_{'ttfb' if per == 'tokens' else 'latency'}_p{int(q * 100)}_ms"
        out[key] = (pct(o.samples(lat), q) - pct(b.samples(lat), q)) * 1e3
    out[f"{base}_ms"] = summary_ms(b.samples(lat))
    out[f"{other}_ms"] = summary_ms(o.samples(lat))
    out["errors"] = {base: b.errors(), other: o.errors()}
    for name, side in ((base, b), (other, o)):
        cpu_rounds = [rd for rd in side.rounds if rd.cpu_s]
        if cpu_rounds:  # per request, or per token for the streams
            served = sum(len(rd.ok) if per == "requests" else sum(r.tokens for r in rd.ok)
                         for rd in cpu_rounds)
            out[f"{name}_cpu_us_per_{per[:-1]}"] = (sum(rd.cpu_s for rd in cpu_rounds)
                                                    / max(served, 1) * 1e6)
    return out


def print_rows(rows: list[dict[str, Any]], base: str, other: str) -> None:
    """One line per row; CPU is microseconds per request (per token for streams) of the
    process behind each side, where it is measured."""
    print(f"{'case':<36} {base:>12} {other:>12} {'ratio':>7} {'+p50 ms':>8} {'+p99 ms':>8}"
          f" {'cpu us':>14}")
    for r in rows:
        unit = "tok/s" if r["per"] == "tokens" else "req/s"
        p50 = next(v for k, v in r.items() if k.startswith("added_") and k.endswith("p50_ms"))
        p99 = next(v for k, v in r.items() if k.startswith("added_") and k.endswith("p99_ms"))
        per = r["per"][:-1]
        cpus = [r.get(f"{r[side]}_cpu_us_per_{per}") for side in ("base", "other")]
        cpu = " / ".join("-" if c is None else f"{c:.1f}" if per == "token" else f"{c:.0f}"
                         for c in cpus) if any(c is not None for c in cpus) else "-"
        print(f"{r['case'] + ' (' + unit + ')':<36} {r[r['base']]:>12,.0f} "
              f"{r[r['other']]:>12,.0f} "
              f"{r['ratio']:>7.3f} {p50:>8.2f} {p99:>8.2f} {cpu:>14}")


def fake_config(args: argparse.Namespace, **top: Any) -> str:
    return toml_config({"small": {"cmd": fake_cmd()},
                        "stream": {"cmd": fake_cmd("--tokens-per-s", str(args.tokens_per_s))}},
                       models_max=2, **top)


async def fake_side_by_side(args: argparse.Namespace) -> list[dict[str, Any]]:
    toml = fake_config(args)
    rows = []
    with Corral(toml, log_level="WARNING") as corral, contextlib.ExitStack() as stack:
        # --baseline: the corral of another revision, in the same run
        old = (stack.enter_context(Corral(toml, root=args.baseline_root,
                                                   log_level="WARNING"))
               if args.baseline_root else None)
        async with session() as s:
            for model in ("small", "stream"):  # load both; learn their children's ports
                await send(s, corral.url, model)
                if old:
                    await send(s, old.url, model)
            listing = await get_json(s, corral.url + "/models")
            ports = {m["id"]: m["port"] for m in listing["data"]}
            cpu = {"corral": corral.pids()}  # (its journal's writer too)
            if old:
                cpu["corral-baseline"] = old.pids()
            fronts = {model: stack.enter_context(nginx(f"127.0.0.1:{ports[model]}",
                                                       workers=args.nginx_workers,
                                                       keepalive=args.nginx_keepalive))
                      for model in ("small", "stream") if with_nginx(args)}
            if fronts:  # (its workers are forked at its start: their pids stay)
                cpu["nginx"] = tuple(p for f in fronts.values() for p in f.pids())

            def targets(model: str) -> dict[str, tuple[str, str]]:
                out = {"direct": (f"http://127.0.0.1:{ports[model]}", model),
                       "corral": (corral.url, model)}
                if old:
                    out["corral-baseline"] = (old.url, model)
                if fronts:
                    out["nginx"] = (fronts[model].url, model)
                return out

            others = ["corral"] + (["corral-baseline"] if old else []) + (
                ["nginx"] if fronts else [])
            for c in args.concurrency:
                sides = await compare(s, targets("small"), args.rounds,
                                      max(args.requests, c), c, stream=False, max_tokens=1,
                                      cpu=cpu)
                rows += side_rows(f"small c={c}", sides, others, "requests")
            n_tokens = int(args.tokens_per_s * args.stream_seconds)
            for n in args.streams:
                sides = await compare(s, targets("stream"), args.rounds, n, n, stream=True,
                                      max_tokens=n_tokens, cpu=cpu)
                rows += side_rows(f"streams n={n}", sides, others, "tokens")
    return rows


def with_nginx(args: argparse.Namespace) -> bool:
    """nginx is asked for, and there (else the bench says so once and goes on)."""
    if "nginx" not in args.routers:
        return False
    if nginx_available() is None:
        if not getattr(args, "said_no_nginx", False):
            print("nginx is not installed: no nginx side (apt install nginx-light)")
            args.said_no_nginx = True
        return False
    return True


def side_rows(case: str, sides: dict[str, Side], others: list[str],
              per: str) -> list[dict[str, Any]]:
    """Each side against direct, then corral against nginx (when it ran), printed."""
    rows = [row(case, sides, "direct", other, per) for other in others]
    if "nginx" in sides:
        rows.append(row(case, sides, "nginx", "corral", per))
    print_rows(rows, "direct", "corral")
    return rows


async def llama_side_by_side(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Tiny GGUF models behind corral and behind llama-server's own router."""
    rows = []
    async with llama_pair(args.llama_server, models_max=2,
                          baseline_root=args.baseline_root) as (urls, cpu), session() as s, \
            contextlib.AsyncExitStack() as stack:
        targets = {name: (url, "m0") for name, url in urls.items()}
        for url, model in targets.values():
            await send(s, url, model)  # load
        if with_nginx(args):  # in front of the child corral serves m0 with
            listing = await get_json(s, urls["corral"] + "/models")
            port = next(m["port"] for m in listing["data"] if m["id"] == "m0")
            front = stack.enter_context(nginx(f"127.0.0.1:{port}", workers=args.nginx_workers,
                                              keepalive=args.nginx_keepalive))
            targets["nginx"], cpu = (front.url, "m0"), {**cpu, "nginx": front.pids()}
        others = [name for name in targets if name.startswith("corral") or name == "nginx"]

        def against_router(case: str, sides: dict[str, Side], per: str) -> None:
            nonlocal rows
            made = [row(case, sides, "llama-router", o, per) for o in others]
            if "nginx" in sides:
                made.append(row(case, sides, "nginx", "corral", per))
            print_rows(made, "llama-router", "corral")
            rows += made
        for c in args.concurrency:
            sides = await compare(s, targets, args.rounds, max(args.requests // 2, c), c,
                                  stream=False, max_tokens=1, cpu=cpu)
            against_router(f"llama small c={c}", sides, "requests")
        for n in (1, 16):
            sides = await compare(s, targets, args.rounds, n, n, stream=True, max_tokens=200,
                                  extra={"ignore_eos": True}, cpu=cpu)
            against_router(f"llama streams n={n}", sides, "tokens")
    return rows


def _counts(v: str) -> list[int]:
    """A comma-separated list of counts; 0 leaves its cases out."""
    return [n for n in map(int, v.split(",")) if n > 0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=600, help="small requests per round")
    ap.add_argument("--concurrency", type=_counts, default=[1, 16, 64])
    ap.add_argument("--streams", type=_counts, default=[1, 64, 256],
                    help="streams at once, one case each (0: no stream case)")
    ap.add_argument("--tokens-per-s", type=float, default=30.0, help="per stream")
    ap.add_argument("--stream-seconds", type=float, default=4.0)
    ap.add_argument("--llama-server", metavar="BIN")
    ap.add_argument("--routers", type=lambda v: v.split(","),
                    default=["direct", "corral", "nginx"],
                    help="nginx is a side where it is named and installed")
    ap.add_argument("--nginx-workers", type=int, default=1,
                    help="nginx's worker processes: as many as corral's fronts (1 here)")
    ap.add_argument("--nginx-keepalive", type=int, default=64,
                    help="idle connections nginx keeps to a child (see bench/README.md: a "
                         "llama-server child needs fewer than its HTTP threads)")
    ap.add_argument("--baseline", metavar="REV",
                    help="also the corral of git revision REV (a worktree), side by side")
    ap.add_argument("--journal-off", action="store_true",
                    help="instead: corral with its journal against corral without it (and "
                         "against a control without it), in --pairs sets of processes")
    ap.add_argument("--pairs", type=int, default=9, help="with --journal-off")
    ap.add_argument("--instructions", action="store_true",
                    help="with --journal-off: instructions a request, counted under "
                         "valgrind, on against off, --rounds times each "
                         "(bench/journal_instructions.py)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.journal_off and args.instructions:
        write_json(args.json, {"bench": "overhead --journal-off --instructions",
                               "machine": machine(), "params": {
                                   k: v for k, v in vars(args).items() if k != "json"},
                               "result": journal_instructions.run(args)})
        return 0
    if args.journal_off:
        write_json(args.json, {"bench": "overhead --journal-off", "machine": machine(),
                               "params": {k: v for k, v in vars(args).items() if k != "json"},
                               "rows": _run(journal_cost.run(args, fake_config))})
        return 0
    with baseline(args.baseline) as args.baseline_root:
        rows = _run(fake_side_by_side(args))
        if args.llama_server:
            rows += _run(llama_side_by_side(args))
    write_json(args.json, {"bench": "overhead", "machine": machine(),
                           "params": {k: v for k, v in vars(args).items()
                                      if k not in ("json", "baseline_root")},
                           "rows": rows})
    return 0


_run = loop.run
