"""The policy decides the same whatever Python's string hashing (PYTHONHASHSEED): its
effects, every one in order, are a function of what it was told. Sets of names iterated
as they come made two identical policies differ (the warm loads given up, a turn's held
models withdrawn, the models wanting a copy looked at, the queues that changed
published); this runs small simulated clusters (bench/cluster_sim.py, the real policy on
a fake clock) under three seeds at once and compares the digests of all their effects.

The first world's run once never ended: a copy's demand due at a sum of floats that
rounded to the instant itself had the policy repump at that instant without end, on the
sim's clock, which moves only with events (scale.py `look_again`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from bench.support import ROOT

WORLDS = {
    "ten nodes, two copies": ["--nodes", "10", "--models", "200", "--rates", "40",
                              "--minutes", "1", "--concurrency", "4", "--replicas", "2"],
    "three nodes, three copies": ["--nodes", "3", "--gpus", "2", "--gpu-gib", "40",
                                  "--models", "60", "--rates", "30", "--minutes", "2",
                                  "--concurrency", "2", "--replicas", "3"],
}


@pytest.mark.parametrize("world", WORLDS)
def test_the_effects_do_not_depend_on_string_hashing(world: str) -> None:
    runs = [subprocess.Popen([sys.executable, "-m", "bench", "cluster-sim", *WORLDS[world]],
                             cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": str(seed)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for seed in (1, 2, 3)]
    try:
        outs = [run.communicate(timeout=100)[0] for run in runs]
    finally:
        for run in runs:
            run.kill()
            run.wait()
    digests = []
    for run, out in zip(runs, outs, strict=True):
        assert run.returncode == 0, out
        found = re.findall(r"effects ([0-9a-f]{16})", out)
        assert len(found) == 2, out  # one copy a model, and more
        digests.append(found)
    assert digests[0] == digests[1] == digests[2]
