"""Trainer(strategy="fastml") and FastMLStrategy on 2 real CPU processes started by Lightning's launcher.

One launch of ``jobs/lightning_job.py`` runs every scenario in the same two processes (Lightning and
torch imports dominate the cost on a 2-core machine); each test below checks one of them.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest

from _launch import JOBS, RECIPES, rank_files, run, run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lightning")
    run([sys.executable, str(JOBS / "lightning_job.py"), str(out), "basic,resume,overflow"],
        timeout=240, FASTML_PLAN="int4").check()
    return out


@pytest.mark.timeout(300)
def test_strategy_fastml_compresses_and_keeps_replicas_identical(job):
    r0, r1 = rank_files(job / "basic")
    assert r0["strategy"] == "FastMLStrategy" and r0["plan"] == "int4"  # strategy="fastml" + FASTML_PLAN
    assert r0["digest"] == r1["digest"], "replicas differ after training"
    for r in (r0, r1):
        assert r["bucket_view"] is True  # FastMLStrategy's default: DDP(gradient_as_bucket_view=True)
        assert r["fastml_step"] == r["global_step"] == 6
        assert r["stats"]["steps"] == 6
        assert r["stats"]["compression_ratio"] > 4.0  # int4 on the two hidden matrices
        layers = r["stats"]["layers"]
        assert layers["net.2.weight"]["codec"] == "int4" and layers["net.4.weight"]["codec"] == "fp32"
        assert 0.0 < layers["net.2.weight"]["rel_error"] < 0.5


@pytest.mark.timeout(300)
def test_compression_stats_reach_the_logger(job):
    rows = list(csv.DictReader(open(job / "csv" / "version_0" / "metrics.csv")))
    ratios = {int(r["step"]): float(r["fastml/compression_ratio"]) for r in rows if r["fastml/compression_ratio"]}
    # log_every_n_steps=2 over 6 steps: on Lightning's own x-axis (0-based step of the batch) 1, 3, 5;
    # plus step 0, where the per-layer errors (every 20 steps by default) are logged with the scalars.
    assert sorted(ratios) == [0, 1, 3, 5] and all(v > 4.0 for v in ratios.values())
    per_step = [float(r["fastml/bytes_sent_per_step"]) for r in rows if r["fastml/bytes_sent_per_step"]]
    assert len(per_step) == 4 and all(v > 0 for v in per_step)
    errs = {int(r["step"]): float(r["fastml/rel_error/net.0.weight"]) for r in rows
            if r.get("fastml/rel_error/net.0.weight")}
    assert list(errs) == [0] and 0.0 < errs[0] < 0.5
    assert not any(r.get("fastml/rel_error/net.0.bias") for r in rows)  # uncompressed: no error to log
    # bytes per step x ratio ~ what fp32 DDP would send: the two figures are consistent
    r0 = rank_files(job / "basic")[0]["stats"]
    assert math.isclose(r0["bytes_uncompressed"] / r0["bytes_sent"], r0["compression_ratio"], rel_tol=1e-6)


@pytest.mark.timeout(300)
def test_validate_test_predict_after_fit(job):
    r0, r1 = rank_files(job / "basic")
    for r in (r0, r1):
        assert r["validate"][0]["val_acc"] == r0["validate"][0]["val_acc"]  # same model on both ranks
        assert "test_acc" in r["test"][0]
        assert r["predict_rows"] == 32  # 64 samples split over 2 ranks
        assert r["stats_after_eval"] == 6  # evaluation did not run the hook


@pytest.mark.timeout(300)
def test_bf16_mixed_with_gradient_accumulation(job):
    a0, a1 = (r["accum"] for r in rank_files(job / "basic"))
    assert a0["plan"] == "int8"
    assert a0["digest"] == a1["digest"]
    for a in (a0, a1):
        # 8 micro-batches, accumulate 2: 4 optimizer steps, 4 hook steps (no_sync micro-batches skip it)
        assert a["batches"] == 8 and a["changed"] == 4
        assert a["fastml_step"] == a["global_step"] == 4
        assert a["stats"]["compression_ratio"] > 2.5


@pytest.mark.timeout(300)
def test_resume_is_bit_exact(job):
    r0, r1 = rank_files(job / "resume")
    for r in (r0, r1):
        assert r["straight_step"] == r["resumed_step"] == 20
        if r["resumed"] != r["straight"]:
            first = next((i for i, (a, b) in enumerate(zip(r["trace_s"][10:], r["trace_r"])) if a != b), None)
            pytest.fail(f"10 steps + checkpoint + 10 steps differs "
                        f"from 20 straight steps (first differing step after the resume: {first})")
    assert r0["resumed"] == r1["resumed"]
    # The checkpoint (written by rank 0 alone) holds BOTH ranks' residuals, and they differ.
    ck = r0["ckpt"]
    assert ck["ranks"] == [0, 1] and ck["step"] == [10, 10]
    assert all(n > 0 for n in ck["residual_norms"]) and ck["residual_norms"][0] != ck["residual_norms"][1]
    # Negative control: without the FastML state the resumed run is NOT the same, and rank 0 warns.
    assert r0["control"] != r0["straight"]
    assert r0["control_warned"]


@pytest.mark.timeout(300)
def test_fp16_overflow_on_one_rank_is_skipped_on_every_rank(job):
    r0, r1 = rank_files(job / "overflow")
    assert r0["digest"] == r1["digest"]
    for r in (r0, r1):
        assert r["nonfinite_steps"] >= 1
        assert r["scale"] == 512.0  # init 1024, halved once
        skipped = [s for s in r["trace"] if s["before"] == s["after"]]
        assert len(skipped) == 1, f"expected exactly one skipped step, got {skipped}"
    # the same step was skipped on both ranks, with the same scale trajectory
    assert [s["scale"] for s in r0["trace"]] == [s["scale"] for s in r1["trace"]]
    assert [s["after"] for s in r0["trace"]] == [s["after"] for s in r1["trace"]]


@pytest.mark.timeout(120)
def test_importing_fastml_strategy_lightning_registers_the_names_in_every_flavour():
    # The contract: `import fastml_strategy` never imports Lightning nor touches the import system;
    # `import fastml_strategy.lightning` registers the names with every installed Lightning flavour.
    code = """
import sys
meta_path = list(sys.meta_path)
import fastml_strategy
assert not any(m in sys.modules for m in ("lightning", "pytorch_lightning", "lightning_fabric", "triton",
                                          "fastml_strategy.lightning")), "import fastml_strategy pulled Lightning"
assert sys.meta_path == meta_path, "import fastml_strategy changed sys.meta_path"
import fastml_strategy.lightning
assert not [f for f in sys.meta_path if type(f).__module__.startswith("fastml_strategy")], sys.meta_path
import lightning.pytorch, pytorch_lightning, lightning.fabric, lightning_fabric
from lightning.pytorch.strategies import StrategyRegistry as A
from pytorch_lightning.strategies import StrategyRegistry as B
from lightning.fabric.strategies import STRATEGY_REGISTRY as C
from lightning_fabric.strategies import STRATEGY_REGISTRY as D
names = [r["fastml"]["strategy"].__name__ for r in (A, B, C, D)]
assert names == ["FastMLStrategy", "_PLFastMLStrategy", "FastMLFabricStrategy", "_LFFastMLFabricStrategy"], names
assert issubclass(B["fastml"]["strategy"], pytorch_lightning.strategies.DDPStrategy)
fsdp = [r["fastml_fsdp"]["strategy"] for r in (A, B, C, D)]
assert [c.__name__ for c in fsdp] == ["FastMLFSDPStrategy", "_PLFastMLFSDPStrategy", "FastMLFSDPFabricStrategy",
                                      "_LFFastMLFSDPFabricStrategy"], fsdp
for cls, pkg in zip(fsdp, (lightning.pytorch, pytorch_lightning, lightning.fabric, lightning_fabric)):
    assert issubclass(cls, pkg.strategies.ModelParallelStrategy), cls
assert [r["fastml_localsgd"]["strategy"].__name__ for r in (A, C)] == ["FastMLLocalSGDStrategy",
                                                                      "FastMLLocalSGDFabricStrategy"]
assert sorted(fastml_strategy.lightning.register_strategies()) == sorted(
    ["lightning.pytorch", "pytorch_lightning", "lightning.fabric", "lightning_fabric"])  # idempotent
t2 = lightning.pytorch.Trainer(strategy="fastml", accelerator="cpu", devices=2, logger=False)
assert type(t2.strategy).__name__ == "FastMLStrategy" and t2.strategy.plan.name == "int2"
t4 = lightning.pytorch.Trainer(strategy="fastml_fsdp", accelerator="cpu", devices=2, logger=False)
assert type(t4.strategy).__name__ == "FastMLFSDPStrategy" and t4.strategy.plan.name == "int2"
f4 = lightning.fabric.Fabric(strategy="fastml_fsdp", accelerator="cpu", devices=2)
assert type(f4.strategy).__name__ == "FastMLFSDPFabricStrategy" and f4.strategy.plan.name == "int2"

# the standalone pytorch_lightning package trains with its own FastML class (one process, gloo)
import torch
class M(pytorch_lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(64, 64)
    def training_step(self, batch, i):
        return self.net(batch[0]).square().mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
t3 = pytorch_lightning.Trainer(strategy="fastml", accelerator="cpu", devices=1, max_steps=3, logger=False,
                               enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
t3.fit(M(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 64)), batch_size=8))
assert t3.strategy.compression_stats()["steps"] == 3
print("OK")
"""
    res = run([sys.executable, "-c", code], timeout=100, FASTML_PLAN="int2").check()
    assert "OK" in res.output
    # Lightning alone: the name is unknown (Lightning's own "invalid strategy name" error). Then
    # Lightning first, `import fastml_strategy` after: registered (only with what is imported), without
    # importing another flavour.
    code2 = ("import sys, lightning.pytorch as L\n"
             "try:\n    L.Trainer(strategy='fastml', accelerator='cpu', devices=1, logger=False)\n"
             "except Exception as e:\n    print('REFUSED', 'invalid strategy name' in str(e))\n"
             "import fastml_strategy\n"
             "t = L.Trainer(strategy='fastml', accelerator='cpu', devices=1, logger=False)\n"
             "print(type(t.strategy).__name__, 'pytorch_lightning' in sys.modules)\n")
    out = run([sys.executable, "-c", code2], timeout=100).check().output
    assert "REFUSED True" in out and "FastMLStrategy False" in out, out


@pytest.mark.timeout(120)
def test_wrong_fastml_plan_fails_on_every_rank_before_the_first_step(tmp_path):
    # Two ranks started as torchrun would start them, but with no agent to kill one when the other
    # fails: each must stop at Trainer(...) on its own, with status 2; rank 0 prints the one line that
    # names the variable and the choices, rank 1 nothing.
    cmd = [sys.executable, str(RECIPES / "train_lightning.py"), "--accelerator", "cpu", "--devices", "2",
           "--max-steps", "5", "--out", str(tmp_path), "--summary", str(tmp_path / "s")]
    r0, r1 = run_ranks(cmd, 2, timeout=90, FASTML_PLAN="int5")
    assert r0.returncode == r1.returncode == 2, (r0.tail(), r1.tail())
    lines = r0.output.strip().splitlines()
    assert len(lines) == 1, r0.output
    assert lines[0].startswith("train_lightning.py: error: FASTML_PLAN='int5' is not a usable plan"), lines
    assert "int4" in lines[0]  # the message lists the recipes to choose from
    assert r1.output.strip() == "", r1.output
    assert not list(tmp_path.glob("s.rank*.json")) and not (tmp_path / "checkpoints").exists()

    # Lightning's own launcher: the first process fails before it starts the other rank: one line.
    res = run([sys.executable, str(RECIPES / "train_lightning.py"), "--accelerator", "cpu", "--devices", "2",
               "--max-steps", "5", "--out", str(tmp_path)], timeout=60, FASTML_PLAN="/no/such/plan.json")
    assert res.returncode == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "FASTML_PLAN='/no/such/plan.json' is not a usable plan" in res.output
    assert "does not exist" in res.output and "Initializing distributed" not in res.output

    # A plan naming a layer the model lacks: the same, before Lightning starts the other rank (it used
    # to fail inside trainer.fit, after the launch, with a traceback per rank and status 1).
    import fastml_strategy as fm

    plan = tmp_path / "plan.json"
    plan.write_text(fm.Plan.from_recipe("int4").with_layers({"net.9.weight": fm.RECIPES["int8"]}).to_json())
    res = run([sys.executable, str(RECIPES / "train_lightning.py"), "--accelerator", "cpu", "--devices", "2",
               "--max-steps", "5", "--out", str(tmp_path), "--plan", str(plan)], timeout=60)
    errors = [ln for ln in res.output.splitlines() if "error" in ln.lower() or "Traceback" in ln]
    assert res.returncode == 2 and errors == [ln for ln in errors if ln.startswith("train_lightning.py: error: ")]
    assert len(errors) == 1 and f"--plan {plan}: plan.layers names ['net.9.weight']" in errors[0], res.output
    assert "net.2.weight" in errors[0] and "Initializing distributed" not in res.output, res.output


@pytest.mark.timeout(200)
def test_recipe_resume_last_continues_mid_epoch_exactly(tmp_path):
    """recipes/train_lightning.py: 30 steps straight against 12 steps (mid-epoch: 23 per epoch here),
    then --resume last to 30. Bit-identical, without Lightning's "not resumable" warning, and without
    the warnings and tips the recipe cannot act on."""
    recipe = [sys.executable, str(RECIPES / "train_lightning.py"), "--accelerator", "cpu", "--devices", "2",
              "--max-steps", "30", "--ckpt-every", "12", "--out", str(tmp_path / "run")]
    straight = run(recipe + ["--summary", str(tmp_path / "straight")], timeout=120).check()
    # the checkpoint of step 12 becomes "last", as if the run had stopped there
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "last.ckpt").unlink()
    (ckpts / "last.ckpt").write_bytes((ckpts / "epoch=0-step=12.ckpt").read_bytes())
    resumed = run(recipe + ["--resume", "last", "--summary", str(tmp_path / "resumed")], timeout=120).check()
    s0, s1 = rank_files(tmp_path / "straight")
    r0, r1 = rank_files(tmp_path / "resumed")
    assert s0["step"] == r0["step"] == 30 and r0["fastml_step"] == 30
    assert r0["params_sha256"] == r1["params_sha256"] == s0["params_sha256"] == s1["params_sha256"]
    assert "Restored all states" in resumed.output and "not resumable" not in resumed.output
    for res in (straight, resumed):
        # --max-steps ends the run, and the epochs it takes bound it (Lightning's rich bar read
        # "Epoch 1/-2" with max_epochs=-1)
        assert "`max_steps=30` reached" in res.output and "/-2" not in res.output, res.tail()
        for noise in ("LeafSpec", "\U0001f4a1 Tip", "exists and is not empty", "Traceback"):
            assert noise not in res.output, (noise, res.tail())
