"""What the autotuner's phases share: the progress bar, the records one phase hands the next
(:class:`_Calibrated`, :class:`_OptionSearch`, :class:`_Searched`), the broadcast to every rank, the
budget's clock (:func:`_fits`, :func:`_reserve`), and a search choice made into a Plan.

The driver (``_run``) runs the phases in order: profile, calibrate and search (``_tune``), check
(``_check``), measure, report. Each phase module imports this one and the phases before it, never one
after it.
"""

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Mapping

from fastml_strategy.autotune.costmodel import (AccuracyRule, BUCKET_MB_CHOICES, CANDIDATES, Convergence,
                                                LocalCalibration, Profile, Sharding, Trial, evaluate, objective)
from fastml_strategy.autotune.catalog import HardwareOption
from fastml_strategy.config import LocalSteps, Plan
from fastml_strategy.autotune.result import CalibrationPoint
from fastml_strategy.autotune.result import winning_row as _winner
from fastml_strategy.codecs import uniform_recipes

# The uniform recipes every report compares against, plus plain DDP: each registered codec's
# ``uniform`` (fastml_strategy.codecs: none, fp16, int8, int4, int2, topk1, lowrank4).
UNIFORM_RECIPES = uniform_recipes()
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


@dataclass(frozen=True)
class _Calibrated:
    """The calibration runs so far and the accuracy rule over them."""

    plans: list[Any]  # the plans run (candidates, repeats, then the chosen plans verified)
    ref: dict[str, Any]  # the reference runs (calibrate.run_calibration)
    points: list[CalibrationPoint]  # one row per calibration run
    rule: AccuracyRule
    run_s: float  # wall seconds of one calibration run (measured on the first round)


@dataclass(frozen=True)
class _OptionSearch:
    """One search of every hardware option under one convergence fit."""

    rows: list[Trial]  # every trial, and each option's plain DDP (or FSDP/HSDP) row
    best: dict[str, Trial]  # option -> best per-step row (plain DDP where nothing pays)
    baseline: dict[str, Trial]  # option -> uncompressed row
    local_best: dict[str, Trial | None]  # option -> best local-steps row (None: none feasible)


@dataclass(frozen=True)
class _Searched:
    """What calibration and search found on rank 0 (broadcast to every rank)."""

    points: list[CalibrationPoint]  # every calibration run
    conv: Convergence
    target_steps: float
    rows: list[Trial]  # every trial row, with "pareto" set
    best: dict[str, Trial]
    baseline: dict[str, Trial]
    front: list[int]  # indices into rows on the Pareto front of priced options
    chosen: str  # the option plan.json is tuned for
    local_best: dict[str, Trial | None]
    local_cal: LocalCalibration | None
    rule: AccuracyRule
    notes: list[str]  # what --budget left out
    check: dict[str, Any] | None = None  # the tuned plan against uniform plans, side by side (_check)


def _ms_text(seconds: float) -> str:
    return f"{1e3 * seconds:.4g} ms" if seconds < 1 else f"{seconds:.3g} s"


# Runs the check against uniform plans may train (the tuned plan, the fastest and the best uniform
# plan, the codec families' recipes not among them: about two more): their time is reserved from
# --budget before the optional runs (repeats, local steps, verification) are started, so that a budget cuts those and never the check (a run whose check the
# budget left out can write a plan slower than a uniform one).
CHECK_RUNS = 5


def _reserve(deadline: float | None, seconds: float) -> float | None:
    """``deadline`` moved ``seconds`` earlier (None: no deadline)."""
    return None if deadline is None else deadline - seconds


def _fits(deadline: float | None, seconds: float) -> bool:
    """Whether work of ``seconds`` started now ends by ``deadline`` (None: no deadline)."""
    return deadline is None or time.time() + seconds <= deadline


def _chosen_option(options: list[HardwareOption], found: _OptionSearch) -> str:
    """The option plan.json is tuned for: the user's own cluster when its link is known, else the
    option whose winning row costs least (then: ends soonest)."""
    if LOCAL in found.best:
        return LOCAL

    def cost_then_time(name: str) -> tuple[float, float]:
        w = _winner(found.best[name], found.local_best.get(name))
        return w.cost_usd, w.tta_s

    return min((o.name for o in options), key=cost_then_time)


def _with_bucket(profile: Profile, groups: Mapping[str, list[str]], opt: HardwareOption, conv: Convergence,
                 target_steps: float, row: Mapping[str, Any], mb: float | None, search: Any) -> Trial:
    """The row priced again with DDP's ``bucket_cap_mb`` = ``mb`` (None: DDP's default buckets)."""
    row = Trial.of(row)
    r = evaluate(profile, search.expand(groups, row.choice), opt, conv, target_steps, hook=row.use_hook,
                 bucket_mb=mb, intra_node=row.get("intra_node"))
    return row.replace({k: r[k] for k in ("step_s", "exposed_s", "tta_s", "cost_usd", "wire_s")},
                       objective=objective(r, opt), bucket_mb=mb)


def _best_bucket(profile: Profile, groups: Mapping[str, list[str]], opt: HardwareOption, conv: Convergence,
                 target_steps: float, row: Mapping[str, Any], search: Any) -> dict[str, Any]:
    """The row with the bucket cap (``bucket_mb``: DDP's ``bucket_cap_mb``; None: DDP's default) of
    :data:`BUCKET_MB_CHOICES` that minimises the option's objective for the row's plan."""
    out = Trial.of(row).replace(bucket_mb=None)
    for mb in BUCKET_MB_CHOICES[1:]:
        r = _with_bucket(profile, groups, opt, conv, target_steps, row, mb, search)
        if r.objective < out.objective * (1 - 1e-9):
            out = r
    return out
