"""How much one corral process carries before its own CPU is the limit.

    python -m bench ceiling [--streams 64,256,512,1024] [--children 4] [--tokens-per-s 50]

Streams: N streams at once, spread over `--children` fake children that stream at
`--tokens-per-s` (a realistic rate), read by a lean client (a raw protocol that counts
events, so the client takes as little of the CPU corral shares with it as it can). For
each N: the tokens per second delivered against the N x rate asked for, corral's CPU per
token, and how much of a core corral used (its process CPU over the wall time). Corral
carries N while its share of a core stays below 1 and delivery keeps up; where the machine
runs out first (the children and the client need CPU too, and this is one small machine),
the one-core figure is 1 s / corral's CPU per token / the rate, which is what the table
calls "streams per core".

Small requests: corral's CPU per request at concurrency 1, 16 and 64 from the lean client
and from an aiohttp client (its parser and session cost more CPU, which a small machine
takes from corral), and the requests per second one core of corral carries (1 s / CPU per
request).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import psutil

from actors.runtime import loop
from bench.common import cpu_seconds, lean_requests, machine, send, session, write_json
from bench.support import Corral, fake_cmd, toml_config


def cpu_of(corral: Corral) -> float:
    """corral's CPU time so far: its process and its front workers' (http.workers)."""
    workers = []
    for p in psutil.Process(corral.proc.pid).children():
        with contextlib.suppress(psutil.Error):
            if "actors.http.worker" in " ".join(p.cmdline()):
                workers.append(p.pid)
    return sum(cpu_seconds(pid) for pid in [corral.proc.pid, *workers])


class _StreamCounter(asyncio.Protocol):
    """One streamed chat completion on its own connection: counts the events it gets."""

    def __init__(self, done: asyncio.Future[int]) -> None:
        self.done = done
        self.events = 0
        self.tail = b""

    def data_received(self, data: bytes) -> None:
        joined = self.tail + data
        self.events += joined.count(b"data: {")
        self.tail = joined[-8:]  # an event split across reads is counted once
        self.events -= self.tail.count(b"data: {")
        if b"data: [DONE]" in joined and not self.done.done():
            self.events += self.tail.count(b"data: {")
            self.done.set_result(self.events)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(self.events)


async def one_stream(host: str, port: int, model: str, tokens: int) -> int:
    body = json.dumps({"model": model, "stream": True, "max_tokens": tokens,
                       "messages": [{"role": "user", "content": "hi"}]})
    raw = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
           f"Connection: close\r\n\r\n{body}").encode()
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    transport, _ = await asyncio.get_running_loop().create_connection(
        lambda: _StreamCounter(done), host, port)
    transport.write(raw)
    try:
        return await done
    finally:
        transport.close()


async def streams_at(corral: Corral, models: list[str], n: int, rate: float,
                     seconds: float) -> dict[str, Any]:
    tokens = int(rate * seconds)
    host, port = "127.0.0.1", corral.port
    cpu0, start = cpu_of(corral), time.perf_counter()
    got = await asyncio.gather(*(one_stream(host, port, models[i % len(models)], tokens)
                                 for i in range(n)))
    wall = time.perf_counter() - start
    cpu = cpu_of(corral) - cpu0
    delivered = sum(got)
    return {"streams": n, "asked_tok_s": n * rate, "delivered_tok_s": delivered / wall,
            "share_of_asked": delivered / (n * tokens), "corral_cores": cpu / wall,
            "corral_cpu_us_per_token": cpu / max(delivered, 1) * 1e6,
            "streams_per_core": 1e6 / (cpu / max(delivered, 1) * 1e6) / rate}


async def small_at(corral: Corral, c: int, n: int, lean: bool) -> dict[str, Any]:
    cpu0, start = cpu_of(corral), time.perf_counter()
    if lean:
        results = await lean_requests(corral.url, "small", n, c, 1)
    else:
        async with session() as s:
            left = [n]
            results = []

            async def worker() -> None:
                while left[0] > 0:
                    left[0] -= 1
                    results.append(await send(s, corral.url, "small"))
            await asyncio.gather(*(worker() for _ in range(c)))
    wall = time.perf_counter() - start
    cpu = cpu_of(corral) - cpu0
    ok = sum(r.status == 200 for r in results)
    return {"client": "lean" if lean else "aiohttp", "concurrency": c,
            "req_s": ok / wall, "corral_cpu_us_per_request": cpu / max(ok, 1) * 1e6,
            "corral_cores": cpu / wall, "req_s_per_core": max(ok, 1) / cpu if cpu else 0.0}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    models = [f"s{i}" for i in range(args.children)]
    table = {m: {"cmd": fake_cmd("--tokens-per-s", str(args.tokens_per_s))} for m in models}
    table["small"] = {"cmd": fake_cmd()}
    out: dict[str, Any] = {"streams": [], "small": []}
    with contextlib.ExitStack() as stack:
        corrals = {w: stack.enter_context(Corral(toml_config(
            table, models_max=len(table), http={"workers": w}), log_level="WARNING"))
            for w in args.workers}
        async with session() as s:
            for corral in corrals.values():
                for m in table:
                    assert (await send(s, corral.url, m)).status == 200
        for n in args.streams:
            for w, corral in corrals.items():  # side by side, one after the other
                row = {"workers": w} | await streams_at(corral, models, n, args.tokens_per_s,
                                                        args.seconds)
                out["streams"].append(row)
                print(f"workers {w}  {n:>5} streams: {row['delivered_tok_s']:>8,.0f} tok/s of "
                      f"{row['asked_tok_s']:>8,.0f} asked "
                      f"({row['delivered_tok_s'] / row['asked_tok_s']:.2f}; tokens delivered: "
                      f"{row['share_of_asked']:.3f}), "
                      f"corral {row['corral_cpu_us_per_token']:.1f} us/token, "
                      f"{row['corral_cores']:.2f} cores; one core: "
                      f"{row['streams_per_core']:,.0f} streams")
        for lean in (True, False):
            for c in args.concurrency:
                for w, corral in corrals.items():
                    row = {"workers": w} | await small_at(corral, c, args.requests, lean)
                    out["small"].append(row)
                    print(f"workers {w}  small c={c:<3} {row['client']:>7} client: "
                          f"{row['req_s']:>7,.0f} req/s, corral "
                          f"{row['corral_cpu_us_per_request']:.0f} us/request, "
                          f"{row['corral_cores']:.2f} cores; one core: "
                          f"{row['req_s_per_core']:,.0f} req/s")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench ceiling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    ap.add_argument("--streams", type=ints, default=[64, 256, 512, 1024])
    ap.add_argument("--children", type=int, default=4)
    ap.add_argument("--tokens-per-s", type=float, default=50.0)
    ap.add_argument("--seconds", type=float, default=4.0, help="each stream's length")
    ap.add_argument("--concurrency", type=ints, default=[1, 16, 64])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--workers", type=ints, default=[1],
                    help="http.workers of each corral compared (e.g. 1,2)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        figures = loop.run(run(args))
        write_json(args.json, {"bench": "ceiling", "machine": machine(),
                               "params": vars(args) | {"json": None}, **figures})
    return 0
