"""The policy decides the same whatever Python's string hashing (PYTHONHASHSEED): its
effects, every one in order, are a function of what it was told. Sets of names iterated
as they come made two identical policies differ (the warm loads given up, then a turn's
held models withdrawn in set order); this runs a small simulated cluster
(bench/cluster_sim.py, the real policy on a fake clock) under two seeds and compares the
digests of all its effects.

The same run once never ended: a copy's demand due at a sum of floats that rounded to the
instant itself had the policy repump at that instant without end, on the sim's clock,
which moves only with events (scale.py `look_again`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from bench.support import ROOT


def digest(seed: int) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "bench", "cluster-sim", "--nodes", "10", "--models", "200",
         "--rates", "40", "--minutes", "1", "--concurrency", "4", "--replicas", "2"],
        cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": str(seed)}, capture_output=True,
        text=True, timeout=50, check=True).stdout
    found = re.findall(r"effects ([0-9a-f]{16})", out)
    assert len(found) == 2, out  # one copy a model, and up to two
    return ",".join(found)


def test_the_effects_do_not_depend_on_string_hashing() -> None:
    assert digest(1) == digest(2)
