"""Fixtures, and the check that the suite leaves no process of ours behind."""

from __future__ import annotations

import compileall
import fcntl
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from actors.policy.quiet import Quiet
from tests.helpers import ROOT, Corral

Quiet.CHECK = True  # the policies the tests drive run the rules where they would be
# skipped, and assert that they decided nothing (actors/policy/quiet.py)

MARK = "CORRAL_TEST_RUN"
# Inherited by every process the tests start (and by a pytest run inside a network
# namespace for the cluster tests, whose processes the outer run then checks too). With
# pytest-xdist each worker has a mark of its own: a worker that ends first checks only
# the processes its own tests started, never those another worker's tests still run.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if WORKER and not os.environ.get(MARK, "").endswith(f"-{WORKER}"):
    os.environ[MARK] = f"{os.environ.get(MARK) or uuid.uuid4().hex}-{WORKER}"
os.environ.setdefault(MARK, uuid.uuid4().hex)


def our_processes() -> list[psutil.Process]:
    """Processes other than this one that carry this run's environment marker."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(MARK) == os.environ[MARK] and proc.status() != "zombie":
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind() -> Iterator[None]:
    # Each run (each worker) has a home of its own for what corral keeps by default
    # (XDG_STATE_HOME: state_dir), so tests that run side by side share nothing on disk.
    home = tempfile.mkdtemp(prefix=f"corral-test-{WORKER or 'run'}-")
    os.environ["XDG_STATE_HOME"] = os.path.join(home, "state")
    yield
    left = psutil.wait_procs(our_processes(), timeout=5)[1]
    for proc in left:
        proc.kill()
    shutil.rmtree(home, ignore_errors=True)
    assert not left, f"processes left behind by the tests: {left}"


@pytest.fixture
def corral(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Corral]]:
    """Start corral processes: `corral(config_text, *cli_args)`; all stopped at teardown."""
    started: list[Corral] = []

    def start(config_text: str | None, *args: str) -> Corral:
        home = tmp_path / f"corral{len(started)}"
        home.mkdir()
        c = Corral(config_text, *args, home=home)
        started.append(c)
        return c

    yield start
    for c in started:
        rc = c.stop()
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            print(f"--- corral log (exit {rc}) ---\n{c.log()[-6000:]}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
    return report


@pytest.fixture(autouse=True)
def alone_when_marked(request: pytest.FixtureRequest,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A test marked `alone` runs while no other test runs, on any worker: it waits for
    the running ones to end, and none starts until it has (a lock file per run: every test
    holds the room shared, an `alone` one holds it whole; the turnstile lets no new test
    in while one waits for the room)."""
    run = getattr(request.config, "workerinput", {}).get("testrunuid")
    if run is None:  # one process: nothing runs beside it
        yield
        return
    # the run's temporary folder, above each worker's own (kept and removed as pytest does)
    locks = tmp_path_factory.getbasetemp().parent / f"alone-{run}"
    alone = request.node.get_closest_marker("alone") is not None
    with open(f"{locks}.turnstile", "a") as turnstile, open(f"{locks}.room", "a") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if alone:
            fcntl.flock(room, fcntl.LOCK_EX)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(room, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile corral's modules once, before any test starts a process: with
    PYTHONDONTWRITEBYTECODE set (as on these machines) every corral, fake child and
    bench process otherwise compiled the ~150 of them again (0.2 s of each start)."""
    if not hasattr(session.config, "workerinput"):  # (the controller, once)
        for folder in ("actors", "bench"):
            compileall.compile_dir(ROOT / folder, quiet=2)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked `alone` run on one worker, one after another (xdist's loadgroup)."""
    for item in items:
        if item.get_closest_marker("alone") is not None:
            item.add_marker(pytest.mark.xdist_group("alone"))
