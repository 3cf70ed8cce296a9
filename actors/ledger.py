"""Pure per-device memory accounting (SPEC section 5; the reference's calibrate/reserve/release).

Per device: `total`, `external` (used by processes corral does not manage) and what each
model holds. `available = total - external - held`; a device never reported is
unlimited. Host memory counts only with `account_host`. Owned by the Scheduler; nothing
here reads a device or a clock.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal

import msgspec

MiB = 1024 * 1024


# Device names. A device on corral's own machine has its backend's name (`CUDA0`, `sim0`);
# one on a cluster node is named `NODE/DEVICE` (`node_b/CUDA0`). These three functions are
# the only place that builds or takes apart such a name.

def on_node(node: str, device: str) -> str:
    """`device` of cluster node `node`, as the head's ledger names it."""
    return f"{node}/{device}"


@functools.cache  # (a pure function of a name, asked thousands of times a plan)
def node_of(device: str) -> str | None:
    """The node a device is on: `node_b/CUDA0` is on node_b; a name with no node is on
    corral's own machine (None)."""
    node, sep, _ = device.rpartition("/")
    return node if sep else None


def local_name(device: str) -> str:
    """The name a device has on its own machine: `node_b/CUDA0` -> `CUDA0`."""
    return device.rpartition("/")[2]


class DeviceUse(msgspec.Struct, frozen=True, kw_only=True):
    """One row of a measurement, in bytes."""

    kind: Literal["device", "host", "buffer_type"]
    """Only `device` rows (and `host` with account_host) are accounted."""
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


MemoryStatus = Literal["unmeasured", "measuring", "measured", "failed", "at_load", "remote"]
"""`at_load`: a `probe` model with no figures yet; its first load is its measurement."""


class MemoryInfo(msgspec.Struct, frozen=True):
    """A model's memory as GET /models and the `model_memory` event show it (R-5.1)."""

    status: MemoryStatus
    min: Breakdown | None = None
    max: Breakdown | None = None
    effective: Breakdown | None = None
    error: str | None = None
    """Why the last measurement failed."""


class DeviceSample(msgspec.Struct, frozen=True):
    """One device as a DeviceMonitor backend saw it, in bytes."""

    name: str
    kind: Literal["device", "host"]
    total: int
    free: int
    backend: str


@dataclass
class DeviceMemory:
    total: int
    kind: str = "device"
    external: int = 0
    free: int | None = None
    """Free at the last report, as the backend saw it."""


@dataclass
class Ledger:
    """What every device has, and what every running model holds on it."""

    margin: int
    """Bytes kept free on every device (memory_margin_mib)."""
    account_host: bool = False
    devices: dict[str, DeviceMemory] = field(default_factory=dict)
    held: dict[str, dict[str, int]] = field(default_factory=dict)
    """Model -> device -> bytes held: per device the larger of what is reserved for the
    model and what its child was last seen using, so use above a reservation (a loading
    child growing, a sleeping child's leftover context, growth after ready) is never
    invisible. Invariant: only models with a live (or not yet accounted-for) child hold
    memory; `held[m][d] == max(reserved[m][d], observed[m][d])`."""
    reserved: dict[str, dict[str, int]] = field(default_factory=dict)
    """Model -> device -> bytes set aside for it: its measured need while it loads, its
    first observed use once ready."""
    observed: dict[str, dict[str, int]] = field(default_factory=dict)
    """Model -> device -> bytes its child was last seen using (DeviceMonitor reports)."""
    shape: int = 0
    """Bumped when a device appears or its kind or emptiness changes (a lost node's
    devices report 0 bytes): what a placement's candidates are computed from."""
    _samples: dict[str, tuple[DeviceSample, int | None]] = field(default_factory=dict)
    """Device -> its last sample and managed bytes: an identical one changes nothing."""
    version: int = 0
    """Bumped by every change to what a device has free or a model holds (a plan that
    waited may be given again while nothing has changed: policy/memory.py)."""
    _per_device: dict[str, int] | None = None
    """Device -> bytes held by all models: summed when asked, dropped when `held`
    changes (a plan asks once per place it weighs; there can be thousands)."""

    def counted(self, kind: str) -> bool:
        """Memory of this kind is accounted (host RAM only with account_host)."""
        return kind == "device" or self.account_host

    def _totals(self) -> dict[str, int]:
        """Device -> bytes held by all models (summed once per change of `held`)."""
        if self._per_device is None:
            totals: dict[str, int] = {}
            for devs in self.held.values():
                for d, size in devs.items():
                    totals[d] = totals.get(d, 0) + size
            self._per_device = totals
        return self._per_device

    def _held_by_others(self, device: str, model: str | None) -> int:
        mine = self.held.get(model, {}).get(device, 0) if model is not None else 0
        return self._totals().get(device, 0) - mine

    def calibrate(self, mem: Breakdown, reporter: str | None,
                  unknown_only: bool = False) -> None:
        """Learn totals and outside usage from a measurement with `total` and `free`.

        `reporter` is the model whose own usage is in the report (None for a measure
        child, which allocates nothing); what others hold is tracked, not external.
        `unknown_only`: leave devices the DeviceMonitor reported alone (its figures are
        fresher than a measurement's).
        """
        for row in mem.devices:
            if row.total <= 0 or not self.counted(row.kind):
                continue
            if unknown_only and row.name in self.devices:
                continue
            own = row.self_bytes if reporter is not None else 0
            dev = self._device(row.name, row.total, row.kind)
            self._samples.pop(row.name, None)  # the next sample is applied, as it is
            self.version += 1
            dev.free = row.free
            dev.external = max(0, row.total - row.free - own
                               - self._held_by_others(row.name, reporter))

    def observe(self, sample: DeviceSample, managed: int | None) -> None:
        """Calibrate from a DeviceMonitor sample.

        `managed` is what corral's children use on the device by per-process accounting;
        None when the backend cannot attribute memory to processes, and then whatever
        the models hold is assumed to be in use (the reference's rule).
        """
        if not self.counted(sample.kind):
            return
        last = self._samples.get(sample.name)
        if managed is not None and last == (sample, managed):
            return  # as the last time: nothing to recompute (most of a large report)
        self._samples[sample.name] = (sample, managed)
        self.version += 1
        if sample.total <= 0:  # gone (a lost node's device): nothing is placed on it
            dev = self._device(sample.name, 0, sample.kind)
            dev.free = 0
            return
        ours = self._held_by_others(sample.name, None) if managed is None else managed
        dev = self._device(sample.name, sample.total, sample.kind)
        dev.free = sample.free
        dev.external = max(0, sample.total - sample.free - ours)

    def observe_all(self, samples: list[DeviceSample], managed: dict[str, int]) -> None:
        """`observe` each of a report's samples; those as the last time (most of a large
        cluster's, whose monitors account per process) are passed over in one loop."""
        last, mine = self._samples.get, managed.get
        for sample in samples:
            bytes_ = mine(sample.name)
            if bytes_ is None or last(sample.name) != (sample, bytes_):
                self.observe(sample, bytes_)

    def _device(self, name: str, total: int, kind: str) -> DeviceMemory:
        """The device `name`, created if new, with its total and kind as reported now;
        `shape` is bumped when what a placement can choose from changed."""
        dev = self.devices.get(name)
        if dev is None:
            dev = self.devices[name] = DeviceMemory(total, kind)
            self.shape += 1
        elif dev.kind != kind or (dev.total > 0) != (total > 0):
            self.shape += 1
        dev.total, dev.kind = total, kind
        return dev

    def reserve(self, model: str, mem: Breakdown | None) -> None:
        """Set `mem` aside for `model`, in place of its earlier reservation (a no-op if
        nothing is known)."""
        if mem is None:
            return
        self.reserved[model] = {row.name: row.self_bytes for row in mem.devices
                                if self.counted(row.kind)}
        self._hold(model)

    def saw(self, model: str, use: dict[str, int]) -> None:
        """`model`'s child was seen using `use` (device -> bytes)."""
        seen = {d: b for d, b in use.items()
                if b > 0 and d in self.devices and self.counted(self.devices[d].kind)}
        if self.observed.get(model) != seen:  # most reports see most children as before
            self.observed[model] = seen
            self._hold(model)

    def unreserve(self, model: str) -> None:
        """Drop the reservation but keep what the child is still seen using (it sleeps)."""
        self.reserved.pop(model, None)
        self._hold(model)

    def release(self, model: str) -> None:
        """The child is gone and no report shows it any more: it holds nothing."""
        self._per_device = None
        self.version += 1
        self.held.pop(model, None)
        self.reserved.pop(model, None)
        self.observed.pop(model, None)

    def _hold(self, model: str) -> None:
        res, seen = self.reserved.get(model, {}), self.observed.get(model, {})
        hold = {d: max(res.get(d, 0), seen.get(d, 0)) for d in res.keys() | seen.keys()}
        if hold or model in self.reserved:
            if self.held.get(model) != hold:
                self.held[model] = hold
                self._per_device = None
                self.version += 1
        elif self.held.pop(model, None) is not None:
            self._per_device = None
            self.version += 1

    def all_available(self) -> dict[str, int]:
        """Device -> `available(device)`, for every device reported."""
        held = self._totals()
        return {d: dev.total - dev.external - held.get(d, 0) for d, dev in self.devices.items()}

    def available(self, device: str) -> int | None:
        """Bytes not used by anyone on `device`; None if the device was never reported."""
        dev = self.devices.get(device)
        if dev is None:
            return None
        return dev.total - dev.external - self._held_by_others(device, None)

    def deficit(self, need: Breakdown | None,
                give_back: dict[str, int] | None = None) -> dict[str, int]:
        """Device -> bytes missing for `need` (a model's `min`), keeping the margin free.

        `give_back` is memory about to come free (held by models being stopped).
        """
        if need is None:
            return {}
        short: dict[str, int] = {}
        for row in need.devices:
            avail = self.available(row.name) if self.counted(row.kind) else None
            if avail is None:
                continue
            avail += (give_back or {}).get(row.name, 0)
            missing = row.self_bytes - (avail - self.margin)
            if missing > 0:
                short[row.name] = missing
        return short

    def holds_of(self, models: list[str]) -> dict[str, int]:
        """Device -> bytes held by `models` together."""
        total: dict[str, int] = {}
        for model in models:
            for device, size in self.held.get(model, {}).items():
                total[device] = total.get(device, 0) + size
        return total
