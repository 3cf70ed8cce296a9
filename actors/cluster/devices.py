"""One device report from many: the head's own monitor and every node's."""

from __future__ import annotations

import msgspec

from ..ledger import Breakdown, DeviceSample, local_name, on_node
from ..messages import DeviceReport


def report_on_node(node: str, report: DeviceReport) -> DeviceReport:
    """A node's report with its devices named `node/device`."""
    def named(device: str) -> str:
        return on_node(node, device)
    return DeviceReport(
        devices=[msgspec.structs.replace(d, name=named(d.name)) for d in report.devices],
        managed={named(d): n for d, n in report.managed.items()},
        usage={m: {named(d): n for d, n in use.items()} for m, use in report.usage.items()},
        tracked=report.tracked, backends=[f"{node}:{b}" for b in report.backends],
        ready=report.ready, suspended=report.suspended)


def merged(each: dict[str | None, DeviceReport]) -> DeviceReport:
    usage: dict[str, dict[str, int]] = {}
    reports = list(each.values())
    for r in reports:
        for model, use in r.usage.items():
            usage.setdefault(model, {}).update(use)
    return DeviceReport(
        devices=[d for r in reports for d in r.devices],
        managed={d: n for r in reports for d, n in r.managed.items()},
        usage=usage, tracked=sorted({m for r in reports for m in r.tracked}),
        backends=sorted({b for r in reports for b in r.backends}),
        ready=sorted({m for r in reports for m in r.ready or []}),
        suspended=sorted({m for r in reports for m in r.suspended}),
        tracked_by={node or "": r.tracked for node, r in each.items()})


def renamed(figures: Breakdown | None, node: str, local: bool = False) -> Breakdown | None:
    """`figures` with each row's device named as on `node` in the head's ledger (or, with
    `local`, as on the node itself)."""
    if figures is None:
        return None
    return Breakdown(n_ctx=figures.n_ctx, devices=[
        msgspec.structs.replace(row, name=local_name(row.name) if local
                                else on_node(node, row.name)) for row in figures.devices])


class DeviceReports:
    """Between the device monitors and the Scheduler: the head's own monitor and every
    node report here, and the Scheduler gets one report of all devices (a node's named
    `node/device`), as from a single monitor. A lost node's devices are reported empty
    until it is back, so nothing is placed there. Each change answers the whole report
    to send on (None: nothing changed). Owned by the ClusterHead: one thread."""

    def __init__(self) -> None:
        self.reports: dict[str | None, DeviceReport] = {}
        """The last report of each node (None: the head's own machine)."""
        self.reported_at: dict[str, float] = {}
        """When each node last reported its devices (wall clock)."""

    def local(self, report: DeviceReport) -> DeviceReport:
        """The head's own monitor reported."""
        return self._update(None, report)

    def reported(self, node: str, report: DeviceReport, now: float) -> DeviceReport:
        self.reported_at[node] = now
        return self._update(node, report_on_node(node, report))

    def absent(self, node: str) -> DeviceReport | None:
        """A node whose agent could not be reached yet: a device with no memory stands for
        it, so its models are told it cannot be placed rather than left waiting."""
        if node in self.reports:
            return None
        return self._update(node, DeviceReport(
            devices=[DeviceSample(name=on_node(node, "unreachable"), kind="device", total=0,
                                  free=0, backend="cluster")],
            managed={}, usage={}, tracked=[], backends=[], ready=[]))

    def lost(self, node: str) -> DeviceReport | None:
        last = self.reports.get(node)
        if last is None:
            return None
        return self._update(node, DeviceReport(
            devices=[DeviceSample(name=d.name, kind=d.kind, total=0, free=0, backend=d.backend)
                     for d in last.devices],
            managed={}, usage={}, tracked=[], backends=last.backends, ready=[]))

    def _update(self, source: str | None, report: DeviceReport) -> DeviceReport:
        self.reports[source] = report
        return merged(self.reports)
