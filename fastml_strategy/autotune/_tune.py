"""Calibration and search, rank 0's phase (:func:`_search_on_rank0`): the first calibration runs and
the accuracy rule fitted to them, the Optuna search of every hardware option
(:func:`_search_options`), the verification rounds that train the chosen plans (and a probe just
beyond the accuracy limit, :func:`_gap_probe`), local-steps calibration, the Pareto front, and then
the check (``_check``). The result goes to every rank as a :class:`~fastml_strategy.autotune._state._Searched`.
"""

import dataclasses
import math
import time
from dataclasses import asdict
from typing import Any, Mapping, Sequence

from fastml_strategy.autotune.costmodel import (AccuracyRule, Convergence, LocalCalibration, Profile, Sharding,
                                                Trial, accuracy_rule, evaluate, fit_convergence, intra_node_choices,
                                                objective, pareto_front)
from fastml_strategy.autotune.catalog import HardwareOption
from fastml_strategy.autotune._settings import Settings
from fastml_strategy.autotune.result import CalibrationPoint
from fastml_strategy.autotune._state import (CHECK_RUNS, _Calibrated, _Failed, _OptionSearch, _Progress, _Searched,
                                             _best_bucket, _broadcast, _chosen_option, _fits, _hash, _reserve)
from fastml_strategy.autotune._check import _check


def _search_on_rank0(s: Settings, profile: Profile, groups: Mapping[str, list[str]],
                     options: list[HardwareOption], cal_name: str, fp: str, bar: _Progress) -> _Searched:
    """Calibrate and search on rank 0; every rank returns its result (or raises its failure)."""
    found: Any = None
    if s.rank == 0:
        try:
            found = _calibrate_and_search(s, profile, groups, options, cal_name, fp, bar)
        except Exception as e:  # tell the waiting ranks, or they would wait for the timeout
            if s.distributed:
                _broadcast(_Failed(f"{type(e).__name__}: {e}"), True)
            raise
    found = _broadcast(found, s.distributed)
    if isinstance(found, _Failed):
        raise RuntimeError(f"rank 0 failed: {found.message}")
    return found


def _calibrate_and_search(s: Settings, profile: Profile, groups: Mapping[str, list[str]],
                          options: list[HardwareOption], cal_name: str, fp: str, bar: _Progress) -> _Searched:
    """Calibrate (reference runs, the candidate plans, then repeats of the runs nearest the limit),
    calibrate local steps, search every option, then verify: train the plans the search chose, refit,
    and search again, until every chosen plan has been trained or ``verify_rounds`` rounds are done.

    Every study lives in the storage (search studies are named by the fit they used), so a resumed
    run replays finished rounds from the database instead of recomputing them. With a deadline
    (``--budget``), runs that would end past it are not started (the reason is in the notes returned).
    """
    notes: list[str] = []
    deadline = _calibration_deadline(s, profile)
    cal = _first_calibration(s, profile, groups, cal_name, bar, deadline, notes)
    # the check against uniform plans always runs: its runs are kept out of the optional ones' time
    optional = _reserve(deadline, CHECK_RUNS * cal.run_s)
    local_cal = _calibrate_local_steps(s, profile, cal_name, cal.run_s, optional, bar, notes) \
        if s.local_steps else None
    rnd = 0
    probed: list[float] = []  # the errors of the probes trained so far
    while True:
        conv = fit_convergence(cal.points, s.max_accuracy_loss, rule=cal.rule)
        found = _search_options(s, profile, groups, options, conv, local_cal, fp, bar)
        new = _untried_plans(found.best, cal.points)
        if rnd >= s.verify_rounds:
            break
        probe = _gap_probe(s, profile, groups, options, conv, cal.rule, found,
                           [p["choice"] for p in cal.points] + new, fp, probed)
        if probe is not None:
            new.append(probe.choice)
            probed.append(probe.error)
        if not new:
            break
        if not _fits(optional, cal.run_s * len(new)):
            notes.append(f"--budget: verification round {rnd + 1} ({len(new)} chosen plans) not run")
            break
        rnd += 1
        bar.phase(f"verifying the chosen plans (round {rnd} of up to {s.verify_rounds})",
                  1 + len(cal.plans) + len(new), "run")
        e_before, halved = conv.e_max, probe is not None and _probe_limit(cal.rule, conv.e_max, probed[:-1])[1]
        cal = _calibrate_again(s, profile, groups, cal, cal.plans + new, cal_name, bar, optional)
        if probe is not None:
            notes.append(_probe_note(probe, e_before, cal, halved))
    chosen = _chosen_option(options, found)
    check = _check(s, profile, groups, options, chosen, found, cal, conv, cal_name, bar, deadline, notes)
    rows, front = _pareto(found.rows, options)
    return _Searched(points=cal.points, conv=conv, target_steps=float(s.target_steps), rows=rows,
                     best=found.best, baseline=found.baseline, front=front,
                     chosen=chosen, local_best=found.local_best, local_cal=local_cal, rule=cal.rule,
                     notes=notes, check=check)


def _calibration_deadline(s: Settings, profile: Profile) -> float | None:
    """When calibration runs must end (None: no --budget): the run's deadline less the time kept for
    timing the plans and writing the report, (plans x steps) of compute and a margin."""
    from fastml_strategy.autotune.measure import steps_per_plan

    if s.deadline is None:
        return None
    # the recipes are timed before calibration; after it the tuned plan and the check's alternatives
    return s.deadline - ((1 + CHECK_RUNS) * steps_per_plan(s.measure_steps) * max(profile.compute_s, 1e-3)
                         + 10.0)


def _calibration_runs(s: Settings, profile: Profile, groups: Mapping[str, list[str]], plans: list[Any],
                      cal_name: str, bar: _Progress,
                      deadline: float | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The reference runs and one training run per plan (finished ones read back from the storage)."""
    from fastml_strategy.autotune import calibrate

    return calibrate.run_calibration(s.workload, profile, groups, plans, storage=s.storage,
                                     study_name=cal_name, steps=s.calibration_steps, seed=s.seed,
                                     progress=bar, references=s.references, deadline=deadline)


def _calibrate_again(s: Settings, profile: Profile, groups: Mapping[str, list[str]], cal: _Calibrated,
                     plans: list[Any], cal_name: str, bar: _Progress, deadline: float | None) -> _Calibrated:
    """Calibrate with ``plans`` (the earlier ones read back from the storage) and refit the rule."""
    ref, points = _calibration_runs(s, profile, groups, plans, cal_name, bar, deadline)
    return _Calibrated(plans, ref, points, _rule(s, ref, points), cal.run_s)


def _first_calibration(s: Settings, profile: Profile, groups: Mapping[str, list[str]], cal_name: str,
                       bar: _Progress, deadline: float | None, notes: list[str]) -> _Calibrated:
    """The reference runs and the candidate plans, then repeats (other seeds) of the plans nearest
    the limit; what --budget leaves out is added to ``notes``."""
    from fastml_strategy.autotune import calibrate

    plans: list[Any] = list(calibrate.calibration_candidates(profile, groups, s.calibration_trials, s.seed))
    bar.phase("calibrating", 1 + len(plans), "run")
    t_cal = time.time()
    # the check's runs, estimated from the profile's step time until a run has been timed
    ref, points = _calibration_runs(s, profile, groups, plans, cal_name, bar,
                                    _reserve(deadline, CHECK_RUNS * s.calibration_steps * profile.compute_s))
    # a resumed run reads its runs back in no time: the profile's step time bounds them
    ran = max(1, len(points) + len(ref.get("references") or {}))
    run_s = max((time.time() - t_cal) / ran, s.calibration_steps * profile.compute_s)
    missing = [p for p in plans if not isinstance(p, tuple) and p not in [q["choice"] for q in points]]
    if missing:
        notes.append(f"--budget: {len(missing)} of {len(plans)} calibration plans not run")
    cal = _Calibrated(plans, ref, points, _rule(s, ref, points), run_s)
    if s.calibration_repeats == 0:
        return cal
    # chosen from the first calibration's runs alone, so a resumed run picks the same ones
    first = [q for q in points if q.get("seed", s.seed) == s.seed and q["choice"] in plans]
    reps = calibrate.repeat_candidates(_rule(s, ref, first), first, s.calibration_repeats, s.seed)
    if not reps:
        return cal
    optional = _reserve(deadline, CHECK_RUNS * run_s)
    if not _fits(optional, run_s * (len(reps) + 1)):
        notes.append(f"--budget: the {len(reps)} repeats nearest the limit were not run")
        return cal
    # the plans nearest the limit, again with other seeds
    bar.phase("repeating the runs nearest the limit", 1 + len(reps), "run")
    return _calibrate_again(s, profile, groups, cal, plans + list(reps), cal_name, bar, optional)


def _calibrate_local_steps(s: Settings, profile: Profile, cal_name: str, run_s: float, deadline: float | None,
                           bar: _Progress, notes: list[str]) -> LocalCalibration | None:
    """Calibrate local steps (LocalSGD, every sync period H), unless --budget leaves no time (None,
    noted)."""
    from fastml_strategy.autotune import calibrate

    steps = calibrate.local_calibration_steps(s.calibration_steps, s.local_every)
    cost = run_s * (steps / s.calibration_steps) * s.world_size * (1 + len(s.local_every))
    if not _fits(deadline, cost):
        notes.append(f"--budget: local steps not calibrated (about {cost / 60:.1f} min of runs), so not searched")
        return None
    bar.phase("calibrating local steps", 1 + len(s.local_every), "run")
    return calibrate.run_local_calibration(
        s.workload, profile, s.local_every, world_size=s.world_size, steps=steps, seed=s.seed,
        max_accuracy_loss=s.max_accuracy_loss, storage=s.storage,
        study_name=f"{cal_name}-local-{_hash([list(s.local_every), steps])}", progress=bar)


def _search_options(s: Settings, profile: Profile, groups: Mapping[str, list[str]],
                    options: list[HardwareOption], conv: Convergence, local_cal: LocalCalibration | None,
                    fp: str, bar: _Progress) -> _OptionSearch:
    """Search every option under the fit ``conv``: its best plan, against plain DDP (or FSDP/HSDP's
    own collectives) and, with local steps, its best LocalSGD configuration."""
    from fastml_strategy.autotune import search

    sh = s.sharding
    target_steps = float(s.target_steps)
    trials = max(s.trials, len(s.options))
    found = _OptionSearch(rows=[], best={}, baseline={}, local_best={})
    bar.phase("searching", len(options) * trials, "trial")
    for opt in options:
        bar.set_description(f"searching {opt.name}")
        key = _search_key(s, profile, opt, conv, local_cal)
        r = search.run_search(profile, groups, opt, conv, target_steps, storage=s.storage,
                              study_name=f"fastml-{fp}-search-{opt.name}-{key}", trials=trials, seed=s.seed,
                              progress=bar, sharding=sh, max_residual_bytes=s.max_residual_bytes,
                              local=local_cal, fragments=s.local_fragments)
        found.rows.extend(x.replace(kind="local-steps" if x.every > 1 else "fastml") for x in r)
        base = _baseline_row(profile, groups, opt, conv, target_steps, sh)
        found.baseline[opt.name] = base
        found.rows.append(base.replace(trial=-1, kind="plain-ddp" if not sh.sharded else f"{sh.kind}-own"))
        # Plain DDP is a candidate too: where no compression pays (a fast link), say so.
        b = search.best_row(r)
        best = b.replace(use_hook=True) if b.objective < base.objective else base.replace()
        if not sh.sharded:  # DDP's bucket size for the chosen plan (plain DDP's too)
            best = _best_bucket(profile, groups, opt, conv, target_steps, best, search)
        found.best[opt.name] = best
        try:
            found.local_best[opt.name] = search.best_row(r, local=True).replace(use_hook=False)
        except ValueError:  # local steps off, or no H within the accuracy limit
            found.local_best[opt.name] = None
    return found


def _search_key(s: Settings, profile: Profile, opt: HardwareOption, conv: Convergence,
                local_cal: LocalCalibration | None) -> str:
    """The hash naming an option's search study: everything the search depends on."""
    sh = s.sharding
    what = [_option_key(opt), asdict(opt.link), asdict(conv), float(s.target_steps), s.options,
            profile.codec_scale]
    if sh.sharded:  # a DDP run's study names stay what they were (resumable)
        what += [sh.to_dict(), s.max_residual_bytes, _option_key(opt, sharded=True),
                 profile.collective_overhead_s]
    if local_cal is not None:  # runs without local steps keep their study names
        what += [local_cal.to_dict(), list(s.local_fragments)]
    intra = intra_node_choices(profile, opt, sh)
    if intra:  # options with no hop inside a machine keep their study names
        what += [list(intra)]
    return _hash(what)


def _baseline_row(profile: Profile, groups: Mapping[str, list[str]], opt: HardwareOption, conv: Convergence,
                  target_steps: float, sh: Sharding) -> Trial:
    """The option's uncompressed row: plain DDP (or FSDP/HSDP's own collectives), no hook."""
    none_choice = {n: "none" for names in groups.values() for n in names}
    base = evaluate(profile, none_choice, opt, conv, target_steps, hook=False, sharding=sh)
    return base.replace(option=opt.name, choice={g: "none" for g in groups}, use_hook=False,
                        objective=objective(base, opt), every=1, fragments=1, delay=0)


# A plan the accuracy rule excludes only for want of a calibration run near its error is trained in
# the verification when the cost model predicts it at least this much faster than the chosen plan.
PROBE_GAIN = 0.9


def _gap_probe(s: Settings, profile: Profile, groups: Mapping[str, list[str]], options: list[HardwareOption],
               conv: Convergence, rule: AccuracyRule, found: _OptionSearch, tried: list[Any],
               fp: str, probed: Sequence[float] = ()) -> Trial | None:
    """The per-step plan to train beside the chosen ones in a verification round, or None.

    The accuracy rule admits errors up to the largest calibrated one within the limit (``e_max``); an
    error between it and the next calibrated error, the first that failed (every error above ``e_max``
    when none failed), is excluded though no run measured anything there. A one-scalar error orders
    codec families only roughly (a top-k plan's error is large while its loss may match int8's), so
    the plan the search would choose on plan.json's option with the limit just below that failing
    error is trained too, when no run has trained it and the cost model predicts it at most
    :data:`PROBE_GAIN` of the chosen plan's objective. Its run enters the rule like any other: within
    the limit it raises ``e_max`` to its error, beyond it it confirms the limit.

    Where that first failing error is an earlier probe's (``probed``: their errors), the gap is halved
    instead (the geometric mean of ``e_max`` and it): the search puts its best plan right under any
    limit, so probing just below a failed probe would train nearly the same plan again, while the
    plans between, which an earlier probe nearer ``e_max`` may have admitted, stay untried. Which plan
    the first probe trains depends on the step times profiled at that moment (bench_autotune_repeat's
    gpt3, issue 38: a mix at error 0.109 within the limit in one run, one at 0.196 beyond it in
    another, which then left the whole gap excluded and the answer another family).
    """
    from fastml_strategy.autotune import search

    name = _chosen_option(options, found)
    opt = next(o for o in options if o.name == name)
    limit, _ = _probe_limit(rule, conv.e_max, probed)
    if limit <= conv.e_max:
        return None
    wide = dataclasses.replace(conv, e_max=limit)
    rows = search.run_search(profile, groups, opt, wide, float(s.target_steps), storage=s.storage,
                             study_name=f"fastml-{fp}-probe-{opt.name}-{_search_key(s, profile, opt, wide, None)}",
                             trials=max(s.trials, len(s.options)), seed=s.seed, sharding=s.sharding,
                             max_residual_bytes=s.max_residual_bytes, local=None,
                             fragments=s.local_fragments)
    try:
        b = search.best_row(rows)
    except ValueError:
        return None
    if (b.error <= conv.e_max + 1e-12 or b.choice in tried
            or not b.objective <= PROBE_GAIN * found.best[name].objective):
        return None
    return b


def _probe_limit(rule: AccuracyRule, e_max: float, probed: Sequence[float] = ()) -> tuple[float, bool]:
    """The error a probe (:func:`_gap_probe`) must stay below: just below the first failing calibrated
    error above ``e_max`` (infinity: none failed), or the middle of the gap (geometric; the arithmetic
    one from 0) when that failing run was an earlier probe's; and whether the gap was halved."""
    failed = [e for e in rule.errors if e > e_max + 1e-12]
    if not failed:
        return math.inf, False
    top = failed[0]
    if any(math.isclose(top, p, rel_tol=1e-9, abs_tol=1e-15) for p in probed):
        return (math.sqrt(e_max * top) if e_max > 0 else top / 2), True
    return top * (1 - 1e-9), False


def _probe_note(probe: Trial, e_before: float, cal: _Calibrated, halved: bool = False) -> str:
    """The report's words for a probe run (:func:`_gap_probe`) and what it decided."""
    run = next((p for p in cal.points if p["choice"] == probe.choice), None)
    what = (f"verification also trained the plan the search prefers just beyond the accuracy rule's "
            f"limit (error {probe.error:.3g} > e_max {e_before:.3g}; no calibration run had measured "
            f"an error between" + ("; in the lower half of the gap, as the earlier probe above it went "
                                   "over the limit" if halved else "") + ")")
    if run is None:
        return what + "; its run did not finish, so the limit stands"
    verdict = (f"within the limit, so plans up to error {cal.rule.e_max:.3g} are admitted"
               if cal.rule.e_max >= probe.error - 1e-12 else "beyond the limit, which stands")
    return f"{what}: accuracy loss {float(run['accuracy_loss']):.3g}, {verdict}"


def _untried_plans(best: Mapping[str, Mapping[str, Any]], points: list[CalibrationPoint]) -> list[Any]:
    """The compressed per-step plans the search chose that no calibration run has trained yet (local
    steps' codecs compress pseudo-gradients, so their rows are not among them)."""
    tried = [p["choice"] for p in points]
    new: list[Any] = []
    for b in best.values():
        c = b.choice
        if c not in tried and c not in new and any(o != "none" for o in c.values()):
            new.append(c)
    return new


def _pareto(rows: list[Trial], options: list[HardwareOption]) -> tuple[list[Trial], list[int]]:
    """The rows with ``pareto`` set, and the front's indices: time against cost over the feasible
    rows of priced options (a cluster you already have costs nothing here)."""
    priced = {o.name for o in options if o.price_per_hour > 0}
    feas = [i for i, r in enumerate(rows) if r.feasible and r.option in priced]
    front = [feas[i] for i in pareto_front([(rows[i].tta_s, rows[i].cost_usd) for i in feas])]
    return [r.replace(pareto=i in front) for i, r in enumerate(rows)], front


def _rule(s: Settings, ref: Mapping[str, Any], points: list[CalibrationPoint]) -> AccuracyRule:
    """The accuracy rule over every calibration run so far (costmodel.accuracy_rule)."""
    return accuracy_rule(points, s.max_accuracy_loss, reference_sigma=ref.get("sigma"),
                         paired=ref.get("paired"), references=len(ref.get("references") or {0: 0}))


def _option_key(opt: HardwareOption, sharded: bool = False) -> Any:
    """What of an option shapes its search: the catalog fields (as before sharding existed), and
    for sharded runs its intra-node link too."""
    d = asdict(opt)
    intra = d.pop("intra_link", None)
    return intra if sharded else d
