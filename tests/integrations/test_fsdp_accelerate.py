"""fastml_strategy.accelerate with FSDP2 on real CPU processes.

Accelerate 1.15 ignores its FSDP plugin on CPU (distributed_type stays MULTI_CPU), so the recipe shards
the model itself (``--fully-shard``) under torchrun with ``Accelerator(cpu=True)``; ``setup`` recognises
the FSDP2 module and ``save_state``/``load_state`` carry every rank's FastML state. An FSDP1 model is
refused on every rank.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_workers
from _launch import RECIPES, rank_files, run, torchrun

pytestmark = pytest.mark.slow
RECIPE = str(RECIPES / "train_accelerate.py")


@pytest.mark.timeout(240)
def test_self_sharded_model_compresses_and_resumes_bit_exact_through_save_state(tmp_path):
    ck = tmp_path / "state"
    base = torchrun(2) + [RECIPE, "--cpu", "--fully-shard", "--max-steps", "20"]
    run(base + ["--ckpt", str(ck), "--ckpt-at", "12", "--summary", str(tmp_path / "a")], timeout=110,
        FASTML_PLAN="int4").check()
    a0, a1 = rank_files(tmp_path / "a")
    assert a0["distributed_type"] == "DistributedType.MULTI_CPU" and a0["model_type"] == "FSDPSequential"
    assert a0["fastml_kind"] == "FSDPState" and a0["plan"] == "int4" and a0["fastml_step"] == 20
    assert a0["compression_ratio"] > 4.0 and a0["residual_bytes"] > 0
    assert a0["params_sha256"] == a1["params_sha256"]

    fml = torch.load(ck / "custom_checkpoint_0.pkl", weights_only=True)  # what save_state wrote at step 12
    assert [(p["rank"], p["step"], p["kind"]) for p in fml["per_rank"]] == [(0, 12, "fsdp"), (1, 12, "fsdp")]

    run(base + ["--resume", str(ck), "--summary", str(tmp_path / "b")], timeout=110, FASTML_PLAN="int4").check()
    b0, b1 = rank_files(tmp_path / "b")
    assert b0["fastml_step"] == b1["fastml_step"] == 20  # load_state restored the FastML step counter
    assert b0["params_sha256"] == b1["params_sha256"] == a0["params_sha256"], "the resumed run differs"


def _fsdp1_setup(rank: int, world: int) -> str:
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from accelerate import Accelerator
    from torch.distributed.fsdp import FullyShardedDataParallel

    import fastml_strategy.accelerate as fa

    accelerator = Accelerator(cpu=True)
    model = FullyShardedDataParallel(torch.nn.Linear(64, 64), device_id=torch.device("cpu"))
    try:
        fa.setup(accelerator, model, plan="int4")
    except TypeError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
def test_fsdp1_model_is_refused_on_every_rank_naming_fsdp2():
    msgs = run_workers(_fsdp1_setup, 2, timeout=100)
    assert msgs[0] == msgs[1]
    assert "FSDP1" in msgs[0] and "fsdp_version: 2" in msgs[0] and "strategy='fastml_fsdp'" in msgs[0]
