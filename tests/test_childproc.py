"""The OS edge with tiny real child programs: exits, process groups, parent death."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import psutil

from actors.childproc import ChildProcess, LogRing, pick_port, port_in_use
from tests.helpers import ROOT, pid_alive, wait_until


def spawn(code: str, ring: LogRing | None = None) -> tuple[ChildProcess, threading.Event]:
    exited = threading.Event()
    child = ChildProcess([sys.executable, "-c", code], {"PATH": "/usr/bin:/bin"},
                         ring or LogRing(), on_exit=exited.set)
    return child, exited


def test_exit_is_noticed_and_reaped_with_its_real_status() -> None:
    child, exited = spawn("import sys; print('hello', flush=True); sys.exit(5)")
    assert exited.wait(10)
    assert child.reap() == 5
    assert child.signal_group(9) is False  # reaped: never signal a group id again


def test_output_is_kept_line_by_line_in_a_bounded_ring() -> None:
    ring = LogRing(capacity=3)
    child, exited = spawn("for i in range(5): print(f'line {i}', flush=True)", ring)
    assert exited.wait(10)
    child.reap()
    wait_until(lambda: ring.lines() == ["line 2", "line 3", "line 4"], 5, "log lines")


def test_reap_kills_a_grandchild_left_in_the_group() -> None:
    code = ("import subprocess, sys\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(p.pid, flush=True)\n")
    ring = LogRing()
    child, exited = spawn(code, ring)
    assert exited.wait(10)  # the leader is gone, its child is orphaned in the group
    grandchild = int(wait_until(lambda: ring.lines(), 5, "grandchild pid")[0])
    assert pid_alive(grandchild)
    assert child.reap() == 0
    wait_until(lambda: not pid_alive(grandchild), 5, "grandchild to die")


def test_children_die_with_a_sigkilled_parent() -> None:
    """PR_SET_PDEATHSIG: the supervisor's death, even by SIGKILL, takes its children."""
    parent_code = (
        "import sys, threading\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from actors.childproc import ChildProcess, LogRing\n"
        "c = ChildProcess([sys.executable, '-c', 'import time; time.sleep(60)'], {},"
        " LogRing(), on_exit=lambda: None)\n"
        "print(c.pid, flush=True)\n"
        "threading.Event().wait()\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert pid_alive(child_pid)
        born = psutil.Process(child_pid).create_time()  # (its pid may be reused once gone)

        def gone() -> bool:
            try:
                return not pid_alive(child_pid) or \
                    psutil.Process(child_pid).create_time() != born
            except psutil.NoSuchProcess:
                return True
        parent.kill()
        parent.wait()
        wait_until(gone, 5, "the child to die with its parent")
    finally:
        parent.kill()
        parent.wait()


def test_stdin_is_a_pipe_that_closes_when_reaped() -> None:
    child, exited = spawn("import sys; sys.stdin.read(); print('eof', flush=True)")
    child.write_stdin("hello")
    assert not exited.wait(0.2)  # still reading stdin
    child.signal_group(15)
    assert exited.wait(10)
    assert child.reap() == -15


def test_pick_port_gives_a_free_port() -> None:
    port = pick_port()
    assert 0 < port < 65536 and not port_in_use(port)


def test_a_missing_program_is_an_error_at_spawn_not_a_strange_exit() -> None:
    import pytest

    with pytest.raises(FileNotFoundError):
        ChildProcess(["corral-no-such-program"], {"PATH": "/usr/bin:/bin"}, LogRing(),
                     on_exit=lambda: None)


def test_the_pid_is_the_program_itself_in_its_own_group() -> None:
    import os

    child, exited = spawn("import time; time.sleep(30)")
    try:
        # setpriv (when used) has exec'd into the program: same pid, the program's argv
        proc = Path(f"/proc/{child.pid}")
        wait_until(lambda: "time.sleep(30)" in (proc / "cmdline").read_text(), 5,
                   "the program to be exec'd")
        status = (proc / "status").read_text()
        assert os.getpgid(child.pid) == child.pid
        assert "PPid:\t" + str(os.getpid()) in status
    finally:
        child.signal_group(9)
        assert exited.wait(10)
        child.reap()
