"""The autotuner's driver: validate, profile, calibrate, search, check, measure, report.

The check (:func:`_check`): before plan.json is written, the tuned plan of its option and the
obvious uniform alternatives (the fastest uniform plan within the accuracy limit, the best by the cost
model) are trained side by side from the same weights; a uniform plan that reaches the tuned plan's
losses sooner (measured stretch x step time: predicted, then, launched distributed, measured,
:func:`_recheck_measured`) within the accuracy limit is written instead. A cost model fitted to short,
noisy runs can be wrong in ways no refit shows; the alternative a user would try first is the test.

The inputs are validated by :func:`~fastml_strategy.autotune._settings.prepare` before any profiling
and before anything is written; outputs are written only at the end, each atomically. The Optuna
storage (an SQLite file in the output folder by default) is the only thing written while the run is
in progress: it is what lets a stopped run resume (the profile is cached in it too), and it is what
several machines share when given an RDB URL. What a run produced is an
:class:`~fastml_strategy.autotune.result.AutotuneResult`; its rows are
:class:`~fastml_strategy.autotune.costmodel.Trial` records.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import dataclasses
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from fastml_strategy.autotune.catalog import HardwareOption, Link
from fastml_strategy.autotune.costmodel import (CANDIDATES, BUCKET_MB_CHOICES, AccuracyRule, Convergence,
                                                LocalCalibration, Profile, Sharding, Trial, accuracy_rule, evaluate,
                                                family, fit_alpha_beta, fit_codec_scale, fit_collective_overhead,
                                                fit_convergence, intra_node_choices, objective, pareto_front,
                                                step_time)
# the inputs and the result, defined in their own modules, are this module's public names too
from fastml_strategy.autotune._settings import (DEFAULT_BUDGET_MIN, Settings, _refuse_finished_out,  # noqa: F401
                                                prepare)
from fastml_strategy.autotune.result import (ASSUMED_TARGET_STEPS, TARGET_STEPS_SOURCES,  # noqa: F401
                                             AutotuneResult, uses_local_steps)
from fastml_strategy.autotune.result import plan_family
from fastml_strategy.autotune.result import winning_row as _winner
from fastml_strategy.autotune.workload import Workload
from fastml_strategy.codecs import uniform_recipes
from fastml_strategy.config import LocalSteps, Plan

__all__ = ["autotune", "AutotuneResult", "Settings", "prepare", "UNIFORM_RECIPES", "SCALING_NODES",
           "WHATIF_NODES", "WHATIF_RANKS_PER_NODE", "ASSUMED_TARGET_STEPS", "baseline_label"]

# The uniform recipes every report compares against, plus plain DDP: each registered codec's
# ``uniform`` (fastml_strategy.codecs: none, fp16, int8, int4, int2, topk1, lowrank4).
UNIFORM_RECIPES = uniform_recipes()
SCALING_NODES = (8, 16, 32, 64, 128, 256, 512, 1024)
# Sharded runs: the what-if grid of cluster shapes (nodes x ranks per node) for every option.
WHATIF_NODES = (2, 8, 32, 128)
WHATIF_RANKS_PER_NODE = (1, 2, 4, 8)
LOCAL = "local"


def recipes_of(profile: Profile) -> tuple[str, ...]:
    """The uniform recipes a run times and reports: those of :data:`UNIFORM_RECIPES` among the codec
    options it profiled (``options=[...]`` / a restricted candidate list leaves the others out: they
    have no profiled error or codec time)."""
    return tuple(r for r in UNIFORM_RECIPES if r in profile.options)


def baseline_label(sharding: Sharding) -> str:
    """The name of the uncompressed baseline in tables: DDP's fp32 all-reduce, or FSDP/HSDP's own
    collectives."""
    return "ddp-fp32" if not sharding.sharded else f"{sharding.kind}-own"


@dataclass
class _Failed:
    message: str


class _Progress:
    """One progress bar per phase, each with a total known when the phase starts.

    The phases count different things (profiling steps, calibration training runs, cost-model trials
    that take microseconds, plans timed for real), so one bar over all of them has no meaningful rate
    and its ETA is fiction (a first estimate of half an hour for a 77-second run). Per phase the rate
    compares like with like, and no bar passes its total: a bar that is finished says so.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.times: dict[str, float] = {}  # wall seconds per phase (a repeated phase adds up)
        self._phase: tuple[str, float] | None = None

    def phase(self, name: str, total: int, unit: str) -> None:
        from tqdm.auto import tqdm

        self.close()
        self._phase = (name.split(" (")[0], time.perf_counter())
        self.bar = tqdm(total=max(1, int(total)), desc=name, unit=unit, disable=not self.enabled,
                        dynamic_ncols=True, leave=True)

    def set_description(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_description(name)

    def update(self, n: int = 1) -> None:
        if self.bar is not None:  # never past the total, whatever a phase's caller counts
            self.bar.update(max(0, min(int(n), self.bar.total - self.bar.n)))

    def close(self) -> None:
        if self._phase is not None:
            name, t0 = self._phase
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
            self._phase = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None


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
                      s.seed, s.min_numel, s.max_groups, s.world_size, s.threads_per_rank], default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:10]


def _broadcast(obj: Any, distributed: bool) -> Any:
    if not distributed:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _plan_from_choice(profile: Profile, choice: Mapping[str, str], name: str,
                      meta: Mapping[str, Any] | None = None,
                      local_steps: LocalSteps | None = None,
                      intra_node: str | None = None, link: Any = None) -> tuple[Plan, dict[str, Any]]:
    """The plan of a layer choice, and its plan.json dict (with ``meta``); ``intra_node`` ("bf16",
    "fp16"; None or "none": exact, and the file has no ``intra_node``) the hop inside the machine;
    ``link`` (the option's :class:`~fastml_strategy.autotune.catalog.Link`): the plan's link hint, so
    that the runtime's ``"auto"`` schedule picks per bucket what the cost model priced."""
    from fastml_strategy.autotune.costmodel.ddp import plan_link_hint

    layers = {lp.name: CANDIDATES[choice.get(lp.name, "none") if lp.tunable else "none"]
              for lp in profile.layers}
    plan = Plan(default=CANDIDATES["none"], layers=layers, min_numel=profile.min_numel, name=name,
                local_steps=local_steps, intra_node=None if intra_node in (None, "none") else intra_node,
                **(plan_link_hint(link) if link is not None else {}))
    d = plan.to_dict()
    if meta:
        d["meta"] = dict(meta)
    return plan, d


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
            _recheck_measured(s, profile, groups, options, found, step_rows, measured_pre)
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


def _time_plans(s: Settings, profile: Profile, groups: Mapping[str, list[str]],
                options: list[HardwareOption], found: _Searched,
                recipe_choices: Mapping[str, Mapping[str, str]], measured_pre: Mapping[str, float],
                bar: _Progress) -> tuple[Profile, list[dict[str, Any]]]:
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
    for r in rows:
        r["error_pct"] = 100.0 * (r["predicted_s"] - r["measured_s"]) / r["measured_s"]
    return profile, rows


def _time_distributed(s: Settings, profile: Profile, local: HardwareOption,
                      choices: Mapping[str, Mapping[str, str] | None],
                      recipe_choices: Mapping[str, Mapping[str, str]],
                      measured_pre: Mapping[str, float],
                      bucket_mb: Mapping[str, float | None] | None = None,
                      beside: Mapping[str, Mapping[str, str]] | None = None,
                      ) -> tuple[list[dict[str, Any]], dict[str, float]]:
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
        rows.append({"plan": k, "where": where + (f", bucket_cap_mb {bucket_mb[k]}" if bucket_mb.get(k) else ""),
                     "predicted_s": pred,
                     "measured_s": measured[k] if k in measured else measured_pre[k], "used_in_fit": fitted})
    return rows, {o: measured[f"uniform {o}"] for o in (beside or {})}


def _time_local(s: Settings, profile: Profile,
                choices: Mapping[str, Mapping[str, str] | None]) -> list[dict[str, Any]]:
    """Time ``choices`` in this one process (compute and codecs, no link) beside their predictions."""
    from fastml_strategy.autotune import profile as prof
    from fastml_strategy.autotune.measure import measure_local, predict_local

    with prof.rank_threads(s.threads_per_rank):
        measured = measure_local(s.workload, choices, steps=s.measure_steps)
    where = f"1 process, {profile.threads} thread(s): compute + codecs (no link)"
    return [{"plan": k, "where": where, "predicted_s": predict_local(profile, c), "measured_s": measured[k],
             "used_in_fit": False} for k, c in choices.items()]


def _scaling(profile: Profile, options: list[HardwareOption], groups: Mapping[str, list[str]],
             best: Mapping[str, Mapping[str, Any]], sh: Sharding) -> list[dict[str, Any]]:
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
                rows.append({"option": opt.name, "nodes": n, "plan": label, "step_s": br.step_s,
                             "compute_s": br.compute_s, "codec_s": br.codec_s,
                             "exposed_comm_s": br.exposed_s, "bytes_per_rank": br.bytes_per_rank,
                             "node_net_bytes": br.node_net_bytes, "ddp_schedule": br.topology,
                             # the all-reduce schedule the runtime picks there (fastml_strategy.comm._halving)
                             "allreduce_schedule": br.schedules})
    return rows


def _result(s: Settings, profile: Profile, groups: Mapping[str, list[str]], options: list[HardwareOption],
            found: _Searched, step_rows: list[dict[str, Any]], link_warning: str | None) -> AutotuneResult:
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


@dataclass(frozen=True)
class _Calibrated:
    """The calibration runs so far and the accuracy rule over them."""

    plans: list[Any]  # the plans run (candidates, repeats, then the chosen plans verified)
    ref: dict[str, Any]  # the reference runs (calibrate.run_calibration)
    points: list[dict[str, Any]]  # one row per calibration run
    rule: AccuracyRule
    run_s: float  # wall seconds of one calibration run (measured on the first round)


@dataclass(frozen=True)
class _OptionSearch:
    """One search of every hardware option under one convergence fit."""

    rows: list[dict[str, Any]]  # every trial, and each option's plain DDP (or FSDP/HSDP) row
    best: dict[str, dict[str, Any]]  # option -> best per-step row (plain DDP where nothing pays)
    baseline: dict[str, dict[str, Any]]  # option -> uncompressed row
    local_best: dict[str, dict[str, Any] | None]  # option -> best local-steps row (None: none feasible)


@dataclass(frozen=True)
class _Searched:
    """What calibration and search found on rank 0 (broadcast to every rank)."""

    points: list[dict[str, Any]]  # every calibration run
    conv: Convergence
    target_steps: float
    rows: list[dict[str, Any]]  # every trial row, with "pareto" set
    best: dict[str, dict[str, Any]]
    baseline: dict[str, dict[str, Any]]
    front: list[int]  # indices into rows on the Pareto front of priced options
    chosen: str  # the option plan.json is tuned for
    local_best: dict[str, dict[str, Any] | None]
    local_cal: LocalCalibration | None
    rule: AccuracyRule
    notes: list[str]  # what --budget left out
    check: dict[str, Any] | None = None  # the tuned plan against uniform plans, side by side (_check)


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
    while True:
        conv = fit_convergence(cal.points, s.max_accuracy_loss, rule=cal.rule)
        found = _search_options(s, profile, groups, options, conv, local_cal, fp, bar)
        new = _untried_plans(found.best, cal.points)
        if rnd >= s.verify_rounds:
            break
        probe = _gap_probe(s, profile, groups, options, conv, cal.rule, found,
                           [p["choice"] for p in cal.points] + new, fp)
        if probe is not None:
            new.append(probe.choice)
        if not new:
            break
        if not _fits(optional, cal.run_s * len(new)):
            notes.append(f"--budget: verification round {rnd + 1} ({len(new)} chosen plans) not run")
            break
        rnd += 1
        bar.phase(f"verifying the chosen plans (round {rnd} of up to {s.verify_rounds})",
                  1 + len(cal.plans) + len(new), "run")
        e_before = conv.e_max
        cal = _calibrate_again(s, profile, groups, cal, cal.plans + new, cal_name, bar, optional)
        if probe is not None:
            notes.append(_probe_note(probe, e_before, cal))
    chosen = _chosen_option(options, found)
    check = _check(s, profile, groups, options, chosen, found, cal, conv, cal_name, bar, deadline, notes)
    return _Searched(points=cal.points, conv=conv, target_steps=float(s.target_steps), rows=found.rows,
                     best=found.best, baseline=found.baseline, front=_pareto(found.rows, options),
                     chosen=chosen, local_best=found.local_best, local_cal=local_cal, rule=cal.rule,
                     notes=notes, check=check)


def _recheck_measured(s: Settings, profile: Profile, groups: Mapping[str, list[str]],
                      options: list[HardwareOption], found: _Searched, step_rows: list[dict[str, Any]],
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
    tuned_m = next((r["measured_s"] for r in step_rows if str(r["plan"]).startswith("tuned")), None)
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
    if not s.sharding.sharded:
        new = _best_bucket(profile, groups, opt, found.conv, float(s.target_steps), new, search)
    found.best[chosen] = new
    c["replaced"] = e["plan"]
    c["verdict"] = (f"{e['plan']} reached the tuned plan's losses in {e['measured_time_ratio']:.3g}x its time "
                    f"with measured step times (the cost model had said {e['time_ratio']:.3g}x), within the "
                    f"accuracy limit ({c['decision_measured']['why']}): plan.json holds {e['plan']} instead")


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


def _ms_text(seconds: float) -> str:
    return f"{1e3 * seconds:.4g} ms" if seconds < 1 else f"{seconds:.3g} s"


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


# The recipe every check also trains (when it is not the tuned plan or an alternative already): the
# library's default, so that a calibration the budget cut short (on a loaded machine only the first,
# fp16, plan may run) cannot leave the answer slower than it where it meets the accuracy limit.
DEFAULT_CHECK_RECIPE = "int4"


def _default_recipe(rows: list[Mapping[str, Any]], option: str, tuned: Trial, groups: Mapping[str, list[str]],
                    alts: list[tuple[Trial, str]]) -> list[tuple[Trial, str]]:
    """Uniform :data:`DEFAULT_CHECK_RECIPE` as one more alternative, unless it is already compared."""
    uni = [t for t in map(Trial.of, rows) if t.option == option and t.kind == "fastml" and t.every == 1
           and t.uniform == DEFAULT_CHECK_RECIPE and len(t.choice) == len(groups) and math.isfinite(t.objective)]
    if not uni or any(a.choice == uni[0].choice for a, _ in alts) or tuned.choice == uni[0].choice:
        return []
    return [(min(uni, key=lambda t: t.objective),
             f"the default recipe ({DEFAULT_CHECK_RECIPE}), trained in every check: judged by its own run")]


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


def _calibration_deadline(s: Settings, profile: Profile) -> float | None:
    """When calibration runs must end (None: no --budget): the run's deadline less the time kept for
    timing the plans and writing the report, (plans x steps) of compute and a margin."""
    from fastml_strategy.autotune.measure import steps_per_plan

    if s.deadline is None:
        return None
    # the recipes are timed before calibration; after it the tuned plan and the check's alternatives
    return s.deadline - ((1 + CHECK_RUNS) * steps_per_plan(s.measure_steps) * max(profile.compute_s, 1e-3)
                         + 10.0)


# Runs the check against uniform plans may train (the tuned plan, the fastest and the best uniform
# plan): their time is reserved from --budget before the optional runs (repeats, local steps,
# verification) are started, so that a budget cuts those and never the check (a run whose check the
# budget left out can write a plan slower than a uniform one).
CHECK_RUNS = 3


def _reserve(deadline: float | None, seconds: float) -> float | None:
    """``deadline`` moved ``seconds`` earlier (None: no deadline)."""
    return None if deadline is None else deadline - seconds


def _fits(deadline: float | None, seconds: float) -> bool:
    """Whether work of ``seconds`` started now ends by ``deadline`` (None: no deadline)."""
    return deadline is None or time.time() + seconds <= deadline


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
    base.update(option=opt.name, choice={g: "none" for g in groups}, use_hook=False,
                objective=objective(base, opt), every=1, fragments=1, delay=0)
    return base


# A plan the accuracy rule excludes only for want of a calibration run near its error is trained in
# the verification when the cost model predicts it at least this much faster than the chosen plan.
PROBE_GAIN = 0.9


def _gap_probe(s: Settings, profile: Profile, groups: Mapping[str, list[str]], options: list[HardwareOption],
               conv: Convergence, rule: AccuracyRule, found: _OptionSearch, tried: list[Any],
               fp: str) -> Trial | None:
    """The per-step plan to train beside the chosen ones in a verification round, or None.

    The accuracy rule admits errors up to the largest calibrated one within the limit (``e_max``); an
    error between it and the next calibrated error, the first that failed (every error above ``e_max``
    when none failed), is excluded though no run measured anything there. A one-scalar error orders
    codec families only roughly (a top-k plan's error is large while its loss may match int8's), so
    the plan the search would choose on plan.json's option with the limit just below that failing
    error is trained too, when no run has trained it and the cost model predicts it at most
    :data:`PROBE_GAIN` of the chosen plan's objective. Its run enters the rule like any other: within
    the limit it raises ``e_max`` to its error, beyond it it confirms the limit.
    """
    from fastml_strategy.autotune import search

    name = _chosen_option(options, found)
    opt = next(o for o in options if o.name == name)
    failed = [e for e in rule.errors if e > conv.e_max + 1e-12]
    limit = failed[0] * (1 - 1e-9) if failed else math.inf
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


def _probe_note(probe: Trial, e_before: float, cal: _Calibrated) -> str:
    """The report's words for a probe run (:func:`_gap_probe`) and what it decided."""
    run = next((p for p in cal.points if p["choice"] == probe.choice), None)
    what = (f"verification also trained the plan the search prefers just beyond the accuracy rule's "
            f"limit (error {probe.error:.3g} > e_max {e_before:.3g}; no calibration run had measured "
            f"an error between)")
    if run is None:
        return what + "; its run did not finish, so the limit stands"
    verdict = (f"within the limit, so plans up to error {cal.rule.e_max:.3g} are admitted"
               if cal.rule.e_max >= probe.error - 1e-12 else "beyond the limit, which stands")
    return f"{what}: accuracy loss {float(run['accuracy_loss']):.3g}, {verdict}"


def _untried_plans(best: Mapping[str, Mapping[str, Any]], points: list[dict[str, Any]]) -> list[Any]:
    """The compressed per-step plans the search chose that no calibration run has trained yet (local
    steps' codecs compress pseudo-gradients, so their rows are not among them)."""
    tried = [p["choice"] for p in points]
    new: list[Any] = []
    for b in best.values():
        c = b.choice
        if c not in tried and c not in new and any(o != "none" for o in c.values()):
            new.append(c)
    return new


def _pareto(rows: list[dict[str, Any]], options: list[HardwareOption]) -> list[int]:
    """Mark each row's ``pareto`` and return the front's indices: time against cost over the feasible
    rows of priced options (a cluster you already have costs nothing here)."""
    priced = {o.name for o in options if o.price_per_hour > 0}
    feas = [i for i, r in enumerate(rows) if r.feasible and r.option in priced]
    front = [feas[i] for i in pareto_front([(rows[i].tta_s, rows[i].cost_usd) for i in feas])]
    for i, r in enumerate(rows):
        r["pareto"] = i in front
    return front


def _chosen_option(options: list[HardwareOption], found: _OptionSearch) -> str:
    """The option plan.json is tuned for: the user's own cluster when its link is known, else the
    option whose winning row costs least (then: ends soonest)."""
    if LOCAL in found.best:
        return LOCAL

    def cost_then_time(name: str) -> tuple[float, float]:
        w = _winner(found.best[name], found.local_best.get(name))
        return w.cost_usd, w.tta_s

    return min((o.name for o in options), key=cost_then_time)


def _best_bucket(profile: Profile, groups: Mapping[str, list[str]], opt: HardwareOption, conv: Convergence,
                 target_steps: float, row: Mapping[str, Any], search: Any) -> dict[str, Any]:
    """The row with the bucket cap (``bucket_mb``: DDP's ``bucket_cap_mb``; None: DDP's default) of
    :data:`BUCKET_MB_CHOICES` that minimises the option's objective for the row's plan."""
    row = Trial.of(row)
    choice = search.expand(groups, row.choice)
    hook = row.use_hook
    out = row.replace(bucket_mb=None)
    for mb in BUCKET_MB_CHOICES[1:]:
        r = evaluate(profile, choice, opt, conv, target_steps, hook=hook, bucket_mb=mb,
                     intra_node=row.get("intra_node"))
        obj = objective(r, opt)
        if obj < out.objective * (1 - 1e-9):
            out.update({k: r[k] for k in ("step_s", "exposed_s", "tta_s", "cost_usd", "wire_s")},
                       objective=obj, bucket_mb=mb)
    return out


def _rule(s: Settings, ref: Mapping[str, Any], points: list[dict[str, Any]]) -> AccuracyRule:
    """The accuracy rule over every calibration run so far (costmodel.accuracy_rule)."""
    return accuracy_rule(points, s.max_accuracy_loss, reference_sigma=ref.get("sigma"),
                         paired=ref.get("paired"), references=len(ref.get("references") or {0: 0}))


def _option_key(opt: HardwareOption, sharded: bool = False) -> Any:
    """What of an option shapes its search: the catalog fields (as before sharding existed), and
    for sharded runs its intra-node link too."""
    d = asdict(opt)
    intra = d.pop("intra_link", None)
    return intra if sharded else d


def _whatif(profile: Profile, options: list[HardwareOption], groups: Mapping[str, list[str]],
            best: Mapping[str, Mapping[str, Any]], sh: Sharding, search: Any) -> list[dict[str, Any]]:
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
                rows.append({
                    "option": opt.name, "nodes": n, "ranks_per_node": a, "ranks": n * a,
                    "tuned_ms": 1e3 * t.step_s, "own_ms": 1e3 * b.step_s,
                    "speedup": b.step_s / t.step_s if t.step_s > 0 else float("nan"),
                    "allgather_MB": t.allgather_bytes / 1e6,
                    "tuned_reduce_MB": (t.reduce_scatter_bytes + t.allreduce_bytes) / 1e6,
                    "own_reduce_MB": (b.reduce_scatter_bytes + b.allreduce_bytes) / 1e6,
                    "residual_MiB_per_rank": t.residual_bytes / 2 ** 20,
                    "fsdp_state_MiB_per_rank": t.state_bytes / 2 ** 20,
                })
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
