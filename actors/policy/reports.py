"""What a measurement or a device report means for the memory accounting (SPEC R-5.2,
R-5.5, R-5.6): a model's figures, the ledger calibrated, a child's real use charged, a
release finished. Part of `Memory` (memory.py), which holds the state named here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..ledger import Breakdown, DeviceSample, DeviceUse, Ledger, MiB
from ..messages import DeviceReport, ModelMemory
from .context import from_slope
from .records import Effect, Learned, Measure, ModelRecord, Publish

log = logging.getLogger("corral.scheduler")


class Reports:
    """The facts half of `Memory` (the state it names is set up there)."""

    on: bool
    ledger: Ledger
    releasing: set[ModelRecord]
    backends: list[str]
    epoch: int
    usage_seen: dict[str, tuple[dict[str, int], int]]

    def unmeasured(self, models: Iterable[ModelRecord]) -> list[Effect]:
        """Queue every unmeasured model at the back of the measure queue (R-5.2)."""
        if not self.on:
            return []
        return [Measure(rec.name, front=False) for rec in models
                if rec.memory == "unmeasured" and not rec.rules.group]  # a copy: as its model

    def measured(self, rec: ModelRecord, ok: bool, min_: Breakdown | None,
                 max_: Breakdown | None, error: str | None,
                 at_load: bool = False, per_token: int = 0) -> list[Effect]:
        """A measurement ended; a failed one leaves the model outside the limits (R-5.2);
        `at_load`: its first load will be its measurement (a `probe` model), `per_token`:
        what its context costs per token (ctx = "fit": a context probe's)."""
        rec.measure_requested_first = False
        rec.mem_error = error
        if at_load:
            rec.memory, rec.mem_min, rec.mem_max = "at_load", None, None
            rec.ctx_per_token = per_token
        elif ok:
            rec.memory, rec.mem_min, rec.mem_max = "measured", min_, max_
            if max_ is not None:  # a device not yet reported: the measure child's view
                self.ledger.calibrate(max_, reporter=None, unknown_only=True)
        else:
            rec.memory, rec.mem_min, rec.mem_max = "failed", None, None
        return [Publish(ModelMemory(model=rec.name, memory=rec.memory_info()))]

    def reported(self, report: DeviceReport, models: dict[str, ModelRecord]) -> list[Effect]:
        """Fresh device figures: finish releases, calibrate, learn real usage (R-5.5, R-5.6)."""
        self.backends = report.backends
        self.epoch += 1
        tracked = set(report.tracked)
        for rec in list(self.releasing):
            if not rec.releasing or models.get(rec.name) is not rec:
                self.releasing.discard(rec)  # spawned again, or dropped, meanwhile
            elif rec.name not in tracked:
                # Sampled after the monitor forgot the child: from now on whatever the
                # device still shows for it is counted as external.
                rec.releasing = False
                self.releasing.discard(rec)
                if not rec.state.is_running:
                    self.ledger.release(rec.name)
        self.ledger.observe_all(report.devices, report.managed)
        seen: dict[str, DeviceSample] = {}  # (asked of a child whose use changed: few)
        out: list[Effect] = []
        last, self.usage_seen = self.usage_seen, {}
        observed, shape = self.ledger.observed, self.ledger.shape
        for name, all_usage in report.usage.items():
            user = models.get(name)
            if user is None or not user.state.is_running:
                continue
            self.usage_seen[name] = (all_usage, shape)
            if (not user.awaiting_usage and last.get(name) == (all_usage, shape)
                    and name in observed):
                continue  # as in the last report (most children of a large one)
            if not seen:
                seen = {d.name: d for d in report.devices}
            usage = {d: b for d, b in all_usage.items()  # host RAM with account_host only
                     if d not in seen or self.ledger.counted(seen[d].kind)}
            seen_ready = report.ready is None or name in report.ready
            if user.awaiting_usage and user.state.is_serving and seen_ready:
                # The first report since it got ready: its load is charged now (the
                # next load on its devices may go), at what it really uses.
                user.awaiting_usage = False
                if usage:
                    n_ctx = user.n_ctx or (user.mem_max or user.mem_min or Breakdown(0, [])).n_ctx
                    user.mem_effective = Breakdown(n_ctx, [
                        DeviceUse(kind=seen[d].kind, name=d, total=seen[d].total,
                                  free=seen[d].free, model=size)
                        for d, size in usage.items() if d in seen and size > 0])
                    self.ledger.reserve(name, user.mem_effective)
                    log.info("model %s uses %s", name, ", ".join(
                        f"{size / MiB:.0f} MiB on {d}" for d, size in usage.items()))
                    if user.memory in ("at_load", "failed"):
                        out += self._learned(user, user.mem_effective)
            if usage:
                self.ledger.saw(name, usage)  # use above its reservation is held too
        return out

    @staticmethod
    def _learned(rec: ModelRecord, figures: Breakdown) -> list[Effect]:
        """No figures but a running child: what it uses is its measurement (a probe is a
        load like any other, and no second copy of a serving model is ever started); with
        its context's cost per token, at ctx_min and ctx_max (context.py `from_slope`)."""
        low, high = from_slope(rec, figures)
        log.info("model %s measured by its running child%s", rec.name, "" if low is high else
                 f" at {rec.n_ctx} context, and so at {low.n_ctx} and at {high.n_ctx}")
        rec.memory, rec.mem_min, rec.mem_max, rec.mem_error = "measured", low, high, None
        out: list[Effect] = [Publish(ModelMemory(model=rec.name, memory=rec.memory_info()))]
        if rec.rules.ctx_fit is None or low is not high:  # (fitted, its context's cost not
            out.append(Learned(rec.name, low, None if low is high else high))  # read: again)
        return out
