"""The `[batches]` table (issue 44, part 1): OpenAI's Files and Batch APIs, whose lines
run below every class while nothing else waits (actors/batches/)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta


class BatchesConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What corral keeps and runs of `POST /v1/files` and `POST /v1/batches`."""

    enabled: bool = True
    """false: /v1/files and /v1/batches answer 404 naming this key."""
    keep_days: Annotated[float, Meta(gt=0)] = 30.0
    """Files and finished batches older than this are deleted (checked hourly and at
    start)."""
    max_file_mib: Annotated[float, Meta(gt=0, le=4096)] = 200.0
    """The largest file `POST /v1/files` takes (OpenAI's bound for a batch's input); the
    body must also fit `max_body_mib`."""
    max_lines: Annotated[int, Meta(ge=1, le=1_000_000)] = 50_000
    """The most lines one batch may have (OpenAI's bound)."""
    idle_s: Annotated[float, Meta(ge=0, le=86400)] = 60.0
    """A line's load makes room only with models no request of a class (not a batch's
    line) has used for this long: the batch runs in the others' idle windows."""
    lines_at_once: Annotated[int, Meta(ge=1, le=256)] = 4
    """A batch's lines in flight at once, all for one model (so that one load serves
    many): each waits, below every class, for a slot no other request wants."""
