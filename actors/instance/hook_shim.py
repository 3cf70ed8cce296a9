"""A hook's group leader (hooks.py): runs the hook's argv as its child, in the process
group it leads, and takes down all the hook started when the hook ends or corral dies,
SIGKILL included. The death signal of a child reaches only the child itself; this one
turns it into a kill of the group and of every descendant.

A process that leaves the group (`setsid`, a daemon's double fork) is still found, two
ways (issue 37, S10): this process is a child subreaper, so an orphan of the hook is
re-parented here rather than to init (its parent chain leads back); and every process of
the hook carries the run's marker in its environment (CORRAL_HOOK_RUN), which corral
sweeps for again once this process has ended. Only a process that both leaves the
chain (before this one ends) and clears its environment escapes.

    python -m actors.instance.hook_shim ARGV...

Its exit status is the hook's (128 + N for a hook killed by signal N).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from types import FrameType

import psutil

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
MARK = "CORRAL_HOOK_RUN"
"""The environment variable that marks every process of one hook run (its value)."""


def sweep(token: str, descendants: bool = False) -> int:
    """SIGKILL the processes that carry `token` as their MARK (and, with `descendants`,
    every descendant of this process, again until none is left: one forked meanwhile
    comes back here as an orphan), wait for them briefly; how many there were."""
    total = 0
    deadline = time.monotonic() + SWEEP_S
    for _ in range(SWEEPS_MAX):
        found = _sweep_once(token, descendants, deadline)
        total += found
        if not found or not descendants or time.monotonic() > deadline:
            break
    return total


SWEEPS_MAX = 100
SWEEP_S = 5.0
"""A sweep's rounds at most, and its time: a fork bomb is not outrun, only stopped from
growing; a process stuck in the kernel (D state) does not hold up the hook's end."""


def _sweep_once(token: str, descendants: bool, deadline: float) -> int:
    me = os.getpid()
    found = {p.pid: p for p in psutil.Process(me).children(recursive=True)} \
        if descendants else {}  # (a zombie among them is ours to reap: the wait does)
    for proc in psutil.process_iter():
        if proc.pid == me or proc.pid in found:
            continue
        try:
            if proc.environ().get(MARK) == token and proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = proc
        except (psutil.Error, OSError):  # gone, or another user's
            continue
    for proc in found.values():
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(found.values()),  # (reaps those that are ours)
                      timeout=max(0.0, min(1.0, deadline - time.monotonic())))
    return len(found)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m actors.instance.hook_shim ARGV...", file=sys.stderr)
        return 2
    parent = os.getppid()
    token = os.environ.setdefault(MARK, f"{os.getpid()}-{os.urandom(8).hex()}")

    def end(signum: int, frame: FrameType | None) -> None:
        sweep(token, descendants=True)  # those that left the group
        os.killpg(0, signal.SIGKILL)  # the hook and all it started, this process too

    signal.signal(signal.SIGTERM, end)
    if sys.platform == "linux":  # corral's thread gone: SIGTERM here, then the group goes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # the hook's orphans come here
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # corral died before the signal was set
        end(signal.SIGTERM, None)
    try:
        child = subprocess.Popen(argv)
    except OSError as e:
        print(f"cannot run {argv[0]}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 127
    status = child.wait()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the sweep is under way: let it end
    sweep(token, descendants=True)  # the hook has ended: nothing it started goes on
    return 128 - status if status < 0 else status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
