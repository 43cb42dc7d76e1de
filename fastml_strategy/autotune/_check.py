"""The check, the last phase before plan.json is written (:func:`_check`): the tuned plan of its
option and the obvious uniform alternatives (the fastest uniform plan within the accuracy limit, the
best by the cost model, each codec family's recipe: int4, the default, lowrank4, topk1) are trained
side by side from the same weights, then torch's PowerSGD hook beside the answer; a uniform plan that reaches the tuned plan's losses sooner
(measured stretch x step time) within the accuracy limit is written instead
(``fastml_strategy.autotune.decide``). Launched distributed, the same comparison runs again with
measured step times (:func:`_recheck_measured`).

A cost model fitted to short, noisy runs can be wrong in ways no refit shows; the alternative a user
would try first is the test.
"""

import math
from typing import Any, Mapping

from fastml_strategy.codecs import check_recipes
from fastml_strategy.config import DEFAULT_RECIPE
from fastml_strategy.autotune.costmodel import Convergence, Profile, Trial
from fastml_strategy.autotune.catalog import HardwareOption
from fastml_strategy.autotune._settings import Settings
from fastml_strategy.autotune.result import StepTimeRow, uses_local_steps
from fastml_strategy.autotune.result import winning_row as _winner
from fastml_strategy.autotune._state import (UNIFORM_RECIPES, _Calibrated, _OptionSearch, _Progress, _Searched,
                                             _best_bucket, _fits, _hash, _ms_text, _with_bucket)


def _recheck_measured(s: Settings, profile: Profile, groups: Mapping[str, list[str]],
                      options: list[HardwareOption], found: _Searched, step_rows: list[StepTimeRow],
                      measured_pre: Mapping[str, float]) -> None:
    """Launched distributed, the tuned plan and the uniform recipes have now been timed for real:
    the check's time ratios again with measured step times (the measured stretch x the measured step
    time over the tuned plan's), and an alternative that is sooner by them (within the accuracy
    limit, its levels reached) replaces the tuned plan in ``found.best`` before plan.json is written.
    A plan the check already replaced (its figures then came from the cost model) is left as is."""
    from fastml_strategy.autotune import search

    c = found.check
    if c is None or not c.get("alternatives") or c.get("replaced"):
        return
    tuned_m = _tuned_measured(step_rows)
    if not tuned_m or not math.isfinite(tuned_m):
        return
    c["tuned_measured_step_s"] = tuned_m
    side = c.get("timed_beside_tuned") or {}
    for a in c["alternatives"]:
        codec = a["plan"].split()[-1]
        _measured_ratio(a, side.get(codec, measured_pre.get(codec)), tuned_m, codec in side, measured_pre)
    e = _decide_measured(c)
    if e is None:
        if any("measured_time_ratio" in a for a in c["alternatives"]):
            c["verdict"] += "; with measured step times too"
        return
    chosen = c["option"]
    row = next(t for t in map(Trial.of, found.rows) if t.option == chosen and t.kind == "fastml"
               and t.every == 1 and t.choice == e["choice"])
    new = row.replace(use_hook=True, checked_over=dict(c["tuned"]), feasible=True)  # within in its run
    opt = next(o for o in options if o.name == chosen)
    if not s.sharding.sharded:  # the recipe as it was timed: DDP's default buckets (issue 36: gpt2 50 Mbit/s
        # seed 1 got the cost model's bucket_cap_mb 1 here, 242 ms per step against 214 at the default)
        new = _with_bucket(profile, groups, opt, found.conv, float(s.target_steps), new, None, search)
    found.best[chosen] = new
    c["replaced"] = e["plan"]
    c["verdict"] = (f"{e['plan']} reached the tuned plan's losses in {e['measured_time_ratio']:.3g}x its time "
                    f"with measured step times (the cost model had said {e['time_ratio']:.3g}x), within the "
                    f"accuracy limit ({c['decision_measured']['why']}): plan.json holds {e['plan']} instead")


def _keep_measured_buckets(s: Settings, profile: Profile, groups: Mapping[str, list[str]],
                           options: list[HardwareOption], found: _Searched, step_rows: list[StepTimeRow],
                           timed: Trial, measured_pre: Mapping[str, float] | None = None) -> None:
    """plan.json's DDP bucket cap comes from the cost model (:func:`_best_bucket`). Launched distributed,
    the plan was then timed with it (``timed``) and, where it is a uniform recipe the check compared,
    at DDP's default buckets side by side in the same rounds (else, for a uniform recipe, with the
    recipes before calibration: ``measured_pre``). Where the default measured faster,
    plan.json keeps DDP's default, and the check's verdict says so. (gpt2 of bench_autotune, uniform
    lowrank4: 242 ms per step at bucket_cap_mb 1 against 210 at the default, where the model had
    predicted 183 against 246: two factor all-reduces per bucket.)"""
    from fastml_strategy.autotune import search

    c, row = found.check, Trial.of(found.best[found.chosen])
    if (c is None or s.sharding.sharded or row.bucket_mb is None or row.uniform is None
            or row.choice != timed.choice or row.bucket_mb != timed.bucket_mb):
        return
    tuned_m = _tuned_measured(step_rows)
    default_m = (c.get("timed_beside_tuned") or {}).get(row.uniform, (measured_pre or {}).get(row.uniform))
    if not (tuned_m and default_m and math.isfinite(tuned_m) and math.isfinite(default_m)) or default_m >= tuned_m:
        return
    opt = next(o for o in options if o.name == found.chosen)
    found.best[found.chosen] = _with_bucket(profile, groups, opt, found.conv, float(s.target_steps), row, None, search)
    c["buckets_measured"] = {"bucket_mb": row.bucket_mb, "step_s": tuned_m, "default_step_s": default_m}
    beside = row.uniform in (c.get("timed_beside_tuned") or {})
    c["verdict"] += (f"; bucket_cap_mb {row.bucket_mb:g} measured {_ms_text(tuned_m)} per step against "
                     f"{_ms_text(default_m)} with DDP's default buckets ("
                     + ("side by side" if beside else "timed at another moment") + "): plan.json keeps the default")


def _tuned_measured(step_rows: list[StepTimeRow]) -> float | None:
    """The tuned plan's measured seconds per step among the timed rows (None: not timed)."""
    return next((r["measured_s"] for r in step_rows if str(r["plan"]).startswith("tuned")), None)


def _measured_ratio(e: dict[str, Any], m: float | None, tuned_m: float, beside: bool,
                    measured_pre: Mapping[str, float]) -> None:
    """An alternative's entry of the check with its measured step time ``m`` (None: not timed)."""
    codec = e["plan"].split()[-1]
    if not m or not math.isfinite(m):
        timed = [r for r in UNIFORM_RECIPES if r in measured_pre]
        e["measured_words"] = f"{codec} was not timed (only the uniform recipes {', '.join(timed)} are)"
        return
    e["measured_step_s"] = m
    e["measured_time_ratio"] = e["ratio"] * m / tuned_m
    e["measured_sooner"] = bool(not e["censored"] and e["levels"] > 0 and e["measured_time_ratio"] < 1.0)
    e["measured_words"] = (f"with measured step times ({_ms_text(m)} against the tuned plan's {_ms_text(tuned_m)}"
                           + (", timed side by side" if beside else ", timed at another moment")
                           + f"): {e['measured_time_ratio']:.3g}x the time")


def _decide_measured(c: dict[str, Any]) -> dict[str, Any] | None:
    """The check's decision (:func:`fastml_strategy.autotune.decide.decide`) again with the measured
    time ratios of the alternatives that were timed; the entry that replaces the tuned plan, or None."""
    from fastml_strategy.autotune.decide import Contender, decide

    timed = [e for e in c["alternatives"] if "measured_time_ratio" in e]
    me = Contender("the tuned plan", len(set(c["tuned"].values())) == 1,
                   1.0, c.get("tuned_accuracy_loss", 0.0) <= c.get("limit", math.inf))
    others = [Contender(e["plan"], True, e["measured_time_ratio"] if not e["censored"] and e["levels"] > 0
                        else math.inf, bool(e["within_limit"])) for e in timed]
    d = decide([me, *others])
    if d is None or d.chosen is me:
        return None
    c["decision_measured"] = d.to_dict([me, *others])
    return timed[others.index(d.chosen)]


def _uniform_alternatives(rows: list[Mapping[str, Any]], option: str, tuned: Mapping[str, Any],
                          groups: Mapping[str, list[str]],
                          measured: Mapping[str, float] | None = None,
                          own: Mapping[str, float] | None = None) -> list[tuple[Trial, str]]:
    """The obvious alternatives to the tuned plan on ``option``: the feasible uniform per-step plan
    (every group on one codec) of the lowest predicted step time, the one of the lowest predicted
    objective and, with ``measured`` (codec -> the stretch its calibration run measured), the one of
    the lowest measured stretch x predicted step time, each with why it was picked; the tuned plan
    itself is not its own alternative. The third is the model's blind spot: one error number does
    not capture every codec family (bench_autotune's gpt, seed 1: top-k plans needed 1.8x the steps at an
    error where int2 needed 1.13x, and the fit of g(e) split the difference).

    ``own`` (codec -> measured stretch, :func:`_own_runs_within`: the uniform recipes whose own
    calibration runs all stayed within the accuracy limit) adds the fastest of those by measured
    stretch x predicted step time, *whether or not the fit admits its error*: the fit pools runs, so
    a noisy neighbour can place a recipe beyond ``e_max`` that its own runs placed within, and then
    no alternative was left to compare with (issue 38: plain DDP, 5x slower than uniform int4)."""
    tuned = Trial.of(tuned)
    uni: dict[str, Trial] = {}
    every_uni: dict[str, Trial] = {}  # feasible by the fit or not
    for t in map(Trial.of, rows):
        o = t.uniform
        if (t.option != option or t.kind != "fastml" or t.every != 1 or o is None
                or len(t.choice) != len(groups) or o == "none" or not math.isfinite(t.objective)):
            continue
        if o not in every_uni or t.objective < every_uni[o].objective:
            every_uni[o] = t
        if t.feasible and (o not in uni or t.objective < uni[o].objective):
            uni[o] = t
    picks: list[tuple[Trial, str]] = []
    if uni:
        fast = min(uni.values(), key=lambda t: (t.step_s, t.objective))
        best = min(uni.values(), key=lambda t: (t.objective, t.step_s))
        picks = [(fast, "the fastest uniform plan within the accuracy limit by predicted step time"),
                 (best, "the best uniform plan by the cost model")]
    timed = [(measured[o] * t.step_s, t) for o, t in uni.items() if measured and o in measured]
    if timed:
        picks.append((min(timed, key=lambda x: x[0])[1],
                      "the fastest uniform plan by its calibration run (measured stretch x predicted "
                      "step time)"))
    mine = [(own[o] * t.step_s, t) for o, t in every_uni.items() if own and o in own]
    if mine:
        picks.append((min(mine, key=lambda x: x[0])[1],
                      "the fastest uniform recipe whose own calibration runs stayed within the accuracy "
                      "limit (measured stretch x predicted step time)"))
    out: list[tuple[Trial, str]] = []
    for t, why in picks:
        if t.choice != tuned.choice and all(t.choice != q.choice for q, _ in out):
            out.append((t, why))
        elif t.choice != tuned.choice:  # the same plan for both reasons
            out = [(q, w if q.choice != t.choice else f"{w}, and {why}") for q, w in out]
    return out


def _own_runs_within(cal: _Calibrated, groups: Mapping[str, list[str]], seed: int,
                     limit: float) -> dict[str, float]:
    """Codec -> the stretch its uniform calibration run at ``seed`` measured, for the uniform
    recipes whose every calibration run (each seed; none pruned) had an accuracy loss within
    ``limit``: the recipes that met the accuracy rule in their own runs, whatever the fit over all
    runs made of their error."""
    measured = _measured_uniform(cal, groups, seed)
    worst: dict[str, float] = {}
    for p in cal.points:
        vals = set((p.get("choice") or {}).values())
        if len(vals) != 1 or len(p["choice"]) != len(groups):
            continue
        o = next(iter(vals))
        v = math.inf if p.get("pruned") else float(p.get("accuracy_loss", math.inf))
        worst[o] = max(worst.get(o, -math.inf), v if math.isfinite(v) else math.inf)
    return {o: r for o, r in measured.items() if worst.get(o, math.inf) <= limit + 1e-12}


def _measured_uniform(cal: _Calibrated, groups: Mapping[str, list[str]], seed: int) -> dict[str, float]:
    """Codec -> the stretch its uniform calibration run at ``seed`` measured (runs that reached a
    level and were not pruned; a censored run's ratio is a bound, left out)."""
    out: dict[str, float] = {}
    for p in cal.points:
        vals = set((p.get("choice") or {}).values())
        if (len(vals) == 1 and len(p["choice"]) == len(groups) and int(p.get("seed", seed)) == seed
                and not p.get("pruned") and not p.get("censored") and p.get("levels", 1) > 0
                and math.isfinite(float(p.get("ratio", math.nan)))):
            out[next(iter(vals))] = float(p["ratio"])
    return out


def _check_curve(s: Settings, profile: Profile, groups: Mapping[str, list[str]], gchoice: Mapping[str, str],
                 cal: _Calibrated, cal_name: str) -> tuple[list[float], float | None]:
    """The loss curve of ``gchoice`` at the run's seed: a calibration run's, else trained now and kept
    in the calibration study (a resumed run reads it back)."""
    import optuna

    from fastml_strategy.autotune import calibrate, search

    for p in cal.points:
        if p["choice"] == dict(gchoice) and int(p.get("seed", s.seed)) == s.seed and p.get("losses") \
                and not p.get("pruned"):
            return list(p["losses"]), p.get("metric")
    study = optuna.create_study(storage=s.storage, study_name=cal_name, direction="minimize",
                                load_if_exists=True)
    key = f"check-{_hash([dict(gchoice), s.seed, s.calibration_steps])}"
    got = study.user_attrs.get(key)
    if got is None:
        losses, metric = calibrate.train_curve(s.workload, search.expand(groups, gchoice),
                                               s.calibration_steps, s.seed)
        got = {"losses": [v if math.isfinite(v) else None for v in losses], "metric": metric}
        study.set_user_attr(key, got)
    return [math.inf if v is None else float(v) for v in got["losses"]], got["metric"]


def _check(s: Settings, profile: Profile, groups: Mapping[str, list[str]], options: list[HardwareOption],
           chosen: str, found: _OptionSearch, cal: _Calibrated, conv: Convergence, cal_name: str,
           bar: _Progress, deadline: float | None, notes: list[str]) -> dict[str, Any] | None:
    """Before the plan is written: the tuned plan of plan.json's option and its obvious alternatives
    (:func:`_uniform_alternatives`) trained side by side from the same weights at the run's seed
    (calibration-length runs; those calibration already ran are reused). An alternative that reaches
    the tuned plan's losses sooner (measured steps x predicted step time,
    :func:`~fastml_strategy.autotune.calibrate.time_to_same_loss`) and stayed within the accuracy
    limit in its run replaces the tuned plan in ``found.best``; the record says what was compared and
    why the choice stands (None: local steps won, which this check does not compare).

    Plain DDP (no compressed plan admitted, or none predicted faster) is checked too: its curve is the
    reference run's, and the alternatives include the fastest uniform recipe whose own calibration
    runs stayed within the limit. The check must never fail open: a search that admitted nothing
    (issue 38) cannot leave plain DDP in place of a recipe that met the accuracy rule in its runs."""
    from fastml_strategy.autotune import search

    tuned = Trial.of(found.best[chosen])
    if uses_local_steps(_winner(tuned, found.local_best.get(chosen))):
        return None
    plain = not tuned.use_hook
    own = _own_runs_within(cal, groups, s.seed, s.max_accuracy_loss)
    alts = _uniform_alternatives(found.rows, chosen, tuned, groups, _measured_uniform(cal, groups, s.seed), own)
    alts += _default_recipe(found.rows, chosen, tuned, groups, alts)
    record: dict[str, Any] = {"option": chosen, "steps": s.calibration_steps, "seed": s.seed,
                              "paired": cal.ref.get("paired"), "tuned": dict(tuned.choice),
                              "tuned_plain": plain, "tuned_step_s": tuned.step_s, "alternatives": [],
                              "limit": s.max_accuracy_loss,
                              "replaced": None, "own_within": sorted(own)}
    ref = cal.ref.get("references", {}).get(s.seed) or cal.ref
    if not alts:
        record["verdict"] = ("nothing to compare: the tuned plan is itself the fastest and the best "
                             "uniform plan within the accuracy limit, or no uniform plan is within it, "
                             "by the fit or in its own calibration runs")
        _powersgd_check(s, profile, groups, options, chosen, found, cal, cal_name, ref, record, bar, deadline, notes)
        return record
    todo = [a for a in ([] if plain else [tuned]) + [r for r, _ in alts]
            if not any(p["choice"] == a.choice and int(p.get("seed", s.seed)) == s.seed and p.get("losses")
                       for p in cal.points)]
    if not _fits(deadline, cal.run_s * len(todo)):  # it runs all the same: say what it cost
        notes.append(f"--budget: the check against uniform plans ({len(todo)} runs of about "
                     f"{cal.run_s:.0f} s) ran past the budget (it always runs; its time was reserved, "
                     f"but the runs before it took longer than estimated)")
    bar.phase("checking the tuned plan against uniform plans", max(1, len(todo)), "run")
    # plain DDP's curve is the reference run itself (uncompressed training, the same weights and batches)
    if plain:
        t_losses, tuned_within = list(ref["losses"]), True
    else:
        t_losses, t_metric = _check_curve(s, profile, groups, tuned.choice, cal, cal_name)
        record["tuned_accuracy_loss"] = _own_accuracy(cal, ref, t_losses, t_metric)
        tuned_within = bool(record["tuned_accuracy_loss"] <= s.max_accuracy_loss + 1e-12)
    bar.update(1)
    _compare_alternatives(s, profile, groups, alts, t_losses, tuned, cal, cal_name, ref, record, bar)
    row = _decide(record, alts, tuned, plain, tuned_within)
    if row is not None:
        # a recipe its own runs placed within the limit is admitted by them, whatever the fit said
        new = row.replace(use_hook=True, checked_over=dict(tuned.choice), feasible=True)
        if not s.sharding.sharded:
            new = _best_bucket(profile, groups, options[[o.name for o in options].index(chosen)], conv,
                               float(s.target_steps), new, search)
        found.best[chosen] = new
    _powersgd_check(s, profile, groups, options, chosen, found, cal, cal_name, ref, record, bar, deadline, notes)
    return record


def _over_limit_fallback(record: dict[str, Any], others: list[Any]) -> Any:
    """The tuned plan went over the accuracy limit in its own run and no alternative has a time to
    its losses (their runs never went that low: censored): it may not stand where a recipe stayed
    within the limit. The answer is then the within-limit alternative of the lowest predicted step
    time (within the limit, their step counts to the target differ by at most the limit)."""
    from fastml_strategy.autotune.decide import Decision

    ok = [(e["step_s"], c) for e, c in zip(record["alternatives"], others) if c.within]
    if not ok:
        return None
    c = min(ok, key=lambda x: x[0])[1]
    return Decision(c, "the tuned plan went over the accuracy limit in its own run; this is the fastest "
                       "recipe by predicted step time that stayed within it")


def _decide(record: dict[str, Any], alts: list[tuple[Trial, str]], tuned: Trial, plain: bool,
            tuned_within: bool) -> Trial | None:
    """Apply :func:`fastml_strategy.autotune.decide.decide` to the check's figures in ``record`` (the
    tuned plan at 1.0, each alternative's time ratio and own-run accuracy), write its ``decision``,
    ``replaced`` and ``verdict``, and return the alternative's row that replaces the tuned plan (None:
    the tuned plan, or plain DDP, stands)."""
    from fastml_strategy.autotune.decide import Contender, decide

    me = Contender("plain DDP" if plain else "the tuned plan", plain or tuned.uniform is not None, 1.0, tuned_within)
    # a run that never reached the tuned plan's losses (censored) has no time to them: not a contender
    others = [Contender(e["plan"], True, float(e["time_ratio"]) if not e.get("censored") and e.get("levels", 1) > 0
                        else math.inf, bool(e["within_limit"])) for e in record["alternatives"]]
    d = decide([me, *others])
    if d is None and not tuned_within:
        d = _over_limit_fallback(record, others)
    if d is not None:
        record["decision"] = d.to_dict([me, *others])
    if d is None or d.chosen is me:
        why_not = [f"{e['plan']}: " + ("over the accuracy limit in its run" if not e["within_limit"] else
                                       f"{e['time_ratio']:.3g}x its time") for e in record["alternatives"]]
        record["verdict"] = (f"{me.label} stands: " + (d.why if d is not None else "no plan compared stayed "
                             "within the accuracy limit in its run") + " (" + "; ".join(why_not) + ")")
        return None
    row = alts[others.index(d.chosen)][0]
    record["replaced"] = f"uniform {row.uniform}"
    record["verdict"] = (f"{record['replaced']} reached the {'reference' if plain else 'tuned plan'}'s losses "
                         f"in {d.chosen.time_ratio:.3g}x its time, within the accuracy limit ({d.why}): "
                         f"plan.json holds {record['replaced']} instead" + (" of plain DDP" if plain else ""))
    return row


# The recipes every check also trains (when none is the tuned plan or an alternative already): each
# codec family's own (``Codec.check``: int4, the library's default; lowrank4; topk1), so that a
# calibration the budget cut short (on a loaded machine only the first, fp16, plan may run) cannot
# leave the answer slower than int4 where it meets the accuracy limit, and a family the calibration
# never ran uniformly is still judged by its own run (gpt2 of bench_autotune: uniform lowrank4 reached
# the target first of every recipe in 6 runs of 6 while the check, not training it, answered int2 or a
# low-rank mix; benchmarks/RESULTS.md, issue 36).
def _default_recipe(rows: list[Mapping[str, Any]], option: str, tuned: Trial, groups: Mapping[str, list[str]],
                    alts: list[tuple[Trial, str]]) -> list[tuple[Trial, str]]:
    """The uniform plan of each of :func:`fastml_strategy.codecs.check_recipes` on ``option`` as one more alternative, unless
    it is already compared (or is the tuned plan, or not an option there)."""
    out: list[tuple[Trial, str]] = []
    for recipe in check_recipes():
        uni = [t for t in map(Trial.of, rows) if t.option == option and t.kind == "fastml" and t.every == 1
               and t.uniform == recipe and len(t.choice) == len(groups) and math.isfinite(t.objective)]
        if not uni or tuned.choice == uni[0].choice or any(a.choice == uni[0].choice for a, _ in alts + out):
            continue
        why = (f"the default recipe ({recipe})" if recipe == DEFAULT_RECIPE else f"its codec family's recipe ({recipe})")
        out.append((min(uni, key=lambda t: t.objective), f"{why}, trained in every check: judged by its own run"))
    return out


def _own_accuracy(cal: _Calibrated, ref: Mapping[str, Any], losses: list[float], metric: float | None) -> float:
    """The accuracy rule's measure of one run against the reference: the gap that a horizontal offset
    within noise does not explain."""
    from fastml_strategy.autotune import calibrate

    slope = calibrate.end_slope([v["losses"] for v in (cal.ref.get("references") or {0: ref}).values()
                                 if v.get("losses")])
    return calibrate.accuracy_within_noise(
        ref, losses, metric, calibrate.stretch(ref["losses"], losses, cal.ref.get("noise")), slope)["accuracy_loss"]


def _compare_alternatives(s: Settings, profile: Profile, groups: Mapping[str, list[str]],
                          alts: list[tuple[Trial, str]], t_losses: list[float], tuned: Trial, cal: _Calibrated,
                          cal_name: str, ref: Mapping[str, Any], record: dict[str, Any], bar: _Progress) -> None:
    """Train (or read back) each alternative and add its entry to ``record["alternatives"]`` (in the
    order of ``alts``): its time to the tuned plan's losses and whether its run stayed within the
    accuracy limit."""
    from fastml_strategy.autotune import calibrate

    for row, why in alts:
        losses, metric = _check_curve(s, profile, groups, row.choice, cal, cal_name)
        bar.update(1)
        cmp = calibrate.time_to_same_loss(t_losses, losses, cal.ref.get("noise"), tuned.step_s, row.step_s)
        acc = _own_accuracy(cal, ref, losses, metric)
        within = bool(acc <= s.max_accuracy_loss + 1e-12)
        record["alternatives"].append({"plan": f"uniform {row.uniform}", "why": why,
                                       "choice": dict(row.choice), "step_s": row.step_s, "accuracy_loss": acc,
                                       "within_limit": within, "feasible_by_fit": row.feasible,
                                       **{k: v for k, v in cmp.items()}})


# torch's PowerSGD hook at these ranks is trained in every check of a DDP plan beside the tuned plan
# (issue 36): the baseline a user who knows gradient compression asks about. It is another hook, so it
# cannot be written as plan.json: a faster one is reported ("torch PowerSGD rank r was faster"), never
# put in place of the plan.
POWERSGD_RANKS = (1, 2, 4)


def _powersgd_curve(s: Settings, rank: int, start: int, cal_name: str) -> tuple[list[float], float | None, float]:
    """torch's PowerSGD hook's calibration-length run at ``rank`` (calibrate.powersgd_curve), kept in
    the calibration study like the check's other runs (a resumed run reads it back)."""
    import optuna

    from fastml_strategy.autotune import calibrate

    study = optuna.create_study(storage=s.storage, study_name=cal_name, direction="minimize",
                                load_if_exists=True)
    key = f"powersgd-{_hash([rank, start, s.seed, s.calibration_steps])}"
    got = study.user_attrs.get(key)
    if got is None:
        losses, metric, hook_s = calibrate.powersgd_curve(s.workload, rank, s.calibration_steps, s.seed, start)
        got = {"losses": [v if math.isfinite(v) else None for v in losses], "metric": metric, "hook_s": hook_s}
        study.set_user_attr(key, got)
    return [math.inf if v is None else float(v) for v in got["losses"]], got["metric"], float(got["hook_s"])


def _powersgd_check(s: Settings, profile: Profile | None, groups: Mapping[str, list[str]],
                    options: list[HardwareOption], chosen: str, found: _OptionSearch, cal: _Calibrated,
                    cal_name: str, ref: Mapping[str, Any], record: dict[str, Any], bar: _Progress,
                    deadline: float | None, notes: list[str]) -> None:
    """The check's last step: torch's PowerSGD hook against the plan plan.json will hold (the tuned
    plan, the uniform plan that replaced it, or plain DDP), :func:`_powersgd_baselines`."""
    if getattr(s, "workload", None) is None or profile is None:
        return
    final = Trial.of(found.best[chosen])
    plain = not final.use_hook
    losses = list(ref["losses"]) if plain else _check_curve(s, profile, groups, final.choice, cal, cal_name)[0]
    record["powersgd_against"] = record.get("replaced") or ("plain DDP" if plain else "the tuned plan")
    _powersgd_baselines(s, profile, options, chosen, final, losses, cal, cal_name, ref, record, bar, deadline, notes)


def _powersgd_baselines(s: Settings, profile: Profile | None, options: list[HardwareOption], chosen: str,
                        tuned: Trial, t_losses: list[float], cal: _Calibrated, cal_name: str,
                        ref: Mapping[str, Any], record: dict[str, Any], bar: _Progress,
                        deadline: float | None, notes: list[str]) -> None:
    """torch's PowerSGD hook (:data:`POWERSGD_RANKS`) beside the tuned plan, as the uniform
    alternatives are: its loss curve from the same weights at the run's seed, its step time from the
    cost model (:func:`~fastml_strategy.autotune.costmodel.powersgd.powersgd_step_time`, one bucket,
    its compute as timed in its run), the time to the tuned plan's losses with its mean step time over
    the run (plain DDP's before ``start_powerSGD_iter``, 10% of the run: torch's advice; its default,
    1000, would never compress in a calibration-length run). Entries go to ``record["powersgd"]``;
    ``record["powersgd_faster"]`` names the soonest one within the accuracy limit, if sooner."""
    from fastml_strategy.autotune import calibrate
    from fastml_strategy.autotune.costmodel import powersgd as psgd

    opt = next((o for o in options if getattr(o, "name", None) == chosen), None)
    if profile is None or opt is None or getattr(s, "workload", None) is None or s.sharding.sharded:
        return
    start = psgd.calibration_start_iter(s.calibration_steps)
    cap = psgd.one_bucket_mb(sum(lp.numel for lp in profile.layers))
    slope = calibrate.end_slope([v["losses"] for v in (cal.ref.get("references") or {0: ref}).values()
                                 if v.get("losses")])
    if not _fits(deadline, cal.run_s * len(POWERSGD_RANKS)):
        notes.append(f"--budget: the check's torch PowerSGD runs ({len(POWERSGD_RANKS)} of about "
                     f"{cal.run_s:.0f} s) ran past the budget (they always run, as the check does)")
    bar.phase("checking the tuned plan against torch's PowerSGD hook", len(POWERSGD_RANKS), "run")
    entries = record.setdefault("powersgd", [])
    for r in POWERSGD_RANKS:
        losses, metric, hook_s = _powersgd_curve(s, r, start, cal_name)
        bar.update(1)
        st = psgd.powersgd_step_time(profile, opt, r, hook_s, start=start, steps=s.calibration_steps,
                                     bucket_mb=cap)
        cmp = calibrate.time_to_same_loss(t_losses, losses, cal.ref.get("noise"), tuned.step_s, st.mean_step_s)
        acc = calibrate.accuracy_within_noise(
            ref, losses, metric, calibrate.stretch(ref["losses"], losses, cal.ref.get("noise")),
            slope)["accuracy_loss"]
        entries.append({"plan": f"torch PowerSGD rank {r}", "rank": r, "start_powerSGD_iter": start,
                        "bucket_cap_mb": cap, "step_s": st.step_s, "plain_step_s": st.plain_step_s,
                        "mean_step_s": st.mean_step_s, "bytes_per_rank": st.bytes_per_rank,
                        "hook_s": hook_s, "accuracy_loss": acc,
                        "within_limit": bool(acc <= s.max_accuracy_loss + 1e-12),
                        "step_words": psgd.words(st), **cmp})
    faster = [e for e in entries if e["sooner"] and e["within_limit"]]
    if faster:
        e = min(faster, key=lambda e: e["time_ratio"])
        against = record.get("powersgd_against", "the tuned plan")
        record["powersgd_faster"] = (f"torch PowerSGD rank {e['rank']} was faster: it reached {against}'s "
                                     f"losses in {e['time_ratio']:.3g}x its time, within the accuracy limit "
                                     f"(another hook: plan.json cannot hold it)")
