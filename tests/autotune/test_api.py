"""The Python API (a Workload object instead of a TARGET string) and calibration pruning."""

import math
from pathlib import Path

import pytest

from fastml_strategy import Plan
from fastml_strategy.autotune import autotune
from fastml_strategy.autotune.calibrate import run_calibration
from fastml_strategy.autotune.profile import profile_workload
from fastml_strategy.autotune.search import group_layers

from tiny_workload import workload


@pytest.mark.timeout(200)
def test_autotune_api_with_a_workload_object(tmp_path):
    res = autotune(workload(), out=tmp_path / "o", link="10gbit", world_size=4, trials=11,
                   calibration_trials=2, calibration_steps=20, profile_steps=2, measure_steps=2,
                   verify_rounds=0, progress=False)
    assert res.option == "local"
    assert Plan.load(tmp_path / "o" / "plan.json") == res.plan
    names = {n for n, _ in workload().model.named_parameters()}
    assert {k for k, _ in res.plan.layers} == names
    local = res.best["local"]
    assert local["tta_s"] == pytest.approx(local["steps"] * local["step_s"])
    assert res.profile.link.bandwidth_Bps == pytest.approx(10e9 / 8)


@pytest.mark.timeout(200)
def test_hopeless_calibration_trials_are_pruned(tmp_path):
    wl = workload()
    prof = profile_workload(wl, steps=2, options=["none", "int8", "topk1"])
    groups = group_layers(prof)
    plans = [{g: "int8" for g in groups}, {g: "topk1" for g in groups}]
    _, points = run_calibration(wl, prof, groups, plans, storage=f"sqlite:///{tmp_path}/c.db",
                                study_name="c", steps=40, seed=0, prune_ratio=1.1)
    by = {tuple(sorted(set(p["choice"].values()))): p for p in points}
    assert not by[("int8",)]["pruned"] and by[("int8",)]["ratio"] < 1.1
    top = by[("topk1",)]  # 1% top-k falls well behind within 40 steps on this task
    assert top["pruned"] and math.isinf(top["accuracy_loss"]) and top["ratio"] > 1.1
