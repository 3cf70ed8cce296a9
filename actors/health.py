"""How corral tells a child is up and still well (R-3.3): the readiness poll after a
spawn, and the liveness probe of a loaded `http` child. Each runs on a helper thread and
hands its finding to a callback, which tells the child's actor."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable

import msgspec


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
        conn = http.client.HTTPConnection(host, port, timeout=2.0)
        try:
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                deliver()
                return
        except (OSError, http.client.HTTPException):
            pass  # not listening yet
        finally:
            conn.close()
        abandon.wait(delay_s)
        if time.monotonic() - start > 1.0:
            delay_s = min(delay_s * 2, 0.25)


def probe_health(host: str, port: int, path: str, timeout_s: float,
                 deliver: Callable[[bool, str], None]) -> None:
    """One liveness check: GET `path`, then `deliver(ok, detail)` once."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read(200).decode(errors="replace")
        ok, detail = resp.status == 200, f"{path} answered {resp.status} {body!r}"
    except TimeoutError:
        ok, detail = False, f"{path} did not answer within {timeout_s:g} s"
    except (OSError, http.client.HTTPException) as e:
        ok, detail = False, f"{path} failed: {e}"
    finally:
        conn.close()
    deliver(ok, detail)


class Liveness(msgspec.Struct, frozen=True):
    """How a loaded `http` child is watched (R-3.3): a poll every `interval_s` (0: none),
    and after `failures` failures or timeouts in a row it is reported unhealthy."""

    interval_s: float = 0.0
    failures: int = 3
