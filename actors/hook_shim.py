"""A hook's group leader (hooks.py): runs the hook's argv as its child, in the process
group it leads, and takes that whole group down when corral dies, SIGKILL included, so
a hook that forks (`["sh", "-c", "..."]`) leaves nothing behind. The death signal of a
child reaches only the child itself; this one turns it into a kill of the group.

    python -m actors.hook_shim ARGV...

Its exit status is the hook's (128 + N for a hook killed by signal N).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from types import FrameType

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m actors.hook_shim ARGV...", file=sys.stderr)
        return 2
    parent = os.getppid()

    def end(signum: int, frame: FrameType | None) -> None:
        os.killpg(0, signal.SIGKILL)  # the hook and all it started, this process too

    signal.signal(signal.SIGTERM, end)
    if sys.platform == "linux":  # corral's thread gone: SIGTERM here, then the group goes
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # corral died before the signal was set
        end(signal.SIGTERM, None)
    try:
        child = subprocess.Popen(argv)
    except OSError as e:
        print(f"cannot run {argv[0]}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 127
    status = child.wait()
    return 128 - status if status < 0 else status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
