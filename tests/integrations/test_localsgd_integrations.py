"""LocalSGD through Lightning (``strategy="fastml_localsgd"``), Fabric and Accelerate, on 2 real CPU ranks.

Two torchrun launches of ``jobs/localsgd_job.py``: one runs the Trainer and Fabric scenarios in the same
two processes, the other Accelerate's; each test below checks one scenario. "No all-reduce in the inner
steps" is checked by what it implies: every rank trains on its own batches, so the replicas differ after
every inner step except those that end with a synchronisation, where they are bit-identical.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from _launch import JOBS, rank_files, run, torchrun

pytestmark = pytest.mark.slow
JOB = str(JOBS / "localsgd_job.py")


def _launch(out: Path, parts: str) -> Path:
    run(torchrun(2) + [JOB, str(out), parts], timeout=150, cwd=out).check()
    return out


@pytest.fixture(scope="module")
def lightning_job(tmp_path_factory) -> Path:
    return _launch(tmp_path_factory.mktemp("localsgd_lightning"), "trainer,resume,fabric")


@pytest.fixture(scope="module")
def accelerate_job(tmp_path_factory) -> Path:
    return _launch(tmp_path_factory.mktemp("localsgd_accelerate"), "accelerate")


def _synced_exactly_at(t0: list, t1: list, sync_steps: set) -> None:
    """Per 1-based step: identical across ranks iff the step ended with a synchronisation."""
    for i, (a, b) in enumerate(zip(t0, t1), start=1):
        assert (a == b) == (i in sync_steps), f"step {i}: replicas {'equal' if a == b else 'differ'}"


@pytest.mark.timeout(200)
def test_trainer_trains_locally_and_synchronises_every_h_steps(lightning_job):
    r0, r1 = rank_files(lightning_job / "trainer")
    assert r0["strategy"] == "FastMLLocalSGDStrategy"
    assert r0["wrapped"] == "Net"  # the LightningModule itself: no DistributedDataParallel
    _synced_exactly_at(r0["trace"], r1["trace"], {4, 8})  # every=4 over 10 steps
    for r in (r0, r1):
        assert r["global_step"] == r["stats"]["inner_steps"] == 10 and r["stats"]["outer_steps"] == 2
        assert r["stats"]["compression_ratio"] > 4.0 and r["stats"]["plan"] == "int4"
    assert r0["validate"] == r1["validate"]  # Lightning's metric sync works without DDP


@pytest.mark.timeout(200)
def test_trainer_logs_localsgd_figures(lightning_job):
    rows = list(csv.DictReader(open(lightning_job / "csv" / "version_0" / "metrics.csv")))
    logged = {int(r["step"]): r for r in rows if r.get("fastml/inner_steps")}
    # log_every_n_steps=2: Lightning's x-axis steps 1, 3, 5, 7, 9 (and 0, with the per-layer errors)
    assert sorted(logged) == [0, 1, 3, 5, 7, 9]
    for step, r in logged.items():
        assert float(r["fastml/inner_steps"]) == step + 1
        assert float(r["fastml/outer_steps"]) == (step + 1) // 4
    r9 = logged[9]
    assert float(r9["fastml/bytes_per_outer_step"]) > 0 and float(r9["fastml/ratio_vs_ddp"]) > 20
    # bytes per inner step = bytes per outer step x outer steps / inner steps
    assert float(r9["fastml/bytes_per_inner_step"]) == pytest.approx(float(r9["fastml/bytes_per_outer_step"]) * 2 / 10)


@pytest.mark.timeout(200)
def test_registered_name_reads_the_environment_and_steps_follow_the_optimizer(lightning_job):
    a0, a1 = (r["accum"] for r in rank_files(lightning_job / "trainer"))
    assert a0["strategy"] == "FastMLLocalSGDStrategy" and a0["every"] == 2  # FASTML_LOCALSGD_EVERY=2
    # 8 micro-batches, accumulate 2: 4 optimizer steps = 4 inner steps, 2 synchronisations
    assert a0["batches"] == 8 and a0["inner_steps"] == 4 and a0["outer_steps"] == 2
    assert a0["digest"] == a1["digest"]  # the last step synchronised
    m0, m1 = (r["manual"] for r in rank_files(lightning_job / "trainer"))
    # manual optimization, opt.step() every other batch: 6 batches, 3 inner steps, 1 synchronisation (every=3)
    assert m0["batches"] == 6 and m0["inner_steps"] == 3 and m0["outer_steps"] == 1
    assert m0["digest"] == m1["digest"]


@pytest.mark.timeout(200)
def test_refits_leak_no_thread_or_group_and_a_bad_setting_fails_every_rank(lightning_job):
    r0, r1 = rank_files(lightning_job / "trainer")
    for r in (r0, r1):
        assert r["threads_after_fits"] == 0 and r["groups_added"] == 0
        assert r["bad_steps"] == 0
        assert r["bad"].startswith("LocalSGD: fragments=99 but the model has 6 trainable parameters")
    assert r0["bad"] == r1["bad"]


@pytest.mark.timeout(200)
def test_trainer_resume_is_bit_exact_on_every_rank(lightning_job):
    r0, r1 = rank_files(lightning_job / "resume")
    assert r0["at_save"] != r1["at_save"]  # saved between two synchronisations: the ranks' models differ
    assert r0["pending_at_save"]  # and a fragment's update was still waiting for its delay
    for r in (r0, r1):
        assert r["straight_inner"] == r["resumed_inner"] == 20
        assert r["trace_r"] == r["trace_s"][10:], "10 steps + checkpoint + 10 steps differs from 20 straight"
        assert r["resumed"] == r["straight"]
        assert r["ckpt"] == {"ranks": [0, 1], "inner": [10, 10], "models_differ": True, "adam_state": True}


@pytest.mark.timeout(200)
def test_fabric_steps_localsgd_from_optimizer_step_and_resumes_exactly(lightning_job):
    f0, f1 = rank_files(lightning_job / "fabric")
    assert f0["start"] == f1["start"]  # different inits, rank 0's weights everywhere after setup
    assert f0["wrapped"] == "Sequential"  # no DDP inside Fabric's wrapper
    _synced_exactly_at(f0["trace"] + f0["continued"], f1["trace"] + f1["continued"], {3, 6, 9, 12})
    for f in (f0, f1):
        assert f["stats"]["inner_steps"] == 12 and f["stats"]["outer_steps"] == 4 and f["stats"]["plan"] == "int8"
        assert f["metrics"]["fastml/outer_steps"] == 4.0 and f["metrics"]["fastml/bytes_per_outer_step"] > 0
        assert f["loaded_step"] == 8 and f["left"] == []
        assert f["resumed"] == f["continued"] and f["resumed_inner"] == 12
        assert f["threads_after_teardown"] == 0


@pytest.mark.timeout(200)
def test_accelerate_prepare_local_sgd_trains_unwrapped_and_resumes_exactly(accelerate_job):
    a0, a1 = rank_files(accelerate_job / "accelerate")
    assert a0["distributed_type"] == "DistributedType.MULTI_CPU" and a0["wrapped"] == "Sequential"
    assert a0["trace"][0] != a1["trace"][0]  # the ranks train apart between synchronisations
    for a in (a0, a1):
        assert a["stats"]["inner_steps"] == 10 and a["stats"]["fragments"] == 2
        assert a["resumed"] == a["continued"], "save_state after 6 steps + load_state differs from going on"
        assert "accelerator.prepare_model(model, evaluation_mode=True)" in a["ddp_error"]


def test_strategies_check_their_settings_before_any_process_starts(monkeypatch):
    from fastml_strategy.lightning import FastMLLocalSGDFabricStrategy, FastMLLocalSGDStrategy

    with pytest.raises(ValueError, match=r"LocalSGD: every=0; use a whole number >= 1"):
        FastMLLocalSGDStrategy(every=0)
    with pytest.raises(ValueError, match="outer='adam'"):
        FastMLLocalSGDFabricStrategy(outer="adam")
    with pytest.raises(ValueError, match="delay=4 must be shorter"):
        FastMLLocalSGDStrategy(every=8, fragments=2, delay=4)
    with pytest.raises(ValueError, match="DDP's arguments \\['static_graph'\\] do not apply"):
        FastMLLocalSGDStrategy(static_graph=True)
    with pytest.raises(ValueError, match="not through DDP.*ddp_comm_hook"):
        FastMLLocalSGDFabricStrategy(ddp_comm_hook=lambda s, b: None)
    monkeypatch.setenv("FASTML_LOCALSGD_EVERY", "often")
    with pytest.raises(ValueError, match="FASTML_LOCALSGD_EVERY='often' is not a whole number"):
        FastMLLocalSGDStrategy()
    monkeypatch.setenv("FASTML_LOCALSGD_EVERY", "16")
    monkeypatch.setenv("FASTML_PLAN", "int5")
    with pytest.raises(ValueError, match="FASTML_PLAN='int5' is not a usable plan"):
        FastMLLocalSGDStrategy()
    monkeypatch.setenv("FASTML_PLAN", "int2")
    s = FastMLLocalSGDStrategy(fragments=2)
    assert s.settings == {"every": 16, "outer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9,
                          "fragments": 2, "delay": 0} and s.plan.name == "int2"
    assert FastMLLocalSGDStrategy(every=5).settings["every"] == 5  # the argument wins over the environment
    with pytest.raises(RuntimeError, match="during or after fit"):
        s.compression_stats()
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["fastml_localsgd"]["strategy"] is FastMLLocalSGDStrategy
    assert STRATEGY_REGISTRY["fastml_localsgd"]["strategy"].__name__ == "FastMLLocalSGDFabricStrategy"


def test_a_plan_with_local_steps_supplies_the_settings(monkeypatch):
    import dataclasses

    from fastml_strategy import LocalSteps, Plan
    from fastml_strategy.localsgd import resolve_settings

    plan = dataclasses.replace(Plan.from_recipe("int4"), local_steps=LocalSteps(
        every=20, fragments=2, delay=3, outer="sgd", outer_lr=1.0, outer_momentum=0.0))
    _, s = resolve_settings(plan, fragments=4)
    assert s == {"every": 20, "outer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0, "fragments": 4, "delay": 3}
    monkeypatch.setenv("FASTML_LOCALSGD_EVERY", "40")
    assert resolve_settings(plan)[1]["every"] == 40


def test_accelerate_local_sgd_in_one_process_checks_the_plan_and_does_nothing():
    import torch
    from accelerate import Accelerator

    import fastml_strategy.accelerate as fa
    from fastml_strategy import Plan

    acc = Accelerator(cpu=True)
    model, opt = fa.prepare_local_sgd(acc, torch.nn.Linear(64, 64),
                                      torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), every=4)
    assert isinstance(model, torch.nn.Linear) and acc.fastml_localsgd is None and acc._custom_objects == []
    bad = Plan.from_recipe("int4").with_layers({"encoder.weight": Plan.from_recipe("int8").default})
    with pytest.raises(ValueError, match=r"\['encoder.weight'\].*no such parameter"):
        fa.local_sgd(acc, model, plan=bad)
    with pytest.raises(ValueError, match="every=-1"):
        fa.local_sgd(acc, model, every=-1)
    with pytest.raises(TypeError, match=r"LocalSGD settings \['evry'\] are not known"):
        fa.local_sgd(acc, model, evry=4)
    with pytest.raises(ValueError, match="delay=4 must be shorter"):  # checked before accelerator.prepare
        fa.prepare_local_sgd(acc, torch.nn.Linear(4, 4), every=8, fragments=2, delay=4)


def test_the_local_sgd_settings_are_declared_once():
    # Every adapter takes LocalSteps' fields as keywords and none restates them in its signature: a new
    # setting added to LocalSteps reaches Lightning, Fabric, Accelerate and the HF Trainer unchanged.
    import dataclasses
    import inspect

    import fastml_strategy.accelerate as fa
    import fastml_strategy.transformers as ft
    from fastml_strategy import LocalSteps
    from fastml_strategy._integration import LOCAL_STEPS
    from fastml_strategy.lightning import FastMLLocalSGDFabricStrategy, FastMLLocalSGDStrategy

    assert set(LOCAL_STEPS) == {f.name for f in dataclasses.fields(LocalSteps)}
    for fn in (fa.local_sgd, fa.prepare_local_sgd, FastMLLocalSGDStrategy.__init__,
               FastMLLocalSGDFabricStrategy.__init__, ft.setup, ft.FastMLCallback.__init__):
        named = set(inspect.signature(fn).parameters) & set(LOCAL_STEPS)
        assert named <= {"every"} if fn in (ft.setup, ft.FastMLCallback.__init__) else not named, (fn, named)
    s = FastMLLocalSGDFabricStrategy(plan="int4", every=7, outer="sgd", outer_lr=1.0, outer_momentum=0.0,
                                     fragments=1, delay=2)
    assert s.settings == {"every": 7, "outer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0,
                          "fragments": 1, "delay": 2}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
