"""Suspend or stop, by cost (issue 45): an eviction suspends a model only while its round
trip through host RAM (the suspend, which the request that made room waits for, and the
wake later) is expected to be cheaper than a stop and a cold load later.

Each model keeps the measured times of its cold loads (spawn to ready), its suspends and
its wakes (`SwapTimes`, a running mean weighing the newest half), remembered across
restarts (actors/swap_times.py). A step never measured is guessed from the bytes it copies
at GUESS_BYTES_PER_S each way (NVIDIA's cuda-checkpoint copies at about that; vLLM's sleep
mode is faster, so the guess errs towards a stop, and one measured suspend corrects it).
A model with no cold load measured is suspended, as before this rule: nothing says a load
would be cheaper. `suspend_when = "always"` (ModelRules.suspend_by_cost False) skips the rule.
"""

from __future__ import annotations

import msgspec

from ..ledger import MiB
from ..messages import SwapTimes

__all__ = ["GUESS_BYTES_PER_S", "SwapTimes", "learned", "weigh"]

GUESS_BYTES_PER_S = 2 * 1024 * MiB
"""A suspend's (or a wake's) copy of a model's device memory, before one is measured."""
NEWEST = 0.5
"""The weight of the newest measurement in a running mean."""


def learned(times: SwapTimes, **took: float) -> SwapTimes:
    """`times` with the step just measured (`cold_s=`, `suspend_s=` or `wake_s=`)."""
    return msgspec.structs.replace(times, **{
        step: s if (old := getattr(times, step)) is None else (1 - NEWEST) * old + NEWEST * s
        for step, s in took.items()})


def weigh(times: SwapTimes, host_bytes: int) -> tuple[bool, str]:
    """Whether a suspend of a model that copies `host_bytes` is cheaper than a stop, and
    what the eviction event says of it."""
    guess = host_bytes / GUESS_BYTES_PER_S
    steps = [times.suspend_s, times.wake_s]
    trip = sum(guess if s is None else s for s in steps)
    how = ("measured" if None not in steps else
           f"guessed from its {host_bytes / MiB:.0f} MiB at 2 GiB/s each way"
           if steps == [None, None] else "measured in part, the rest guessed at 2 GiB/s")
    if times.cold_s is None:
        return True, f"a suspend and wake take about {trip:.1f} s ({how}); no cold load " \
                     "measured yet"
    if trip < times.cold_s:
        return True, f"a suspend and wake take about {trip:.1f} s ({how}), a cold load " \
                     f"{times.cold_s:.1f} s"
    return False, f"a suspend and wake would take about {trip:.1f} s ({how}), a cold " \
                  f"load {times.cold_s:.1f} s"
