"""recipes/train_fsdp.py (FSDP2 + FastML) under torchrun, 2 processes: a short run that checkpoints
mid-run and goes on, a resume from that checkpoint to the same step (the same parameters, bit for bit,
as the recipe's docstring promises), and a resume from a checkpoint that does not exist. Saving and
loading each print one line saying what (folder, step); a missing checkpoint is one line from the
recipe and status 2 on every rank (it used to be 195 lines of torch tracebacks)."""

from __future__ import annotations

import re

import pytest

from _launch import RECIPES, rank_files, run, torchrun

pytestmark = pytest.mark.slow
RECIPE = str(RECIPES / "train_fsdp.py")


@pytest.mark.timeout(600)  # three torchrun jobs of ~20 s each (90 s at a load of 30)
def test_fsdp_recipe_says_what_it_saved_and_loaded_and_refuses_a_missing_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    common = ["--max-steps", "6", "--hidden", "64"]
    first = run(torchrun(2) + [RECIPE, *common, "--ckpt", str(ck), "--ckpt-at", "3",
                               "--summary", str(tmp_path / "a")], timeout=180, cwd=tmp_path).check()
    assert re.findall(r"^saved checkpoint .*$", first.output, re.M) == [f"saved checkpoint {ck} at step 3"], \
        first.tail()
    second = run(torchrun(2) + [RECIPE, *common, "--resume", str(ck), "--summary", str(tmp_path / "b")],
                 timeout=180, cwd=tmp_path).check()
    assert re.findall(r"^resumed from .*$", second.output, re.M) == [f"resumed from checkpoint {ck} at step 3"], \
        second.tail()
    a, b = rank_files(tmp_path / "a"), rank_files(tmp_path / "b")
    assert a[0]["step"] == b[0]["step"] == 6
    assert a[0]["params_sha256"] == b[0]["params_sha256"] == b[1]["params_sha256"]

    missing = run(torchrun(2) + [RECIPE, *common, "--resume", "no-such-ck"], timeout=180, cwd=tmp_path)
    assert missing.returncode == 1, missing.tail()  # torchrun's own status when its workers fail
    assert sorted(re.findall(r"^\s*exitcode\s+: (-?\d+)", missing.output, re.M)) == ["2", "2"], missing.tail()
    errors = [ln for ln in missing.output.splitlines() if ln.startswith("train_fsdp.py: error:")]
    assert errors == ["train_fsdp.py: error: --resume no-such-ck: no such checkpoint folder; pass the --ckpt "
                      "folder of an earlier run, or drop --resume"], missing.output
    # no traceback of the ranks (torchrun's agent prints its own ChildFailedError summary)
    assert "train_fsdp.py\", line" not in missing.output and "torch/distributed/checkpoint" not in missing.output, \
        missing.output
