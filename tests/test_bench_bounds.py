"""The bounds `benchmarks/bench_allreduce.py` prints beside every row: pure arithmetic, checked here so
that a figure quoted in RESULTS.md means what its docstring says."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_allreduce import _schedule_bound  # noqa: E402


def test_schedule_bound_takes_the_latest_gradients_wire_time():
    # 1 element ready at 10 ms, 3 at 100 ms; 80 ms of wire in all; 5 ms of SGD after backward.
    # The late gradients carry 3/4 of the bytes: 100 + 60 + 5 beats 10 + 80 + 5.
    assert _schedule_bound([(10.0, 1), (100.0, 3)], 80.0, 5.0) == pytest.approx(165.0)


def test_schedule_bound_is_the_wire_when_every_gradient_is_ready_early():
    # everything ready at once: the bound is the start plus the whole wire
    assert _schedule_bound([(2.0, 5), (2.0, 5)], 50.0, 0.0) == pytest.approx(52.0)
    # ready times in any order; a late tiny gradient does not hide the early big one's wire time
    assert _schedule_bound([(30.0, 1), (1.0, 99)], 100.0, 0.0) == pytest.approx(max(1 + 100, 30 + 1))


def test_schedule_bound_is_never_below_the_physical_wire_bound():
    ready = [(float(t), n) for t, n in [(5, 4), (40, 16), (60, 4)]]
    for wire in (0.0, 10.0, 208.0):
        assert _schedule_bound(ready, wire, 0.0) >= wire
