"""The memory rules of the policy (SPEC R-5.2, R-5.5 to R-5.7), mixed into `Policy`.

What a measurement, a device report or a load means for the ledger, and whether a model
that is about to load fits, must wait, or makes idle models go. Pure like the rest of the
policy: effects go to `_out`, the time comes in as an argument.
"""

from __future__ import annotations

import logging
from typing import Literal

from .ledger import Breakdown, DeviceUse, Ledger, MiB
from .lifecycle import ModelState
from .messages import (
    DeviceReport,
    DevicesSnapshot,
    DeviceView,
    EvictionReason,
    ModelMemory,
    Shortfall,
)
from .records import Effect, Measure, ModelRecord, Publish

log = logging.getLogger("corral.scheduler")

S = ModelState


class MemoryRules:
    """Needs from its host class: the records, the ledger, the effect list, and the
    queue rules named below."""

    models: dict[str, ModelRecord]
    ledger: Ledger
    memory_on: bool
    backends: list[str]
    _out: list[Effect]

    def _pump(self, now: float) -> None:
        raise NotImplementedError

    def _flush(self) -> list[Effect]:
        raise NotImplementedError

    def _pick_victim(self) -> ModelRecord | None:
        raise NotImplementedError

    def _stop(self, rec: ModelRecord, reason: EvictionReason, for_model: str | None,
              now: float, shortfalls: list[Shortfall] | None = None) -> None:
        raise NotImplementedError

    def _refuse_entry(self, model: str, status: int, message: str) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ memory facts

    def start_measuring(self) -> list[Effect]:
        """Queue every unmeasured model at the back of the measure queue (R-5.2)."""
        if self.memory_on:
            for rec in self.models.values():
                if rec.memory == "unmeasured":
                    self._out.append(Measure(rec.name, front=False))
        return self._flush()

    def measure_started(self, model: str) -> list[Effect]:
        rec = self.models.get(model)
        if rec is not None:
            rec.memory = "measuring"
            rec.measure_attempts += 1
        return []

    def measured(self, model: str, ok: bool, min_: Breakdown | None,
                 max_: Breakdown | None, now: float, error: str | None = None) -> list[Effect]:
        """A measurement ended; a failed one leaves the model outside the limits (R-5.2)."""
        rec = self.models.get(model)
        if rec is None:
            return []
        rec.measure_front = False
        rec.mem_error = error
        if ok:
            rec.memory, rec.mem_min, rec.mem_max = "measured", min_, max_
            if max_ is not None:
                self.ledger.calibrate(max_, reporter=None)  # the latest view of the devices
        else:
            rec.memory, rec.mem_min, rec.mem_max = "failed", None, None
        self._out.append(Publish(ModelMemory(model, rec.memory_info())))
        self._pump(now)
        return self._flush()

    def devices_reported(self, report: DeviceReport, now: float) -> list[Effect]:
        """Fresh device figures: finish releases, calibrate, learn real usage (R-5.5, R-5.6)."""
        self.backends = report.backends
        tracked = set(report.tracked)
        for rec in self.models.values():
            if rec.releasing and rec.name not in tracked:
                # Sampled after the monitor forgot the child: from now on whatever the
                # device still shows for it is counted as external.
                rec.releasing = False
                if not rec.state.is_running:
                    self.ledger.release(rec.name)
        for sample in report.devices:
            self.ledger.observe(sample, report.managed.get(sample.name))
        seen = {d.name: d for d in report.devices}
        for name, usage in report.usage.items():
            user = self.models.get(name)
            if user is None or not user.awaiting_usage or not user.state.is_serving or not usage:
                continue
            user.awaiting_usage = False
            n_ctx = (user.mem_max or user.mem_min or Breakdown(0, [])).n_ctx
            user.mem_effective = Breakdown(n_ctx, [
                DeviceUse(kind=seen[d].kind, name=d, total=seen[d].total, free=seen[d].free,
                          model=size) for d, size in usage.items() if d in seen])
            self.ledger.release(name)
            self.ledger.reserve(name, user.mem_effective)
            log.info("model %s uses %s", name, ", ".join(
                f"{size / MiB:.0f} MiB on {d}" for d, size in usage.items()))
        self._pump(now)
        return self._flush()

    def devices_snapshot(self) -> DevicesSnapshot:
        led = self.ledger
        views = []
        for name, dev in led.devices.items():
            held = {m: devs[name] for m, devs in led.held.items() if name in devs}
            views.append(DeviceView(name=name, kind=dev.kind, total=dev.total, free=dev.free,
                                    external=dev.external, held=held,
                                    available=led.available(name) or 0))
        return DevicesSnapshot(memory_accounting=self.memory_on, margin=led.margin,
                               account_host=led.account_host, backends=self.backends,
                               devices=views)

    # ------------------------------------------------------------ the rule

    def _make_room(self, rec: ModelRecord, now: float) -> Literal["go", "wait", "refused"]:
        """R-5.7: may `rec` spawn now? Evicts idle LRU models until it fits."""
        if not rec.memory_settled:
            if not rec.measure_front:
                rec.measure_front = True
                self._out.append(Measure(rec.name, front=True))
            return "wait"  # the measurement decides what to unload
        need = rec.mem_min
        short = self.ledger.deficit(need, self._freeing())
        while short:
            victim = self._pick_victim()
            if victim is None:
                break
            shortfalls = [Shortfall(d, row.self_bytes, self.ledger.available(d) or 0)
                          for row in (need.devices if need else []) if (d := row.name) in short]
            self._stop(victim, "memory", rec.name, now, shortfalls)
            short = self.ledger.deficit(need, self._freeing())
        if not short:
            # It fits once what is being stopped has come back.
            return "go" if not self.ledger.deficit(need) else "wait"
        others = [r for r in self.models.values()
                  if r is not rec and (r.state.is_running or r.releasing)]
        missing = ", ".join(f"{b / MiB:.0f} MiB on {d}" for d, b in short.items())
        if not others:
            log.warning("model %s is projected to be short by %s with nothing else loaded; "
                        "loading anyway (the minimum is pessimistic)", rec.name, missing)
            return "go"
        if all(r.pinned and r.state is not S.STOPPING and not r.releasing for r in others):
            self._refuse_entry(rec.name, 503, (
                f"model '{rec.name}' does not fit: short by {missing} beyond "
                f"memory_margin_mib, and the models holding memory are pinned "
                f"({', '.join(r.name for r in others)}); unload one"))
            return "refused"
        return "wait"  # busy models finish, stops complete: both re-pump

    def _freeing(self) -> dict[str, int]:
        """Memory held by children on their way out, per device."""
        return self.ledger.holds_of([r.name for r in self.models.values()
                                     if r.state is S.STOPPING or r.releasing])
