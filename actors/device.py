"""DeviceMonitor actor and its backends: nvml, host and simulated (R-5.8).

The monitor samples every device (total and free) and what the process tree of each
tracked model uses, and reports both to the Scheduler, which owns the ledger. It decides
nothing. It samples every `device_poll_s` and at once whenever a child is spawned, ready
or gone, so the ledger learns about a freed device without waiting for the next poll.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, assert_never

import psutil

from .base import BaseActor, CrashHandler
from .config.model import Config, ConfigError, DeviceConfig
from .ledger import DeviceSample, MiB
from .messages import (
    DeviceReport,
    DevicesReported,
    Inbox,
    MonitorMessage,
    SampleTick,
    SchedulerMessage,
    TrackModel,
)
from .runtime.timers import Timers

log = logging.getLogger("corral.devices")

ProcessTable = dict[str, dict[int, int]]
"""Device name -> pid -> bytes that process uses there."""


class Backend(Protocol):
    name: str

    def sample(self) -> list[DeviceSample]:
        """Every device this backend sees, with its total and free bytes."""
        ...

    def processes(self, pids: set[int]) -> ProcessTable | None:
        """Per-process usage covering at least `pids`; None if it cannot attribute."""
        ...


def _alive(pid: int) -> bool:
    """True for a running process; a zombie has freed its memory already."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def process_tree(pid: int) -> set[int]:
    """`pid` and all its descendants (a child server may fork workers)."""
    try:
        return {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
    except psutil.Error:
        return {pid}


class SimulatedBackend:
    """Devices declared in the config; used memory is what live processes registered.

    Each user writes `<ledger_dir>/<device>/<pid>` holding a decimal byte count (the
    fake model server's --device-mib does). A file whose process is dead counts nothing
    and is removed, so memory frees when its process dies.
    """

    name = "simulated"

    def __init__(self, devices: list[DeviceConfig], ledger_dir: Path) -> None:
        self.totals = {d.name: int(d.total_mib * MiB) for d in devices}
        self.ledger_dir = ledger_dir
        for device in self.totals:
            (ledger_dir / device).mkdir(parents=True, exist_ok=True)

    def _table(self) -> ProcessTable:
        table: ProcessTable = {}
        for device in self.totals:
            users = table[device] = {}
            with os.scandir(self.ledger_dir / device) as entries:
                for entry in entries:
                    if not entry.name.isdigit():
                        continue
                    pid = int(entry.name)
                    if not _alive(pid):
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                        continue
                    try:
                        users[pid] = int(Path(entry.path).read_text().strip() or 0)
                    except (OSError, ValueError):
                        continue  # being written, or not a number: not counted
        return table

    def sample(self) -> list[DeviceSample]:
        table = self._table()
        return [DeviceSample(name, "device", total, max(0, total - sum(table[name].values())),
                             self.name)
                for name, total in self.totals.items()]

    def processes(self, pids: set[int]) -> ProcessTable | None:
        return self._table()


class HostBackend:
    """Host memory through psutil; counted only with `account_host = true`."""

    name = "host"

    def sample(self) -> list[DeviceSample]:
        vm = psutil.virtual_memory()
        return [DeviceSample("host", "host", vm.total, vm.available, self.name)]

    def processes(self, pids: set[int]) -> ProcessTable | None:
        users: dict[int, int] = {}
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                users[pid] = psutil.Process(pid).memory_info().rss
        return {"host": users}


class NvmlBackend:
    """NVIDIA GPUs through NVML (nvidia-ml-py). Devices are named CUDA0, CUDA1, ...

    NVML reports host pids: inside a container none of them exists here, and then
    `processes` returns None and the monitor attributes by the change in free memory.
    The names follow NVML's order, which is CUDA's only with CUDA_DEVICE_ORDER=PCI_BUS_ID.
    """

    name = "nvml"

    def __init__(self) -> None:
        import pynvml  # raises NVMLError_LibraryNotFound at nvmlInit without a driver

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                        for i in range(pynvml.nvmlDeviceGetCount())]

    def sample(self) -> list[DeviceSample]:
        out = []
        for i, handle in enumerate(self.handles):
            info = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(DeviceSample(f"CUDA{i}", "device", int(info.total), int(info.free),
                                    self.name))
        return out

    def processes(self, pids: set[int]) -> ProcessTable | None:
        table: ProcessTable = {}
        seen: set[int] = set()
        for i, handle in enumerate(self.handles):
            users = table[f"CUDA{i}"] = {}
            for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                seen.add(proc.pid)
                # usedGpuMemory is None where the driver cannot tell (e.g. Windows WDDM)
                users[proc.pid] = users.get(proc.pid, 0) + int(proc.usedGpuMemory or 0)
        if seen and not any(psutil.pid_exists(pid) for pid in seen):
            return None  # host pids seen from inside a container
        return table

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()


def discover(config: Config) -> list[Backend]:
    """The backends for this config: simulated devices if declared, else NVML if a driver
    answers; host memory too with `account_host`."""
    backends: list[Backend] = []
    if config.devices:
        path = config.sim_ledger_path()
        try:
            backends.append(SimulatedBackend(config.devices, path))
        except OSError as e:
            raise ConfigError(f"simulated_ledger_dir: cannot use {path}: {e.strerror}; "
                              "set simulated_ledger_dir or state_dir to a writable "
                              "folder") from None
    else:
        try:
            nvml = NvmlBackend()
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded...
            log.info("nvml: no usable NVIDIA driver (%s: %s); GPU memory is not watched",
                     type(e).__name__, e)
        else:
            log.info("nvml: %d device(s)", len(nvml.handles))
            backends.append(nvml)
    # Always: suspended models' copies are in host RAM, and a reload may add the first
    # model with a suspend method (counted only with account_host in the ledger).
    backends.append(HostBackend())
    return backends


class DeviceMonitor(BaseActor):
    """Samples the backends and reports to the Scheduler (R-5.8)."""

    def __init__(self, backends: list[Backend], scheduler: Inbox[SchedulerMessage], timers: Timers,
                 poll_s: float, on_crash: CrashHandler) -> None:
        super().__init__("devices", on_crash)
        self.backends = backends
        self.scheduler = scheduler
        self.timers = timers
        self.poll_s = poll_s
        self.tracked: dict[str, int] = {}
        """Model -> pid of its ready child."""
        self.baseline: dict[str, dict[str, int]] = {}
        """Model -> device -> free bytes when its child was spawned."""
        self.ready: set[str] = set()
        """Tracked models whose child is ready."""
        self.suspended: set[str] = set()
        """Tracked models whose child is suspended (its devices given back)."""
        self.charged: dict[str, dict[str, int]] = {}
        """Model -> device -> what its load took on a device with no per-process figures:
        the free memory lost between its spawn and its ready (loads on one device run
        one at a time, so no other load is in that window), fixed from then on."""

    def on_start(self) -> None:
        if self.backends:
            self.actor_ref.tell(SampleTick())

    def on_stop(self) -> None:
        for backend in self.backends:
            if isinstance(backend, NvmlBackend):
                backend.close()

    def on_receive(self, message: MonitorMessage) -> None:
        match message:
            case SampleTick():
                self.report()
                self.timers.after(self.poll_s, self.actor_ref, SampleTick())
            case TrackModel(model=model, event=event, pid=pid):
                self.track(model, event, pid)
            case _:
                assert_never(message)

    def track(self, model: str, event: str, pid: int | None) -> None:
        if event in ("spawned", "waking") and pid is not None:  # a wake is a load
            devices, _ = self.sample(set())
            self.baseline[model] = {d.name: d.free for d in devices}
            self.tracked[model] = pid
            self.ready.discard(model)
            self.suspended.discard(model)
        elif event == "suspended":  # it gave its devices back
            self.charged[model] = dict.fromkeys(self.charged.get(model, {}), 0)
            self.suspended.add(model)
        elif event == "woken" and model not in self.tracked:
            self.suspended.discard(model)  # not tracked: no memory accounting
        elif event in ("ready", "woken") and pid is not None:
            self.tracked[model] = pid
            self.suspended.discard(model)
            self.ready.add(model)
            devices, _ = self.sample(set())
            before = self.baseline.pop(model, {})
            self.charged[model] = {d.name: max(0, before[d.name] - d.free) for d in devices
                                   if d.name in before and d.kind == "device"}
        else:
            self.tracked.pop(model, None)
            self.baseline.pop(model, None)
            self.charged.pop(model, None)
            self.ready.discard(model)
            self.suspended.discard(model)
        self.report()

    def sample(self, pids: set[int]) -> tuple[list[DeviceSample], ProcessTable]:
        """Every device, and per-process usage on the devices that can attribute it."""
        devices: list[DeviceSample] = []
        table: ProcessTable = {}
        for backend in self.backends:
            try:
                devices += backend.sample()
                table.update(backend.processes(pids) or {})
            except Exception as e:  # a GPU fell off the bus, a file vanished: skip once
                self.log.warning("%s: sampling failed: %s", backend.name, e)
        return devices, table

    @staticmethod
    def usage_of(tree: Iterable[int], table: ProcessTable) -> dict[str, int]:
        pids = set(tree)
        return {device: sum(b for pid, b in users.items() if pid in pids)
                for device, users in table.items()}

    def report(self) -> None:
        trees = {model: process_tree(pid) for model, pid in self.tracked.items()}
        devices, table = self.sample(set().union(*trees.values()))
        usage = {model: self.usage_of(tree, table) for model, tree in trees.items()}
        for model, tree_usage in usage.items():
            # No per-process figures on a device (a container): what its free memory
            # lost since the spawn is this model's while it loads, and what it lost by
            # its ready after that (later drops belong to later loads).
            before = self.baseline.get(model, {})
            charged = self.charged.get(model, {})
            for d in devices:
                if d.name in table or d.kind != "device":
                    continue
                if d.name in charged:
                    tree_usage[d.name] = charged[d.name]
                elif d.name in before:
                    tree_usage[d.name] = max(0, before[d.name] - d.free)
        managed = {device: sum(u.get(device, 0) for u in usage.values()) for device in table}
        self.scheduler.tell(DevicesReported(report=DeviceReport(
            devices=devices, managed=managed, usage=usage, tracked=sorted(self.tracked),
            backends=[b.name for b in self.backends], ready=sorted(self.ready),
            suspended=sorted(self.suspended))))
