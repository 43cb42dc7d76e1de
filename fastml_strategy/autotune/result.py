"""What an autotuning run produced, in the form the report and the command's output read it.

:class:`AutotuneResult` (returned by :func:`~fastml_strategy.autotune.autotune`) and the few facts about
a result row that the driver (``_run``) and the report (``report``) both need live here, so that
neither imports the other: the driver builds a result, the report reads one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, TypedDict

from fastml_strategy.autotune.catalog import HardwareOption
from fastml_strategy.autotune.costmodel import (AccuracyRule, Convergence, LocalCalibration, Profile, Sharding,
                                                Trial)
from fastml_strategy.config import Plan

__all__ = ["AutotuneResult", "ASSUMED_TARGET_STEPS", "TARGET_STEPS_SOURCES", "CalibrationPoint", "StepTimeRow",
           "ScalingRow", "WhatIfRow", "codec_family", "plan_family", "uses_local_steps", "winning_row"]

# Training length when the user gives none (--target-steps) and is not asked: every time and cost scales
# with it, the choice of plan does not (it multiplies every option and plan alike). The report says it
# was assumed, never that the user gave it.
ASSUMED_TARGET_STEPS = 10_000
# Where the training length came from, as the report words it.
TARGET_STEPS_SOURCES = {"given": "--target-steps", "entered": "entered at the prompt",
                        "assumed": "assumed; pass --target-steps N for your run"}


class CalibrationPoint(TypedDict, total=False):
    """One calibration training run (``calibration.csv``; ``calibrate.points``, then the stretch and
    the accuracy allowance its curve gave): a plan's measured error per step, its stretch (steps
    against the uncompressed reference to the same losses) and accuracy loss."""

    trial: int  # the calibration study's trial number
    error: float  # the plan's relative error per step (math.inf: unknown)
    ratio: float  # the stretch: the plan's steps / the reference's to the same losses
    ratio_lo: float  # its interval (nan: none) and standard error
    ratio_hi: float
    ratio_se: float
    censored: bool  # the run ended before reaching the reference's last level (ratio: a lower bound)
    pruned: bool  # stopped by the pruner: its accuracy loss is math.inf
    levels: int  # loss levels the stretch was measured at, and how many the run reached
    levels_reached: int
    stretch_sigma: float  # the noise of one run's stretch, and where that figure came from
    stretch_noise: str
    accuracy_loss: float  # against the reference (its metric, else its final loss), after the allowance
    accuracy_loss_raw: float
    accuracy_allowance: float
    metric: float | None  # the run's eval metric (None: the workload has no eval_fn)
    choice: dict[str, str]  # search group -> codec option
    seed: int
    losses: list[float] | None  # the run's loss curve (None: stored before curves were kept)


class StepTimeRow(TypedDict):
    """One plan's step time measured beside the cost model's prediction (``step_times.csv``)."""

    plan: str  # "tuned (OPTION)", a uniform recipe, or the uncompressed baseline's label
    where: str  # what was timed: ranks and link, or one process without a link
    predicted_s: float
    measured_s: float
    used_in_fit: bool  # the measurement fitted the codec-time scales or the collective overhead
    error_pct: float  # 100 (predicted - measured) / measured


class ScalingRow(TypedDict):
    """An option's tuned plan or its uncompressed baseline predicted on ``nodes`` machines
    (``scaling.csv``; ``_run.SCALING_NODES``)."""

    option: str
    nodes: int
    plan: str  # "tuned" or the baseline's label
    step_s: float
    compute_s: float
    codec_s: float
    exposed_comm_s: float
    bytes_per_rank: int
    node_net_bytes: int  # bytes leaving each machine per step
    ddp_schedule: str  # flat or hierarchical
    allreduce_schedule: Any  # the all-reduce schedule(s) the runtime picks there: ring or halving


class WhatIfRow(TypedDict):
    """Sharded runs: an option's tuned plan on another cluster shape against FSDP/HSDP's own
    collectives on it (``whatif.csv``; ``_run.WHATIF_NODES`` x ``WHATIF_RANKS_PER_NODE``)."""

    option: str
    nodes: int
    ranks_per_node: int
    ranks: int
    tuned_ms: float
    own_ms: float
    speedup: float  # own_ms / tuned_ms
    allgather_MB: float
    tuned_reduce_MB: float
    own_reduce_MB: float
    residual_MiB_per_rank: float
    fsdp_state_MiB_per_rank: float


@dataclass
class AutotuneResult:
    """What a run produced (the files in ``out`` hold the same)."""

    out: Path
    plan: Plan
    option: str  # the hardware option plan.json was tuned for
    options: list[HardwareOption]
    best: dict[str, Trial]  # option -> best per-step trial (plain DDP where nothing pays)
    baseline: dict[str, Trial]  # option -> uncompressed DDP (or FSDP/HSDP's own) row
    profile: Profile
    convergence: Convergence
    calibration: list[CalibrationPoint]
    trials: list[Trial]  # every search trial of every option, and each option's baseline row
    step_times: list[StepTimeRow]
    scaling: list[ScalingRow]
    pareto: list[int] = field(default_factory=list)
    groups: dict[str, list[str]] = field(default_factory=dict)
    sharding: Sharding = field(default_factory=Sharding)
    whatif: list[WhatIfRow] = field(default_factory=list)  # sharded: cluster shapes per option
    target_steps: float = ASSUMED_TARGET_STEPS  # steps of uncompressed training every time and cost is for
    target_steps_source: str = "assumed"  # see TARGET_STEPS_SOURCES
    # Set when the measured link is not a network (every rank on one machine): the report flags it.
    link_warning: str | None = None
    # Local steps: option -> best feasible LocalSGD row (None: none feasible), and the calibration.
    local_best: dict[str, Trial | None] = field(default_factory=dict)
    local_calibration: LocalCalibration | None = None
    # How the accuracy limit was decided (fit, band, noise, pairing): costmodel.accuracy_rule
    accuracy_rule: AccuracyRule | None = None
    # Wall seconds per phase (profiling, calibrating, ..., writing the report) and in all
    phase_s: dict[str, float] = field(default_factory=dict)
    # What --budget left out (empty: nothing)
    budget_notes: list[str] = field(default_factory=list)
    # The tuned plan against the obvious uniform alternatives, trained side by side (None: not checked)
    check: dict[str, Any] | None = None
    # What the target was (Workload.kind: "workload", "trainer", "lightning"): the report names the
    # call that trains with plan.json for it
    target_kind: str = "workload"

    @property
    def family(self) -> str:
        """plan.json's plan family (:func:`plan_family`): what a repeated run must agree on."""
        from fastml_strategy.autotune.search import expand

        w = self.winner(self.option)
        numel = {lp.name: lp.numel for lp in self.profile.layers if lp.tunable}
        return plan_family(expand(self.groups, w.choice), numel, every=int(w.get("every", 1)),
                           hook=bool(w.get("use_hook", True)))

    @property
    def plan_uses_hook(self) -> bool:
        """Whether plan.json asks for FastML (a hook, FSDP registration or LocalSGD); False: plain
        DDP (or FSDP/HSDP's own collectives), no hook."""
        w = self.winner(self.option)
        return bool(w.get("use_hook", True)) or uses_local_steps(w)

    def winner(self, option: str) -> Trial:
        """The row the option should use: its local-steps row when that beats per-step compression
        (or plain DDP) on the objective, else ``best[option]``."""
        return winning_row(self.best[option], self.local_best.get(option))


def winning_row(best: Mapping[str, Any], local: Mapping[str, Any] | None) -> Trial:
    """The local-steps row when there is one and it beats the per-step row on the objective."""
    best = Trial.of(best)
    return Trial.of(local) if local is not None and local["objective"] < best.objective else best


def uses_local_steps(row: Mapping[str, Any]) -> bool:
    """Whether a result row is a LocalSGD configuration (H > 1)."""
    return int(row.get("every", 1)) > 1


# The codec classes' families (``Codec.family``) in the words the report and plan.json's meta use.
_FAMILY_WORDS = {"quantize": "quantized", "topk": "top-k", "cast": "16-bit", "lowrank": "low-rank", "fp32": "fp32"}


def codec_family(option: str) -> str:
    """A codec option's family, read from its codec class (``Codec.family``) through the autotuner's
    candidates: ``quantized`` (int2-int8, with or without error feedback), ``top-k`` (values fp32 or
    int4), ``low-rank`` (every rank), ``16-bit``, ``fp32`` (``none``), or a newer codec's own family
    name; a ``-rbf16`` residual does not change it. An option that is no candidate is its own family."""
    from fastml_strategy.autotune.costmodel.base import CANDIDATES, family

    cfg = CANDIDATES.get(option, CANDIDATES.get(option.removesuffix("-rbf16")))
    if cfg is None:
        return option
    f = family(cfg)
    return _FAMILY_WORDS.get(f, f)


def plan_family(choice: Mapping[str, str], numel: Mapping[str, int], every: int = 1, hook: bool = True) -> str:
    """What kind of answer a plan is: ``local steps``, ``plain DDP`` (no hook, or fp32 for every tuned
    tensor), else the codec family (:func:`codec_family`) of most of the tuned gradient elements
    (``numel``: parameter -> elements). Two runs of one command must agree on it (issue 38: one run
    of the same command gave an int4/int6/int8 mix, the next fp32 everywhere)."""
    if every > 1:
        return "local steps"
    by: dict[str, int] = {}
    for name, n in numel.items():
        f = codec_family(choice.get(name, "none"))
        by[f] = by.get(f, 0) + int(n)
    if not hook or not by or set(by) == {"fp32"}:
        return "plain DDP"
    return max(by, key=lambda f: (by[f], f))
