"""Joining the Ray cluster with a deadline, in a way that can be abandoned (issue 19).

`ray.init` towards an address where nothing listens retries inside Ray's C++ core for
minutes, printing only its own warnings, and cannot be interrupted. So the head first
checks that something accepts connections at the address (plain sockets, a short timeout
each), and only then runs `ray.init`, on a daemon thread it waits for with the same
deadline. Whoever waits can be woken by `Waker.abandon` (SIGTERM during startup): the
wait ends at once, and a `ray.init` still running is left to die with the process.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import ray

from ..config.model import ClusterConfig, ConfigError

log = logging.getLogger("corral.cluster")

PROBE_EVERY_S = 0.5
"""How often the address is tried again while nothing accepts connections there."""
DEFAULT_GCS_PORT = 6379


class Abandoned(Exception):
    """corral was told to stop while it waited to join or to reach its agents."""


class Waker:
    """One condition for the waits of a startup: what they wait for, or `abandon`."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        # Not an actor: the startup thread waits on it, and a signal's handler (through
        # the loop) must be able to end that wait at once; it holds no state but a flag.
        self.abandoned = False

    def abandon(self) -> None:
        """Wake every wait, now and later, with Abandoned (not from a signal handler)."""
        with self._cv:
            self.abandoned = True
            self._cv.notify_all()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def wait_for(self, done: Callable[[], bool], deadline: float) -> bool:
        """Wait until `done()` (True) or `deadline` (monotonic; False); raise Abandoned."""
        with self._cv:
            ok = self._cv.wait_for(lambda: done() or self.abandoned,
                                   max(0.0, deadline - time.monotonic()))
            if self.abandoned:
                raise Abandoned
            return bool(ok)


def gcs_target(address: str) -> tuple[str, int] | None:
    """Where a `ray_address` is expected to accept connections: (host, port), or None
    when it names no place (`auto`, `local`)."""
    rest = address.split("://", 1)[-1]
    if not rest or rest in ("auto", "local"):
        return None
    host, sep, port = rest.rpartition(":")
    if not sep:
        return rest, DEFAULT_GCS_PORT
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return None


def probe(address: str, target: tuple[str, int], deadline: float, waker: Waker,
          timeout_s: float) -> None:
    """Return once something accepts a connection at `target`; raise ConfigError at
    `deadline`, Abandoned when woken."""
    last: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            socket.create_connection(target, timeout=min(1.0, remaining)).close()
            return
        except OSError as e:
            last = e
        waker.wait_for(lambda: False, min(time.monotonic() + PROBE_EVERY_S, deadline))
    why = (last.strerror or str(last)) if last is not None else "no time left"
    raise ConfigError(
        f"cluster.ray_address: nothing answers at {target[0]}:{target[1]} ({why}; tried "
        f"for {timeout_s:g} s, cluster.connect_timeout_s); check that a Ray head runs "
        f"there (ray status --address {address}) and that this machine can reach that "
        "port")


class _QuietMainThreadWarning(logging.Filter):
    """ray.init on another thread warns that it set no SIGTERM handler: corral has its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def join(cluster: ClusterConfig, waker: Waker) -> None:
    """Join the Ray cluster at `cluster.ray_address` as a driver within
    `cluster.connect_timeout_s`; raise ConfigError saying what to check, or Abandoned."""
    address = cluster.ray_address
    assert address is not None
    timeout_s = cluster.connect_timeout_s
    deadline = time.monotonic() + timeout_s
    target = gcs_target(address)
    log.info("joining the Ray cluster at %s (for at most %g s)", address, timeout_s)
    if target is not None:
        probe(address, target, deadline, waker, timeout_s)
        log.info("%s:%d accepts connections; starting Ray's driver", *target)
    failed: list[BaseException] = []
    done = threading.Event()

    def init() -> None:
        try:
            ray.init(address=address, namespace=cluster.namespace, log_to_driver=False,
                     logging_level=logging.WARNING)
        except BaseException as e:  # handed to the waiting thread
            failed.append(e)
        finally:
            done.set()
            waker.wake()

    quiet = _QuietMainThreadWarning()
    logging.getLogger("ray._private.worker").addFilter(quiet)
    threading.Thread(target=init, daemon=True, name="ray-init").start()
    try:
        joined = waker.wait_for(done.is_set, deadline)
    finally:
        logging.getLogger("ray._private.worker").removeFilter(quiet)
    if not joined:
        raise ConfigError(
            f"cluster.ray_address: the Ray cluster at {address} did not let corral join "
            f"within {timeout_s:g} s (cluster.connect_timeout_s); check that it is a Ray "
            f"head's address and that it runs Ray {ray.__version__}, as corral does")
    if failed:
        e = failed[0]
        raise ConfigError(f"cluster.ray_address: cannot join the Ray cluster at {address}: "
                          f"{type(e).__name__}: {e}") from None
