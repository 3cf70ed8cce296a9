"""The OS edge: spawn a child, watch it exit, signal its group, reap it, keep its log.

Rules learned the hard way (shared/STYLE.md):
- argv exec, never a shell; the child leads its own session and process group, so one
  `killpg` reaches every grandchild too.
- The exit watcher waits on this one pid with WNOWAIT: it notices the exit (within a
  millisecond) without reaping, so the pid, and with it the process group id, cannot be
  reused before the owner has signalled the group's stragglers and reaped. The owner
  reaps, in exactly one place (`reap`). Never `waitpid(-1)`.
- PR_SET_PDEATHSIG kills the child when the thread that spawned it exits, which is the
  spawning ModelInstance actor's thread: it lives until the supervisor has stopped every
  child, and it dies with the supervisor, even under SIGKILL. stdin is a pipe held by
  corral, so children that watch it see EOF too. The signal is set by exec'ing the child
  through util-linux's `setpriv --pdeathsig KILL`: a `preexec_fn` would force Python to
  fork instead of vfork, which costs ~10 ms with a 200 MB heap against 0.2 ms
  (measured on this machine); without setpriv, the preexec_fn is the fallback.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

CHILD_HOST = "127.0.0.1"
"""Children bind loopback only; the Router is the one door in (R-3.2)."""
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_SETPRIV = shutil.which("setpriv") if sys.platform == "linux" else None


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    def setup() -> None:  # runs in the child between fork and exec: keep it tiny
        if _libc is not None:
            _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
    return setup


LINE_COST = 64
"""Bytes a kept line costs beyond its text (the str and its deque slot), for the budget."""


class LogRing:
    """What a child printed, appended line by line by its reader thread: the last
    `capacity` lines for GET /models/logs, and up to `backlog_bytes` of lines (never fewer
    than `capacity`) for the readers that follow it.

    Lines are numbered from 0 as they come, so a follower keeps only a number (the lines
    it has seen) and reads on from there (`since`): the ring is every follower's buffer,
    and one that falls behind everything kept learns how many lines it lost. A burst of
    short lines fits in the byte budget, so a reader that keeps up on the whole is not
    dropped by one. The reader thread never waits for a follower: it only wakes those
    that asked (`wake`).
    """

    def __init__(self, capacity: int = 1000, backlog_bytes: int = 4 << 20) -> None:
        self.capacity = capacity
        self.backlog_bytes = backlog_bytes
        self._lines: collections.deque[str] = collections.deque()
        self._bytes = 0
        self._count = 0
        self._lock = threading.Lock()
        self._wakers: list[Callable[[], None]] = []

    def append(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)
            self._bytes += len(line) + LINE_COST
            self._count += 1
            while len(self._lines) > self.capacity and self._bytes > self.backlog_bytes:
                self._bytes -= len(self._lines.popleft()) + LINE_COST
            wakers, self._wakers = self._wakers, []
        for wake in wakers:
            wake()

    def lines(self) -> list[str]:
        """The last `capacity` lines."""
        with self._lock:
            skip = max(0, len(self._lines) - self.capacity)
            return list(itertools.islice(self._lines, skip, None))

    def recent(self) -> int:
        """The number of lines before the last `capacity`: where a new follower starts."""
        with self._lock:
            return self._count - min(len(self._lines), self.capacity)

    def since(self, seen: int) -> tuple[list[str], int, int]:
        """(the lines after the first `seen`, the count now, how many of those lines are
        no longer kept)."""
        with self._lock:
            first = self._count - len(self._lines)
            lost = max(0, first - seen)
            lines = list(itertools.islice(self._lines, max(0, seen - first), None))
            return lines, self._count, lost

    def wake(self, seen: int, waker: Callable[[], None]) -> bool:
        """Call `waker` once (on the appending thread) when a line after the first
        `seen` arrives; False, and no call, if one already has."""
        with self._lock:
            if self._count > seen:
                return False
            self._wakers.append(waker)
            return True


def pick_port(host: str = CHILD_HOST) -> int:
    """A port free right now on `host` (it may be taken before the child binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def port_in_use(port: int, host: str = CHILD_HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class ChildProcess:
    """One spawned child: its pid, its process group, its stdin, its log."""

    def __init__(self, argv: list[str], env: dict[str, str], log: LogRing,
                 on_exit: Callable[[], None], on_line: Callable[[str], None] | None = None,
                 label: str = "child") -> None:
        """Spawn `argv`; `on_exit` is called once from a watcher thread when it exits."""
        self.started_at = time.monotonic()
        preexec = None
        if _SETPRIV is not None:
            # setpriv would report a missing program only by exiting 127: say it here
            if shutil.which(argv[0], path=env.get("PATH")) is None:
                raise FileNotFoundError(2, "No such file or directory", argv[0])
            argv = [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]
        else:
            preexec = _die_with_parent(os.getpid())
        self._popen = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            preexec_fn=preexec,
        )
        self.pid = self._popen.pid
        self.returncode: int | None = None
        threading.Thread(target=self._watch_exit, args=(on_exit,), daemon=True,
                         name=f"{label}-exit-{self.pid}").start()
        threading.Thread(target=self._read_lines, args=(log, on_line), daemon=True,
                         name=f"{label}-log-{self.pid}").start()

    def _watch_exit(self, on_exit: Callable[[], None]) -> None:
        try:
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass  # already reaped: the exit is known anyway
        on_exit()

    def _read_lines(self, log: LogRing, on_line: Callable[[str], None] | None) -> None:
        assert self._popen.stdout is not None
        for raw in self._popen.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            log.append(line)
            if on_line is not None:
                on_line(line)

    def signal_group(self, sig: int) -> bool:
        """Send `sig` to the child's whole process group; False if nothing was there.

        Only call before `reap`: until then the group id cannot have been reused.
        """
        if self.returncode is not None:
            return False
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def write_stdin(self, line: str) -> None:
        try:
            assert self._popen.stdin is not None
            self._popen.stdin.write(line.encode() + b"\n")
            self._popen.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the child is exiting; its exit arrives as a message

    def reap(self) -> int:
        """Kill what is left of the group, reap the child, return its Popen returncode.

        Call only after `on_exit` fired: the wait is then immediate.
        """
        self.signal_group(signal.SIGKILL)  # grandchildren must not outlive their leader
        self.returncode = self._popen.wait()
        if self._popen.stdin is not None:
            try:
                self._popen.stdin.close()
            except OSError:
                pass
        return self.returncode
