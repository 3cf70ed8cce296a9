"""corral's own files beside its data (the downloads registry, the key budgets): what is
done with one that is damaged.

Such a file is corral's, but it lives in a folder an operator may edit, copy or restore
from a backup, so it is read as untrusted input (issue 37, S3): decoded into typed
structs, and a file that does not decode, or holds values out of range, is set aside
under a new name with one log line naming it and what was wrong. corral then goes on
without it; the file is kept for a person to read, never deleted.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path


def set_aside(path: Path, wrong: str, log: logging.Logger, what: str) -> Path | None:
    """Rename `path` to `<name>.bad-YYYYMMDDTHHMMSS` (a number added if that is taken)
    and log one line saying what was wrong and what corral does instead (`what`, e.g.
    "starting with no downloads remembered"); the new path, or None if it could not be
    moved (said in the same line)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    aside = path.with_name(f"{path.name}.bad-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.bad-{stamp}-{n}")
    try:
        path.rename(aside)
    except FileNotFoundError:
        return None  # set aside by another reader meanwhile (a reload beside a download)
    except OSError as e:
        log.error("%s: %s; it could not be set aside either (%s): %s", path, wrong,
                  e.strerror, what)
        return None
    log.error("%s: %s; set aside as %s, %s", path, wrong, aside.name, what)
    return aside
