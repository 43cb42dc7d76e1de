"""Faults at N = 8 with the recursive halving/doubling schedule (fastml_strategy.comm._halving): a rank that
stalls or dies blocks only its partners of the round, so the others hear of it through the failure
channel the hook sets on the flat path, and every other rank raises CompressionError within seconds,
as the ring schedule does at N = 2 (tests/faults/test_faults_ranks.py).
"""

from __future__ import annotations

import json
import os
import time

import pytest

from _dist import run_workers
from test_faults_ranks import COMM_TIMEOUT, DEATH_TIMEOUT, PG_TIMEOUT, _check_fault_results, _rank_fault

pytestmark = [pytest.mark.slow]


def _plan():
    import fastml_strategy as fm

    return fm.Plan.from_recipe("int4", schedule="halving")


def _halving_faults(rank, world_size, path):
    """Two faults in one launch of 8 ranks (8 processes on 2 cores: start-up is the cost): rank 7 stalls
    at step 3 (past the group's 5 s timeout; its round partners time out, the others hear of it
    through the failure channel); then, with a fresh hook and groups whose timeout is 30 s, rank 5
    dies at step 3: its partner of the first round sees the closed connection, every other rank must
    hear of it through the channel, long before that timeout."""
    t0 = time.monotonic()
    stall = _rank_fault(rank, world_size, "stall", 7, _plan())
    with open(os.path.join(path, f"stall{rank}.json"), "w") as f:
        json.dump({**stall, "phase_s": time.monotonic() - t0}, f)
    marks = os.path.join(path, "marks")
    os.makedirs(marks, exist_ok=True)
    return _rank_fault(rank, world_size, "exit", 5, _plan(), comm_timeout=DEATH_TIMEOUT, marks=marks)


@pytest.mark.timeout(600)
def test_halving_dead_or_stalled_rank_fails_every_other_rank_fast(tmp_path):
    W = 8
    results = run_workers(_halving_faults, W, str(tmp_path), timeout=580, pg_timeout=PG_TIMEOUT,
                          allow_deaths=True)
    stall = [("ok", json.loads((tmp_path / f"stall{r}.json").read_text())) for r in range(W)]
    _check_fault_results(stall, W, "stall", 7, within=COMM_TIMEOUT + 6)
    # every survivor raised long before the groups' 30 s timeout (alive until all had)
    _check_fault_results(results, W, "exit", 5, within=DEATH_TIMEOUT / 3)
