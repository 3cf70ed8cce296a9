"""Key budgets kept across restarts: the windows of the keys with a requests_per_min or
tokens_per_min (policy/tenants.py), in `STATE_DIR/key-budgets.json`, written atomically
(a temporary file renamed over it) every SAVE_EVERY_S while they change, and at shutdown.
A restart within a minute therefore does not hand a key a fresh budget.

The file is read as untrusted input (issue 37, S3): one that cannot be read, does not
decode or was saved in the future is set aside (runtime/state_files.py) and every key starts
with a fresh window; values out of range within one are dropped by `Tenants.restore`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import msgspec

from .policy.tenants import WINDOW_S, KeptUsage
from .runtime.state_files import set_aside

log = logging.getLogger("corral.scheduler")

SAVE_EVERY_S = 2.0
FILE = "key-budgets.json"


class Budgets(msgspec.Struct, frozen=True):
    saved_at: float
    """Wall time (time.time()) of the save."""
    keys: dict[str, KeptUsage]


def save(state_dir: Path, keys: dict[str, KeptUsage]) -> None:
    path = state_dir / FILE
    tmp = path.with_suffix(".tmp")
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(msgspec.json.encode(Budgets(saved_at=time.time(), keys=keys)))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not save the key budgets to %s: %s (a restart now would give "
                    "every key a fresh window)", path, e)


FRESH = "every key starts with a fresh window"


def load(state_dir: Path) -> tuple[dict[str, KeptUsage], float]:
    """The saved windows and how long ago (wall time) they were saved; none if there is
    no file, or one that is damaged (set aside, saying why in one line)."""
    path = state_dir / FILE
    try:
        data = msgspec.json.decode(path.read_bytes(), type=Budgets)
    except FileNotFoundError:
        return {}, 0.0
    except OSError as e:
        set_aside(path, f"cannot be read ({e.strerror})", log, FRESH)
        return {}, 0.0
    except (msgspec.DecodeError, RecursionError) as e:  # (ValidationError is one)
        set_aside(path, f"not a key budgets file: {e}", log, FRESH)
        return {}, 0.0
    away_s = time.time() - data.saved_at
    if away_s < -WINDOW_S:  # a clock set back a little is no reason to lose them
        set_aside(path, f"saved {-away_s:.0f} s in the future (saved_at {data.saved_at})",
                  log, FRESH)
        return {}, 0.0
    return data.keys, max(0.0, away_s)
