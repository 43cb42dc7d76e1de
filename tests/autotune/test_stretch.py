"""The stretch estimate (calibrate.stretch) and the fit's censoring, on synthetic loss curves: pure
functions, no training."""

import math

import numpy as np
import pytest

from fastml_strategy.autotune.calibrate import Noise, stretch, stretch_noise
from fastml_strategy.autotune.costmodel import fit_convergence


def curve(n, speed=1.0, noise=0.0, seed=0, k=0.05, floor=0.1):
    """A loss curve ``2 exp(-k speed t) + floor`` with white noise: ``speed`` 1/1.5 is truly 1.5x
    slower (it reaches every loss at 1.5x the step)."""
    rng = np.random.default_rng(seed)
    t = np.arange(1, n + 1)
    return list(2.0 * np.exp(-k * t * speed) + floor + noise * rng.standard_normal(n))


def refs_noise(n, noise, seed, **kw):
    """Two references of different seeds, and the noise their difference measures."""
    refs = {0: {"losses": curve(n, noise=noise, seed=seed, **kw)},
            1: {"losses": curve(n, noise=noise, seed=seed + 1, **kw)}}
    return refs, stretch_noise(refs)


def test_equal_curves_plus_noise_give_a_stretch_consistent_with_1():
    held, ratios = 0, []
    for s in range(20):
        refs, noise = refs_noise(60, 0.05, 3 * s)
        st = stretch(refs[0]["losses"], curve(60, noise=0.05, seed=3 * s + 2), noise)
        held += st.contains(1.0)
        ratios.append(st.ratio)
        assert st.levels >= 10 and not st.censored and st.hi < 1.25  # measured, and narrow
    assert held >= 17  # ~95% intervals
    assert np.exp(np.mean(np.log(ratios))) == pytest.approx(1.0, abs=0.03)


def test_noise_on_a_flattened_curve_does_not_inflate_the_stretch():
    # the failure: the reference has flattened by 40% of the run, where a vertical offset
    # within noise is a large horizontal one (one level read alone: often 1.3x, or never reached)
    held = 0
    for s in range(10):
        refs, noise = refs_noise(60, 0.02, 3 * s, k=0.15)
        st = stretch(refs[0]["losses"], curve(60, noise=0.02, seed=3 * s + 2, k=0.15), noise)
        held += st.contains(1.0)
        assert st.ratio < 1.15 and st.hi < 1.3
        # read at a flattened level alone, the same curves are uncertain (or unknown) by far more
        late = stretch(refs[0]["losses"], curve(60, noise=0.02, seed=3 * s + 2, k=0.15), noise,
                       fractions=(0.8,))
        assert late.levels == 0 or late.hi - late.lo > 3 * (st.hi - st.lo)
    assert held >= 9


def test_a_curve_truly_1_5x_slower_gives_1_5_within_its_interval():
    held = 0
    for s in range(10):
        refs, noise = refs_noise(60, 0.05, 3 * s)
        st = stretch(refs[0]["losses"], curve(60, speed=1 / 1.5, noise=0.05, seed=3 * s + 2), noise)
        held += st.contains(1.5)
        assert not st.contains(1.0) and st.lo > 1.2 and st.ratio == pytest.approx(1.5, rel=0.1)
    assert held >= 9
    assert "slower than the reference beyond noise" in st.words()


def test_a_run_that_reaches_no_level_is_a_lower_bound():
    refs, noise = refs_noise(60, 0.02, 1)
    st = stretch(refs[0]["losses"], curve(60, speed=0.1, noise=0.02, seed=5), noise)  # truly 10x
    assert st.censored and math.isinf(st.hi) and st.reached == 0
    assert 2.0 < st.ratio <= 10.0  # a bound below the truth, not a value
    assert "lower bound" in st.words()


def test_the_noise_is_the_larger_of_the_references_and_the_repeats():
    refs, band = refs_noise(60, 0.05, 0)
    # paired repeats that differ by little: the references' band still sets the noise
    base = [np.asarray(refs[s]["losses"]) for s in (0, 1)]
    rng = np.random.default_rng(4)
    quiet = [[(list(b + 0.005 * rng.standard_normal(60)), list(b)) for b in base]]
    assert stretch_noise(refs, quiet, paired=True).sigma == pytest.approx(band.sigma)
    # repeats that differ by more than the references: they do
    loud = [[(list(b + 0.3 * rng.standard_normal(60)), list(b)) for b in base]]
    got = stretch_noise(refs, loud, paired=True)
    assert got.sigma > 1.5 * band.sigma and "repeat" in got.source
    assert isinstance(got, Noise) and got.dof > 0
    assert math.isnan(stretch_noise({0: refs[0]}).sigma)  # one reference, no repeat: unknown


def _pts(rows):
    return [{"error": e, "ratio": r, "accuracy_loss": 0.0, "censored": c, "ratio_se": se}
            for e, r, c, se in rows]


def test_a_censored_point_is_a_bound_in_the_fit():
    # the others say g(0.2) ~ 1.2; a bound of 1.5 there pulls the fit up to it, never above
    low = [(0.05, 1.05, False, 0.02), (0.1, 1.1, False, 0.02), (0.3, 1.3, False, 0.02)]
    alone = fit_convergence(_pts(low), 1.0)
    bound = fit_convergence(_pts(low + [(0.2, 1.5, True, 0.02)]), 1.0)
    value = fit_convergence(_pts(low + [(0.2, 1.5, False, 0.02)]), 1.0)
    assert alone.g(0.2) < 1.3 and bound.g(0.2) > alone.g(0.2) + 0.01
    assert bound.g(0.2) <= 1.5 + 1e-6  # never above the bound
    # the others say g(0.2) ~ 3: a bound of 1.5 is already met and changes nothing; as a value it
    # would drag the fit down
    high = [(0.1, 2.0, False, 0.02), (0.3, 4.0, False, 0.02)]
    alone = fit_convergence(_pts(high), 1.0)
    bound = fit_convergence(_pts(high + [(0.2, 1.5, True, 0.02)]), 1.0)
    value = fit_convergence(_pts(high + [(0.2, 1.5, False, 0.02)]), 1.0)
    assert bound.g(0.2) == pytest.approx(alone.g(0.2), rel=1e-6)
    assert value.g(0.2) < bound.g(0.2) - 0.1


def test_a_run_measured_within_wide_noise_pulls_the_fit_little():
    pts = [(0.05, 1.02, False, 0.02), (0.1, 1.04, False, 0.02), (0.3, 1.12, False, 0.02)]
    sure = fit_convergence(_pts(pts + [(0.16, 2.0, False, 0.02)]), 1.0)
    noisy = fit_convergence(_pts(pts + [(0.16, 2.0, False, 1.0)]), 1.0)
    none = fit_convergence(_pts(pts + [(0.16, 2.0, False, math.inf)]), 1.0)
    base = fit_convergence(_pts(pts), 1.0).g(0.16)
    assert sure.g(0.16) - base > 0.1 and noisy.g(0.16) - base < (sure.g(0.16) - base) / 10
    assert none.g(0.16) == pytest.approx(base, rel=1e-6)


def test_the_check_picks_the_uniform_plan_that_reaches_the_same_loss_sooner():
    from fastml_strategy.autotune.calibrate import time_to_same_loss

    refs, noise = refs_noise(60, 0.02, 0)
    tuned = curve(60, noise=0.02, seed=10)
    same = curve(60, noise=0.02, seed=11)  # trains alike, each step 0.6x the tuned plan's
    got = time_to_same_loss(tuned, same, noise, tuned_step_s=1.0, other_step_s=0.6)
    assert got["sooner"] and got["time_ratio"] == pytest.approx(0.6, rel=0.1) and got["time_hi"] < 1.0
    slow = curve(60, speed=1 / 1.5, noise=0.02, seed=11)  # 1.5x the steps at 0.8x the step: 1.2x
    got = time_to_same_loss(tuned, slow, noise, tuned_step_s=1.0, other_step_s=0.8)
    assert not got["sooner"] and got["time_ratio"] == pytest.approx(1.2, rel=0.1)
    never = curve(60, speed=0.1, noise=0.02, seed=11)  # a bound only: never "sooner", however fast
    assert not time_to_same_loss(tuned, never, noise, tuned_step_s=1.0, other_step_s=0.01)["sooner"]


def test_the_alternatives_are_the_fastest_and_the_best_feasible_uniform_plans():
    from fastml_strategy.autotune._check import _uniform_alternatives

    groups = {"a": ["a"], "b": ["b"]}

    def row(choice, step_s, objective, feasible=True, kind="fastml"):
        return {"option": "x", "kind": kind, "every": 1, "choice": choice, "step_s": step_s,
                "objective": objective, "feasible": feasible}

    rows = [row({"a": "int8", "b": "int8"}, 1.6, 10.0), row({"a": "int4", "b": "int4"}, 1.0, 12.0),
            row({"a": "int2", "b": "int2"}, 0.5, 9.0, feasible=False),  # over the error limit
            row({"a": "int8", "b": "int4"}, 1.2, 8.0),  # the tuned plan: mixed
            row({"a": "none", "b": "none"}, 3.0, 30.0)]
    alts = _uniform_alternatives(rows, "x", rows[3], groups)
    assert [a["choice"]["a"] for a, _ in alts] == ["int4", "int8"]
    assert "fastest" in alts[0][1] and "cost model" in alts[1][1]
    # the tuned plan is uniform int8, the best by the model: the fastest, int4, is left
    alts = _uniform_alternatives(rows, "x", rows[0], groups)
    assert len(alts) == 1 and alts[0][0]["choice"]["a"] == "int4"



def test_the_uniform_plan_its_calibration_measured_fastest_is_an_alternative_too():
    # issue 28, gpt seed 1: the fit of g(e) charged a top-k mix ~1.3x the steps where its calibration
    # run measured 1.8x; the model's own fastest and best uniform plans were top-k too, so the check
    # never met uniform int2 (measured 1.13x), which reached the target sooner in training
    from fastml_strategy.autotune._check import _uniform_alternatives

    groups = {"a": ["a"], "b": ["b"]}

    def row(o, step_s, objective):
        return {"option": "x", "kind": "fastml", "every": 1, "choice": {"a": o, "b": o}, "step_s": step_s,
                "objective": objective, "feasible": True}

    rows = [row("topk1-int4", 0.50, 1.3), row("int2", 0.59, 1.5), row("int4", 0.83, 1.7)]
    tuned = {"choice": {"a": "topk1", "b": "topk1-int4"}}
    assert [a.uniform for a, _ in _uniform_alternatives(rows, "x", tuned, groups)] == ["topk1-int4"]
    alts = _uniform_alternatives(rows, "x", tuned, groups, {"topk1-int4": 1.8, "int2": 1.13, "int4": 1.0})
    assert [a.uniform for a, _ in alts] == ["topk1-int4", "int2"]  # 1.13 x 0.59 < 1.8 x 0.50 < 1.0 x 0.83
    assert "calibration run" in alts[1][1]

def test_measured_step_times_can_overturn_the_check():
    from types import SimpleNamespace

    from fastml_strategy.autotune._check import _recheck_measured

    tuned = {"a": "int8", "b": "int4"}
    alt = {"a": "int4", "b": "int4"}

    def setup(alt_stretch):
        entry = {"plan": "uniform int4", "choice": alt, "ratio": alt_stretch, "censored": False, "levels": 12,
                 "within_limit": True, "time_ratio": 1.3}
        check = {"option": "x", "tuned": tuned, "alternatives": [entry], "replaced": None,
                 "verdict": "the tuned plan stands (uniform int4: not sooner)"}
        rows = [{"option": "x", "kind": "fastml", "every": 1, "choice": alt, "step_s": 1.0, "objective": 2.0}]
        found = SimpleNamespace(check=check, rows=rows, best={"x": {"choice": tuned}}, conv=None)
        return found, check

    s = SimpleNamespace(sharding=SimpleNamespace(sharded=True), target_steps=1000.0)
    steps = [{"plan": "tuned (x)", "measured_s": 3.6}]
    # predicted 1.3x, but the tuned plan measured 3.6 s per step and uniform int4 1.9: sooner
    found, check = setup(1.05)
    _recheck_measured(s, None, {}, [SimpleNamespace(name="x")], found, steps, {"int4": 1.9})
    assert check["replaced"] == "uniform int4" and found.best["x"]["choice"] == alt
    assert check["alternatives"][0]["measured_time_ratio"] == pytest.approx(1.05 * 1.9 / 3.6)
    # measured: the mix 1.32x sooner than uniform int4 (more than MIX_MARGIN): the tuned plan stands
    found, check = setup(2.5)
    _recheck_measured(s, None, {}, [SimpleNamespace(name="x")], found, steps, {"int4": 1.9})
    assert check["replaced"] is None and found.best["x"]["choice"] == tuned
    assert "measured step times" in check["verdict"]
    # measured: the mix only 1.06x sooner, within the margin: uniform int4 (issue 38's decision)
    found, check = setup(2.0)
    _recheck_measured(s, None, {}, [SimpleNamespace(name="x")], found, steps, {"int4": 1.9})
    assert check["replaced"] == "uniform int4"



def test_the_recheck_uses_the_step_times_measured_beside_the_tuned_plan():
    # the recipes are timed before calibration, the tuned plan minutes later: under a load that
    # changes in between, their ratio says little; the check's alternatives are timed again in the
    # tuned plan's rounds, and those figures decide
    from types import SimpleNamespace

    from fastml_strategy.autotune._check import _recheck_measured

    tuned, alt = {"a": "int8", "b": "int4"}, {"a": "int4", "b": "int4"}
    entry = {"plan": "uniform int4", "choice": alt, "ratio": 1.05, "censored": False, "levels": 12,
             "within_limit": True, "time_ratio": 1.3}
    check = {"option": "x", "tuned": tuned, "alternatives": [entry], "replaced": None,
             "verdict": "the tuned plan stands (uniform int4: not sooner)", "timed_beside_tuned": {"int4": 1.9}}
    rows = [{"option": "x", "kind": "fastml", "every": 1, "choice": alt, "step_s": 1.0, "objective": 2.0}]
    found = SimpleNamespace(check=check, rows=rows, best={"x": {"choice": tuned}}, conv=None)
    s = SimpleNamespace(sharding=SimpleNamespace(sharded=True), target_steps=1000.0)
    # timed before, under another load: 5.0 s (not sooner); beside the tuned plan's 3.6 s: 1.9 s
    _recheck_measured(s, None, {}, [SimpleNamespace(name="x")], found, [{"plan": "tuned (x)", "measured_s": 3.6}],
                      {"int4": 5.0})
    assert check["replaced"] == "uniform int4"
    assert check["alternatives"][0]["measured_time_ratio"] == pytest.approx(1.05 * 1.9 / 3.6)
    assert "timed side by side" in check["alternatives"][0]["measured_words"]

def test_a_bucket_cap_measured_slower_than_ddps_default_buckets_is_dropped():
    # gpt2 of bench_autotune: the check put uniform lowrank4 in plan.json and the cost model gave it
    # bucket_cap_mb 1 (predicted 183 ms per step against 246); timed, 242 ms against 210 with DDP's
    # default buckets, side by side: plan.json now keeps the default
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_costmodel import make_profile, option

    from fastml_strategy.autotune._check import _keep_measured_buckets
    from fastml_strategy.autotune.costmodel import Convergence, Trial

    prof = make_profile()
    groups = {lp.name: [lp.name] for lp in prof.layers}
    plan = {n: "lowrank4" for n in groups}

    def setup(default_s, bucket_mb=1.0, choice=plan):
        best = Trial({"option": "x", "kind": "fastml", "every": 1, "choice": choice, "step_s": 0.18,
                      "objective": 1.0, "use_hook": True, "bucket_mb": bucket_mb})
        check = {"verdict": "uniform lowrank4 reached ...: plan.json holds uniform lowrank4 instead",
                 "timed_beside_tuned": {"lowrank4": default_s}}
        found = SimpleNamespace(check=check, best={"x": best}, chosen="x",
                                conv=Convergence(k=0.0, gamma=1.0, e_max=1.0))
        return found, best

    s = SimpleNamespace(sharding=SimpleNamespace(sharded=False), target_steps=1000.0)
    steps = [{"plan": "tuned (x)", "measured_s": 0.242}]
    found, timed = setup(0.210)
    _keep_measured_buckets(s, prof, groups, [option()], found, steps, timed)
    assert found.best["x"].bucket_mb is None and found.best["x"].choice == plan
    assert found.check["buckets_measured"] == {"bucket_mb": 1.0, "step_s": 0.242, "default_step_s": 0.210}
    assert "keeps the default" in found.check["verdict"]
    # the default measured slower: the cap stands; a mix has no default-bucket timing: it stands too
    for default_s, choice in ((0.250, plan), (0.210, {**plan, "l0.weight": "int4"})):
        found, timed = setup(default_s, choice=choice)
        _keep_measured_buckets(s, prof, groups, [option()], found, steps, timed)
        assert found.best["x"].bucket_mb == 1.0 and "buckets_measured" not in found.check
    # the plan the measured recheck put in place was not the one timed: nothing measured applies
    # not timed beside it: the recipe's own timing before calibration decides
    found, timed = setup(0.210)
    del found.check["timed_beside_tuned"]
    _keep_measured_buckets(s, prof, groups, [option()], found, steps, timed, {"lowrank4": 0.196})
    assert found.best["x"].bucket_mb is None and "timed at another moment" in found.check["verdict"]
    found, timed = setup(0.210)
    found.best["x"] = timed.replace(choice={n: "int4" for n in groups})
    _keep_measured_buckets(s, prof, groups, [option()], found, steps, timed)
    assert found.best["x"].bucket_mb == 1.0


def test_a_recipe_the_measured_recheck_chooses_keeps_the_buckets_it_was_timed_with():
    # bench_autotune gpt2, 50 Mbit/s, seed 1: the recheck with measured step times put uniform lowrank4
    # (timed at DDP's default buckets) in plan.json, and it got the cost model's bucket_cap_mb 1:
    # 242 ms per step against 214 at the default
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_costmodel import make_profile, option

    from fastml_strategy.autotune._check import _recheck_measured
    from fastml_strategy.autotune.costmodel import Convergence

    prof = make_profile()
    groups = {lp.name: [lp.name] for lp in prof.layers}
    alt = {n: "lowrank4" for n in groups}
    tuned = {**alt, next(iter(groups)): "int4"}
    opt = option()
    entry = {"plan": "uniform lowrank4", "choice": alt, "ratio": 1.0, "censored": False, "levels": 12,
             "within_limit": True, "time_ratio": 1.3}
    check = {"option": opt.name, "tuned": tuned, "alternatives": [entry], "replaced": None,
             "verdict": "the tuned plan stands"}
    rows = [{"option": opt.name, "kind": "fastml", "every": 1, "choice": alt, "step_s": 0.18, "objective": 2.0}]
    found = SimpleNamespace(check=check, rows=rows, best={opt.name: {"choice": tuned}},
                            conv=Convergence(k=0.0, gamma=1.0, e_max=1.0))
    s = SimpleNamespace(sharding=SimpleNamespace(sharded=False), target_steps=1000.0)
    _recheck_measured(s, prof, groups, [opt], found, [{"plan": f"tuned ({opt.name})", "measured_s": 0.30}],
                      {"lowrank4": 0.21})
    assert check["replaced"] == "uniform lowrank4"
    assert found.best[opt.name].choice == alt and found.best[opt.name].bucket_mb is None


def _check_inputs(tuned_curve, alt_curve, alt_step_s):
    """What _check._check needs, with every curve already among the calibration runs (no training)."""
    from types import SimpleNamespace

    from fastml_strategy.autotune._state import _Calibrated, _OptionSearch
    from fastml_strategy.autotune.costmodel import AccuracyRule, Convergence

    groups = {"a": ["a"], "b": ["b"]}
    tuned = {"a": "int8", "b": "int4"}
    alt = {"a": "int4", "b": "int4"}
    refs, noise = refs_noise(60, 0.02, 0)
    rows = [{"option": "x", "kind": "fastml", "every": 1, "choice": alt, "step_s": alt_step_s,
             "objective": 2.0, "feasible": True}]
    best = {"x": {"option": "x", "choice": tuned, "step_s": 1.0, "objective": 1.0, "use_hook": True}}
    found = _OptionSearch(rows=rows, best=best, baseline={}, local_best={"x": None})
    points = [{"choice": c, "seed": 0, "losses": l, "metric": None, "pruned": False}
              for c, l in ((tuned, tuned_curve), (alt, alt_curve))]
    ref = {"losses": refs[0]["losses"], "metric": None, "references": refs, "noise": noise, "paired": True}
    cal = _Calibrated(plans=[], ref=ref, points=points, rule=AccuracyRule(limit=0.05), run_s=30.0)
    s = SimpleNamespace(calibration_steps=60, seed=0, max_accuracy_loss=0.05, target_steps=1000.0,
                        sharding=SimpleNamespace(sharded=True), storage=None)
    return s, groups, found, cal, Convergence(k=0.0, gamma=1.0, e_max=1.0), tuned, alt


def test_the_check_runs_whatever_the_budget_left():
    # issue 28: gpt2 seed 0 at 50 Mbit/s missed "no later than the best uniform plan" because the
    # check was skipped once --budget was spent; it now always runs and says what it cost
    import time

    from fastml_strategy.autotune._check import _check
    from fastml_strategy.autotune._state import _Progress

    s, groups, found, cal, conv, tuned, alt = _check_inputs(curve(60, noise=0.02, seed=10),
                                                            curve(60, noise=0.02, seed=11), 0.6)
    notes = []
    rec = _check(s, None, groups, [], "x", found, cal, conv, "c", _Progress(False),
                 deadline=time.time() - 100.0, notes=notes)
    assert rec["alternatives"] and rec["alternatives"][0]["plan"] == "uniform int4"
    assert rec["replaced"] == "uniform int4" and found.best["x"]["choice"] == alt  # 0.6x the step, same curve
    assert "not run" not in rec["verdict"]



# -- the accuracy rule on the same curves: a horizontal offset within noise is not an accuracy loss ----
def _acc_points(seed=0):
    """Calibration points as run_calibration makes them: references of two seeds (the second 5%
    behind: the horizontal jitter a seed makes), and runs (error, speed) against the first: fp16
    3.5% and int4 3% of their steps behind, int2 truly 1.5x slower (a pure delay)."""
    from fastml_strategy.autotune.calibrate import accuracy_within_noise, end_slope

    refs = {0: {"losses": curve(60, noise=0.01, seed=seed, k=0.03, floor=1.0), "metric": None},
            1: {"losses": curve(60, speed=1 / 1.05, noise=0.01, seed=seed + 1, k=0.03, floor=1.0),
                "metric": None}}
    noise = stretch_noise(refs)
    slope = end_slope([r["losses"] for r in refs.values()])
    pts = []
    for i, (e, speed) in enumerate(((0.0002, 1 / 1.035), (0.15, 1 / 1.03), (0.5, 1 / 1.5))):
        c = curve(60, speed=speed, noise=0.01, seed=seed + 2 + i, k=0.03, floor=1.0)
        st = stretch(refs[0]["losses"], c, noise)
        pts.append({"error": e, "choice": {"g": f"p{i}"}, "seed": 0, "pruned": False, "censored": False,
                    "stretch": st, **accuracy_within_noise(refs[0], c, None, st, slope)})
    return pts


def test_a_delayed_run_where_the_loss_still_falls_steeply_passes_the_accuracy_rule():
    # issue 28: where the loss still fell steeply at the end of a 60-step run, uniform fp16 (error
    # 0.0002, stretch interval containing 1) ended 2.3% above the reference and the rule, limit 1%,
    # chose plain DDP on gpt2; on gpt uniform int2, 1.13x slow, ended 11% above and was excluded,
    # though it reached the target in training at 1.16x the steps: the delay was charged twice
    from fastml_strategy.autotune.costmodel import accuracy_rule

    old_excluded = 0
    for seed in range(0, 30, 3):
        fp16, int4, int2 = pts = _acc_points(seed=seed)
        assert fp16["stretch"].contains(1.0) and int4["stretch"].contains(1.0) and int2["stretch"].lo > 1.3
        raw = accuracy_rule([dict(p, accuracy_loss=p["accuracy_loss_raw"]) for p in pts], 0.01, paired=True)
        old_excluded += raw.e_max == 0.0  # the final loss alone: no compressed plan within the limit
        # the delays explain the gaps: every plan is within the limit, int2's 1.5x is g(e)'s to charge
        assert accuracy_rule(pts, 0.01, paired=True).e_max == 0.5
        assert all(abs(p["accuracy_loss"]) <= 0.01 for p in pts) and int2["accuracy_loss_raw"] > 0.15
    assert old_excluded >= 8


def test_a_higher_plateau_keeps_its_gap():
    # a run that follows the reference, then levels off above it: the early levels say it is not
    # delayed, so no delay within its interval explains its final gap
    from fastml_strategy.autotune.calibrate import accuracy_within_noise, end_slope

    for plateau, least in ((1.45, 0.03), (1.6, 0.1)):
        for seed in range(3):
            refs = {s: {"losses": curve(60, noise=0.01, seed=3 * seed + s, k=0.03, floor=1.0), "metric": None}
                    for s in (0, 1)}
            rng = np.random.default_rng(3 * seed + 2)
            c = list(np.maximum(curve(60, k=0.03, floor=1.0), plateau) + 0.01 * rng.standard_normal(60))
            st = stretch(refs[0]["losses"], c, stretch_noise(refs))
            acc = accuracy_within_noise(refs[0], c, None, st, end_slope([r["losses"] for r in refs.values()]))
            assert acc["accuracy_loss"] > least and acc["accuracy_loss"] > 0.75 * acc["accuracy_loss_raw"]



def test_a_run_ahead_of_the_reference_is_never_charged_more_than_its_gap():
    # gpt2 seed 0: int2 measured 0.83x (0.76-0.90) the reference's steps and ended 3.7% above it;
    # shifting it by a delay of its interval would have charged it 11%
    from fastml_strategy.autotune.calibrate import Stretch, accuracy_within_noise

    ref = {"losses": curve(60, k=0.03, floor=1.0), "metric": None}
    ahead = Stretch(0.83, 0.76, 0.90, 0.04, False, 15, 15, 0.01)
    behind = Stretch(1.2, 1.1, 1.3, 0.04, False, 15, 15, 0.01)
    worse = list(np.asarray(ref["losses"]) * 1.037)
    better = list(np.asarray(ref["losses"]) * 0.97)
    assert accuracy_within_noise(ref, worse, None, ahead, 0.5)["accuracy_loss"] == pytest.approx(0.037, rel=1e-6)
    assert accuracy_within_noise(ref, better, None, behind, 0.5)["accuracy_loss"] == pytest.approx(-0.03, rel=1e-6)
    # a run behind that ends above, or ahead that ends below, is shifted towards no gap
    assert abs(accuracy_within_noise(ref, worse, None, behind, 0.5)["accuracy_loss"]) < 0.037
    assert abs(accuracy_within_noise(ref, better, None, ahead, 0.5)["accuracy_loss"]) < 0.03

def test_a_vertical_offset_where_the_reference_has_flattened_counts_in_full():
    from fastml_strategy.autotune.calibrate import accuracy_within_noise, end_slope

    refs = {s: {"losses": curve(60, noise=0.01, seed=s, k=0.2, floor=1.0), "metric": None} for s in (0, 1)}
    worse = list(np.asarray(curve(60, noise=0.01, seed=2, k=0.2, floor=1.0)) + 0.03)  # 3% higher floor
    st = stretch(refs[0]["losses"], worse, stretch_noise(refs))
    acc = accuracy_within_noise(refs[0], worse, None, st, end_slope([r["losses"] for r in refs.values()]))
    assert acc["accuracy_loss_raw"] == pytest.approx(0.03, abs=0.01)
    assert acc["accuracy_allowance"] < 0.002 and acc["accuracy_loss"] > 0.02


def test_no_allowance_for_an_eval_metric_or_a_censored_run():
    from fastml_strategy.autotune.calibrate import accuracy_within_noise, end_slope

    refs = {s: {"losses": curve(60, noise=0.01, seed=s, k=0.03, floor=1.0), "metric": 0.9} for s in (0, 1)}
    c = curve(60, speed=1 / 1.03, noise=0.01, seed=2, k=0.03, floor=1.0)
    st = stretch(refs[0]["losses"], c, stretch_noise(refs))
    slope = end_slope([r["losses"] for r in refs.values()])
    assert slope > 0.3  # still steep: a loss-based run gets an allowance
    assert accuracy_within_noise(dict(refs[0], metric=None), c, None, st, slope)["accuracy_allowance"] > 0
    by_metric = accuracy_within_noise(refs[0], c, 0.88, st, slope)  # measured once, at the end
    assert by_metric["accuracy_allowance"] == 0 and by_metric["accuracy_loss"] == pytest.approx(0.02)
    never = curve(60, speed=0.1, noise=0.01, seed=5, k=0.03, floor=1.0)
    cst = stretch(refs[0]["losses"], never, stretch_noise(refs))
    assert cst.censored
    got = accuracy_within_noise(dict(refs[0], metric=None), never, None, cst, slope)
    assert got["accuracy_allowance"] == 0 and got["accuracy_loss"] == got["accuracy_loss_raw"] > 0.1
