"""Suspend or stop, by cost (issue 45): an eviction suspends a model only while its round
trip through host RAM (the suspend, which the request that made room waits for, and the
wake later) is expected to be cheaper than a stop and a cold load later.

Each model keeps the measured times of its cold loads (spawn to ready), its suspends and
its wakes (`SwapTimes`, a running mean weighing the newest half), remembered across
restarts (actors/swap_times.py). A step never measured is guessed from the bytes it copies
at GUESS_BYTES_PER_S each way (NVIDIA's cuda-checkpoint copies at about that; vLLM's sleep
mode is faster, so the guess errs towards a stop). A guess that chose a stop is put to the
test at the model's next eviction, which suspends it once: a stop measures nothing, so
the guess would otherwise decide for ever. A model with no cold load measured is
suspended, as before this rule: nothing says a load would be cheaper.
`suspend_when = "always"` (ModelRules.suspend_by_cost False) skips the rule.
"""

from __future__ import annotations

import msgspec

from ..ledger import MiB
from ..messages import SwapTimes

__all__ = ["GUESS_BYTES_PER_S", "MAX_S", "SwapTimes", "guessed", "learned", "weigh"]

MAX_S = 86_400.0
"""A step measured longer than this is kept as this (what swap-times.json may hold)."""
GUESS_BYTES_PER_S = 2 * 1024 * MiB
"""A suspend's (or a wake's) copy of a model's device memory, before one is measured."""
NEWEST = 0.5
"""The weight of the newest measurement in a running mean."""


def learned(times: SwapTimes, **took: float) -> SwapTimes:
    """`times` with the step just measured (`cold_s=`, `suspend_s=` or `wake_s=`)."""
    new = {}
    for step, s in took.items():
        s = min(max(s, 0.0), MAX_S)
        old = getattr(times, step)
        new[step] = s if old is None else (1 - NEWEST) * old + NEWEST * s
    return msgspec.structs.replace(times, **new)


def guessed(times: SwapTimes) -> bool:
    """Part of a round trip is not measured yet."""
    return times.suspend_s is None or times.wake_s is None


def weigh(times: SwapTimes, host_bytes: int, guess_stops: int = 0) -> tuple[bool, str]:
    """Whether a suspend of a model that copies `host_bytes` is cheaper than a stop, and
    what the eviction event says of it; `guess_stops`: how often a guess chose a stop
    for it before (a guess that said stop is put to the test once: nothing else would
    ever measure it)."""
    guess = host_bytes / GUESS_BYTES_PER_S
    steps = [times.suspend_s, times.wake_s]
    trip = sum(guess if s is None else s for s in steps)
    how = ("measured" if None not in steps else
           "measured in part, the rest guessed at 2 GiB/s" if steps != [None, None] else
           f"guessed from its {host_bytes / MiB:.0f} MiB at 2 GiB/s each way" if host_bytes
           else "guessed: no device memory of it seen, none to copy")
    if times.cold_s is None:
        return True, f"a suspend and wake take about {trip:.1f} s ({how}); no cold load " \
                     "measured yet"
    if trip < times.cold_s:
        return True, f"a suspend and wake take about {trip:.1f} s ({how}), a cold load " \
                     f"{times.cold_s:.1f} s"
    stop = f"a suspend and wake would take about {trip:.1f} s ({how}), a cold load " \
           f"{times.cold_s:.1f} s"
    if guessed(times) and guess_stops:
        return True, stop + "; suspended all the same, once, to measure it (the guess " \
                            "chose a stop before)"
    return False, stop
