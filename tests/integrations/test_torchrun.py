"""Plain torch.distributed + register_hook (recipes/train_torchrun.py) under torchrun: one node with 2
processes, and 2 "nodes" x 1 process through a c10d rendezvous on localhost (the multi-node path)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch

from _launch import RECIPES, Result, env, free_port, rank_files, run, run_ranks, torchrun

pytestmark = pytest.mark.slow
RECIPE = str(RECIPES / "train_torchrun.py")


@pytest.mark.timeout(240)
def test_torchrun_trains_compressed_with_identical_replicas_and_resumes(tmp_path):
    ck = tmp_path / "ckpt.pt"
    first = run(torchrun(2) + [RECIPE, "--max-steps", "12", "--ckpt", str(ck), "--summary", str(tmp_path / "a")],
                timeout=100).check()
    a0, a1 = rank_files(tmp_path / "a")
    assert a0["params_sha256"] == a1["params_sha256"]
    assert a0["world_size"] == 2 and a0["plan"] == "int4" and a0["fastml_step"] == 12
    assert a0["compression_ratio"] > 4.0 and a1["compression_ratio"] > 4.0
    saved = torch.load(ck, weights_only=True)
    assert [p["rank"] for p in saved["fastml"]["per_rank"]] == [0, 1]  # rank 0 wrote both ranks' residuals

    # Resuming continues the FastML step counter from the checkpoint. (Bit-exactness of a resume is
    # tested through Lightning in test_lightning.py; this recipe passes the same check by hand.)
    second = run(torchrun(2) + [RECIPE, "--max-steps", "24", "--resume", str(ck), "--summary", str(tmp_path / "b")],
                 timeout=100).check()
    b0, b1 = rank_files(tmp_path / "b")
    assert b0["fastml_step"] == b1["fastml_step"] == 24 and b0["step"] == 24
    assert b0["params_sha256"] == b1["params_sha256"] != a0["params_sha256"]
    # The bytes per step a resumed run prints are those of the first run (every step sends the same):
    # the restored byte counters are divided by the restored step counter, not by this run's steps.
    per_step = [re.findall(r"step (\d+) .*\(([\d.]+) KiB sent per step\)", r.output) for r in (first, second)]
    assert [s for s, _ in per_step[0]] == ["12"] and [s for s, _ in per_step[1]] == ["24"], per_step
    assert per_step[0][0][1] == per_step[1][0][1], per_step


@pytest.mark.timeout(150)
def test_two_nodes_one_process_each_with_c10d_rendezvous(tmp_path):
    # What two machines would run, here as two torchrun agents on localhost.
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "fastml-test",
           RECIPE, "--max-steps", "10", "--summary", str(tmp_path / "n")]
    start = time.monotonic()
    nodes = [subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    for p, out in zip(nodes, outs):
        assert p.returncode == 0, Result(cmd, p.returncode, out, time.monotonic() - start).tail()
    n0, n1 = rank_files(tmp_path / "n")
    assert n0["world_size"] == n1["world_size"] == 2
    assert n0["params_sha256"] == n1["params_sha256"]
    assert n0["compression_ratio"] > 4.0 and n0["fastml_step"] == 10


@pytest.mark.timeout(120)
def test_wrong_fastml_plan_fails_on_every_rank_before_the_first_step(tmp_path):
    # Each rank on its own (no agent to kill one when the other fails): both stop with status 2, and
    # the job's whole report is one line from rank 0, naming the plan and the choices.
    cmd = [sys.executable, RECIPE, "--max-steps", "5", "--summary", str(tmp_path / "s")]
    r0, r1 = run_ranks(cmd, 2, timeout=90, FASTML_PLAN="int5")
    assert r0.returncode == r1.returncode == 2, (r0.tail(), r1.tail())
    lines = r0.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train_torchrun.py: error: "), r0.output
    assert "'int5'" in lines[0] and "int4" in lines[0] and "Traceback" not in r0.output
    assert r1.output.strip() == "", r1.output
    assert not list(tmp_path.glob("s.rank*.json"))
