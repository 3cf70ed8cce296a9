"""The journal's instruction count (bench/journal_instructions.py): what it reads of
callgrind's output."""

from __future__ import annotations

import pytest

from bench.journal_instructions import totals

CALLGRIND_OUT = """# callgrind format
version: 1
events: Ir
summary: 0

fn=(1) main
3 17
totals: 83835131
"""


def test_the_count_is_the_totals_line_not_the_summary() -> None:
    assert totals(CALLGRIND_OUT) == 83_835_131


def test_an_output_without_totals_is_refused_with_why() -> None:
    with pytest.raises(ValueError, match="no totals line"):
        totals(CALLGRIND_OUT.replace("totals:", "total"))
