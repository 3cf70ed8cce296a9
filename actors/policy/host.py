"""The host tier's accounts (issue 23): what host RAM the DeviceMonitor saw available,
what suspends since then have taken or will take, and the two bounds a suspend must
keep: host_memory_margin_mib and suspended_max.

The host is not a ledger device (that is `account_host`'s job, for loads): a suspended
child's host copy is real resident memory, so the monitor's figure of available host RAM
holds every suspend it has seen. What it has not seen yet is counted here: a suspend
under way at its estimate (the device memory the child holds), one done at what the
child's resident memory grew by, until a report taken after it; a suspended child being
stopped counts as coming back until a report no longer tracks it (when too little is
available, so as to stop no more than needed; a new suspend never counts on it).

Each machine's host RAM is its own tier (issue 42): corral's own (node None) and each
cluster node's, as that node's monitor reports it (`node/host`), each keeping the margin.
A suspend is counted on the node its child runs on; a lost node reports no host RAM, and
its suspended models are gone with its other children.
"""

from __future__ import annotations

from ..ledger import Ledger, MiB, node_of
from ..lifecycle import ModelState
from ..messages import DeviceReport
from .records import ModelRecord

S = ModelState


class HostTier:
    """Host RAM for suspended models, and the rules that bound it."""

    def __init__(self, margin: int, suspended_max: int) -> None:
        self.margin = margin
        """Bytes of host RAM kept available (host_memory_margin_mib)."""
        self.suspended_max = suspended_max
        """Most models suspended or suspending at once (0: no limit)."""
        self.available: dict[str | None, int] = {}
        """Node (None: corral's own machine) -> host RAM available at the last report; a
        machine not in it has not reported any: unlimited."""
        self.unseen: dict[str, tuple[str | None, int]] = {}
        """Model -> (its node, the host bytes its suspend takes that no report has seen
        yet)."""
        self.freeing: dict[str, tuple[str | None, int]] = {}
        """Model -> (its node, the host bytes of its suspended child that exited), until no
        report tracks it."""

    def estimate(self, rec: ModelRecord, ledger: Ledger) -> int:
        """What a suspend of `rec` moves to the host: the device memory it holds (vLLM's
        level 1 keeps the weights and drops the KV cache, so this is an upper bound), or
        what its last suspend took if that was more. A child on no device the monitor
        sees, suspended for the first time, is judged by the margin alone."""
        held = ledger.held.get(rec.name, {})
        return max(rec.host_last, sum(
            size for d, size in held.items()
            if (dev := ledger.devices.get(d)) is not None and dev.kind == "device"))

    def room(self, node: str | None, stopping: list[ModelRecord],
             back: bool = True) -> int | None:
        """Host bytes available on `node` beyond the margin once what suspends take is
        counted (None: unlimited); `back`: counting what comes back too, from exited
        children and from `stopping` (suspended models being stopped)."""
        available = self.available.get(node)
        if available is None:
            return None
        coming = (sum(b for n, b in self.freeing.values() if n == node)
                  + sum(r.host_bytes for r in stopping if r.node == node) if back else 0)
        return available + coming - sum(b for n, b in self.unseen.values()
                                        if n == node) - self.margin

    def why_not(self, rec: ModelRecord, ledger: Ledger,
                stopping: list[ModelRecord]) -> str | None:
        """Why `rec` may not be suspended now (None: it may); suspended_max is for the
        caller, who may stop another suspended model for it."""
        if not rec.rules.suspend:
            return "it has no suspend method"
        if rec.state is not S.LOADED:
            return f"it is {rec.state.value}"
        if rec.awaiting_usage and not ledger.held.get(rec.name) and not rec.host_last:
            return "what it holds is not known yet (no device report since it got ready)"
        # Not what is coming back: a stopping child holds its host copy until it is
        # gone, and a suspend done before that would overshoot the margin meanwhile.
        room = self.room(rec.node, stopping, back=False)
        need = self.estimate(rec, ledger)
        if room is not None and need > room:
            where = "" if rec.node is None else f" on node {rec.node}"
            return (f"host memory{where}: its {need / MiB:.0f} MiB would leave less than "
                    f"host_memory_margin_mib ({self.margin / MiB:.0f} MiB) available "
                    f"(room for {max(room, 0) / MiB:.0f} MiB)")
        return None

    def suspending(self, rec: ModelRecord, ledger: Ledger) -> None:
        rec.host_bytes = self.estimate(rec, ledger)
        self.unseen[rec.name] = (rec.node, rec.host_bytes)

    def suspended(self, rec: ModelRecord, host_bytes: int) -> None:
        """The suspend is done: it took `host_bytes` (measured) in place of the estimate."""
        rec.host_bytes = rec.host_last = host_bytes
        self.unseen[rec.name] = (rec.node, host_bytes)

    def awake(self, rec: ModelRecord) -> None:
        """Woken: its host copy is given back (the next report shows it)."""
        rec.host_bytes = 0
        self.unseen.pop(rec.name, None)

    def gone(self, rec: ModelRecord) -> None:
        """Its child exited: what it held on the host comes back (what no report saw it
        take is not in `available`: it comes back from nothing). Called before the
        record forgets its node."""
        unseen = self.unseen.pop(rec.name, None)
        if rec.host_bytes and unseen is None:
            self.freeing[rec.name] = (rec.node, rec.host_bytes)
        rec.host_bytes = 0

    def reported(self, report: DeviceReport, models: dict[str, ModelRecord]) -> None:
        """Fresh figures: a suspend the monitor had seen done when it sampled is in them,
        and so is the exit of a child it no longer tracks."""
        for sample in report.devices:  # (a machine not sampled keeps its last figure)
            if sample.kind == "host" and sample.total:
                self.available[node_of(sample.name)] = sample.free
            elif sample.kind == "host":  # a lost node's (0 of 0): no figure, nothing runs
                self.available.pop(node_of(sample.name), None)
        for name in report.suspended:
            rec = models.get(name)
            if rec is not None and rec.state is S.SUSPENDED:
                self.unseen.pop(name, None)
                rec.draining = False
        tracked = set(report.tracked)  # each machine's own, when the report says them
        on = {node or None: set(names) for node, names in report.tracked_by.items()}
        for name, (node, _) in list(self.freeing.items()):
            if name not in on.get(node, tracked if not on else set()):
                del self.freeing[name]

    def short(self, stopping: list[ModelRecord]) -> list[str | None]:
        """The machines where less than the margin is available, counting what is coming
        back."""
        return [node for node in self.available
                if (room := self.room(node, stopping)) is not None and room < 0]
