"""The `[journal]` table (issue 40): one record of every request, kept in memory and in
SQLite under `state_dir`."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta


class JournalConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What corral keeps of the requests it served (actors/journal/)."""

    enabled: bool = True
    """false: no record is kept (GET /requests answers 404 naming this key)."""
    keep_days: Annotated[float, Meta(gt=0)] = 7.0
    """Records older than this are deleted from the file."""
    max_mib: Annotated[float, Meta(gt=0)] = 256.0
    """The file's size bound: past it, the oldest records are deleted."""
    ring: Annotated[int, Meta(ge=1, le=1_000_000)] = 2000
    """Records kept in memory (the newest: at least this many, in whole pages of up to
    500), answered when the file cannot be."""
    capture: bool = False
    """Keep each model request's body and its answer's too, up to capture_kib each,
    shown to admin keys only. Headers (a key, Authorization) are never kept."""
    capture_kib: Annotated[int, Meta(ge=1, le=1024)] = 32
