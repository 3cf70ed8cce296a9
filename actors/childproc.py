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
from collections.abc import Callable, Iterator

CHILD_HOST = "127.0.0.1"
"""Children bind loopback only; the front is the one door in (R-3.2)."""
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


MAX_LINE_BYTES = 16 << 10
"""The longest line of a child's output corral keeps, in UTF-8 bytes (issue 19, R4: a
child that logs prompts puts client-controlled text in its lines). Longer lines are cut
to this, marked with CUT_MARK; the rest of such a line is read and thrown away."""
CUT_MARK = " [corral: line cut at 16 KiB]"
_CUT_MARK_BYTES = len(CUT_MARK.encode())
READ_CHUNK = 64 << 10
"""What one read of a child's pipe takes at most (the size of a Linux pipe's buffer)."""
DRAIN_S = 1.0
"""How long a child's last lines are waited for once it exited (`ChildProcess.drain`)."""


def cut_line(raw: bytes) -> str:
    """The first MAX_LINE_BYTES of `raw` (marker included), cut at a character boundary."""
    end = MAX_LINE_BYTES - _CUT_MARK_BYTES
    floor = end - 3  # a UTF-8 character has at most 3 continuation bytes
    while end > floor and raw[end] & 0xC0 == 0x80:
        end -= 1
    return raw[:end].decode("utf-8", "replace") + CUT_MARK


def clip_line(line: str) -> str:
    """`line` as a ring keeps it: unchanged if it has at most MAX_LINE_BYTES in UTF-8,
    else cut and marked. The work is bounded whatever the line's length."""
    if len(line) <= MAX_LINE_BYTES // 4:  # no character takes more than 4 bytes
        return line
    raw = line[:MAX_LINE_BYTES + 1].encode("utf-8", "replace")
    return line if len(raw) <= MAX_LINE_BYTES else cut_line(raw)


def line_cost(line: str) -> int:
    """The bytes a kept line holds: the str object and its slot in the deque."""
    return sys.getsizeof(line) + 8


def bounded_lines(read: Callable[[], bytes]) -> Iterator[str]:
    """The lines of a byte stream that `read` returns in pieces (b"" at its end), each
    decoded and cut at MAX_LINE_BYTES. A line too long is given out cut as soon as
    MAX_LINE_BYTES of it have come, and the rest of it is skipped as it is read, so at
    most MAX_LINE_BYTES plus one piece are held however long a line is (issue 19, R4)."""
    partial = b""  # Invariant: the start of the current line, at most MAX_LINE_BYTES
    skipping = False  # the current line was given out cut: drop the rest of it
    while piece := read():
        start = 0
        while (end := piece.find(b"\n", start)) != -1:
            if not skipping:
                yield _decode(partial + piece[start:end])
            partial, skipping, start = b"", False, end + 1
        if not skipping:
            partial += piece[start:]
            if len(partial) > MAX_LINE_BYTES:
                yield cut_line(partial)
                partial, skipping = b"", True
    if partial:
        yield _decode(partial)


def _decode(raw: bytes) -> str:
    if len(raw) > MAX_LINE_BYTES:
        return cut_line(raw)
    return raw.decode("utf-8", "replace").rstrip("\r")


class LogRing:
    """What a child printed, appended line by line by its reader thread: the last
    `capacity` lines for GET /models/logs, and more for the readers that follow it.

    Bounded twice (issue 19, R4): every line is clipped to MAX_LINE_BYTES, and the lines
    kept cost at most `max_bytes` (a ceiling, counted with `line_cost`); beyond the last
    `capacity` lines, older ones stay only while all kept cost at most `backlog_bytes`.

    Lines are numbered from 0 as they come, so a follower keeps only a number (the lines
    it has seen) and reads on from there (`since`): the ring is every follower's buffer,
    and one that falls behind everything kept learns how many lines it lost. A burst of
    short lines fits in the byte budget, so a reader that keeps up on the whole is not
    dropped by one. The reader thread never waits for a follower: it only wakes those
    that asked (`wake`).
    """

    def __init__(self, capacity: int = 1000, backlog_bytes: int = 4 << 20,
                 max_bytes: int = 4 << 20) -> None:
        # the worst clipped line (4 bytes a character) must fit, or it would not be kept
        assert max_bytes >= 5 * MAX_LINE_BYTES, "max_bytes must hold the longest line"
        self.capacity = capacity
        self.backlog_bytes = backlog_bytes
        self.max_bytes = max_bytes
        self._lines: collections.deque[str] = collections.deque()
        self._bytes = 0
        """Invariant: the sum of `line_cost` over `_lines`, at most `max_bytes`."""
        self._count = 0
        self._lock = threading.Lock()
        # Not an actor: a leaf buffer that decides nothing; a mailbox hop per output line
        # would cost more than it buys.
        self._wakers: list[Callable[[], None]] = []

    def append(self, line: str) -> None:
        line = clip_line(line)
        with self._lock:
            self._lines.append(line)
            self._bytes += line_cost(line)
            self._count += 1
            while self._bytes > self.max_bytes or (len(self._lines) > self.capacity
                                                   and self._bytes > self.backlog_bytes):
                self._bytes -= line_cost(self._lines.popleft())
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
        self._reader = threading.Thread(target=self._read_lines, args=(log, on_line),
                                        daemon=True, name=f"{label}-log-{self.pid}")
        self._reader.start()

    def _watch_exit(self, on_exit: Callable[[], None]) -> None:
        try:
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass  # already reaped: the exit is known anyway
        on_exit()

    def _read_lines(self, log: LogRing, on_line: Callable[[str], None] | None) -> None:
        assert self._popen.stdout is not None
        fd = self._popen.stdout.fileno()  # read raw: a buffered readline holds a whole line
        for line in bounded_lines(lambda: os.read(fd, READ_CHUNK)):
            log.append(line)
            if on_line is not None:
                on_line(line)

    def drain(self, timeout_s: float = DRAIN_S) -> None:
        """Wait, at most `timeout_s`, for the child's last lines to reach its log: its exit
        can be seen before its reader has read them (a busy machine). Longer only while
        a grandchild still holds its output open."""
        self._reader.join(timeout_s)

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
        except (OSError, ValueError):  # a broken pipe, or one closed at its reap
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


def placement_env(devices: list[str] | None) -> dict[str, str]:
    """What tells a child where it was placed: CUDA_VISIBLE_DEVICES for NVML's `CUDA<n>`
    devices, CORRAL_DEVICES for simulated ones (the fake model registers its use there)."""
    if not devices:
        return {}
    env = {"CORRAL_DEVICES": ",".join(devices)}
    cuda = [d[4:] for d in devices if d.startswith("CUDA") and d[4:].isdigit()]
    if cuda and len(cuda) == len(devices):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(cuda)
    return env
