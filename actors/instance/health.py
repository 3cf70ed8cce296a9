"""How corral tells a child is up and still well (R-3.3): the readiness poll after a
spawn, and the liveness probe of a loaded `http` child. Each runs on a helper thread and
hands its finding to a callback, which tells the child's actor."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import msgspec

from .childcall import call

POLL_S = 2.0
"""The longest one readiness poll may take, its whole answer included."""
ANSWER_MAX = 1 << 20
"""The most of a health answer read: a child's /health says little."""


def wait_ready_http(host: str, port: int, path: str, abandon: threading.Event,
                    deliver: Callable[[], None]) -> None:
    """Poll `path` until it answers 200, then call `deliver()` once (R-3.3 `http` mode).

    Polls every 10 ms for the first second (most children are up by then, and a late
    poll is pure added latency), then backs off to 250 ms; returns early once `abandon`
    is set (the child exited or is being stopped).
    """
    delay_s = 0.01
    start = time.monotonic()
    while not abandon.is_set():
        try:
            status, _ = call(host, port, "GET", path, deadline=time.monotonic() + POLL_S,
                             max_bytes=ANSWER_MAX)
            if status == 200:
                deliver()
                return
        except (OSError, ValueError):
            pass  # not listening yet (or not answering as a server would)
        abandon.wait(delay_s)
        if time.monotonic() - start > 1.0:
            delay_s = min(delay_s * 2, 0.25)


def probe_health(host: str, port: int, path: str, timeout_s: float,
                 deliver: Callable[[bool, str], None]) -> None:
    """One liveness check: GET `path`, its whole answer within `timeout_s` (a child that
    trickles it a byte at a time fails the check: the review of S6), then
    `deliver(ok, detail)` once."""
    try:
        status, body = call(host, port, "GET", path,
                            deadline=time.monotonic() + timeout_s, max_bytes=ANSWER_MAX)
        text = body[:200].decode(errors="replace")
        ok, detail = status == 200, f"{path} answered {status} {text!r}"
    except TimeoutError:
        ok, detail = False, f"{path} did not answer within {timeout_s:g} s"
    except (OSError, ValueError) as e:
        ok, detail = False, f"{path} failed: {e}"
    deliver(ok, detail)


class Liveness(msgspec.Struct, frozen=True):
    """How a loaded `http` child is watched (R-3.3): a poll every `interval_s` (0: none),
    and after `failures` failures or timeouts in a row it is reported unhealthy."""

    interval_s: float = 0.0
    failures: int = 3
