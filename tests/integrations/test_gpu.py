"""CUDA checks (skipped without a GPU): Lightning ``precision="16-mixed"`` with FastML on NCCL, where
one rank's overflow must make GradScaler skip the step on every rank; and the torchrun recipe on NCCL.

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
