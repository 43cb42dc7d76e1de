"""Trainer(strategy="fastml_fsdp") on 2 real CPU processes started by Lightning's launcher.

One launch of ``jobs/fsdp_lightning_job.py`` runs every scenario in the same two processes (process
start and imports dominate on a 2-core machine); each test below checks one of them.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from _launch import JOBS, rank_files, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp_lightning")
    run([sys.executable, str(JOBS / "fsdp_lightning_job.py"), str(out), "basic,resume,errors"],
        timeout=240, FASTML_PLAN="int4").check()
    return out


@pytest.mark.timeout(300)
def test_strategy_name_shards_compresses_and_keeps_ranks_consistent(job):
    r0, r1 = (r["default"] for r in rank_files(job / "basic"))
    assert r0["strategy"] == "FastMLFSDPStrategy" and r0["plan"] == "int4"  # the name + FASTML_PLAN
    assert r0["mesh"] == ["shard"] and r0["units"] == 1  # default wrap rule: the small MLP is one root unit
    assert r0["digest"] == r1["digest"], "the gathered parameters differ between ranks"
    for r in (r0, r1):
        s = r["stats"]
        assert r["fastml_step"] == r["global_step"] == s["steps"] == 6 and r["changed"] == 6
        assert s["world_size"] == 2 and s["shard_size"] == 2 and s["replicate_size"] == 1
        assert s["compression_ratio"] > 4.0 and "reduce_scatter" in s and "all_reduce" not in s
        # error feedback keeps a residual per compressed weight, unsharded: (8192 + 16384) fp32
        assert s["residual_bytes"] == (8192 + 16384) * 4
        layers = s["layers"]
        assert layers["net.2.weight"]["codec"] == "int4" and layers["net.4.weight"]["codec"] == "fp32"
        assert 0.0 < layers["net.2.weight"]["rel_error"] < 0.5


@pytest.mark.timeout(300)
def test_compression_figures_reach_the_logger(job):
    rows = list(csv.DictReader(open(job / "csv" / "version_0" / "metrics.csv")))
    ratios = {int(r["step"]): float(r["fastml/compression_ratio"]) for r in rows if r["fastml/compression_ratio"]}
    # log_every_n_steps=2 over 6 steps: Lightning's 0-based steps 1, 3, 5, plus step 0 (per-layer errors)
    assert sorted(ratios) == [0, 1, 3, 5] and all(v > 4.0 for v in ratios.values())
    assert all(float(r["fastml/bytes_sent_per_step"]) > 0 for r in rows if r["fastml/compression_ratio"])
    assert {float(r["fastml/residual_bytes"]) for r in rows if r["fastml/residual_bytes"]} == {(8192 + 16384) * 4.0}
    errs = [float(r["fastml/rel_error/net.0.weight"]) for r in rows if r.get("fastml/rel_error/net.0.weight")]
    assert len(errs) == 1 and 0.0 < errs[0] < 0.5
    assert not any(r.get("fastml/rel_error/net.0.bias") for r in rows)  # uncompressed: no error to log


@pytest.mark.timeout(300)
def test_wrap_policy_gradient_accumulation_and_quantized_all_gather(job):
    a0, a1 = (r["accum"] for r in rank_files(job / "basic"))
    assert a0["plan"] == "int8" and a0["units"] == 4  # {nn.Linear}: three units, then the root
    assert a0["digest"] == a1["digest"]
    for a in (a0, a1):
        # 8 micro-batches, accumulate 2: 4 optimizer steps and 4 FastML steps (no reduce-scatter at all
        # on the first micro-batch of each pair)
        assert a["changed"] == a["global_step"] == a["fastml_step"] == 4
        assert a["stats"]["compression_ratio"] > 2.5
        assert a["stats"]["all_gather"]["compression_ratio"] > 3.0  # all_gather_bits=8 reached register


@pytest.mark.timeout(300)
def test_configure_model_sharding_is_kept_and_the_root_added(job):
    s0, s1 = (r["self_sharded"] for r in rank_files(job / "basic"))
    assert s0["units"] == 3  # net.0 and net.2 sharded in configure_model, the root added by the strategy
    assert s0["digest"] == s1["digest"] and s0["fastml_step"] == 3
    assert s0["stats"]["layers"]["net.0.weight"]["codec"] == "int4" and s0["stats"]["compression_ratio"] > 4.0
    assert s0["warned"]  # auto_wrap_policy was given but the model was already sharded: rank 0 says so


@pytest.mark.timeout(300)
def test_resume_from_a_distributed_checkpoint_is_bit_exact(job):
    r0, r1 = rank_files(job / "resume")
    # Lightning's shards, its meta.pt, and FastML's own DCP subfolder with one file per rank
    assert {"meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp", "fastml_strategy"} <= set(r0["ckpt_files"])
    assert r0["fastml_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for r in (r0, r1):
        assert r["straight_step"] == r["resumed_step"] == 20
        assert r["resumed"] == r["straight"], "10 steps + checkpoint + 10 steps differs from 20 straight steps"
        assert r["resumed_residual_bytes"] == (8192 + 16384) * 4
    assert r0["first_digest"] != r0["straight"]
    # save_distributed_checkpoint=False: one file that rank 0 wrote, with every rank's FastML state
    for r in (r0, r1):
        f = r["full_ckpt"]
        assert f["is_file"] and f["ranks"] == [0, 1] and f["steps"] == [10, 10]
        assert f["resumed"] == r["straight"], "resuming from a single-file checkpoint is not bit-exact"
    # Negative control: without the FastML subfolder the resumed run is NOT the same, and rank 0 warns.
    assert r0["control"] != r0["straight"] and r0["control_warned"]


@pytest.mark.timeout(300)
def test_fsdp1_and_ddp_mixups_fail_on_every_rank_naming_the_fix(job):
    e0, e1 = rank_files(job / "errors")
    assert e0 == e1  # the same message on both ranks
    assert "FSDP1 FullyShardedDataParallel" in e0["fsdp1"] and "fully_shard" in e0["fsdp1"]
    assert "strategy='fastml'" in e0["ddp_sharded"] and "use strategy='fastml_fsdp'" in e0["ddp_sharded"]
