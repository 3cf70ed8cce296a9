"""The cost of a cold start and of swapping models, side by side.

    python -m bench swap [--runs 20] [--json FILE]
    python -m bench swap --llama-server BIN     # also corral vs llama-server's router
    python -m bench swap --suspend [--rounds 3] [--runs 8]

1. Cold start: request -> first byte for an unloaded model through corral, against the
   same child started by the bench itself (spawn -> its readiness -> the same request),
   interleaved run by run; corral's share is the difference of the medians. Measured
   with a child that announces readiness on stdout (llama protocol) and with one that
   is polled on /health (http readiness, corral polls from 10 ms backing off).
2. Swap: two models, models_max 1, requests alternating between them one at a time, so
   every request stops one child and starts the other.
With --llama-server: both, on real llama-server children with tiny GGUF models, through
corral and through llama-server's own router (same models, same requests).
With --suspend (issue 23): the swap of 2., with models_max 2 and two fake vLLM children
that do not fit on one simulated device together (a cold load takes --load-s, a wake
--wake-s), on two corrals at once: one that stops the model it evicts, one that suspends
it (`suspend = "vllm"`, `suspend_when = "always"`); their swaps alternate, one at a time,
--runs of each a round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from actors.childproc import pick_port
from actors.runtime import loop
from bench.common import (
    get_json,
    llama_pair,
    machine,
    send,
    session,
    summary_ms,
    wait_up,
    write_json,
)
from bench.support import Corral, fake_cmd, toml_config

PUSH = fake_cmd("--llama-protocol")


async def unload(s: aiohttp.ClientSession, url: str, model: str) -> None:
    async with s.post(url + "/models/unload", json={"model": model}) as resp:
        await resp.read()
    for _ in range(1000):
        listing = await get_json(s, url + "/models")
        status = next(m["status"]["value"] for m in listing["data"] if m["id"] == model)
        if status == "unloaded":
            return
        await asyncio.sleep(0.01)
    raise RuntimeError(f"{model} did not unload")


async def direct_cold(s: aiohttp.ClientSession, cmd: list[str], push: bool) -> float:
    """Spawn the child ourselves, wait for its readiness, send the request: first byte."""
    port = pick_port()
    argv = [a.replace("{host}", "127.0.0.1").replace("{port}", str(port))
            .replace("{model}", "m") for a in cmd]
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE,
                                                stdin=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        if push:
            assert proc.stdout is not None
            while b'"state": "ready"' not in await proc.stdout.readline():
                pass
        else:  # the best a poller can do: every millisecond
            await wait_up(s, url, every_s=0.001)
        result = await send(s, url, "m")
        assert result.status == 200, result
        return time.perf_counter() - start - result.latency_s + result.ttfb_s
    finally:
        proc.kill()
        await proc.wait()


async def corral_cold(s: aiohttp.ClientSession, url: str, model: str) -> float:
    await unload(s, url, model)
    result = await send(s, url, model)
    assert result.status == 200, result
    return result.ttfb_s


async def swaps(s: aiohttp.ClientSession, url: str, models: list[str], runs: int,
                extra: dict[str, Any] | None = None) -> list[float]:
    out = []
    for i in range(runs + 1):
        result = await send(s, url, models[i % 2], extra=extra)
        assert result.status == 200, result
        if i:  # the first only loads
            out.append(result.ttfb_s)
    return out


async def fake_runs(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, cmd, health in (("push", PUSH, "llama"), ("http", fake_cmd(), "http")):
        toml = toml_config({"m": {"cmd": cmd, "health": health}}, models_max=1)
        with Corral(toml, log_level="WARNING") as corral:
            async with session() as s:
                direct, through = [], []
                for _ in range(args.runs):
                    direct.append(await direct_cold(s, cmd, push=health == "llama"))
                    through.append(await corral_cold(s, corral.url, "m"))
        share = statistics.median(through) - statistics.median(direct)
        out[f"cold_{label}"] = {"direct_ms": summary_ms(direct),
                                "corral_ms": summary_ms(through),
                                "corral_share_ms": share * 1e3}
        print(f"cold start ({label} readiness): direct p50 {statistics.median(direct) * 1e3:.1f}"
              f" ms, through corral p50 {statistics.median(through) * 1e3:.1f} ms: "
              f"corral's share {share * 1e3:.2f} ms")
    toml = toml_config({m: {"cmd": PUSH, "health": "llama"} for m in "ab"}, models_max=1)
    with Corral(toml, log_level="WARNING") as corral:
        async with session() as s:
            samples = await swaps(s, corral.url, ["a", "b"], args.runs)
    out["swap"] = {"corral_ms": summary_ms(samples)}
    print(f"swap at models_max 1 (fake, push readiness): p50 "
          f"{statistics.median(samples) * 1e3:.1f} ms, p99 {summary_ms(samples)['p99']:.1f} ms")
    return out


async def llama_runs(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with llama_pair(args.llama_server, models_max=1) as (urls, _), session() as s:
        cold: dict[str, list[float]] = {k: [] for k in urls}
        swap: dict[str, list[float]] = {}
        for i in range(args.runs):
            for name in list(urls)[i % 2:] + list(urls)[:i % 2]:
                await send(s, urls[name], "m0")
                cold[name].append(await corral_cold(s, urls[name], "m0"))
        for name in urls:
            swap[name] = await swaps(s, urls[name], ["m0", "m1"], args.runs)
    for name in urls:
        out[f"llama_{name}"] = {"cold_ms": summary_ms(cold[name]),
                                "swap_ms": summary_ms(swap[name])}
        print(f"{name:<13} cold start p50 {statistics.median(cold[name]) * 1e3:7.1f} ms"
              f", swap p50 {statistics.median(swap[name]) * 1e3:7.1f} ms, p99 "
              f"{summary_ms(swap[name])['p99']:7.1f} ms")
    return out


def suspend_config(args: argparse.Namespace, home: Path, suspend: bool) -> str:
    cmd = fake_cmd("--device-mib", str(args.device_mib), "--load-delay", str(args.load_s),
                   "--sleep-mode", "--wake-s", str(args.wake_s))
    model: dict[str, Any] = {"cmd": cmd, **({"suspend": "vllm", "suspend_when": "always"}
                                             if suspend else {})}  # (each arm, whatever it costs)
    return toml_config({"a": model, "b": model}, models_max=2, memory_margin_mib=64,
                       device_poll_s=0.5, state_dir=str(home / "state"),
                       devices=[{"name": "gpu0", "kind": "simulated",
                                 "total_mib": args.device_mib * 1.7}])


async def suspend_runs(args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        corrals = {}
        for label, suspend in (("stop", False), ("suspend", True)):
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="corral-")))
            corrals[label] = stack.enter_context(Corral(
                suspend_config(args, home, suspend), home=home, log_level="WARNING"))
        async with session() as s:
            for c in corrals.values():  # each model's first load, and measure, off the clock
                await wait_measured(s, c.url, ["a", "b"])
            await asyncio.gather(*(send(s, c.url, m) for c in corrals.values() for m in "ab"))
            for r in range(args.rounds):
                samples: dict[str, list[float]] = {k: [] for k in corrals}
                for i in range(args.runs):
                    for label, c in corrals.items():
                        result = await send(s, c.url, "ab"[(i + r) % 2])
                        assert result.status == 200, result
                        samples[label].append(result.ttfb_s)
                p50 = {k: statistics.median(v) for k, v in samples.items()}
                rounds.append({k: summary_ms(v) | {"median": p50[k] * 1e3}
                               for k, v in samples.items()}
                              | {"ratio": p50["suspend"] / p50["stop"]})
                print(f"round {r + 1}: swap p50 stopping {p50['stop'] * 1e3:8.1f} ms, "
                      f"suspending {p50['suspend'] * 1e3:7.1f} ms "
                      f"(p99 {summary_ms(samples['suspend'])['p99']:.1f} ms): "
                      f"{p50['suspend'] / p50['stop']:.3f} of it")
    ratios = [r["ratio"] for r in rounds]
    print(f"suspend/stop swap p50 over {len(rounds)} rounds: "
          f"{min(ratios):.3f}-{max(ratios):.3f}")
    return {"suspend_swap": rounds}


async def wait_measured(s: aiohttp.ClientSession, url: str, models: list[str]) -> None:
    for _ in range(3000):
        listing = await get_json(s, url + "/models")
        if all(m["memory"]["status"] == "measured" for m in listing["data"]
               if m["id"] in models):
            return
        await asyncio.sleep(0.02)
    raise RuntimeError("the models were not measured in 60 s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench swap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--llama-server", metavar="BIN")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--suspend", action="store_true",
                    help="stopping against suspending, side by side (issue 23)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load-s", type=float, default=10.0)
    ap.add_argument("--wake-s", type=float, default=0.5)
    ap.add_argument("--device-mib", type=int, default=600)
    args = ap.parse_args(argv)
    if args.suspend:
        result = loop.run(suspend_runs(args))
        write_json(args.json, {"bench": "swap --suspend", "machine": machine(),
                               "params": vars(args) | {"json": None}, **result})
        return 0
    result = loop.run(fake_runs(args))
    if args.llama_server:
        result.update(loop.run(llama_runs(args)))
    write_json(args.json, {"bench": "swap", "machine": machine(),
                           "params": {"runs": args.runs, "llama_server": args.llama_server},
                           **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
