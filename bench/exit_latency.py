"""How fast corral notices a child's exit, at two depths, measured side by side.

    python bench/exit_latency.py [--runs 100]

- watcher: SIGKILL -> the exit watcher's callback (os.waitid on the one pid);
- scheduler: SIGKILL of a loaded model's child -> the Scheduler has marked it `failed`
  (the StatusChanged event, which the Scheduler publishes in the same step).
Both kill the same kind of child (a fake model server), so most of either figure is the
kernel tearing that process down; the difference is corral's own share (messages to the
ModelInstance and the Scheduler, the reap).

Prints p50/p99 in milliseconds and one JSON line with the machine and the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors import Config, ModelConfig, StatusChanged, Supervisor
from actors.bridge import ThreadReply
from actors.childproc import ChildProcess, LogRing, pick_port
from actors.messages import GetModels, ModelsSnapshot


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


FAKE = [sys.executable, "-m", "actors.fake_model", "--port", "{port}", "--model", "{model}"]


def watcher_latency(runs: int) -> list[float]:
    """The same child as the Scheduler run (a fake model), so the two compare directly."""
    return [one_watcher_run() for _ in range(runs)]


def one_watcher_run() -> float:
    noticed = threading.Event()
    ready = threading.Event()
    at: list[float] = []

    def on_exit() -> None:
        at.append(time.perf_counter())
        noticed.set()

    def on_line(line: str) -> None:
        if "ready" in line:
            ready.set()

    argv = [a.replace("{port}", str(pick_port())).replace("{model}", "m") for a in FAKE]
    child = ChildProcess(argv, dict(os.environ), LogRing(), on_exit=on_exit, on_line=on_line)
    ready.wait(30)
    t0 = time.perf_counter()
    os.kill(child.pid, signal.SIGKILL)
    noticed.wait(10)
    child.reap()
    return at[0] - t0


def scheduler_latency(runs: int) -> list[float]:
    events: queue.Queue[tuple[float, StatusChanged]] = queue.Queue()

    def on_event(e: object) -> None:
        if isinstance(e, StatusChanged):
            events.put((time.perf_counter(), e))

    # every run is a crash: lift the restart budget so the model keeps coming back
    config = Config(restart_intensity=1_000_000, models={"m": ModelConfig(cmd=FAKE)})
    sup = Supervisor(config, on_event=on_event)
    sup.start()
    out = []
    try:
        for _ in range(runs):
            with sup.lease("m", timeout_s=30):
                pass
            reply = ThreadReply()
            sup.scheduler.tell(GetModels(reply))
            snap = reply.wait(5)
            assert isinstance(snap, ModelsSnapshot) and snap.models[0].pid
            while not events.empty():
                events.get_nowait()
            t0 = time.perf_counter()
            os.kill(snap.models[0].pid, signal.SIGKILL)
            while True:
                at, e = events.get(timeout=10)
                if e.status == "failed":
                    out.append(at - t0)
                    break
    finally:
        sup.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args()
    watcher = watcher_latency(args.runs)
    sched = scheduler_latency(args.runs)
    result = {
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "runs": {"watcher": len(watcher), "scheduler": len(sched)},
        "watcher_ms": {"p50": pct(watcher, 0.5), "p99": pct(watcher, 0.99),
                       "mean": statistics.mean(watcher) * 1000},
        "scheduler_ms": {"p50": pct(sched, 0.5), "p99": pct(sched, 0.99),
                         "mean": statistics.mean(sched) * 1000},
    }
    print(f"exit noticed by the watcher:   p50 {result['watcher_ms']['p50']:.2f} ms, "
          f"p99 {result['watcher_ms']['p99']:.2f} ms ({len(watcher)} runs)")
    print(f"exit known to the Scheduler:   p50 {result['scheduler_ms']['p50']:.2f} ms, "
          f"p99 {result['scheduler_ms']['p99']:.2f} ms ({len(sched)} runs)")
    print(f"corral's share (p50 difference): "
          f"{result['scheduler_ms']['p50'] - result['watcher_ms']['p50']:.2f} ms")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
