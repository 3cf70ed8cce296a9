"""The `[metrics]` table (issue 40): what GET /metrics shows beside corral's own."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta


class MetricsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """GET /metrics (http/metrics.py, http/scrape.py)."""

    children: bool = False
    """Also each loaded child's own /metrics, merged, with a `model` (and `copy`) label
    (GET /metrics?children=1 asks it of one scrape)."""
    child_timeout_s: Annotated[float, Meta(gt=0, le=60)] = 2.0
    """How long a child's /metrics may take; one that takes longer is left out (its
    corral_child_scrape_ok says 0)."""
