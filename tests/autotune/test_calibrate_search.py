"""Calibration curves, layer grouping and the search's guarantees, on synthetic inputs."""

import math

import numpy as np
import pytest

from fastml_strategy.autotune.calibrate import calibration_candidates, lag_ratio, smooth, steps_ratio
from fastml_strategy.autotune.costmodel import CANDIDATES, Convergence, evaluate, plan_error
from fastml_strategy.autotune.search import (TIE_TOLERANCE, _load_rows, best_row, expand, group_layers,
                                             lagrangian_plans, run_search)

from test_costmodel import make_profile, option


def curve(n, speed=1.0, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    t = np.arange(1, n + 1)
    return list(2.0 * np.exp(-0.03 * t * speed) + 0.1 + noise * rng.standard_normal(n))


def test_steps_ratio_of_a_slower_curve():
    ref = curve(200)
    r, censored = steps_ratio(ref, curve(400, speed=0.5))  # half as fast, run twice as long
    assert r == pytest.approx(2.0, rel=0.05) and not censored
    r, censored = steps_ratio(ref, ref)
    assert r == pytest.approx(1.0) and not censored


def test_steps_ratio_is_censored_when_a_level_is_never_reached():
    ref = curve(100)
    r, censored = steps_ratio(ref, curve(100, speed=0.2))  # reaches the first level only: a value
    assert not censored and r == pytest.approx(5.0, rel=0.05)
    r, censored = steps_ratio(ref, curve(100, speed=0.1))  # reaches none: a lower bound
    assert censored and 100 / 80 <= r <= 10.0


def test_smooth_is_monotone_and_tolerates_nan():
    s = smooth(curve(100, noise=0.2) + [float("nan")])
    assert np.all(np.diff(s) <= 0) and np.isfinite(s).all()


def test_lag_ratio():
    ref = curve(200)
    assert lag_ratio(smooth(ref), ref[:100]) == pytest.approx(1.0, rel=0.1)
    assert lag_ratio(smooth(ref), curve(100, speed=1 / 3)) == pytest.approx(3.0, rel=0.2)


def test_group_layers_by_role_then_size():
    prof = make_profile(numels=(1 << 16,) * 8)
    for i, lp in enumerate(prof.layers):
        lp.name = f"blocks.{i // 2}.{'attn' if i % 2 == 0 else 'mlp'}.weight"
    assert len(group_layers(prof, max_groups=8)) == 8  # few layers: one group each
    g = group_layers(prof, max_groups=4)
    assert sorted(g) == ["blocks.*.attn.weight", "blocks.*.mlp.weight"]
    assert g["blocks.*.attn.weight"] == [f"blocks.{i}.attn.weight" for i in range(4)]
    g1 = group_layers(prof, max_groups=1)
    assert len(g1) == 1 and sorted(next(iter(g1.values()))) == sorted(lp.name for lp in prof.layers)


def test_calibration_candidates_start_with_uniform_plans_spread_over_error():
    prof = make_profile(errors={"fp16": 1e-4, "int8": 0.01, "int6": 0.03, "int4": 0.1, "int3": 0.2,
                                "int2": 0.4, "int4-noef": 0.15, "topk10": 0.5, "topk1": 0.9,
                                "topk1-int4": 0.95})
    groups = group_layers(prof)
    cands = calibration_candidates(prof, groups, 5, seed=0)
    assert len(cands) == 5
    uniform = [c for c in cands if len(set(c.values())) == 1]
    errs = [plan_error(prof, expand(groups, c)) for c in uniform]
    assert errs == sorted(errs) and errs[0] <= 1e-3 and errs[-1] >= 0.9


def test_search_never_predicts_worse_than_the_best_uniform_plan(tmp_path):
    import optuna

    prof = make_profile(numels=(1 << 20, 1 << 18, 1 << 16), codec_s=1e-4,
                        errors={"int2": 0.5, "topk1": 0.9, "topk1-int4": 0.92, "topk10": 0.6})
    groups = group_layers(prof)
    opt = option(gbps=1.0, price=2.0)
    conv = Convergence(k=1.0, gamma=1.0, e_max=0.55)
    rows = run_search(prof, groups, opt, conv, 1000, storage=None, study_name="t", trials=40, seed=0)
    best = best_row(rows)
    assert best["feasible"] and best["error"] <= conv.e_max
    for o in CANDIDATES:
        r = evaluate(prof, {n: o for ns in groups.values() for n in ns}, opt, conv, 1000)
        if r["feasible"]:
            assert best["cost_usd"] <= r["cost_usd"] * (1 + TIE_TOLERANCE) + 1e-12  # near ties: lower error
    # saved to the storage, and read back instead of searched again
    url = f"sqlite:///{tmp_path}/s.db"
    rows1 = run_search(prof, groups, opt, conv, 1000, storage=url, study_name="t", trials=15, seed=0)
    study = optuna.load_study(study_name="t", storage=url)
    assert len(_load_rows(study)) == len(rows1) == 15  # one JSON document, not trial by trial
    rows2 = run_search(prof, groups, opt, conv, 1000, storage=url, study_name="t", trials=15, seed=1)
    assert rows2 == rows1  # every figure read back as it was predicted
    # read back, not searched: a shorter search would give fewer rows
    assert run_search(prof, groups, opt, conv, 1000, storage=url, study_name="t", trials=10, seed=1) == rows1
    assert len(run_search(prof, groups, opt, conv, 1000, storage=None, study_name="t", trials=10, seed=1)) == 10


def test_saved_rows_are_cut_to_fit_a_text_column(tmp_path, monkeypatch):
    import optuna

    from fastml_strategy.autotune import search

    monkeypatch.setattr(search, "_ROWS_CHUNK", 100)
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/s.db", study_name="t")
    rows = [{"option": "x", "trial": i, "objective": i / 3, "choice": {"g": "int4"}, "inf": math.inf}
            for i in range(20)]
    search._save_rows(study, rows)
    attrs = optuna.load_study(study_name="t", storage=f"sqlite:///{tmp_path}/s.db").user_attrs
    assert attrs["rows.chunks"] > 10 and all(len(attrs[f"rows.{i}"]) <= 100 for i in range(attrs["rows.chunks"]))
    assert _load_rows(study) == rows
    study.set_user_attr("rows.chunks", attrs["rows.chunks"] + 1)  # a save cut short: nothing to read back
    assert _load_rows(study) is None


def test_lagrangian_plans_trace_time_against_error():
    prof = make_profile(numels=(1 << 20, 1 << 18), codec_s=1e-5)
    plans = lagrangian_plans(prof, group_layers(prof), option(gbps=1.0))
    assert len(plans) >= 2
    errs = [plan_error(prof, expand(group_layers(prof), p)) for p in plans]
    # small multiplier: fast and lossy; large: accurate; in between, error never rises
    assert errs[0] > errs[-1] and all(a >= b for a, b in zip(errs, errs[1:]))


def test_verification_probes_the_gap_the_accuracy_rule_has_no_run_in():
    """The rule admits errors up to the largest calibrated one within the limit; a faster plan whose
    error lies between that and the first failing calibrated error is trained (probed), not excluded
    for want of a run; none is probed when nothing in the gap pays or it was trained already."""
    from types import SimpleNamespace

    from fastml_strategy.autotune import _state, _tune
    from fastml_strategy.autotune.costmodel import Sharding
    from fastml_strategy.autotune.costmodel import accuracy_rule
    from fastml_strategy.autotune.search import run_search

    base = {"fp16": 0.001, "int8": 0.02, "int6": 0.05, "int4": 0.15, "int3": 0.3, "int2": 1.0,
            "int4-noef": 0.15, "topk10": 0.4, "topk1": 0.6, "topk1-int4": 0.62,
            # (flat layers: the low-rank codec sends them as fp32, so no plan here takes it)
            "lowrank1": 0.9, "lowrank2": 0.8, "lowrank4": 0.7, "lowrank8": 0.5}
    known = [o for o in CANDIDATES if o == "none" or o.removesuffix("-rbf16") in base]  # the options named here
    prof = make_profile(numels=(1 << 20, 1 << 18, 1 << 16), codec_s=1e-5,
                        errors={o: base[o.removesuffix("-rbf16")] for o in known if o != "none"})
    prof.options = known
    groups = group_layers(prof)
    opt = option(gbps=0.1, price=0.0)  # a slow link: the fewer bytes the better
    s = SimpleNamespace(target_steps=1000, storage=None, trials=60, options=tuple(known), seed=0,
                        sharding=Sharding(), max_residual_bytes=None, local_fragments=(1,))

    def situation(points):
        rule = accuracy_rule(points, 0.01)
        conv = Convergence(k=0.2, gamma=1.0, e_max=rule.e_max)
        best = best_row(run_search(prof, groups, opt, conv, 1000, storage=None, study_name="t", trials=60,
                                   seed=0))
        found = _state._OptionSearch(rows=[], best={opt.name: best}, baseline={}, local_best={})
        return rule, conv, found

    runs = [{"error": 0.001, "accuracy_loss": 0.0}, {"error": 0.05, "accuracy_loss": 0.002},
            {"error": 0.15, "accuracy_loss": 0.004}, {"error": 1.0, "accuracy_loss": 0.05}]
    rule, conv, found = situation(runs)
    assert conv.e_max == pytest.approx(0.15)
    probe = _tune._gap_probe(s, prof, groups, [opt], conv, rule, found, [], "fp")
    assert probe is not None and 0.15 < probe.error < 1.0, probe
    assert probe.objective <= _tune.PROBE_GAIN * found.best[opt.name].objective
    # already trained: nothing new to learn
    assert _tune._gap_probe(s, prof, groups, [opt], conv, rule, found, [probe.choice], "fp") is None
    # a failing run just above the limit: no gap to probe
    rule2, conv2, found2 = situation(runs[:3] + [{"error": 0.16, "accuracy_loss": 0.05}])
    assert _tune._gap_probe(s, prof, groups, [opt], conv2, rule2, found2, [], "fp") is None
    # the probe's run within the limit raises the rule's limit to its error
    assert accuracy_rule(runs + [{"error": probe.error, "accuracy_loss": 0.003}], 0.01).e_max == \
        pytest.approx(probe.error)
    # beyond it, the next probe halves the gap below it (geometric mean with e_max), where it would
    # otherwise train nearly the same plan just below the failed one again (issue 38, gpt3)
    rule3, conv3, found3 = situation(runs + [{"error": probe.error, "accuracy_loss": 0.05}])
    assert conv3.e_max == pytest.approx(0.15)
    assert _tune._probe_limit(rule3, conv3.e_max)[0] == pytest.approx(probe.error)
    half, halved = _tune._probe_limit(rule3, conv3.e_max, [probe.error])
    assert halved and half == pytest.approx(math.sqrt(0.15 * probe.error))
    second = _tune._gap_probe(s, prof, groups, [opt], conv3, rule3, found3, [probe.choice], "fp", [probe.error])
    assert second is not None and 0.15 < second.error <= half < probe.error, (second, half)
    # from e_max = 0 the arithmetic half
    zero = accuracy_rule([{"error": 0.2, "accuracy_loss": 0.05}], 0.01)
    assert _tune._probe_limit(zero, 0.0, [0.2]) == (pytest.approx(0.1), True)


def _hier_option(intra_gbps):
    from fastml_strategy.autotune.catalog import HardwareOption, Link

    return HardwareOption(name="hier", nodes=2, accelerators_per_node=4, price_per_hour=1.0, bandwidth_gbps=10.0,
                          latency_us=0.0, compute_speed=1.0, intra_link=Link(intra_gbps * 1e9 / 8, 0.0, "given"))


def test_search_halves_a_slow_hop_inside_the_machine_unless_the_error_limit_forbids_it():
    """On 2 machines of 4 ranks whose intra-node link is slow (1 Gbit/s against 10 across, compute
    negligible), the search sends the hop inside the machine in bf16 (half its bytes) when the error
    limit has room; with a limit below bf16's rounding (2^-8) it keeps the hop exact."""
    prof = make_profile(numels=(1 << 20, 1 << 18), codec_s=1e-6, fwd=1e-3, bwd=1e-3, opt=1e-4,
                        errors={"fp16": 2e-3})
    groups = group_layers(prof)
    roomy = Convergence(k=0.01, gamma=1.0, e_max=0.5)
    rows = run_search(prof, groups, _hier_option(1.0), roomy, 1000, storage=None, study_name="t", trials=60, seed=0)
    assert all(r["intra_node"] in ("none", "bf16") for r in rows)  # fp16 measured 2e-3: not offered
    best = best_row(rows)
    assert best.intra_node == "bf16", dict(best)
    # tight: only fp16 (error 2e-3) or exact layers fit under 3e-3, and bf16's rounding alone is 3.9e-3
    tight = Convergence(k=0.01, gamma=1.0, e_max=3e-3)
    rows = run_search(prof, groups, _hier_option(1.0), tight, 1000, storage=None, study_name="t", trials=60, seed=0)
    best = best_row(rows)
    assert best.intra_node is None and best["intra_node"] == "none" and best.error <= 3e-3, dict(best)
    assert any(r["intra_node"] == "bf16" for r in rows)  # it was tried, and infeasible
    assert all(not r["feasible"] for r in rows if r["intra_node"] == "bf16")


def test_plan_json_carries_the_chosen_intra_node():
    """plan.json holds the chosen hop inside the machine and round-trips it; an exact hop (or none
    searched) writes the file as before, with no intra_node."""
    from fastml_strategy import RECIPES, Plan
    from fastml_strategy.autotune._state import _plan_from_choice

    prof = make_profile()
    choice = {"l0.weight": "int4", "l1.weight": "int8"}
    plan, d = _plan_from_choice(prof, choice, "t", meta={"x": 1}, intra_node="bf16")
    assert plan.intra_node == RECIPES["bf16"] and d["intra_node"] == RECIPES["bf16"].to_dict()
    assert Plan.from_dict(d) == plan
    assert Plan.from_dict(__import__("json").loads(plan.to_json())) == plan
    before, d0 = _plan_from_choice(prof, choice, "t", meta={"x": 1})
    for i in (None, "none"):
        p, di = _plan_from_choice(prof, choice, "t", meta={"x": 1}, intra_node=i)
        assert "intra_node" not in di and p.to_json() == before.to_json() and di == d0
