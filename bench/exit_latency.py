"""How fast corral notices a child's exit, measured from the moment the child is gone.

    python -m bench exit-latency [--runs 30]

A SIGKILL'd process is not gone at once: the kernel first tears it down (its memory, its
threads), which for a ~40 MB multi-threaded fake model takes a few milliseconds that no
supervisor can shorten. So an observer *process* (its own interpreter, no GIL shared
with corral) waits on a pidfd for the same child and prints the CLOCK_MONOTONIC time at
which the child is gone; corral's figures start from that moment:

- kill -> gone: the kernel's teardown (not corral's);
- gone -> watcher: the exit watcher's callback (os.waitid on the one pid);
- gone -> Scheduler: the Scheduler has marked the model `unloaded`, `failed` (the StatusChanged
  event, published in the same step): watcher, ModelInstance and Scheduler together.

Prints p50/p99 in milliseconds and one JSON line with the machine and the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from actors import Config, ModelConfig, StatusChanged, Supervisor
from actors.childproc import ChildProcess, LogRing, pick_port
from actors.messages import GetModels, ModelsSnapshot
from actors.runtime.bridge import ThreadReply
from bench.common import machine, pct
from bench.support import fake_cmd

OBSERVER = """
import os, select, sys, time
for line in sys.stdin:
    fd = os.pidfd_open(int(line))
    print("armed", flush=True)
    select.select([fd], [], [])
    print(time.monotonic(), flush=True)
    os.close(fd)
"""


class Observer:
    """A separate process that reports when a pid is gone (pidfd readable)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", OBSERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def arm(self, pid: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{pid}\n")
        assert self.proc.stdout.readline().strip() == "armed"

    def gone_at(self) -> float:
        assert self.proc.stdout is not None
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


Run = tuple[float, float]
"""(kill -> gone, gone -> noticed), in seconds."""


def watcher_latency(runs: int, observer: Observer) -> list[Run]:
    """The same child as the Scheduler run (a fake model), so the two compare directly."""
    return [one_watcher_run(observer) for _ in range(runs)]


def one_watcher_run(observer: Observer) -> Run:
    noticed = threading.Event()
    ready = threading.Event()
    at: list[float] = []

    def on_exit() -> None:
        at.append(time.monotonic())
        noticed.set()

    def on_line(line: str) -> None:
        if "ready" in line:
            ready.set()

    argv = [a.replace("{host}", "127.0.0.1").replace("{port}", str(pick_port()))
            .replace("{model}", "m") for a in fake_cmd()]
    child = ChildProcess(argv, dict(os.environ), LogRing(), on_exit=on_exit, on_line=on_line)
    ready.wait(30)
    observer.arm(child.pid)
    t0 = time.monotonic()
    os.kill(child.pid, signal.SIGKILL)
    noticed.wait(10)
    child.reap()
    gone = observer.gone_at()
    return gone - t0, at[0] - gone


def scheduler_latency(runs: int, observer: Observer) -> list[Run]:
    events: queue.Queue[tuple[float, StatusChanged]] = queue.Queue()

    def on_event(e: object) -> None:  # called in the Scheduler's thread as it publishes
        if isinstance(e, StatusChanged):
            events.put((time.monotonic(), e))

    # every run is a crash: lift the restart budget so the model keeps coming back
    config = Config(restart_intensity=1_000_000, models={"m": ModelConfig(cmd=fake_cmd())})
    sup = Supervisor(config, on_event=on_event)
    sup.start()
    out = []
    try:
        for _ in range(runs):
            with sup.lease("m", timeout_s=30):
                pass
            reply = ThreadReply()
            sup.scheduler.tell(GetModels(reply=reply))
            snap = reply.wait(5)
            assert isinstance(snap, ModelsSnapshot) and snap.models[0].pid
            while not events.empty():
                events.get_nowait()
            observer.arm(snap.models[0].pid)
            t0 = time.monotonic()
            os.kill(snap.models[0].pid, signal.SIGKILL)
            while True:
                at, e = events.get(timeout=10)
                if e.status == "unloaded" and e.failed:
                    gone = observer.gone_at()
                    out.append((gone - t0, at - gone))
                    break
    finally:
        sup.stop()
    return out


def figures(samples: list[float]) -> dict[str, float]:
    return {"p50": pct(samples, 0.5) * 1000, "p99": pct(samples, 0.99) * 1000,
            "max": max(samples) * 1000, "mean": statistics.mean(samples) * 1000}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench exit-latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args(argv)
    observer = Observer()
    try:
        watcher = watcher_latency(args.runs, observer)
        sched = scheduler_latency(args.runs, observer)
    finally:
        observer.close()
    result: dict[str, Any] = {
        "machine": machine(),
        "runs": {"watcher": len(watcher), "scheduler": len(sched)},
        "teardown_ms": figures([k for k, _ in watcher + sched]),
        "watcher_ms": figures([n for _, n in watcher]),
        "scheduler_ms": figures([n for _, n in sched]),
    }
    rows = [("kill -> gone (the kernel's teardown)", "teardown_ms", len(watcher + sched)),
            ("gone -> exit watcher", "watcher_ms", len(watcher)),
            ("gone -> Scheduler knows", "scheduler_ms", len(sched))]
    for label, key, n in rows:
        f = result[key]
        print(f"{label:<38} p50 {f['p50']:.2f} ms, p99 {f['p99']:.2f} ms, "
              f"max {f['max']:.2f} ms ({n} runs)")
    print(json.dumps(result))
    return 0
