"""The plan search: Optuna over per-layer (or per-group) codec choices, one study per hardware option.

Search space. Each tunable layer (``numel >= min_numel``) picks one of the profiled codec options.
Large models are searched by *groups*: layers whose names differ only in their numeric indices
(``blocks.3.attn.qkv.weight`` and ``blocks.7.attn.qkv.weight``) play the same role and share a choice;
when that still leaves more than ``max_groups`` groups, groups of similar size are merged (sorted by
size, cut into ``max_groups`` runs of near-equal count), since the cost model's trade-off depends
mostly on a layer's size and error.

Objective, per option ``c``: the predicted cost ``S_ref g(e(p)) T(p, c) N P / 3600`` in USD (the time to
accuracy when the option has no price, e.g. the user's own cluster), under the constraint
``e(p) <= e_max`` from the calibration (``Trial.set_constraint``, so TPE learns the feasible region
instead of seeing a penalty cliff). A trial is a cost-model evaluation, so the study runs in memory
and its rows are saved to the storage afterwards as one JSON document (resumed runs read it back).

Seeding. Before TPE starts, the study gets the uniform plans (every group on one option) and a
Lagrangian sweep in the spirit of L-GreCo: for a multiplier ``lam`` each layer independently takes the
option minimising ``time_l + lam * w_l e_l^2`` (its own wire + codec time, and its share of the
plan's squared error), which for additive costs traces the best time-error trade-off; TPE then
refines with the full model (overlap, latency rounds, g(e)). The tuned plan is therefore never
predicted worse than the best uniform recipe.

Local steps (``local``, a :class:`~fastml_strategy.autotune.costmodel.LocalCalibration`): two more
dimensions, the sync period ``every`` (H: 1 is per-step compression through the DDP hook, the others
the calibrated periods of :class:`~fastml_strategy.LocalSGD`) and ``fragments`` (F, ignored at H = 1),
evaluated with ``costmodel.evaluate_local``; the codecs then compress the pseudo-gradients. An H whose
calibration lost more accuracy than allowed is infeasible (the same constraint). Seeds add the
calibrated outer plan (uniform int4) at every (H, F) and every uniform plan at each H with F = 1.

The Pareto front of (time to accuracy, cost) over all feasible trials of all options is computed after
the studies (a multi-objective study would lose the per-option constraint handling and pruning).

The hop inside a machine (``Plan.intra_node``): on an option of several machines of several ranks,
where the DDP hook is hierarchical, one more dimension ``intra_node`` (per-step rows only) picks the
dtype of the reduce-scatter and all-gather inside the machine among
:func:`~fastml_strategy.autotune.costmodel.intra_node_choices` ("none" = exact fp32, "bf16", and
"fp16" where the profile shows its range suffices): half the bytes on the intra-node link against one
uncorrected 16-bit rounding added to the plan's error. Seeds add every per-step seed with the
finest 16-bit choice offered. Every other option's study is unchanged (its rows have no
``intra_node``).
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from typing import Any, Callable, Mapping

import numpy as np

from fastml_strategy.autotune.catalog import HardwareOption
from fastml_strategy.autotune.costmodel import (DEFAULT_LOCAL_FRAGMENTS, LOCAL_CALIBRATION_OPTION, Convergence,
                                                LocalCalibration, Profile, Sharding, Trial, evaluate, evaluate_local,
                                                intra_node_choices, objective)

__all__ = ["group_layers", "lagrangian_plans", "run_search", "expand", "best_row", "local_fragments"]


def group_layers(profile: Profile, max_groups: int = 24) -> "OrderedDict[str, list[str]]":
    """Tunable layer names grouped by role (numeric indices removed), at most ``max_groups`` groups."""
    if max_groups < 1:
        raise ValueError(f"max_groups is {max_groups}; give at least 1")
    tunable = [lp for lp in profile.layers if lp.tunable]
    if len(tunable) <= max_groups:
        return OrderedDict((lp.name, [lp.name]) for lp in tunable)
    by_role: "OrderedDict[str, list[str]]" = OrderedDict()
    for lp in tunable:
        key = re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", lp.name)
        by_role.setdefault(key, []).append(lp.name)
    if len(by_role) <= max_groups:
        return by_role
    # embeddings keep a group of their own (row-sparse gradients: their best codec differs)
    own = [k for k, v in by_role.items() if all(profile.layer(n).kind == "embedding" for n in v)]
    own = own[:max(0, max_groups - 1)]
    size = {k: sum(profile.layer(n).numel for n in v) for k, v in by_role.items()}
    keys = sorted((k for k in by_role if k not in own), key=lambda k: size[k])
    merged: "OrderedDict[str, list[str]]" = OrderedDict((k, by_role[k]) for k in own)
    for chunk in np.array_split(np.arange(len(keys)), max_groups - len(own)):
        if not len(chunk):
            continue
        ks = [keys[i] for i in chunk]
        label = ks[0] if len(ks) == 1 else f"{ks[0]} (+{len(ks) - 1} of similar size)"
        merged[label] = [n for k in ks for n in by_role[k]]
    return merged


def expand(groups: Mapping[str, list[str]], gchoice: Mapping[str, str]) -> dict[str, str]:
    """Group choice -> layer choice."""
    return {n: gchoice[g] for g, names in groups.items() for n in names}


def lagrangian_plans(profile: Profile, groups: Mapping[str, list[str]], option: HardwareOption,
                     count: int = 8, sharding: Sharding | None = None) -> list[dict[str, str]]:
    """Group choices on the time-error frontier (each group alone: min time + lam * error share)."""
    from fastml_strategy.autotune.costmodel import step_time

    base = {n: "none" for names in groups.values() for n in names}
    t0 = step_time(profile, base, option, sharding=sharding)
    den = sum(lp.grad_sq for lp in profile.layers) or 1.0
    cost: dict[str, dict[str, tuple[float, float]]] = {}
    for g, names in groups.items():
        cost[g] = {}
        for o in profile.options:
            c = dict(base)
            c.update({n: o for n in names})
            t = step_time(profile, c, option, sharding=sharding)
            dt = (t.codec_s + t.wire_s) - (t0.codec_s + t0.wire_s)
            de = sum(profile.layer(n).grad_sq * profile.layer(n).rel_error[o] ** 2 for n in names) / den
            cost[g][o] = (dt, de)
    plans = []
    for lam in np.logspace(-4, 4, count) * max(t0.wire_s + t0.codec_s, 1e-9):
        plans.append({g: min(cost[g], key=lambda o: cost[g][o][0] + lam * cost[g][o][1])
                      for g in groups})
    unique = []
    for p in plans:
        if p not in unique:
            unique.append(p)
    return unique


def run_search(profile: Profile, groups: Mapping[str, list[str]], option: HardwareOption,
               conv: Convergence, target_steps: float, *, storage: Any, study_name: str, trials: int,
               seed: int, progress: Any = None, sharding: Sharding | None = None,
               max_residual_bytes: float | None = None, local: LocalCalibration | None = None,
               fragments: tuple[int, ...] = DEFAULT_LOCAL_FRAGMENTS) -> list[Trial]:
    """Search one option; return every finished trial (a :class:`~fastml_strategy.autotune.costmodel.Trial`).

    Local steps (``local``, DDP only): ``every`` and ``fragments`` are searched too (module
    docstring); every row has ``every`` (1: per-step compression), ``fragments`` and ``delay``.

    Sharded (``sharding``): the cost model is FSDP's or HSDP's, and with ``max_residual_bytes`` a
    second constraint keeps the error-feedback memory per rank under the limit.

    The study runs in memory (a trial is a cost-model evaluation, microseconds) and its rows are
    then saved to ``storage`` under ``study_name`` as one JSON document in the study's user
    attributes (:func:`_save_rows`: Optuna's ``add_trials`` commits every parameter and attribute of
    every trial on its own, about 40 ms per trial on SQLite, minutes for a default run); if a study
    of that name already holds the rows (a resumed run, or another machine did it), they are read
    back instead of searched again.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = list(groups)
    keys = {g: f"g{i}" for i, g in enumerate(names)}
    saved = None
    if storage is not None:
        saved = optuna.create_study(storage=storage, study_name=study_name, direction="minimize",
                                    load_if_exists=True)
        rows = _load_rows(saved)
        if rows is not None and len(rows) >= trials:
            if progress is not None:
                progress.update(trials)
            return rows
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(1, trials // 5)))
    study = optuna.create_study(direction="minimize", sampler=sampler)
    frags = local_fragments(profile, fragments) if local is not None else [1]
    intra = intra_node_choices(profile, option, sharding)
    for params in _seed_params(_first_trials(profile, groups, option, sharding, local, frags), keys, intra,
                               local is not None)[:trials]:
        study.enqueue_trial(params, skip_if_exists=True)

    def tick(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if progress is not None:
            progress.update(1)

    study.optimize(_trial_objective(profile, groups, option, conv, target_steps, keys, frags, sharding=sharding,
                                    max_residual_bytes=max_residual_bytes, local=local, intra=intra),
                   n_trials=trials, callbacks=[tick])
    done = [t for t in study.get_trials(deepcopy=False) if t.state is optuna.trial.TrialState.COMPLETE]
    rows = _rows(done, option, names, keys)
    if saved is not None:
        saved.set_user_attr("option", option.name)
        _save_rows(saved, rows)
    return rows


def _seed_params(first: list[tuple[dict[str, str], int, int]], keys: Mapping[str, str], intra: tuple[str, ...],
                 local: bool) -> list[dict[str, Any]]:
    """The study's first trials as Optuna parameters: ``first`` (group choice, every, fragments), and
    where ``intra`` offers choices of the hop inside the machine, the per-step ones with the exact hop,
    then again with the finest 16-bit one offered."""
    seeds: list[tuple[dict[str, str], int, int, str | None]] = [(gc, h, f, None) for gc, h, f in first]
    if intra:
        per_step = [gc for gc, h, _ in first if h == 1]
        seeds = ([(gc, 1, 1, i) for i in ("none", intra[-1]) for gc in per_step]
                 + [x for x in seeds if x[1] != 1])
    out = []
    for gc, h, f, i in seeds:
        params: dict[str, Any] = {keys[g]: o for g, o in gc.items()}
        if local:
            params.update(every=h, fragments=f)
        if i is not None and h == 1:
            params["intra_node"] = i
        out.append(params)
    return out


# A study's rows are saved as JSON text cut into user attributes of at most this many characters:
# Optuna keeps an attribute in a TEXT column, 64 KiB on MySQL (escaping can double the size).
_ROWS_CHUNK = 30_000


def _save_rows(study: Any, rows: list[Trial]) -> None:
    text = json.dumps([dict(r) for r in rows])
    chunks = [text[i:i + _ROWS_CHUNK] for i in range(0, len(text), _ROWS_CHUNK)] or [""]
    for i, c in enumerate(chunks):
        study.set_user_attr(f"rows.{i}", c)
    study.set_user_attr("rows.chunks", len(chunks))  # last: a study cut short mid-save reads as unsaved


def _load_rows(study: Any) -> list[Trial] | None:
    attrs = study.user_attrs
    n = attrs.get("rows.chunks")
    if not isinstance(n, int) or any(f"rows.{i}" not in attrs for i in range(n)):
        return None
    return [Trial(r) for r in json.loads("".join(attrs[f"rows.{i}"] for i in range(n)))]


def _first_trials(profile: Profile, groups: Mapping[str, list[str]], option: HardwareOption,
                  sharding: Sharding | None, local: LocalCalibration | None,
                  frags: list[int]) -> list[tuple[dict[str, str], int, int]]:
    """The ``(group choice, H, F)`` trials the search starts from: every uniform plan, the Lagrangian
    plans and, with local steps, the uniform plans at every sync period."""
    names = list(groups)
    seeds = [({g: o for g in names}, 1, 1) for o in profile.options]
    seeds += [(p, 1, 1) for p in lagrangian_plans(profile, groups, option, sharding=sharding)]
    if local is not None:
        cal = LOCAL_CALIBRATION_OPTION if LOCAL_CALIBRATION_OPTION in profile.options else profile.options[-1]
        seeds += [({g: cal for g in names}, h, f) for h in local.every for f in frags]
        seeds += [({g: o for g in names}, h, 1) for h in local.every for o in profile.options if o != cal]
    return seeds


def _trial_objective(profile: Profile, groups: Mapping[str, list[str]], option: HardwareOption,
                     conv: Convergence, target_steps: float, keys: Mapping[str, str], frags: list[int], *,
                     sharding: Sharding | None, max_residual_bytes: float | None,
                     local: LocalCalibration | None, intra: tuple[str, ...] = ()) -> Callable[[Any], float]:
    """The study's objective: the option's objective of the trial's plan (and H, F, and the hop inside
    the machine where ``intra`` offers choices), with the error (and residual memory) limits as
    constraints, every predicted figure kept on the trial."""
    every = [1] + (local.every if local is not None else [])

    def run_trial(trial: Any) -> float:
        gchoice = {g: trial.suggest_categorical(keys[g], profile.options) for g in keys}
        h = trial.suggest_categorical("every", every) if local is not None else 1
        f = trial.suggest_categorical("fragments", frags) if local is not None else 1
        choice = expand(groups, gchoice)
        if h == 1:
            i = trial.suggest_categorical("intra_node", intra) if intra else None
            r = evaluate(profile, choice, option, conv, target_steps, sharding=sharding,
                         max_residual_bytes=max_residual_bytes, intra_node=i)
            r = r.replace(every=1, fragments=1, delay=0)
            limit = conv.e_max
        else:
            r = evaluate_local(profile, choice, option, conv, local, target_steps, h, f)
            limit = max(conv.e_max, local.e_cal) if local.feasible(h) else -math.inf
        for k, v in r.items():
            trial.set_user_attr(k, v if isinstance(v, str) else bool(v) if k in ("feasible", "memory_ok")
                                else float(v))
        # <= 0 is feasible; TPE reads it (Trial.set_constraint replaces v4's constraints_func)
        trial.set_constraint("error_over_limit", min(r.error - limit, 1e9))
        if max_residual_bytes is not None:
            trial.set_constraint("residual_over_limit", r["residual_bytes"] / max_residual_bytes - 1.0)
        return objective(r, option)

    return run_trial


def _rows(trials: list[Any], option: HardwareOption, names: list[str],
          keys: Mapping[str, str]) -> list[Trial]:
    rows = []
    for t in sorted(trials, key=lambda t: t.number):
        attrs = {"option": option.name, "trial": t.number, "objective": t.value, **t.user_attrs}
        attrs["choice"] = {g: t.params[keys[g]] for g in names if keys[g] in t.params}
        for k in ("every", "fragments", "delay"):
            attrs[k] = int(attrs.get(k, 1 if k != "delay" else 0))
        rows.append(Trial(attrs))
    return rows


def local_fragments(profile: Profile, fragments: tuple[int, ...] = DEFAULT_LOCAL_FRAGMENTS) -> list[int]:
    """The fragment counts searched: those LocalSGD accepts for this model (at most one fragment per
    trainable parameter), 1 always."""
    return sorted({1, *(f for f in fragments if 1 <= f <= len(profile.layers))})


# Predicted objectives this close (relative) are a tie, settled by the lower gradient error: codec
# times are measured, and noise of a few percent must not flip the plan between runs of one command
# (int4 and int4-noef send the same bytes; only their measured codec times and errors differ).
TIE_TOLERANCE = 0.05


def best_row(rows: list[Mapping[str, Any]], local: bool | None = False) -> Trial:
    """The feasible trial with the lowest objective, where objectives within :data:`TIE_TOLERANCE`
    of the lowest are a tie settled by the lower error (then the lower objective): among per-step
    rows (``local`` False, the default), local-steps rows (True), or all (None)."""
    trials = [Trial.of(r) for r in rows]
    feas = [t for t in trials if t.feasible and math.isfinite(t.objective)
            and (local is None or (t.every > 1) == local)]
    if not feas:
        raise ValueError("no feasible plan was found (not even uncompressed); raise --trials")
    low = min(t.objective for t in feas)
    near = [t for t in feas if t.objective <= low * (1 + TIE_TOLERANCE) + 1e-15]
    return min(near, key=lambda t: (round(t.error, 12), t.objective))
