"""One device report from many: the head's own monitor and every node's."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec

from ..ledger import DeviceSample, on_node
from ..messages import (
    DeviceReport,
    DevicesReported,
    TrackModel,
)

if TYPE_CHECKING:
    from .head import Cluster


def report_on_node(node: str, report: DeviceReport) -> DeviceReport:
    """A node's report with its devices named `node/device`."""
    def named(device: str) -> str:
        return on_node(node, device)
    return DeviceReport(
        devices=[msgspec.structs.replace(d, name=named(d.name)) for d in report.devices],
        managed={named(d): n for d, n in report.managed.items()},
        usage={m: {named(d): n for d, n in use.items()} for m, use in report.usage.items()},
        tracked=report.tracked, backends=[f"{node}:{b}" for b in report.backends],
        ready=report.ready)


def merged(reports: list[DeviceReport]) -> DeviceReport:
    usage: dict[str, dict[str, int]] = {}
    for r in reports:
        for model, use in r.usage.items():
            usage.setdefault(model, {}).update(use)
    return DeviceReport(
        devices=[d for r in reports for d in r.devices],
        managed={d: n for r in reports for d, n in r.managed.items()},
        usage=usage, tracked=sorted({m for r in reports for m in r.tracked}),
        backends=sorted({b for r in reports for b in r.backends}),
        ready=sorted({m for r in reports for m in r.ready or []}))


class DeviceHub:
    """Between the device monitors and the Scheduler: the head's own monitor and every
    node's report here, and the Scheduler gets one report of all devices (a node's named
    `node/device`), as from a single monitor. The Scheduler's TrackModel goes to the
    monitor of the node the model runs on. A lost node's devices are reported empty until
    it is back, so nothing is placed there."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.local: Any = None
        """The head's own DeviceMonitor."""
        self.reports: dict[str | None, DeviceReport] = {}
        self.reported_at: dict[str, float] = {}
        """When each node last reported its devices (wall clock)."""
        self.lock = threading.Lock()

    def tell(self, message: Any) -> None:
        match message:
            case DevicesReported(report=report):  # from the head's own monitor
                self._update(None, report)
            case TrackModel(model=model):
                remote = self.cluster.instances.get(model)
                if remote is None:
                    if self.local is not None:
                        self.local.tell(message)
                elif remote.node is not None:
                    self.cluster.send(remote.node, model, message)

    def absent(self, node: str) -> None:
        """A node whose agent could not be reached yet: a device with no memory stands for
        it, so its models are told it cannot be placed rather than left waiting."""
        with self.lock:
            if node in self.reports:
                return
        self._update(node, DeviceReport(
            devices=[DeviceSample(on_node(node, "unreachable"), "device", 0, 0, "cluster")],
            managed={}, usage={}, tracked=[], backends=[], ready=[]))

    def reported(self, node: str, report: DeviceReport) -> None:
        self.reported_at[node] = time.time()
        self._update(node, report_on_node(node, report))

    def lost(self, node: str) -> None:
        with self.lock:
            last = self.reports.get(node)
        if last is not None:
            self._update(node, DeviceReport(
                devices=[DeviceSample(d.name, d.kind, 0, 0, d.backend) for d in last.devices],
                managed={}, usage={}, tracked=[], backends=last.backends, ready=[]))

    def _update(self, source: str | None, report: DeviceReport) -> None:
        with self.lock:
            self.reports[source] = report
            whole = merged(list(self.reports.values()))
        if self.cluster.scheduler is not None:
            self.cluster.scheduler.tell(DevicesReported(whole))
