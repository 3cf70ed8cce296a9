"""Pure per-device memory accounting (SPEC section 5; the reference's calibrate/reserve/release).

Per device: `total`, `external` (used by processes corral does not manage) and what each
model holds. `available = total - external - held`; a device never reported is
unlimited. Host memory counts only with `account_host`. Owned by the Scheduler; nothing
here reads a device or a clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import msgspec


class DeviceUse(msgspec.Struct, frozen=True, kw_only=True):
    """One row of a measurement, in bytes."""

    kind: Literal["device", "host"]
    name: str
    total: int = 0
    free: int = 0
    model: int = 0
    context: int = 0
    compute: int = 0

    @property
    def self_bytes(self) -> int:
        """What the model itself needs here: weights, KV cache and compute buffers."""
        return self.model + self.context + self.compute


class Breakdown(msgspec.Struct, frozen=True):
    """A model's memory at one context size: `{n_ctx, devices: [...]}`."""

    n_ctx: int
    devices: list[DeviceUse]


@dataclass
class DeviceMemory:
    total: int
    external: int = 0


@dataclass
class Ledger:
    """What every device has, and what every running model holds on it."""

    margin: int
    """Bytes kept free on every device (memory_margin_mib)."""
    account_host: bool = False
    devices: dict[str, DeviceMemory] = field(default_factory=dict)
    held: dict[str, dict[str, int]] = field(default_factory=dict)
    """Model -> device -> bytes reserved. Invariant: only running models hold memory."""

    def _counts(self, row: DeviceUse) -> bool:
        return row.total > 0 and (row.kind == "device" or self.account_host)

    def calibrate(self, mem: Breakdown, reporter: str | None) -> None:
        """Learn totals and outside usage from a report with `total` and `free` per device.

        `reporter` is the model whose own usage is in the report (None for a measure
        child, which allocates nothing); what others hold is tracked, not external.
        """
        for row in mem.devices:
            if not self._counts(row):
                continue
            others = sum(devs.get(row.name, 0) for m, devs in self.held.items() if m != reporter)
            own = row.self_bytes if reporter is not None else 0
            dev = self.devices.setdefault(row.name, DeviceMemory(row.total))
            dev.total = row.total
            dev.external = max(0, row.total - row.free - own - others)

    def reserve(self, model: str, mem: Breakdown | None) -> None:
        """Hold `mem` for `model` (a no-op if it already holds, or nothing is known)."""
        if mem is None or model in self.held:
            return
        self.held[model] = {row.name: row.self_bytes for row in mem.devices if self._counts(row)}

    def release(self, model: str) -> None:
        self.held.pop(model, None)

    def available(self, device: str) -> int | None:
        """Bytes not used by anyone on `device`; None if the device was never reported."""
        dev = self.devices.get(device)
        if dev is None:
            return None
        held = sum(devs.get(device, 0) for devs in self.held.values())
        return dev.total - dev.external - held

    def deficit(self, need: Breakdown | None) -> dict[str, int]:
        """Device -> bytes missing for `need` (a model's `min`), keeping the margin free."""
        if need is None:
            return {}
        short: dict[str, int] = {}
        for row in need.devices:
            avail = self.available(row.name) if self._counts(row) else None
            if avail is None:
                continue
            missing = row.self_bytes - (avail - self.margin)
            if missing > 0:
                short[row.name] = missing
        return short
