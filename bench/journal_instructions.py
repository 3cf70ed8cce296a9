"""What the request journal costs a request in instructions: corral run under valgrind's
callgrind, which counts every instruction its process runs (in user space: not the
kernel's, not the journal writer's, a process of its own), with the journal on and off.
Unlike CPU time, the count does not move with the machine's noise (two runs of a side
differ by about 0.1 %), so it shows where the cost is and whether a change cut it.

    python -m bench overhead --journal-off --instructions [--requests 2000]
                                                          [--concurrency 1]

Each side is a corral of its own with the one small model, warmed (its child up, its
journal's writer started), then counted over `--requests` small requests and the
feeder's take after them (BATCH_WAIT_S and a half). Needs valgrind (`apt install
valgrind`); it runs corral about 30 times slower, so keep `--requests` to a few thousand.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from actors.journal.store import BATCH_WAIT_S
from bench.common import lean_requests
from bench.support import ROOT, fake_cmd, toml_config

START_S = 300.0
"""corral's start under valgrind (its imports, about 30 times slower)."""


def totals(text: str) -> int:
    """The instructions a callgrind output file counted (its `totals:` line)."""
    found = re.search(r"^totals: (\d+)", text, re.M)
    if found is None:
        raise ValueError("no totals line: not a callgrind output file, or an empty one")
    return int(found[1])


def counted(enabled: bool, requests: int, concurrency: int) -> int:
    """Instructions corral ran for `requests` small requests, its journal on or off."""
    with tempfile.TemporaryDirectory(prefix="corral-cg-") as folder:
        home = Path(folder)
        (home / "corral.toml").write_text(toml_config(
            {"small": {"cmd": fake_cmd()}}, journal={"enabled": enabled}))
        out = home / "callgrind.out"
        argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                f"--callgrind-out-file={out}", sys.executable, str(ROOT / "supervisor.py"),
                "serve", "--port", "0", "--config", str(home / "corral.toml"),
                "--log-level", "WARNING"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(home / "state")}
        with open(home / "corral.log", "wb") as log:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, cwd=ROOT,
                                    env=env)
            try:
                url = asyncio.run(_count(proc, requests, concurrency))
            finally:
                proc.terminate()
                proc.wait(START_S)
        if url is None:
            raise RuntimeError(f"corral did not start:\n{(home / 'corral.log').read_text()}")
        return totals(out.read_text(errors="replace"))


async def _count(proc: subprocess.Popen[bytes], requests: int,
                 concurrency: int) -> str | None:
    assert proc.stdout is not None
    loop = asyncio.get_running_loop()
    line = b""
    while b"listening on " not in line:
        line = await asyncio.wait_for(loop.run_in_executor(None, proc.stdout.readline),
                                      START_S)
        if not line:
            return None
    url = line.decode().split("listening on ", 1)[1].strip()
    await lean_requests(url, "small", 300, 1, 1)  # (its child up, its writer started)
    await asyncio.sleep(3 * BATCH_WAIT_S)
    _control(proc.pid, "on")
    done = await lean_requests(url, "small", requests, concurrency, 1)
    await asyncio.sleep(1.5 * BATCH_WAIT_S)  # (the feeder's take of the last rows)
    _control(proc.pid, "off")
    failed = sum(r.status != 200 for r in done)
    if failed:
        raise RuntimeError(f"{failed} of {requests} requests failed under valgrind")
    return url


def _control(pid: int, state: str) -> None:
    subprocess.run(["callgrind_control", "-i", state, str(pid)], check=True,
                   capture_output=True)


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt install valgrind): nothing counted")
        return None
    sides: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for side in ("off", "on"):
            sides[side].append(counted(side == "on", args.requests, args.concurrency[0])
                               / args.requests)
    off, on = min(sides["off"]), min(sides["on"])
    print(f"instructions a request at c={args.concurrency[0]}, the least of "
          f"{args.rounds} each: off {off:,.0f}, on {on:,.0f}: the journal "
          f"+{on - off:,.0f} ({on / off - 1:+.1%})")
    return {"requests": args.requests, "concurrency": args.concurrency[0],
            "off": sides["off"], "on": sides["on"], "journal": on - off}
