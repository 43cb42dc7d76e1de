"""recipes/train_localsgd.py (LocalSGD, DiLoCo-style local steps) under torchrun: 2 processes, a short
run that checkpoints mid-run and goes on, then a resume from that checkpoint to the same step, which
must end with the same parameters on every rank, bit for bit."""

from __future__ import annotations

import re

import pytest
import torch

from _launch import RECIPES, rank_files, run, torchrun

pytestmark = pytest.mark.slow
RECIPE = str(RECIPES / "train_localsgd.py")


@pytest.mark.timeout(90)  # two torchrun jobs of ~12 s each on a loaded 2-core machine
def test_localsgd_recipe_trains_and_resumes_exactly(tmp_path):
    ck = tmp_path / "ckpt.pt"
    # H=4 in 2 fragments with delay 1: fragment 1 synchronises at steps 2, 6, 10, 14 and is applied a
    # step later, so the checkpoint at step 14 holds a fragment update still waiting for its delay.
    common = ["--max-steps", "24", "--every", "4", "--fragments", "2", "--delay", "1", "--log-every", "4",
              "--batch-size", "16"]
    first = run(torchrun(2) + [RECIPE, *common, "--ckpt", str(ck), "--ckpt-at", "14",
                               "--summary", str(tmp_path / "a")], timeout=40).check()
    saved = torch.load(ck, weights_only=True)  # plain tensors and containers: loads without pickle
    assert saved["step"] == 14 and [p["rank"] for p in saved["per_rank"]] == [0, 1]
    assert all(p["localsgd"]["pending"] for p in saved["per_rank"]), "no fragment update pending at step 14"
    assert not list(tmp_path.glob(".ckpt.*")), "a temporary checkpoint file was left behind"

    second = run(torchrun(2) + [RECIPE, *common, "--resume", str(ck), "--summary", str(tmp_path / "b")],
                 timeout=40).check()
    a, b = rank_files(tmp_path / "a"), rank_files(tmp_path / "b")
    for r in range(2):  # each rank ends where it would have without the restart
        assert b[r]["params_sha256"] == a[r]["params_sha256"], (first.tail(), second.tail())
        assert b[r]["inner_steps"] == a[r]["inner_steps"] == 24
        assert b[r]["outer_steps"] == a[r]["outer_steps"] and b[r]["bytes_sent"] == a[r]["bytes_sent"]
    assert a[0]["plan"] == "int4" and a[0]["compression_ratio"] > 4.0 and a[0]["ratio_vs_ddp"] > 4 * 4

    # The log lines after the checkpoint (loss, bytes per inner step, ratio against DDP) are the same.
    def lines(out: str) -> dict:
        return {int(m.group(1)): m.group(0) for m in re.finditer(r"^step (\d+) loss .*$", out, re.M)}

    before, after = lines(first.output), lines(second.output)
    assert sorted(after) == [16, 20, 24] and all(after[s] == before[s] for s in after), (before, after)
    assert "KiB sent per inner step" in after[24] and "fewer bytes than DDP fp32" in after[24]
    assert re.search(r"^validation accuracy 0\.\d+", second.output, re.M), second.tail()
