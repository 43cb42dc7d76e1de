"""Fabric(strategy=FastMLFabricStrategy()) on 2 real CPU processes started by Fabric's launcher
(recipes/train_fabric.py), with fabric.save / fabric.load carrying every rank's FastML state."""

from __future__ import annotations

import sys

import pytest
import torch

from _launch import RECIPES, rank_files, run

pytestmark = pytest.mark.slow
RECIPE = str(RECIPES / "train_fabric.py")


@pytest.mark.timeout(240)
def test_fabric_trains_compressed_with_identical_replicas_and_resumes(tmp_path):
    ck = tmp_path / "fabric.ckpt"
    base = [sys.executable, RECIPE, "--accelerator", "cpu", "--devices", "2", "--out", str(tmp_path)]
    run(base + ["--max-steps", "12", "--ckpt", str(ck), "--summary", str(tmp_path / "a")], timeout=100,
        FASTML_PLAN="int8").check()
    a0, a1 = rank_files(tmp_path / "a")
    assert a0["world_size"] == 2 and a0["params_sha256"] == a1["params_sha256"]
    assert a0["plan"] == "int8"  # --plan unset: FastMLFabricStrategy(plan=None) reads FASTML_PLAN
    assert a0["compression_ratio"] > 3.0 and a0["fastml_step"] == 12

    saved = torch.load(ck, weights_only=True)
    fml = saved["fastml_strategy"]
    assert [p["rank"] for p in fml["per_rank"]] == [0, 1] and fml["per_rank"][1]["step"] == 12
    assert set(saved) == {"model", "optimizer", "step", "fastml_strategy"}

    run(base + ["--max-steps", "20", "--resume", str(ck), "--summary", str(tmp_path / "b")], timeout=100,
        FASTML_PLAN="int8").check()
    b0, b1 = rank_files(tmp_path / "b")
    assert b0["fastml_step"] == b1["fastml_step"] == 20  # the step counter came back from the checkpoint
    assert b0["params_sha256"] == b1["params_sha256"] != a0["params_sha256"]
