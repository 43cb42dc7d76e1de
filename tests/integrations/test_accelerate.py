"""fastml_strategy.accelerate on real processes: Accelerate under torchrun (2 CPU ranks, MULTI_CPU),
save_state/load_state, a single process (no DDP: a no-op), `accelerate launch` with the multi-CPU
config (needs Open MPI's mpirun), and a wrong FASTML_PLAN on every rank."""

from __future__ import annotations

import shutil
import sys

import pytest
import torch

from _launch import RECIPES, ROOT, rank_files, run, run_ranks, torchrun

pytestmark = pytest.mark.slow
RECIPE = str(RECIPES / "train_accelerate.py")


@pytest.mark.timeout(240)
def test_accelerate_under_torchrun_compresses_and_checkpoints_every_rank(tmp_path):
    ck = tmp_path / "state"
    run(torchrun(2) + [RECIPE, "--cpu", "--max-steps", "12", "--ckpt", str(ck), "--summary", str(tmp_path / "a")],
        timeout=100, FASTML_PLAN="int4", FASTML_CHECK_REPLICAS_EVERY="4").check()
    a0, a1 = rank_files(tmp_path / "a")
    assert a0["distributed_type"] == "DistributedType.MULTI_CPU" and a0["world_size"] == 2
    assert a0["params_sha256"] == a1["params_sha256"]
    assert a0["plan"] == "int4" and a0["compression_ratio"] > 4.0 and a0["fastml_step"] == 12

    fml = torch.load(ck / "custom_checkpoint_0.pkl", weights_only=True)  # what save_state wrote
    assert [p["rank"] for p in fml["per_rank"]] == [0, 1] and fml["per_rank"][0]["step"] == 12

    run(torchrun(2) + [RECIPE, "--cpu", "--max-steps", "20", "--resume", str(ck), "--summary", str(tmp_path / "b")],
        timeout=100, FASTML_PLAN="int4").check()
    b0, b1 = rank_files(tmp_path / "b")
    assert b0["fastml_step"] == b1["fastml_step"] == 20  # load_state restored the FastML step counter
    assert b0["params_sha256"] == b1["params_sha256"]


@pytest.mark.timeout(120)
def test_single_process_is_a_harmless_no_op(tmp_path):
    res = run([sys.executable, RECIPE, "--cpu", "--max-steps", "5", "--ckpt", str(tmp_path / "state"),
               "--summary", str(tmp_path / "one")], timeout=90).check()
    one = rank_files(tmp_path / "one", world=1)[0]
    assert one["world_size"] == 1 and one["plan"] is None and one["step"] == 5  # trained, nothing registered
    assert "compression 1.00x" in res.output
    assert not (tmp_path / "state" / "custom_checkpoint_0.pkl").exists()
    # (that a bad plan is still reported in one process is checked in test_adapter_arguments.py)


@pytest.mark.timeout(120)
def test_wrong_fastml_plan_fails_on_every_rank_before_the_first_step(tmp_path):
    # Each rank on its own: both stop with status 2; the main process prints the one line naming the
    # variable, the other nothing.
    cmd = [sys.executable, RECIPE, "--cpu", "--max-steps", "5", "--summary", str(tmp_path / "s")]
    r0, r1 = run_ranks(cmd, 2, timeout=90, FASTML_PLAN="topk50")
    assert r0.returncode == r1.returncode == 2, (r0.tail(), r1.tail())
    lines = r0.output.strip().splitlines()
    assert len(lines) == 1, r0.output
    assert lines[0].startswith("train_accelerate.py: error: FASTML_PLAN='topk50' is not a usable plan"), lines
    assert r1.output.strip() == "", r1.output
    assert not list(tmp_path.glob("s.rank*.json"))  # no step ran


@pytest.mark.timeout(150)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun (apt-get install openmpi-bin)")
def test_accelerate_launch_multi_cpu_config_starts_two_ranks(tmp_path):
    res = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "recipes" / "accelerate" / "multi_cpu.yaml"), RECIPE, "--cpu", "--max-steps", "8",
               "--summary", str(tmp_path / "m")], timeout=130, OMPI_ALLOW_RUN_AS_ROOT="1",
              OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1").check()
    m0, m1 = rank_files(tmp_path / "m")
    assert m0["distributed_type"] == "DistributedType.MULTI_CPU" and m0["world_size"] == 2
    assert m0["params_sha256"] == m1["params_sha256"] and m0["compression_ratio"] > 4.0, res.tail()
