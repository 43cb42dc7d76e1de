"""CUDA checks (skipped without a GPU): Lightning ``precision="16-mixed"`` with FastML on NCCL, where
one rank's overflow must make GradScaler skip the step on every rank; the torchrun recipe on NCCL;
and whole training steps under ``torch.cuda.set_sync_debug_mode("error")`` (no host synchronisation
on the hot path but the hook's one counted read per step; jobs/sync_free_job.py).

With one GPU the Lightning run has one rank (the CUDA/NCCL/fp16 path of the hook, the GradScaler
skip); with two or more it uses two and the overflow happens on the last rank only.
"""

from __future__ import annotations

import sys

import pytest
import torch

from _launch import JOBS, RECIPES, rank_files, run, torchrun

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.timeout(300)
def test_lightning_16_mixed_on_gpu_skips_the_overflow_step_on_every_rank(tmp_path):
    devices = min(2, torch.cuda.device_count())
    run([sys.executable, str(JOBS / "lightning_job.py"), str(tmp_path), "overflow"], timeout=280,
        FASTML_PLAN="int4", FASTML_TEST_ACCELERATOR="gpu", FASTML_TEST_DEVICES=str(devices),
        TRITON_INTERPRET="0").check()  # real kernels on the GPU (tests/conftest.py sets the interpreter)
    results = rank_files(tmp_path / "overflow", world=devices)
    for r in results:
        assert r["device"].startswith("cuda") and r["world_size"] == devices
        assert r["nonfinite_steps"] >= 1 and r["scale"] == 512.0  # init 1024, halved once
        assert len([s for s in r["trace"] if s["before"] == s["after"]]) == 1  # exactly one skipped step
        assert r["digest"] == results[0]["digest"]
        assert [s["scale"] for s in r["trace"]] == [s["scale"] for s in results[0]["trace"]]
        if devices > 1:
            assert r["compression_ratio"] > 4.0


@pytest.mark.timeout(200)
def test_torchrun_recipe_on_nccl(tmp_path):
    n = min(2, torch.cuda.device_count())
    run(torchrun(n) + [str(RECIPES / "train_torchrun.py"), "--max-steps", "20", "--summary", str(tmp_path / "g")],
        timeout=180, TRITON_INTERPRET="0").check()
    results = rank_files(tmp_path / "g", world=n)
    assert all(r["params_sha256"] == results[0]["params_sha256"] and r["fastml_step"] == 20 for r in results)


@pytest.mark.timeout(300)
def test_training_steps_have_no_host_synchronisation(tmp_path):
    # whole steps (forward, backward with the hook, optimizer) of int4, top-k and a
    # mixed plan, one rank on NCCL, under torch.cuda.set_sync_debug_mode("error"): an implicit host
    # synchronisation anywhere on the hot path raises. The hook's one explicit read per step
    # (fastml_strategy.comm._status.host: a pinned copy and an event wait) is counted instead.
    import json

    run([sys.executable, str(JOBS / "sync_free_job.py"), str(tmp_path)], timeout=280,
        TRITON_INTERPRET="0").check()
    results = json.loads((tmp_path / "sync_free.json").read_text())
    for plan, r in results.items():
        assert "error" not in r, f"{plan}: {r.get('error')}\n{r.get('traceback')}"
        assert r["reads"] == [1] * len(r["reads"]), (plan, r["reads"])
        assert r["finite"] and r["nonfinite_steps"] == 0 and r["buckets"] >= 2, (plan, r)
