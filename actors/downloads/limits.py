"""What one download may take (issue 37, S4: 30 downloads ran at once, one filled 2.9 GiB
in 15 s, and failed ones stayed listed forever). Pure but for `free_bytes`: each check
takes what the download child said and the free space, and returns the reason it must
stop, worded for the download's entry and event, or None.

The bounds, from `[downloads]`: `max_concurrent` (the queue is jobs.py's), `max_gib` for
one download, `min_free_gib` left free on the folder's disk, `keep_failed` entries.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..config.downloads import DownloadsConfig

GIB = 1 << 30


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def free_bytes(folder: Path) -> int:
    """Free bytes on the disk that holds `folder` (or its nearest existing parent)."""
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def before_start(limits: DownloadsConfig, free: int, folder: Path) -> str | None:
    """Why no download may start now (the disk is under its floor already)."""
    if free < limits.min_free_gib * GIB:
        return (f"{gib(free)} GiB free in {folder}, under downloads.min_free_gib = "
                f"{limits.min_free_gib:g}; free some space there, or lower it")
    return None


def while_running(limits: DownloadsConfig, downloaded: int, total: int, free: int,
                  folder: Path) -> str | None:
    """Why a download that has brought `downloaded` bytes of the `total` its child
    listed (0: not known yet) must stop, with `free` bytes left on the disk."""
    cap = limits.max_gib
    if cap is not None and total > cap * GIB:
        return (f"the hub lists {gib(total)} GiB to download, over downloads.max_gib = "
                f"{cap:g}; raise it to download this repo")
    if cap is not None and downloaded > cap * GIB:
        return (f"{gib(downloaded)} GiB downloaded (more than the hub listed), over "
                f"downloads.max_gib = {cap:g}; stopped")
    floor = limits.min_free_gib * GIB
    coming = max(0, total - downloaded)
    if free - coming < floor:
        then = f"{gib(coming)} GiB more would leave" if coming else "that leaves"
        return (f"{then} {gib(max(0, free - coming))} GiB free in {folder}, under "
                f"downloads.min_free_gib = {limits.min_free_gib:g}; free some space "
                "there, or lower it")
    return None
