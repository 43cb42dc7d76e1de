"""torchrun's elastic restart with FastML: a rank killed at step 3 costs a restart, not the job.

Two real ``torchrun --nproc_per_node 2`` launches of ``elastic_train.py``: one where rank 1 SIGKILLs
itself at step 3 (``--max-restarts 1``), one that never fails. The first must finish after one
restart, resumed from its step-2 checkpoint, with parameters bit-identical to the second's: model,
optimizer and error-feedback residuals all came back from the checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _torchrun(workdir: Path, max_restarts: int, kill_at: int) -> tuple[subprocess.CompletedProcess, list]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1",
               # torch 2.13: torchrun's rendezvous store is shared with the workers and outlives a
               # restart, so the restarted gloo groups read the dead attempt's addresses and fail
               # ("Gloo connectFullMesh failed ... Connection refused"; pytorch/pytorch#135712).
               # A fresh store per attempt avoids it.
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", str(max_restarts), "--monitor-interval", "0.2",
           str(HERE / "elastic_train.py"), "--dir", str(workdir), "--steps", "8", "--every", "2",
           "--kill-at", str(kill_at)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    results = []
    for r in range(2):
        f = workdir / f"result-rank{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    return proc, results


def test_killed_rank_resumes_from_checkpoint_under_torchrun(tmp_path):
    killed, res = _torchrun(tmp_path / "killed", max_restarts=1, kill_at=3)
    log = killed.stdout[-3000:] + killed.stderr[-6000:]
    assert killed.returncode == 0, log
    assert "killing myself at step 3" in log
    for r in res:
        assert r is not None, log
        assert r["attempt"] == 1 and r["resumed_from"] == 2, r  # restarted once, from the checkpoint
        assert r["steps"] == 8 and r["identical"], r

    clean, ref = _torchrun(tmp_path / "clean", max_restarts=0, kill_at=-1)
    assert clean.returncode == 0, clean.stderr[-4000:]
    assert ref[0]["attempt"] == 0 and ref[0]["resumed_from"] == 0
    # Nothing was lost: the resumed run ends exactly where the uninterrupted one does.
    assert res[0]["params_sha256"] == ref[0]["params_sha256"]
