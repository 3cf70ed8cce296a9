"""`[[devices]]`: simulated devices, for a machine without the GPUs a config names
(R-5.8; actors/device.py runs them)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta


class DeviceConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One `[[devices]]` table: a simulated device (R-5.8)."""

    name: str
    kind: Literal["simulated"]
    total_mib: Annotated[float, Meta(gt=0)]
