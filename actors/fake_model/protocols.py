"""What the fake model tells corral besides HTTP, written out as a foreign server would:
llama-server's child protocol, the simulated devices' ledger, and the measure line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

MiB = 1024 * 1024


# ------------------------------------------------------------ llama-server's child protocol
# (corral's side: actors/llama.py)

LLAMA_STATE = "cmd_child_to_router:state:"
LLAMA_EXIT = "cmd_router_to_child:exit"


def llama_state(state: str, payload: dict[str, Any]) -> None:
    """One line of llama-server's child protocol on stdout (the leading newline as it has)."""
    print("\n" + LLAMA_STATE + json.dumps({"state": state, "payload": payload}), flush=True)


# ------------------------------------------------------------ simulated devices

def sim_devices() -> list[str]:
    return [d for d in os.environ.get("CORRAL_DEVICES", "").split(",") if d]


_registered = 0.0


def registered_mib() -> float:
    """What this process said it uses on each simulated device, last."""
    return _registered


def register_memory(mib: float, zero_ok: bool = False) -> list[str]:
    """Write this process's use of every simulated device (nothing for 0, unless
    `zero_ok`: it gave its memory back); return the files written."""
    global _registered
    _registered = max(0.0, mib)
    ledger = os.environ.get("CORRAL_SIM_LEDGER")
    if not ledger or (mib <= 0 and not zero_ok):
        return []
    paths = []
    for device in sim_devices():
        path = os.path.join(ledger, device, str(os.getpid()))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # written aside and renamed over: a reader between a truncate and its write saw
        # an empty file, 0 bytes, and corral charged a loaded child nothing
        with open(path + ".new", "w") as f:
            f.write(str(int(_registered * MiB)))
        os.replace(path + ".new", path)
        paths.append(path)
    return paths


async def grow(start_mib: float, end_mib: float, seconds: float) -> None:
    """--grow-to-mib: use more of the simulated devices, linearly, over `seconds`."""
    steps = 20
    for i in range(1, steps + 1):
        await asyncio.sleep(seconds / steps)
        register_memory(start_mib + (end_mib - start_mib) * i / steps)


# ------------------------------------------------------------ corral's measure protocol

def used_mib(args: argparse.Namespace, n_ctx: int | None = None) -> float:
    """What it holds on a device: its --device-mib, and its context's at --ctx-mib-per-1k."""
    return float(args.device_mib + args.ctx_mib_per_1k * (n_ctx or args.n_ctx) / 1024)


def measure(args: argparse.Namespace) -> int:
    """CORRAL_ROLE=measure: report the memory need on stdout (corral's measure protocol)."""
    time.sleep(args.measure_delay)
    if args.measure_hang:
        print("fake_model: measuring forever", flush=True)
        while True:
            time.sleep(3600)
    if args.measure_malformed:
        print('corral:measure:{"result": "measured", "min": 42}', flush=True)
        return 0
    if args.measure_fail is not None:
        print("corral:measure:" + json.dumps({"result": "failed", "error": args.measure_fail}),
              flush=True)
        return 0
    mib = used_mib(args) if args.measure_mib is None else args.measure_mib
    min_mib = (mib if not args.ctx_mib_per_1k else used_mib(args, 512)) \
        if args.measure_min_mib is None else args.measure_min_mib

    def figures(n_ctx: int, mib: float) -> dict[str, Any]:  # a model that fits on one GPU
        return {"n_ctx": n_ctx, "devices": [
            {"kind": "device", "name": d, "total": 0, "free": 0, "model": int(mib * MiB),
             "context": 0, "compute": 0} for d in sim_devices()[:1]]}

    print("corral:measure:" + json.dumps({"result": "measured", "min": figures(512, min_mib),
                                          "max": figures(args.n_ctx, mib)}), flush=True)
    return 0
