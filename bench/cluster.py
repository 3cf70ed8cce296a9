"""corral on a two-node Ray cluster on this machine, against corral's own machine.

    python -m bench cluster [--runs 10] [--requests 2000] [--json FILE]

Ray is started only inside a private network namespace (loopback only): run as root, the
bench re-runs itself under `unshare --net`. One ray.cluster_utils.Cluster with two
logical nodes; one corral head with two fake models, `here` (no nodes: beside the head)
and `there` (on node_b, through its agent). Side by side, interleaved:
1. Cold start: request -> whole answer for an unloaded model, `here` vs `there`
   (unloaded between runs); the difference of the medians is the agent's share.
2. Proxy: the same small requests (c=1, then c=16) to the loaded `here` and `there`:
   latency and corral's CPU per request (the data path is the same HTTP).
3. Node lost: SIGKILL `there`'s agent; time until GET /models shows it failed with
   `node lost` (the agent is back after agent_retry_s = 1 s, between runs).
4. Head restart: stop the head with `there` loaded, start a new one; time from the new
   process's start to `there` loaded (adopted) and to its first answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import (
    cpu_seconds,
    get_json,
    machine,
    send,
    session,
    write_json,
)
from bench.support import Corral, fake_cmd, in_private_netns, toml_config, two_ray_nodes


def config(namespace: str) -> str:
    return toml_config({"here": {"cmd": fake_cmd()}, "there": {"cmd": fake_cmd(),
                                                               "nodes": ["node_b"]}},
                       cluster={"namespace": namespace, "nodes": ["node_a", "node_b"],
                                "agent_retry_s": 1})


async def status_of(s: aiohttp.ClientSession, url: str, model: str) -> dict[str, Any]:
    listing = await get_json(s, url + "/models")
    return next(m for m in listing["data"] if m["id"] == model)


async def wait_for(s: aiohttp.ClientSession, url: str, model: str, check: Any,
                   timeout_s: float = 30.0, every_s: float = 0.005) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = await status_of(s, url, model)
        if check(m):
            return m
        await asyncio.sleep(every_s)
    raise RuntimeError(f"{model}: not reached within {timeout_s} s")


async def unload(s: aiohttp.ClientSession, url: str, model: str) -> None:
    async with s.post(url + "/models/unload", json={"model": model}) as resp:
        await resp.read()
    await wait_for(s, url, model, lambda m: m["status"]["value"] == "unloaded")


async def proxy(s: aiohttp.ClientSession, head: Corral, model: str, n: int,
                concurrency: int) -> dict[str, float]:
    cpu = cpu_seconds(head.proc.pid)
    start = time.perf_counter()
    latencies: list[float] = []

    async def worker(count: int) -> None:
        for _ in range(count):
            r = await send(s, head.url, model)
            assert r.status == 200, r
            latencies.append(r.latency_s)

    await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))
    took = time.perf_counter() - start
    done = len(latencies)
    return {"req_per_s": done / took, "p50_ms": statistics.median(latencies) * 1e3,
            "cpu_us_per_request": (cpu_seconds(head.proc.pid) - cpu) / done * 1e6}


async def measure(args: argparse.Namespace, address: str) -> dict[str, Any]:
    import ray

    ns = f"bench{uuid.uuid4().hex[:6]}"
    out: dict[str, Any] = {}
    head = Corral(config(ns), "--ray", address, log_level="WARNING")
    try:
        async with session() as s:
            out["cold_start_ms"] = await cold_starts(s, head.url, args.runs)
            out["proxy"] = await proxy_runs(s, head, args.requests)
            ray.init(address=address, log_to_driver=False)
            out["node_lost_s"] = await node_lost(s, head.url, ns)
        head.stop()
        # 4. Head restarts, here so that `finally` stops whichever head is running
        adoption: list[dict[str, float]] = []
        for _ in range(3):
            start = time.perf_counter()
            head = Corral(config(ns), "--ray", address, log_level="WARNING")
            listening = time.perf_counter() - start
            async with session() as s:
                await wait_for(s, head.url, "there", lambda m: m["status"]["value"] == "loaded")
                loaded = time.perf_counter() - start
                r = await send(s, head.url, "there")
                assert r.status == 200, r
                adoption.append({"listening_s": listening, "loaded_s": loaded,
                                 "first_answer_s": time.perf_counter() - start})
            head.stop()
        out["head_restart"] = adoption
    finally:
        head.stop()
    return out


async def cold_starts(s: aiohttp.ClientSession, url: str, runs: int) -> dict[str, float]:
    """1. Median cold start of `here` and `there`, and what the agent adds to it."""
    cold: dict[str, list[float]] = {"here": [], "there": []}
    for _ in range(runs):
        for model in ("here", "there"):
            start = time.perf_counter()
            r = await send(s, url, model)
            assert r.status == 200, r
            cold[model].append(time.perf_counter() - start)
            await unload(s, url, model)
    medians = {m: statistics.median(v) * 1e3 for m, v in cold.items()}
    medians["agent_adds"] = medians["there"] - medians["here"]
    return medians


async def proxy_runs(s: aiohttp.ClientSession, head: Corral,
                     requests: int) -> dict[str, dict[str, list[dict[str, float]]]]:
    """2. Both models loaded, `requests` each run at c=1 then c=16, interleaved."""
    for model in ("here", "there"):
        await send(s, head.url, model)
    rows: dict[str, dict[str, list[dict[str, float]]]] = {}
    for concurrency in (1, 16):
        for model in ("here", "there", "here", "there"):
            row = await proxy(s, head, model, requests, concurrency)
            rows.setdefault(f"c{concurrency}", {}).setdefault(model, []).append(row)
    return rows


async def node_lost(s: aiohttp.ClientSession, url: str, ns: str) -> list[float]:
    """3. Seconds from SIGKILLing `there`'s agent to `node lost` in GET /models, 3 times."""
    import ray

    lost: list[float] = []
    for _ in range(3):
        await wait_for(s, url, "there", lambda m: m["status"]["value"] == "loaded")
        agent = ray.get_actor("corral-agent-node_b", namespace=ns)
        pid = ray.get(agent.hello.remote())["pid"]
        start = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        await wait_for(s, url, "there", lambda m: "node lost" in str(m["status"].get("exit")))
        lost.append(time.perf_counter() - start)
        for _ in range(100):  # the agent is back after agent_retry_s
            if (await send(s, url, "there")).status == 200:
                break
            await asyncio.sleep(0.2)
    return lost


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="cold starts each (default 10)")
    ap.add_argument("--requests", type=int, default=2000,
                    help="requests per proxy run (default 2000)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if os.environ.get("CORRAL_NETNS") != "1":
        return subprocess.run(in_private_netns(
            [sys.executable, "-m", "bench", "cluster", *argv])).returncode
    with two_ray_nodes() as address:
        figures = asyncio.run(measure(args, address))
    result = {"bench": "cluster", "machine": machine(), "runs": args.runs, **figures}
    write_json(args.json, result)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    return 0
