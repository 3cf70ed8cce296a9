"""The suite runs on pytest-xdist (issue 38); a test marked `alone` runs while no other
test runs on any worker (conftest.py). Checked on a small suite run the same way: no
other test's span overlaps the `alone` one's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

SUITE = '''
import json, os, time
import pytest
from tests.conftest import alone_when_marked  # noqa: F401 (the fixture under test)

def span(name):
    start = time.monotonic()
    time.sleep(0.3)
    with open(os.environ["SPANS"], "a") as f:
        f.write(json.dumps([name, start, time.monotonic()]) + "\\n")

@pytest.mark.alone
def test_alone():
    span("alone")

@pytest.mark.parametrize("i", range(6))
def test_beside(i):
    span(f"beside{i}")
'''


def test_an_alone_test_shares_the_machine_with_no_other(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(SUITE)
    spans = tmp_path / "spans.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-c", "/dev/null",
         str(tmp_path / "test_inner.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "SPANS": str(spans), "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    seen = [json.loads(line) for line in spans.read_text().splitlines()]
    assert len(seen) == 7
    (_, start, end), = [s for s in seen if s[0] == "alone"]
    overlapping = [name for name, s, e in seen if name != "alone" and s < end and e > start]
    assert overlapping == [], f"ran beside the alone test: {overlapping}"
