"""The Python API (a Workload object instead of a TARGET string) and calibration pruning."""

import json
import math
import random

import numpy as np
import pytest
import torch

from fastml_strategy import Plan
from fastml_strategy.autotune import autotune
from fastml_strategy.autotune.calibrate import run_calibration
from fastml_strategy.autotune.profile import profile_workload
from fastml_strategy.autotune.search import group_layers

from tiny_workload import workload


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_autotune_api_with_a_workload_object(tmp_path):
    wl = workload()  # (the test's workload seeds torch itself)
    # the caller's global RNGs, moved off their defaults so a reseed to any fixed value shows
    torch.manual_seed(1234), random.seed(1234), np.random.seed(1234)
    torch.rand(3), random.random(), np.random.rand()
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()
    res = autotune(wl, out=tmp_path / "o", link="10gbit", world_size=4, trials=11,
                   calibration_trials=2, calibration_steps=20, profile_steps=2, measure_steps=2,
                   verify_rounds=0, progress=False)
    # the autotuner seeds its runs, but leaves the caller's random state as it found it
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), before[2]))
    assert Plan.load(tmp_path / "o" / "plan.json") == res.plan
    # one rank per machine (the local cluster): no hop inside a machine, plan.json as before
    assert res.plan.intra_node is None and "intra_node" not in (tmp_path / "o" / "plan.json").read_text()
    # the catalog's options of several machines of several ranks searched it (trials.csv's intra_node)
    searched = {r["option"] for r in res.trials if isinstance(r.get("intra_node"), str)}
    assert searched == {o.name for o in res.options if o.nodes > 1 and o.accelerators_per_node > 1} != set()
    assert "intra_node" in (tmp_path / "o" / "trials.csv").read_text().splitlines()[0]
    names = {n for n, _ in workload().model.named_parameters()}
    assert {k for k, _ in res.plan.layers} == names
    local = res.best["local"]
    assert local["tta_s"] == pytest.approx(local["steps"] * local["step_s"])
    assert res.profile.link.bandwidth_Bps == pytest.approx(10e9 / 8)
    assert res.target_steps == 10_000 and res.target_steps_source == "assumed"  # nothing given
    # issue 36: the check trained torch's PowerSGD hook beside the tuned plan, and the report says so
    assert [e["rank"] for e in res.check["powersgd"]] == [1, 2, 4]
    assert "torch PowerSGD rank 4" in (tmp_path / "o" / "report.md").read_text()
    assert "torch_powersgd" in json.loads((tmp_path / "o" / "plan.json").read_text())["meta"]["checked_against_uniform"]
    _check_figures_do_not_overlap(res)


def _check_figures_do_not_overlap(res):
    """Every figure of the report, as drawn: no legend over an axes frame or a title, and the
    predicted-vs-measured plot names its plans on an axis (no labels beside points to collide)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from fastml_strategy.autotune.report import data, plots

    drawn = []
    orig = plots._png
    plots._png = lambda fig: drawn.append(fig) or orig(fig)
    try:
        names = list(plots.figures(res, data.tables(res)))
    finally:
        plots._png = orig
    assert len(drawn) == len(names) >= 6
    for name, fig in zip(names, drawn):
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        r = canvas.get_renderer()
        legends = [a.get_legend() for a in fig.axes if a.get_legend() is not None] + list(fig.legends)
        titles = [a.title for a in fig.axes if a.get_title()] + ([fig._suptitle] if fig._suptitle else [])
        for leg in legends:
            box = leg.get_window_extent(r)
            for ax in fig.axes:
                assert not box.overlaps(ax.get_window_extent(r)), f"{name}: a legend covers a plot"
            for t in titles:
                assert not box.overlaps(t.get_window_extent(r)), f"{name}: a legend covers {t.get_text()!r}"
        if name == "step_times":
            ax = fig.axes[0]
            assert sorted(t.get_text() for t in ax.get_yticklabels()) == \
                sorted(row["plan"] for row in res.step_times)
            assert not ax.texts, "labels beside points"


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_restricted_codec_options_time_and_report_only_those_recipes(tmp_path):
    # issue 28: options=[...] without fp16/int2/topk1 raised KeyError in predict_local, which
    # priced the uniform recipes of every codec whether profiled or not
    res = autotune(workload(), out=tmp_path / "o", link="10gbit", world_size=2, trials=11,
                   calibration_trials=2, calibration_steps=20, profile_steps=2, measure_steps=2,
                   verify_rounds=0, calibration_repeats=0, references=1, local_steps=False,
                   options=["none", "int8", "int4"], progress=False)
    timed = {r["plan"] for r in res.step_times}
    assert {"none", "int8", "int4"} <= timed
    assert not timed & {"fp16", "int2", "topk1"}
    assert {c.describe() for _, c in res.plan.layers} <= {"fp32", "int8", "int4"}
