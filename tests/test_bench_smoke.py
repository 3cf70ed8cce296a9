"""The benches run with tiny parameters so they cannot rot (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT


def test_exit_latency_bench_runs() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "exit_latency.py"), "--runs", "2"],
                         capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["runs"] == {"watcher": 2, "scheduler": 2}
    assert result["watcher_ms"]["p50"] > 0 and result["scheduler_ms"]["p50"] > 0


def test_gpu_check_runs_and_skips_cleanly_without_a_driver() -> None:
    from tests.test_devices import nvml_driver_present

    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"),
                          "--alloc-mib", "64"], capture_output=True, text=True, timeout=120)
    if nvml_driver_present():
        assert out.returncode == 0, out.stdout + out.stderr
        assert "all checks passed" in out.stdout
    else:
        assert out.returncode == 77, out.stdout + out.stderr
        assert out.stdout.startswith("skipped: no usable NVIDIA driver")
