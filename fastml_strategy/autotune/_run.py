"""The autotuner's driver: validate, profile, calibrate and search, check, measure, report.

The phases live in their own modules, each importing only those before it: ``_state`` (what they
share), ``_tune`` (calibration and search, on rank 0), ``_check`` (the tuned plan trained against the
uniform alternatives and torch's PowerSGD hook before plan.json is written). This module profiles,
times the plans (launched distributed: measured, then :func:`~fastml_strategy.autotune._check._recheck_measured`),
builds the result and writes the report.

The inputs are validated by :func:`~fastml_strategy.autotune._settings.prepare` before any profiling
and before anything is written; outputs are written only at the end, each atomically. The Optuna
storage (an SQLite file in the output folder by default) is the only thing written while the run is
in progress: it is what lets a stopped run resume (the profile is cached in it too), and it is what
several machines share when given an RDB URL. What a run produced is an
:class:`~fastml_strategy.autotune.result.AutotuneResult`; its rows are
:class:`~fastml_strategy.autotune.costmodel.Trial` records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from typing import Any, Mapping

from fastml_strategy.autotune.catalog import HardwareOption, Link
from fastml_strategy.autotune.costmodel import (CANDIDATES, Convergence, LocalCalibration, Profile, Sharding, Trial,
                                                family, fit_alpha_beta, fit_codec_scale, fit_collective_overhead,
                                                step_time)
# the inputs and the result, defined in their own modules, are this module's public names too
from fastml_strategy.autotune._settings import (DEFAULT_BUDGET_MIN, Settings, _refuse_finished_out,  # noqa: F401
                                                prepare)
from fastml_strategy.autotune._state import (LOCAL, UNIFORM_RECIPES, _Progress, _Searched, _broadcast,
                                             _plan_from_choice, baseline_label, recipes_of)
from fastml_strategy.autotune._check import _keep_measured_buckets, _recheck_measured
from fastml_strategy.autotune._tune import _search_on_rank0
from fastml_strategy.autotune.result import (ASSUMED_TARGET_STEPS, TARGET_STEPS_SOURCES,  # noqa: F401
                                             AutotuneResult, uses_local_steps)
from fastml_strategy.autotune.result import ScalingRow, StepTimeRow, WhatIfRow, plan_family
from fastml_strategy.autotune.workload import Workload
from fastml_strategy.config import LocalSteps, Plan

__all__ = ["autotune", "AutotuneResult", "Settings", "prepare", "UNIFORM_RECIPES", "SCALING_NODES",
           "WHATIF_NODES", "WHATIF_RANKS_PER_NODE", "ASSUMED_TARGET_STEPS", "baseline_label"]

SCALING_NODES = (8, 16, 32, 64, 128, 256, 512, 1024)
# Sharded runs: the what-if grid of cluster shapes (nodes x ranks per node) for every option.
WHATIF_NODES = (2, 8, 32, 128)
WHATIF_RANKS_PER_NODE = (1, 2, 4, 8)


def _one_machine_warning(s: Settings, link: Link) -> str | None:
    """Every rank on one host: the measured "link" is loopback or shared memory, not a network."""
    import socket

    import torch.distributed as dist

    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    if len(set(hosts)) > 1:
        return None
    return (f"All {len(hosts)} ranks ran on one machine ({hosts[0]}), so the measured link "
            f"({link.rate_words()}, {link.latency_words()} per message) is "
            f"between processes of that machine (loopback or shared memory), "
            f"not a network (unless you shaped it, e.g. with tc). The 'local' figures, and the 8-1024 "
            f"node predictions drawn from them, describe that machine, not a cluster; pass --link RATE "
            f"(e.g. --link 10gbit) for your cluster's link, or launch across machines.")


def _fingerprint(s: Settings) -> str:
    shapes = [(n, tuple(p.shape)) for n, p in s.workload.model.named_parameters()]
    key = json.dumps([s.workload.name, shapes, s.options, s.profile_steps, s.calibration_steps,
                      s.seed, s.min_numel, s.max_groups, s.world_size, s.threads_per_rank, s.calibration_ranks],
                     default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _local_steps_of(row: Mapping[str, Any], cal: LocalCalibration | None) -> LocalSteps | None:
    """The LocalSGD settings of a local-steps row (None for a per-step row)."""
    if not uses_local_steps(row) or cal is None:
        return None
    return LocalSteps(every=int(row["every"]), fragments=int(row["fragments"]), delay=int(row["delay"]),
                      outer=cal.outer, outer_lr=cal.outer_lr, outer_momentum=cal.outer_momentum)


def _option_plan(profile: Profile, groups: Mapping[str, list[str]], result: "AutotuneResult", s: Settings,
                 option: str) -> tuple[Plan, dict[str, Any]]:
    """The plan file of one option: its winning row's codecs, with local steps when they won."""
    from fastml_strategy.autotune import search

    w = result.winner(option)
    meta = _meta(s, option, result.best[option], result.baseline[option], result.convergence,
                 local=result.local_best.get(option), winner=w)
    # Plain DDP: every layer and the default are fp32 (``none``) and the file says not to register a
    # hook. Registered anyway, such a plan runs one plain all-reduce per bucket (DDP's own arithmetic,
    # one collective per bucket: the hook skips its status exchange on steps of plain buckets only).
    meta["hook"] = w.use_hook or uses_local_steps(w)
    meta["family"] = plan_family(search.expand(groups, w.choice),
                                 {lp.name: lp.numel for lp in profile.layers if lp.tunable},
                                 every=int(w.get("every", 1)), hook=bool(w.use_hook))
    if not s.sharding.sharded and not uses_local_steps(w):
        mb = w.bucket_mb
        meta["ddp"] = {"bucket_cap_mb": mb, "how": (
            "DDP's default buckets (bucket_cap_mb=None)" if mb is None else
            f"DistributedDataParallel(model, bucket_cap_mb={mb}); Lightning/Fabric: "
            f"FastMLStrategy(..., bucket_cap_mb={mb}) (DDPStrategy passes it to DDP); Accelerate: "
            f"Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb={mb})]); Hugging Face "
            f"Trainer: TrainingArguments(ddp_bucket_cap_mb={mb})")}
    chk = result.check
    if chk is not None and chk.get("option") == option:
        meta["checked_against_uniform"] = {
            "verdict": chk.get("verdict"), "replaced": chk.get("replaced"),
            "time_ratio": {e["plan"]: e["time_ratio"] if math.isfinite(e["time_ratio"]) else None
                           for e in chk.get("alternatives", []) + chk.get("powersgd", [])},
            "torch_powersgd": chk.get("powersgd_faster") or ("not sooner" if chk.get("powersgd") else None),
            "decision": chk.get("decision")}
    rule = result.accuracy_rule
    if rule is not None:
        f = (lambda v: None if isinstance(v, float) and not math.isfinite(v) else v)
        meta["accuracy_rule"] = {"e_max": rule.e_max, "e_noise": rule.e_noise, "e_sure": rule.e_sure,
                                 "confidence": f(rule.confidence), "sigma": f(rule.sigma),
                                 "runs": rule.trials, "repeats": rule.repeats, "paired": rule.paired}
    per_step_hook = w.use_hook and not uses_local_steps(w)
    return _plan_from_choice(
        profile, search.expand(groups, w.choice), f"autotuned-{option}", meta=meta,
        local_steps=_local_steps_of(w, result.local_calibration),
        intra_node=w.intra_node if per_step_hook else None,
        link=next((o.link for o in result.options if o.name == option), None))


def autotune(target: str | Workload | Any, **kwargs: Any) -> AutotuneResult:
    """Tune a per-layer plan for ``target`` and write the outputs to ``out``. See :func:`prepare` for
    the keyword arguments (they mirror the ``fastml-autotune`` options)."""
    return run(prepare(target, **kwargs))


def run(s: Settings) -> AutotuneResult:
    """Profile, calibrate, search, measure and report (rank 0 writes; every rank returns the result).
    The global RNGs of torch, ``random`` and numpy are as the caller left them when it returns."""
    from fastml_strategy.autotune.calibrate import preserved_rng

    with preserved_rng():
        return _run(s)


def _run(s: Settings) -> AutotuneResult:
    """The run's steps in order (see :func:`run`)."""
    from fastml_strategy.autotune import search

    lead = s.rank == 0
    fp = _fingerprint(s)
    bar = _Progress(s.progress and lead)
    started = time.time()
    s.deadline = None if not s.budget_s else started + s.budget_s
    try:
        # -- 1. profile (cached in the storage, so a resumed run skips it) -----------------------------
        cal_name = f"fastml-{fp}-calibration"
        profile = _profile(s, bar, cal_name)
        link_warning = _one_machine_warning(s, profile.link) if s.distributed else None
        options = _hardware_options(s, profile)
        groups = search.group_layers(profile, s.max_groups)
        tunable = [n for names in groups.values() for n in names]
        recipe_choices = {r: {n: r for n in tunable} for r in recipes_of(profile)}
        # -- 1b. distributed: time the uniform recipes for real and fit the codec-time scales -------
        measured_pre = _time_recipes(s, profile, options, recipe_choices, bar) if s.distributed else {}
        # -- 2. calibrate, 3. search (rank 0; the others wait for its result) ------------------------
        found = _search_on_rank0(s, profile, groups, options, cal_name, fp, bar)
        # -- 4. measure step times: the tuned plan (never used in a fit) and the recipes -----------
        profile, step_rows = _time_plans(s, profile, groups, options, found, recipe_choices, measured_pre,
                                         bar)
        # -- 4b. the check against uniform plans again, with measured step times ---------------------
        if lead:
            timed = found.best[found.chosen]
            _recheck_measured(s, profile, groups, options, found, step_rows, measured_pre)
            _keep_measured_buckets(s, profile, groups, options, found, step_rows, timed, measured_pre)
        # -- 5. scaling predictions and the report (rank 0) ----------------------------------------
        result = _result(s, profile, groups, options, found, step_rows, link_warning)
        bar.close()
        result.phase_s = dict(bar.times)
        result.plan, main_dict = _option_plan(profile, groups, result, s, found.chosen)
        if lead:
            _write_report(s, profile, groups, result, main_dict, bar)
        bar.close()
        result.phase_s = dict(bar.times)
        result.phase_s["total"] = time.time() - started
        return result
    finally:
        bar.close()


def _profile(s: Settings, bar: _Progress, cal_name: str) -> Profile:
    """Profile the workload, with the link measured (distributed) or given (``--link``); every rank
    returns rank 0's profile."""
    from fastml_strategy.autotune import profile as prof

    bar.phase("profiling", s.profile_steps, "step")
    profile = _cached_or_new_profile(s, bar, cal_name)
    if s.distributed:
        samples = prof.measure_link()
        if s.rank == 0:
            profile.link = fit_alpha_beta(samples, "measured")
            profile.link_samples = samples
    elif s.link is not None and s.rank == 0:
        profile.link = s.link
    return _broadcast(profile, s.distributed)


def _cached_or_new_profile(s: Settings, bar: _Progress, cal_name: str) -> Profile | None:
    """Rank 0's profile: read back from the calibration study of the storage, else measured and
    stored there (None on the other ranks)."""
    import optuna

    from fastml_strategy.autotune import profile as prof

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    lead = s.rank == 0
    profile: Profile | None = None
    cached = None
    if lead:
        cal_study = optuna.create_study(storage=s.storage, study_name=cal_name,
                                        direction="minimize", load_if_exists=True)
        cached = cal_study.user_attrs.get("profile")
    # Launched distributed, every rank profiles at once (rank 0's figures are kept): compute and
    # codec times are then measured under the same contention as real training.
    if _broadcast(cached is None, s.distributed):
        with prof.rank_threads(s.threads_per_rank):  # compute timed as one rank will run it
            measured = prof.profile_workload(s.workload, steps=s.profile_steps, options=s.options,
                                             min_numel=s.min_numel, world_size=s.world_size,
                                             progress=bar.update)
        measured.threads_source = s.threads_source
        if lead:
            profile = measured
            cal_study.set_user_attr("profile", profile.to_dict())
    elif lead:
        profile = Profile.from_dict(cached)
        bar.update(s.profile_steps)
    return profile


def _hardware_options(s: Settings, profile: Profile) -> list[HardwareOption]:
    """The catalog's options, after the user's own cluster (:data:`LOCAL`) when its link is known."""
    options = list(s.catalog)
    if profile.link is None:
        return options
    sh = s.sharding
    # Sharded: the user's cluster is nodes x ranks per node, and the link is the node's (its
    # ranks share it). All on one node, a measured link is the link between its ranks.
    per_node = s.ranks_per_node if sh.sharded else 1
    nodes = s.world_size // per_node
    intra = profile.link if (sh.sharded and nodes == 1 and s.distributed) else None
    options.insert(0, HardwareOption(name=LOCAL, nodes=nodes, accelerators_per_node=per_node,
                                     price_per_hour=0.0, bandwidth_gbps=profile.link.bandwidth_Bps * 8 / 1e9,
                                     latency_us=profile.link.latency_s * 1e6, compute_speed=1.0,
                                     measured_link=profile.link, intra_link=intra))
    return options


def _time_recipes(s: Settings, profile: Profile, options: list[HardwareOption],
                  recipe_choices: Mapping[str, Mapping[str, str]], bar: _Progress) -> dict[str, float]:
    """Distributed: time the baseline and the uniform recipes across the ranks, and fit the profile's
    codec-time scales (and, sharded, FSDP's cost per collective) to them on rank 0."""
    from fastml_strategy.autotune.measure import measure_distributed

    sh = s.sharding
    base_label = baseline_label(sh)
    plans = {base_label: None}
    plans.update({r: _plan_from_choice(profile, c, r)[0] for r, c in recipe_choices.items()})
    bar.phase("timing the recipes", len(plans), "plan")
    measured = measure_distributed(s.workload, plans, steps=s.measure_steps, sharding=sh,
                                   ranks_per_node=s.ranks_per_node)
    bar.update(len(plans))
    if s.rank == 0:
        if sh.sharded:  # FSDP2's own cost per collective first, then the codecs'
            profile.collective_overhead_s = fit_collective_overhead(profile, options[0],
                                                                    measured[base_label], sh)
        profile.codec_scale = fit_codec_scale(
            profile, options[0], {r: measured[r] for r in recipe_choices}, sharding=sh)
    return measured


def _time_plans(s: Settings, profile: Profile, groups: Mapping[str, list[str]],
                options: list[HardwareOption], found: _Searched,
                recipe_choices: Mapping[str, Mapping[str, str]], measured_pre: Mapping[str, float],
                bar: _Progress) -> tuple[Profile, list[StepTimeRow]]:
    """Time the baseline, the tuned plan and the uniform recipes beside their predicted step times.
    Returns the profile (distributed: rank 0's, with its codec scales, on every rank) and the rows."""
    from fastml_strategy.autotune import search

    base_label = baseline_label(s.sharding)
    tuned = found.best[found.chosen]
    choices: dict[str, Mapping[str, str] | None] = {
        base_label: None,
        f"tuned ({found.chosen})": search.expand(groups, tuned.choice) if tuned.use_hook else None}
    # Distributed, the baseline and the recipes were timed before the search (step 1b); the tuned
    # plan is timed now, side by side with the uniform plans the check compared it with (the same
    # rounds, so that load on a shared machine hits them alike: _recheck_measured compares them).
    beside = {e["plan"].split()[-1]: search.expand(groups, e["choice"])
              for e in ((found.check or {}).get("alternatives") or [])} if s.distributed else {}
    total = 1 + len(beside) if s.distributed else len(choices) + len(recipe_choices)
    bar.phase("timing the tuned plan" if s.distributed else "timing plans (compute + codecs)", total, "plan")
    rows: list[dict[str, Any]] = []
    if s.distributed:
        profile = _broadcast(profile if s.rank == 0 else None, True)  # with rank 0's codec scales
        local = {o.name: o for o in options}[LOCAL]
        # the tuned plan runs with the bucket size chosen for it (plan.json meta.ddp), as users will
        buckets = {f"tuned ({found.chosen})": tuned.bucket_mb}
        rows, side = _time_distributed(s, profile, local, choices, recipe_choices, measured_pre, buckets,
                                       beside)
        if found.check is not None:
            found.check["timed_beside_tuned"] = side
    elif s.rank == 0:
        rows = _time_local(s, profile, {**choices, **recipe_choices})
    bar.update(total)
    bar.close()
    return profile, rows


def _time_distributed(s: Settings, profile: Profile, local: HardwareOption,
                      choices: Mapping[str, Mapping[str, str] | None],
                      recipe_choices: Mapping[str, Mapping[str, str]],
                      measured_pre: Mapping[str, float],
                      bucket_mb: Mapping[str, float | None] | None = None,
                      beside: Mapping[str, Mapping[str, str]] | None = None,
                      ) -> tuple[list[StepTimeRow], dict[str, float]]:
    """Time ``choices`` not timed before (``measured_pre``) across the ranks, side by side with the
    uniform plans ``beside`` (codec -> choice; DDP's default buckets); ``bucket_mb``: DDP's bucket
    cap by label (default buckets otherwise). Returns rows for ``choices`` and the recipes, each with
    the step time the cost model predicts on the measured link for the same buckets, and the
    seconds per step of each plan ``beside``."""
    from fastml_strategy.autotune.measure import measure_distributed

    sh = s.sharding
    base_label = baseline_label(sh)
    plans = {k: (None if c is None else _plan_from_choice(profile, c, k)[0]) for k, c in choices.items()
             if k not in measured_pre}
    plans.update({f"uniform {o}": _plan_from_choice(profile, c, o)[0] for o, c in (beside or {}).items()})
    bucket_mb = {} if sh.sharded else dict(bucket_mb or {})
    measured = measure_distributed(s.workload, plans, steps=s.measure_steps, sharding=sh,
                                   ranks_per_node=s.ranks_per_node, bucket_mb=bucket_mb)
    where = f"{s.world_size} ranks, measured link" + (f", {sh.kind}" if sh.sharded else "")
    rows = []
    for k, c in {**choices, **recipe_choices}.items():
        pred = step_time(profile, c or {}, local, hook=c is not None, sharding=sh,
                         bucket_mb=bucket_mb.get(k)).step_s
        fitted = (k in recipe_choices and family(CANDIDATES[k]) in profile.codec_scale) or (
            sh.sharded and k == base_label and profile.collective_overhead_s > 0)
        rows.append(_step_row(k, where + (f", bucket_cap_mb {bucket_mb[k]}" if bucket_mb.get(k) else ""), pred,
                              measured[k] if k in measured else measured_pre[k], fitted))
    return rows, {o: measured[f"uniform {o}"] for o in (beside or {})}


def _time_local(s: Settings, profile: Profile,
                choices: Mapping[str, Mapping[str, str] | None]) -> list[StepTimeRow]:
    """Time ``choices`` in this one process (compute and codecs, no link) beside their predictions."""
    from fastml_strategy.autotune import profile as prof
    from fastml_strategy.autotune.measure import measure_local, predict_local

    with prof.rank_threads(s.threads_per_rank):
        measured = measure_local(s.workload, choices, steps=s.measure_steps)
    where = f"1 process, {profile.threads} thread(s): compute + codecs (no link)"
    return [_step_row(k, where, predict_local(profile, c), measured[k], False) for k, c in choices.items()]


def _step_row(plan: str, where: str, predicted_s: float, measured_s: float, used_in_fit: bool) -> StepTimeRow:
    return StepTimeRow(plan=plan, where=where, predicted_s=predicted_s, measured_s=measured_s, used_in_fit=used_in_fit,
                       error_pct=100.0 * (predicted_s - measured_s) / measured_s)


def _scaling(profile: Profile, options: list[HardwareOption], groups: Mapping[str, list[str]],
             best: Mapping[str, Mapping[str, Any]], sh: Sharding) -> list[ScalingRow]:
    """Each option's tuned plan and the uncompressed baseline on :data:`SCALING_NODES` nodes."""
    from fastml_strategy.autotune import search

    base_label = baseline_label(sh)
    rows = []
    for opt in options:
        c = search.expand(groups, best[opt.name].choice) if best[opt.name].use_hook else None
        intra = Trial.of(best[opt.name]).intra_node
        for n in SCALING_NODES:
            for label, ch in (("tuned", c), (base_label, None)):
                br = step_time(profile, ch or {}, opt, nodes=n, hook=ch is not None, sharding=sh,
                               intra_node=intra if ch is not None else None)
                rows.append(ScalingRow(option=opt.name, nodes=n, plan=label, step_s=br.step_s,
                                       compute_s=br.compute_s, codec_s=br.codec_s,
                                       exposed_comm_s=br.exposed_s, bytes_per_rank=br.bytes_per_rank,
                                       node_net_bytes=br.node_net_bytes, ddp_schedule=br.topology,
                                       # the schedule the runtime picks there (fastml_strategy.comm._halving)
                                       allreduce_schedule=br.schedules))
    return rows


def _result(s: Settings, profile: Profile, groups: Mapping[str, list[str]], options: list[HardwareOption],
            found: _Searched, step_rows: list[StepTimeRow], link_warning: str | None) -> AutotuneResult:
    """The run's result (its plan still empty), with the scaling and what-if predictions."""
    from fastml_strategy.autotune import search

    sh = s.sharding
    whatif = _whatif(profile, options, groups, found.best, sh, search) if sh.sharded else []
    return AutotuneResult(out=s.out, plan=Plan(), option=found.chosen, options=options, best=found.best,
                          baseline=found.baseline, profile=profile, convergence=found.conv,
                          calibration=found.points, trials=found.rows, step_times=step_rows,
                          scaling=_scaling(profile, options, groups, found.best, sh), pareto=found.front,
                          groups=dict(groups), sharding=sh, whatif=whatif, target_steps=found.target_steps,
                          target_steps_source=s.target_steps_source, link_warning=link_warning,
                          local_best=found.local_best, local_calibration=found.local_cal,
                          accuracy_rule=found.rule, budget_notes=found.notes, check=found.check,
                          target_kind=getattr(s.workload, "kind", "workload"))


def _write_report(s: Settings, profile: Profile, groups: Mapping[str, list[str]], result: AutotuneResult,
                  main_dict: dict[str, Any], bar: _Progress) -> None:
    """Write plan.json, every option's plan, the report and the tables (rank 0)."""
    from fastml_strategy.autotune import report

    bar.phase("writing the report", 1, "file set")
    per_option_plans = {o.name: _option_plan(profile, groups, result, s, o.name)[1] for o in result.options}
    report.write_outputs(result, s, main_dict, per_option_plans)
    bar.update(1)


def _whatif(profile: Profile, options: list[HardwareOption], groups: Mapping[str, list[str]],
            best: Mapping[str, Mapping[str, Any]], sh: Sharding, search: Any) -> list[WhatIfRow]:
    """Each option's tuned plan on other cluster shapes (nodes x ranks per node), against FSDP/HSDP's
    own collectives on the same shape: step time, bytes per rank and memory per rank."""
    rows = []
    for opt in options:
        c = search.expand(groups, best[opt.name].choice)
        hook = best[opt.name].use_hook
        for n in WHATIF_NODES:
            for a in WHATIF_RANKS_PER_NODE:
                o = dataclasses.replace(opt, nodes=n, accelerators_per_node=a)
                t = step_time(profile, c, o, hook=hook, sharding=sh)
                b = step_time(profile, {}, o, hook=False, sharding=sh)
                rows.append(WhatIfRow(
                    option=opt.name, nodes=n, ranks_per_node=a, ranks=n * a,
                    tuned_ms=1e3 * t.step_s, own_ms=1e3 * b.step_s,
                    speedup=b.step_s / t.step_s if t.step_s > 0 else float("nan"),
                    allgather_MB=t.allgather_bytes / 1e6,
                    tuned_reduce_MB=(t.reduce_scatter_bytes + t.allreduce_bytes) / 1e6,
                    own_reduce_MB=(b.reduce_scatter_bytes + b.allreduce_bytes) / 1e6,
                    residual_MiB_per_rank=t.residual_bytes / 2 ** 20,
                    fsdp_state_MiB_per_rank=t.state_bytes / 2 ** 20,
                ))
    return rows


def _meta(s: Settings, option: str, best: Mapping[str, Any], base: Mapping[str, Any],
          conv: Convergence, local: Mapping[str, Any] | None = None,
          winner: Mapping[str, Any] | None = None) -> dict[str, Any]:
    def f(v: Any) -> Any:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    sh = s.sharding
    keys = ("step_s", "tta_s", "cost_usd", "error", "g")
    if winner is not None and uses_local_steps(winner):
        advice = ("local steps: fastml_strategy.LocalSGD.from_plan(model, inner_optimizer, this file) "
                  "on a model not wrapped in DDP; the codecs compress the pseudo-gradients")
    elif not sh.sharded:
        advice = ("register the hook with this plan" if Trial.of(best).use_hook else
                  "plain DDP: no compression pays on this option (this plan is fp32 throughout)")
    else:
        advice = (f"fastml_strategy.fsdp.register(model, plan=this file) after fully_shard ({sh.kind})"
                  if Trial.of(best).use_hook else
                  f"{sh.kind.upper()}'s own collectives: no compression pays on this option (this plan "
                  f"is fp32 throughout; do not register FastML)")
    meta = {
        "tuned_by": "fastml-autotune",
        "target": s.target,
        "hardware_option": option,
        "recommendation": advice,
        "world_size_ref": s.world_size,
        # every time and cost below is for this many steps of uncompressed training (source: given,
        # entered, or assumed when the user gave none)
        "target_steps": s.target_steps,
        "target_steps_source": s.target_steps_source,
        "predicted": {k: f((winner or best)[k]) for k in keys},
        f"uncompressed_{sh.kind}": {k: f(base[k]) for k in ("step_s", "tta_s", "cost_usd")},
        "convergence": {"k": conv.k, "gamma": conv.gamma, "e_max": conv.e_max},
    }
    if s.local_steps:  # both modes' predictions, whichever this file holds
        meta["mode"] = "local-steps" if winner is not None and uses_local_steps(winner) else "per-step"
        meta["per_step"] = {k: f(best[k]) for k in keys}
        meta["local_steps"] = None if local is None else {
            **{k: f(local[k]) for k in keys}, "every": int(local["every"]),
            "fragments": int(local["fragments"]), "delay": int(local["delay"]),
            "stretch": f(local["stretch"])}
    if sh.sharded:
        meta["sharding"] = {"kind": sh.kind, "ranks_per_node": s.ranks_per_node,
                            "param_dtype": sh.param_dtype, "reduce_dtype": sh.reduce,
                            "reshard_after_forward": sh.reshard_after_forward}
        meta["predicted"]["residual_bytes_per_rank"] = int(best.get("residual_bytes", 0))
        meta["predicted"]["fsdp_state_bytes_per_rank"] = int(best.get("state_bytes", 0))
    return meta
