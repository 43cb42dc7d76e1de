"""The autotuner's driver: validate, profile, calibrate, search, check, measure, report.

The check (:func:`_check`, issue 28): before plan.json is written, the tuned plan of its option and the
obvious uniform alternatives (the fastest uniform plan within the accuracy limit, the best by the cost
model) are trained side by side from the same weights; a uniform plan that reaches the tuned plan's
losses sooner (measured stretch x step time: predicted, then, launched distributed, measured,
:func:`_recheck_measured`) within the accuracy limit is written instead. A cost model fitted to short,
noisy runs can be wrong in ways no refit shows; the alternative a user would try first is the test.

Everything that can be wrong with the inputs (target, catalog, link, numbers, storage URL) is checked
in :func:`prepare`, before any profiling and before anything is written; outputs are written only at
the end, each atomically. The Optuna storage (an SQLite file in the output folder by default) is the
only thing written while the run is in progress: it is what lets a stopped run resume (the profile is
cached in it too), and it is what several machines share when given an RDB URL.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from fastml_strategy.autotune.catalog import HardwareOption, Link, load_catalog, parse_link
from fastml_strategy.autotune.costmodel import (CANDIDATES, DEFAULT_LOCAL_EVERY, DEFAULT_LOCAL_FRAGMENTS,
                                                BUCKET_MB_CHOICES, SHARDINGS, AccuracyRule, Convergence,
                                                LocalCalibration,
                                                Profile, Sharding, accuracy_rule,
                                                default_options, evaluate, family, fit_alpha_beta,
                                                fit_codec_scale, fit_collective_overhead,
                                                fit_convergence, objective, pareto_front, step_time)
from fastml_strategy.autotune.workload import Workload, as_workload, load_target
from fastml_strategy._validate import env_whole_number, whole_number
from fastml_strategy.config import DEFAULT_MIN_NUMEL, LocalSteps, Plan

__all__ = ["autotune", "AutotuneResult", "Settings", "prepare", "UNIFORM_RECIPES", "SCALING_NODES",
           "WHATIF_NODES", "WHATIF_RANKS_PER_NODE", "ASSUMED_TARGET_STEPS", "baseline_label"]

# The uniform recipes every report compares against (the list), plus plain DDP.
UNIFORM_RECIPES = ("none", "fp16", "int8", "int4", "int2", "topk1")
SCALING_NODES = (8, 16, 32, 64, 128, 256, 512, 1024)
# Sharded runs: the what-if grid of cluster shapes (nodes x ranks per node) for every option.
WHATIF_NODES = (2, 8, 32, 128)
WHATIF_RANKS_PER_NODE = (1, 2, 4, 8)
LOCAL = "local"
# Training length when the user gives none (--target-steps) and is not asked: every time and cost scales
# with it, the choice of plan does not (it multiplies every option and plan alike). The report says it
# was assumed, never that the user gave it.
ASSUMED_TARGET_STEPS = 10_000
# --budget's default, minutes: the optional runs (repeats, local steps, verification) are skipped
# when they would not fit; the search then uses what was measured by then.
DEFAULT_BUDGET_MIN = 15.0
# Where the training length came from, as the report words it.
TARGET_STEPS_SOURCES = {"given": "--target-steps", "entered": "entered at the prompt",
                        "assumed": "assumed; pass --target-steps N for your run"}


def baseline_label(sharding: Sharding) -> str:
    """The name of the uncompressed baseline in tables: DDP's fp32 all-reduce, or FSDP/HSDP's own
    collectives."""
    return "ddp-fp32" if not sharding.sharded else f"{sharding.kind}-own"


@dataclass
class Settings:
    """Validated inputs of one autotuning run."""

    workload: Workload
    target: str
    out: Path
    catalog: list[HardwareOption]
    catalog_path: str
    world_size: int
    link: Link | None
    storage_url: str
    trials: int = 200
    calibration_trials: int = 6
    calibration_steps: int = 60
    # Accuracy rule: reruns (other seeds) of the plans nearest the limit, and reference runs
    calibration_repeats: int = 2
    references: int = 2
    profile_steps: int = 5
    measure_steps: int = 10
    max_accuracy_loss: float = 0.01
    target_steps: float = ASSUMED_TARGET_STEPS
    target_steps_source: str = "assumed"  # "given" (--target-steps), "entered" (prompt) or "assumed"
    max_groups: int = 24
    min_numel: int = DEFAULT_MIN_NUMEL
    options: list[str] = field(default_factory=lambda: list(CANDIDATES))
    verify_rounds: int = 2
    seed: int = 0
    progress: bool = True
    sharding: Sharding = field(default_factory=Sharding)
    ranks_per_node: int = 1  # sharded: ranks of one node of the user's own cluster (HSDP: the shard)
    max_residual_bytes: float | None = None  # sharded: error-feedback memory limit per rank
    # Local steps (LocalSGD) searched against per-step compression: DDP runs only (--no-local-steps)
    local_steps: bool = False
    local_every: tuple[int, ...] = DEFAULT_LOCAL_EVERY  # sync periods H calibrated and searched
    local_fragments: tuple[int, ...] = DEFAULT_LOCAL_FRAGMENTS  # fragment counts F searched
    # Threads one rank's compute is timed with (None: as launched, under torchrun), and why
    threads_per_rank: int | None = None
    threads_source: str = "as launched"
    budget_s: float | None = DEFAULT_BUDGET_MIN * 60.0  # wall-time cap (--budget); None: no cap
    distributed: bool = False
    rank: int = 0
    storage: Any = None  # the opened optuna storage (rank 0)
    created_out: bool = False
    deadline: float | None = None  # time.time() by which the run should end (set by run from budget_s)


@dataclass
class AutotuneResult:
    """What a run produced (the files in ``out`` hold the same)."""

    out: Path
    plan: Plan
    option: str  # the hardware option plan.json was tuned for
    options: list[HardwareOption]
    best: dict[str, dict[str, Any]]  # option -> best trial row
    baseline: dict[str, dict[str, Any]]  # option -> uncompressed DDP row
    profile: Profile
    convergence: Convergence
    calibration: list[dict[str, Any]]
    trials: list[dict[str, Any]]
    step_times: list[dict[str, Any]]
    scaling: list[dict[str, Any]]
    pareto: list[int] = field(default_factory=list)
    groups: dict[str, list[str]] = field(default_factory=dict)
    sharding: Sharding = field(default_factory=Sharding)
    whatif: list[dict[str, Any]] = field(default_factory=list)  # sharded: cluster shapes per option
    target_steps: float = ASSUMED_TARGET_STEPS  # steps of uncompressed training every time and cost is for
    target_steps_source: str = "assumed"  # see TARGET_STEPS_SOURCES
    # Set when the measured link is not a network (every rank on one machine): the report flags it.
    link_warning: str | None = None
    # Local steps: option -> best feasible LocalSGD row (None: none feasible), and the calibration.
    local_best: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    local_calibration: LocalCalibration | None = None
    # How the accuracy limit was decided (fit, band, noise, pairing): costmodel.accuracy_rule
    accuracy_rule: AccuracyRule | None = None
    # Wall seconds per phase (profiling, calibrating, ..., writing the report) and in all
    phase_s: dict[str, float] = field(default_factory=dict)
    # What --budget left out (empty: nothing)
    budget_notes: list[str] = field(default_factory=list)
    # The tuned plan against the obvious uniform alternatives, trained side by side (None: not checked)
    check: dict[str, Any] | None = None

    @property
    def plan_uses_hook(self) -> bool:
        """Whether plan.json asks for FastML (a hook, FSDP registration or LocalSGD); False: plain
        DDP (or FSDP/HSDP's own collectives), no hook."""
        w = self.winner(self.option)
        return bool(w.get("use_hook", True)) or uses_local_steps(w)

    def winner(self, option: str) -> dict[str, Any]:
        """The row the option should use: its local-steps row when that beats per-step compression
        (or plain DDP) on the objective, else ``best[option]``."""
        return _winner(self.best[option], self.local_best.get(option))


def _winner(best: dict[str, Any], local: dict[str, Any] | None) -> dict[str, Any]:
    """The local-steps row when there is one and it beats the per-step row on the objective."""
    return local if local is not None and local["objective"] < best["objective"] else best


def uses_local_steps(row: Mapping[str, Any]) -> bool:
    """Whether a result row is a LocalSGD configuration (H > 1)."""
    return int(row.get("every", 1)) > 1


def _autotune_output(path: Path) -> bool:
    """Whether ``path`` is a file this command wrote (not a user's own file of the same name)."""
    try:
        if path.name == "plan.json":
            return json.loads(path.read_text()).get("meta", {}).get("tuned_by") == "fastml-autotune"
        if path.name in ("report.html", "report.md"):
            return "fastml-autotune report" in path.read_text(errors="replace")[:2000]
    except (OSError, ValueError, AttributeError):
        return False
    return False


def _refuse_finished_out(out: Path) -> None:
    """An earlier run's outputs in ``out`` are replaced only with ``--overwrite``."""
    if not out.is_dir():
        return
    found = [n for n in ("plan.json", "report.html", "report.md") if _autotune_output(out / n)]
    if not found:  # empty, or only autotune.db of a stopped run: resume into it
        return
    import datetime

    when = datetime.datetime.fromtimestamp(max((out / n).stat().st_mtime for n in found))
    shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
    raise ValueError(f"--out {str(out)!r} already holds the outputs of an earlier run ({shown}; written "
                     f"{when:%Y-%m-%d %H:%M}); pass --overwrite to replace them (its autotune.db is "
                     f"reused, so finished steps are not redone), or give another --out")


def _check_storage(url: str) -> Any:
    import optuna

    try:
        return optuna.storages.RDBStorage(url)
    except Exception as e:  # driver missing, host unreachable, bad path: all one message
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"storage URL {url!r} is unreachable ({type(e).__name__}: {msg[:200]}); "
                         f"check the URL, that the database server is up and its driver installed, "
                         f"or leave --storage out for an SQLite file in --out") from None


def prepare(target: str | Workload | Any, *, out: str | os.PathLike = "fastml-autotune-out",
            world_size: int | None = None, link: str | Link | None = None,
            hardware: str | os.PathLike | None = None, trials: int = 200, storage: str | None = None,
            calibration_trials: int = 6, calibration_steps: int = 60, profile_steps: int = 5,
            measure_steps: int = 10, max_accuracy_loss: float = 0.01, target_steps: float | None = None,
            max_groups: int = 24, min_numel: int = DEFAULT_MIN_NUMEL, options: list[str] | None = None,
            verify_rounds: int = 2, seed: int = 0, progress: bool = True, sharding: str = "ddp",
            ranks_per_node: int | None = None, param_dtype: str | None = None,
            reduce_dtype: str | None = None, reshard_after_forward: bool = True,
            intra_node_link: str | Link | None = None,
            max_residual_gb: float | None = None, overwrite: bool = False,
            target_steps_source: str | None = None, local_steps: bool | None = None,
            local_every: Any = None, local_fragments: Any = None, calibration_repeats: int = 2,
            references: int = 2, threads_per_rank: int | None = None,
            budget: float | None = DEFAULT_BUDGET_MIN) -> Settings:
    """Validate every input and open the storage; raise ValueError (one line) on the first problem.
    Writes nothing unless everything else is valid (then: the output folder and the default SQLite).

    ``out`` holding the outputs of an earlier finished run (plan.json, a report) is refused unless
    ``overwrite``: the new run would replace them. Its ``autotune.db`` is reused either way, so a
    rerun (or a run stopped before it wrote anything) resumes instead of starting over.

    ``target_steps``: steps uncompressed training takes to reach the target; every time and cost is
    for that many steps. None: :data:`ASSUMED_TARGET_STEPS`, reported as assumed.
    ``target_steps_source`` says where a given value came from (``"given"``, the default, or
    ``"entered"`` at the command's prompt).

    Sharded training (``sharding="fsdp"`` or ``"hsdp"``): ``ranks_per_node`` (default: torchrun's
    LOCAL_WORLD_SIZE, else 1), ``param_dtype`` / ``reduce_dtype`` (fp32 or bf16, as in FSDP2's
    MixedPrecisionPolicy), ``reshard_after_forward``, ``intra_node_link`` (a RATE like ``--link``) and
    ``max_residual_gb`` (error-feedback memory per rank) describe it; they are errors with DDP.

    Local steps (DDP only; default on): ``local_steps=False`` searches per-step compression alone;
    ``local_every`` (sync periods H >= 2, default :data:`DEFAULT_LOCAL_EVERY`) and
    ``local_fragments`` (F >= 1, default :data:`DEFAULT_LOCAL_FRAGMENTS`) set what is calibrated and
    searched.

    Accuracy rule (:func:`~fastml_strategy.autotune.costmodel.accuracy_rule`): ``references``
    reference runs (seeds ``seed``, ``seed + 1``, ...) measure the noise; ``calibration_repeats``
    plans nearest the limit run again with other seeds.

    ``threads_per_rank``: intra-op threads compute is profiled and timed with (default: the cores
    divided by the world size, one process standing in for every rank; under torchrun, as launched).
    ``budget``: minutes the run may take (default :data:`DEFAULT_BUDGET_MIN`; 0 or None: no cap)."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    out_p = _check_out(out, refuse_finished=rank == 0 and not overwrite)
    # The whole-number options: each is checked under its flag's name and stored under its own.
    counts = {"trials": (trials, 1), "calibration_trials": (calibration_trials, 1),
              "calibration_steps": (calibration_steps, 10), "profile_steps": (profile_steps, 1),
              "measure_steps": (measure_steps, 1), "max_groups": (max_groups, 1), "min_numel": (min_numel, 0),
              "verify_rounds": (verify_rounds, 0), "calibration_repeats": (calibration_repeats, 0),
              "references": (references, 1)}
    for name, (v, lo) in counts.items():
        whole_number("--" + name.replace("_", "-"), v, lo)
    steps_source = _check_accuracy_and_length(max_accuracy_loss, target_steps, target_steps_source)
    sharding_v = _check_sharding(sharding, ranks_per_node, param_dtype, reduce_dtype,
                                 reshard_after_forward, intra_node_link, max_residual_gb)
    local_v, every_v, frags_v = _check_local(local_steps, local_every, local_fragments, sharding_v)
    opts = _check_options(options, sharding_v)
    world_size = _world_size(world_size, distributed)
    threads_v, threads_src = _threads_per_rank(threads_per_rank, world_size, distributed)
    _check_budget(budget)
    link_v = _check_link(link, world_size)
    rpn = _ranks_per_node(sharding_v, ranks_per_node, link_v, world_size, distributed)
    # The catalog before the target: reading a file is cheaper than building a model.
    catalog = load_catalog(hardware)
    wl, tname = _load_workload(target)
    st = _open_storage(out_p, storage) if rank == 0 else _Storage(storage)
    return Settings(workload=wl, target=tname, out=out_p, catalog=catalog,
                    catalog_path=str(hardware) if hardware else "built-in", world_size=world_size,
                    link=link_v, storage_url=st.url or "", max_accuracy_loss=float(max_accuracy_loss),
                    target_steps=float(target_steps) if target_steps is not None else float(ASSUMED_TARGET_STEPS),
                    target_steps_source=steps_source, options=opts, seed=seed, progress=progress,
                    sharding=sharding_v, ranks_per_node=rpn,
                    max_residual_bytes=None if max_residual_gb is None else float(max_residual_gb) * 2 ** 30,
                    local_steps=local_v, local_every=every_v, local_fragments=frags_v,
                    threads_per_rank=threads_v, threads_source=threads_src,
                    budget_s=float(budget) * 60.0 if budget else None,
                    distributed=distributed, rank=rank, storage=st.storage, created_out=st.created,
                    **{k: v for k, (v, _) in counts.items()})


def _check_out(out: str | os.PathLike, refuse_finished: bool) -> Path:
    """The output folder, validated: not a file, and (``refuse_finished``) not holding an earlier
    run's outputs."""
    out_p = Path(out)
    if out_p.exists() and not out_p.is_dir():
        raise ValueError(f"--out {str(out_p)!r} is a file; give a folder for the outputs")
    if refuse_finished:
        _refuse_finished_out(out_p)
    return out_p


def _check_accuracy_and_length(max_accuracy_loss: Any, target_steps: Any, source: str | None) -> str:
    """Validate the accuracy-loss limit and the training length; return where the length came from
    (a key of :data:`TARGET_STEPS_SOURCES`)."""
    if isinstance(max_accuracy_loss, bool) or not isinstance(max_accuracy_loss, (int, float)) \
            or not max_accuracy_loss >= 0:
        raise ValueError(f"--max-accuracy-loss is {max_accuracy_loss!r}; give a number >= 0 "
                         f"(0.01 = one accuracy point, or 1% more final loss without an eval function)")
    if target_steps is not None and (isinstance(target_steps, bool) or not isinstance(target_steps, (int, float))
                                     or not 0 < target_steps < math.inf):
        raise ValueError(f"--target-steps is {target_steps!r}; give the number of steps uncompressed "
                         f"training takes to reach your target (> 0)")
    if target_steps is None:
        return "assumed"
    steps_source = source or "given"
    if steps_source not in TARGET_STEPS_SOURCES:
        raise ValueError(f"target_steps_source is {steps_source!r}; use one of {list(TARGET_STEPS_SOURCES)}")
    return steps_source


def _check_options(options: list[str] | None, sharding: Sharding) -> list[str]:
    """The codec options searched: the given ones, all known, or the sharding's defaults."""
    opts = list(options or default_options(sharding))
    bad = [o for o in opts if o not in CANDIDATES]
    if bad:
        raise ValueError(f"codec option(s) {bad} unknown; choose from {list(CANDIDATES)}")
    return opts


def _world_size(world_size: Any, distributed: bool) -> int:
    """The world size: as launched when distributed (a different ``world_size`` is an error), else
    the given one or 2."""
    if distributed:
        import torch.distributed as dist

        actual = dist.get_world_size()
        if world_size is not None and world_size != actual:
            raise ValueError(f"--world-size {world_size} but this run was launched with {actual} ranks; "
                             f"leave --world-size out when launching distributed")
        world_size = actual
    elif world_size is None:
        world_size = 2
    whole_number("--world-size", world_size, 1)
    return world_size


def _threads_per_rank(threads_per_rank: Any, world_size: int, distributed: bool) -> tuple[int | None, str]:
    """The intra-op threads one rank's compute is timed with (None: as launched), and why."""
    if threads_per_rank is not None:
        whole_number("--threads-per-rank", threads_per_rank, 1)
    if distributed:
        return threads_per_rank, "--threads-per-rank" if threads_per_rank is not None else "as launched"
    if threads_per_rank is not None:
        return threads_per_rank, "--threads-per-rank"
    from fastml_strategy.autotune.profile import available_cores

    return max(1, available_cores() // world_size), f"cores / world size ({available_cores()} / {world_size})"


def _check_budget(budget: Any) -> None:
    """``--budget`` is minutes (> 0), or 0 / None for no cap."""
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not budget >= 0 or math.isinf(budget)):
        raise ValueError(f"--budget is {budget!r}; give the minutes the tuner may take (> 0), or 0 for "
                         f"no limit")


def _check_link(link: str | Link | None, world_size: int) -> Link | None:
    """The link between ranks (``--link``), parsed; it needs two ranks or more."""
    link_v = parse_link(link) if isinstance(link, str) else link
    if link_v is not None and world_size < 2:
        raise ValueError("--link describes the link between ranks, but --world-size is 1; "
                         "give --world-size 2 or more")
    return link_v


def _ranks_per_node(sharding: Sharding, ranks_per_node: Any, link: Link | None, world_size: int,
                    distributed: bool) -> int:
    """Ranks of one node of the user's cluster: 1 for DDP; sharded, the given number, else torchrun's
    LOCAL_WORLD_SIZE, else 1. It must divide the world size."""
    if not sharding.sharded:
        return 1
    rpn = ranks_per_node
    if rpn is None and sharding.kind == "hsdp" and link is not None and not distributed:
        raise ValueError("--sharding hsdp with --link describes your own cluster, whose shard group "
                         "is the ranks of one node: give --ranks-per-node S (--world-size is "
                         "nodes x S), or launch with torchrun, which sets LOCAL_WORLD_SIZE")
    if rpn is None:
        rpn = env_whole_number("LOCAL_WORLD_SIZE", None, 1, minimum=1) if distributed else 1
    if world_size % rpn:
        raise ValueError(f"--ranks-per-node {rpn} does not divide the world size {world_size}; the "
                         f"world is nodes x ranks per node: give a divisor of {world_size}")
    return rpn


def _load_workload(target: str | Workload | Any) -> tuple[Workload, str]:
    """The workload and the name the report gives it: a ``file.py:function`` / module target is
    loaded, anything else converted and validated."""
    if isinstance(target, str):
        return load_target(target), target
    wl = as_workload(target)
    wl.validate()
    return wl, wl.name


@dataclass(frozen=True)
class _Storage:
    """The Optuna storage as opened on rank 0 (the other ranks keep only the URL they were given)."""

    url: str | None
    storage: Any = None
    created: bool = False  # whether the output folder was created for the default SQLite file


def _open_storage(out: Path, url: str | None) -> _Storage:
    """Open the storage at ``url`` (default: an SQLite file in ``out``, created if need be); a
    folder created here is removed again when the storage cannot be opened."""
    created = False
    if url is None:
        created = not out.exists()
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--out {str(out)!r} cannot be created ({e.strerror}); "
                             f"give a writable folder") from None
        url = f"sqlite:///{(out / 'autotune.db').resolve()}"
    try:
        return _Storage(url, _check_storage(url), created)
    except ValueError:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _int_list(name: str, v: Any, minimum: int, words: str) -> tuple[int, ...]:
    """``10,50`` or a sequence of whole numbers -> a sorted tuple without repeats."""
    items = [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else list(v)
    try:
        out = [int(x) if isinstance(x, str) else x for x in items]
    except ValueError:
        out = []
    if not out or any(isinstance(x, bool) or not isinstance(x, int) or x < minimum for x in out):
        raise ValueError(f"{name} is {v!r}; give whole numbers >= {minimum} separated by commas, "
                         f"e.g. {words}")
    return tuple(sorted(set(out)))


def _check_local(local_steps: Any, every: Any, fragments: Any,
                 sharding: Sharding) -> tuple[bool, tuple[int, ...], tuple[int, ...]]:
    """The local-steps options, validated: on by default for DDP; LocalSGD does not shard."""
    if local_steps is not None and not isinstance(local_steps, bool):
        raise ValueError(f"local_steps is {local_steps!r}; give True, False or None (on for DDP)")
    if sharding.sharded:
        if local_steps or every is not None or fragments is not None:
            raise ValueError(f"--local-steps / --local-every / --local-fragments describe LocalSGD, which "
                             f"replicates the model, but --sharding is {sharding.kind}; drop them or use "
                             f"--sharding ddp")
        return False, DEFAULT_LOCAL_EVERY, DEFAULT_LOCAL_FRAGMENTS
    on = True if local_steps is None else local_steps
    every_v = DEFAULT_LOCAL_EVERY if every is None else _int_list(
        "--local-every", every, 2, "10,50 (H = 1, per-step compression, is always searched)")
    frags_v = DEFAULT_LOCAL_FRAGMENTS if fragments is None else _int_list(
        "--local-fragments", fragments, 1, "1,2,4,8")
    if not on and (every is not None or fragments is not None):
        raise ValueError("--local-every / --local-fragments choose what local steps search, but "
                         "--no-local-steps turns them off; drop one or the other")
    return on, every_v, frags_v


def _check_sharding(sharding: Any, ranks_per_node: Any, param_dtype: Any, reduce_dtype: Any,
                    reshard_after_forward: Any, intra_node_link: Any, max_residual_gb: Any) -> Sharding:
    """The sharding options, validated (ValueError naming the option and the fix)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"--sharding {sharding!r} is not a sharding; use ddp (replicated, the default), "
                         f"fsdp or hsdp")
    if sharding == "ddp":
        given = [name for name, v in (("--ranks-per-node", ranks_per_node), ("--param-dtype", param_dtype),
                                      ("--reduce-dtype", reduce_dtype),
                                      ("--intra-node-link", intra_node_link),
                                      ("--max-residual-gb", max_residual_gb))
                 if v is not None] + ([] if reshard_after_forward else ["--no-reshard-after-forward"])
        if given:
            raise ValueError(f"{given[0]} describes sharded training, but --sharding is ddp; add "
                             f"--sharding fsdp or --sharding hsdp, or drop {given[0]}")
        return Sharding()
    if ranks_per_node is not None:
        whole_number("--ranks-per-node", ranks_per_node, 1)
    if max_residual_gb is not None and (isinstance(max_residual_gb, bool)
                                        or not isinstance(max_residual_gb, (int, float))
                                        or not max_residual_gb > 0 or math.isinf(max_residual_gb)):
        raise ValueError(f"--max-residual-gb is {max_residual_gb!r}; give the error-feedback memory "
                         f"allowed per rank in GiB (> 0), or leave it out for no limit")
    intra = None
    if isinstance(intra_node_link, Link):
        intra = intra_node_link
    elif intra_node_link is not None:
        try:
            intra = parse_link(str(intra_node_link))
        except ValueError:
            raise ValueError(f"--intra-node-link {intra_node_link!r} is not a link rate; write e.g. "
                             f"200gbit, 2400gbit,2us (NVLink) or 100gbit,5us") from None
    kw: dict[str, Any] = {"kind": sharding, "param_dtype": param_dtype or "fp32",
                          "reduce_dtype": reduce_dtype,
                          "reshard_after_forward": bool(reshard_after_forward)}
    if intra is not None:
        kw["intra_link"] = intra
    return Sharding(**kw)


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
                      local_steps: LocalSteps | None = None) -> tuple[Plan, dict[str, Any]]:
    layers = {lp.name: CANDIDATES[choice.get(lp.name, "none") if lp.tunable else "none"]
              for lp in profile.layers}
    plan = Plan(default=CANDIDATES["none"], layers=layers, min_numel=profile.min_numel, name=name,
                local_steps=local_steps)
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
    meta["hook"] = bool(w.get("use_hook", True)) or uses_local_steps(w)
    if not s.sharding.sharded and not uses_local_steps(w):
        mb = w.get("bucket_mb")
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
                           for e in chk.get("alternatives", [])}}
    rule = result.accuracy_rule
    if rule is not None:
        f = (lambda v: None if isinstance(v, float) and not math.isfinite(v) else v)
        meta["accuracy_rule"] = {"e_max": rule.e_max, "e_sure": rule.e_sure,
                                 "confidence": f(rule.confidence), "sigma": f(rule.sigma),
                                 "runs": rule.trials, "repeats": rule.repeats, "paired": rule.paired}
    return _plan_from_choice(
        profile, search.expand(groups, w["choice"]), f"autotuned-{option}", meta=meta,
        local_steps=_local_steps_of(w, result.local_calibration))


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
        recipe_choices = {r: {n: r for n in tunable} for r in UNIFORM_RECIPES}
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
            profile, options[0], {r: measured[r] for r in UNIFORM_RECIPES}, sharding=sh)
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
        f"tuned ({found.chosen})": search.expand(groups, tuned["choice"]) if tuned["use_hook"] else None}
    # Distributed, the recipes were timed before the search (step 1b): only these two plans are left.
    total = len(choices) if s.distributed else len(choices) + len(recipe_choices)
    bar.phase("timing the tuned plan" if s.distributed else "timing plans (compute + codecs)", total, "plan")
    rows: list[dict[str, Any]] = []
    if s.distributed:
        profile = _broadcast(profile if s.rank == 0 else None, True)  # with rank 0's codec scales
        local = {o.name: o for o in options}[LOCAL]
        # the tuned plan runs with the bucket size chosen for it (plan.json meta.ddp), as users will
        buckets = {f"tuned ({found.chosen})": tuned.get("bucket_mb")}
        rows = _time_distributed(s, profile, local, choices, recipe_choices, measured_pre, buckets)
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
                      bucket_mb: Mapping[str, float | None] | None = None) -> list[dict[str, Any]]:
    """Time ``choices`` across the ranks (``bucket_mb``: DDP's bucket cap by label; default buckets
    otherwise); rows for them and for the recipes timed before, each with the step time the cost
    model predicts on the measured link for the same buckets."""
    from fastml_strategy.autotune.measure import measure_distributed

    sh = s.sharding
    base_label = baseline_label(sh)
    plans = {k: (None if c is None else _plan_from_choice(profile, c, k)[0]) for k, c in choices.items()}
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
    return rows


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
        c = search.expand(groups, best[opt.name]["choice"]) if best[opt.name]["use_hook"] else None
        for n in SCALING_NODES:
            for label, ch in (("tuned", c), (base_label, None)):
                br = step_time(profile, ch or {}, opt, nodes=n, hook=ch is not None, sharding=sh)
                rows.append({"option": opt.name, "nodes": n, "plan": label, "step_s": br.step_s,
                             "compute_s": br.compute_s, "codec_s": br.codec_s,
                             "exposed_comm_s": br.exposed_s, "bytes_per_rank": br.bytes_per_rank,
                             "node_net_bytes": br.node_net_bytes, "ddp_schedule": br.topology})
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
                          accuracy_rule=found.rule, budget_notes=found.notes, check=found.check)


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
    local_cal = _calibrate_local_steps(s, profile, cal_name, cal.run_s, deadline, bar, notes) \
        if s.local_steps else None
    rnd = 0
    while True:
        conv = fit_convergence(cal.points, s.max_accuracy_loss, rule=cal.rule)
        found = _search_options(s, profile, groups, options, conv, local_cal, fp, bar)
        new = _untried_plans(found.best, cal.points)
        if not new or rnd >= s.verify_rounds:
            break
        if not _fits(deadline, cal.run_s * len(new)):
            notes.append(f"--budget: verification round {rnd + 1} ({len(new)} chosen plans) not run")
            break
        rnd += 1
        bar.phase(f"verifying the chosen plans (round {rnd} of up to {s.verify_rounds})",
                  1 + len(cal.plans) + len(new), "run")
        cal = _calibrate_again(s, profile, groups, cal, cal.plans + new, cal_name, bar, deadline)
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
    best: tuple[float, dict[str, Any]] | None = None
    for e in c["alternatives"]:
        codec = e["plan"].split()[-1]
        m = measured_pre.get(codec)
        if not m or not math.isfinite(m):
            e["measured_words"] = f"{codec} was not timed (only the uniform recipes {', '.join(UNIFORM_RECIPES)} are)"
            continue
        e["measured_step_s"] = m
        e["measured_time_ratio"] = e["ratio"] * m / tuned_m
        e["measured_sooner"] = bool(not e["censored"] and e["levels"] > 0 and e["measured_time_ratio"] < 1.0)
        e["measured_words"] = (f"with measured step times ({_ms_text(m)} against the tuned plan's "
                               f"{_ms_text(tuned_m)}): {e['measured_time_ratio']:.3g}x the time")
        if e["measured_sooner"] and e["within_limit"] and (best is None or e["measured_time_ratio"] < best[0]):
            best = (e["measured_time_ratio"], e)
    if best is None:
        if any("measured_time_ratio" in e for e in c["alternatives"]):
            c["verdict"] += "; with measured step times too"
        return
    e = best[1]
    chosen = c["option"]
    row = next(r for r in found.rows if r["option"] == chosen and r.get("kind") == "fastml"
               and int(r.get("every", 1)) == 1 and r["choice"] == e["choice"])
    new = dict(row, use_hook=True, checked_over=dict(c["tuned"]))
    opt = next(o for o in options if o.name == chosen)
    if not s.sharding.sharded:
        new = _best_bucket(profile, groups, opt, found.conv, float(s.target_steps), new, search)
    found.best[chosen] = new
    c["replaced"] = e["plan"]
    c["verdict"] = (f"{e['plan']} reached the tuned plan's losses in {best[0]:.3g}x its time with measured "
                    f"step times (the cost model had said {e['time_ratio']:.3g}x), within the accuracy "
                    f"limit: plan.json holds {e['plan']} instead")


def _ms_text(seconds: float) -> str:
    return f"{1e3 * seconds:.4g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _uniform_alternatives(rows: list[dict[str, Any]], option: str, tuned: Mapping[str, Any],
                          groups: Mapping[str, list[str]]) -> list[tuple[dict[str, Any], str]]:
    """The obvious alternatives to the tuned plan on ``option``: the feasible uniform per-step plan
    (every group on one codec) of the lowest predicted step time and the one of the lowest predicted
    objective, each with why it was picked; the tuned plan itself is not its own alternative."""
    uni: dict[str, dict[str, Any]] = {}
    for r in rows:
        vals = set(r["choice"].values())
        if (r["option"] != option or r.get("kind") != "fastml" or int(r.get("every", 1)) != 1
                or len(vals) != 1 or len(r["choice"]) != len(groups) or not r["feasible"]
                or vals == {"none"} or not math.isfinite(r["objective"])):
            continue
        o = next(iter(vals))
        if o not in uni or r["objective"] < uni[o]["objective"]:
            uni[o] = r
    out: list[tuple[dict[str, Any], str]] = []
    if not uni:
        return out
    fast = min(uni.values(), key=lambda r: (r["step_s"], r["objective"]))
    best = min(uni.values(), key=lambda r: (r["objective"], r["step_s"]))
    for r, why in ((fast, "the fastest uniform plan within the accuracy limit by predicted step time"),
                   (best, "the best uniform plan by the cost model")):
        if r["choice"] != tuned["choice"] and all(r["choice"] != q["choice"] for q, _ in out):
            out.append((r, why))
        elif r["choice"] != tuned["choice"]:  # the same plan for both reasons
            out = [(q, w if q["choice"] != r["choice"] else f"{w}, and {why}") for q, w in out]
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
    why the choice stands (None: nothing to check, e.g. plain DDP or local steps won)."""
    from fastml_strategy.autotune import calibrate, search

    tuned = found.best[chosen]
    if not tuned.get("use_hook", True) or uses_local_steps(_winner(tuned, found.local_best.get(chosen))):
        return None
    alts = _uniform_alternatives(found.rows, chosen, tuned, groups)
    record: dict[str, Any] = {"option": chosen, "steps": s.calibration_steps, "seed": s.seed,
                              "paired": cal.ref.get("paired"), "tuned": dict(tuned["choice"]),
                              "tuned_step_s": tuned["step_s"], "alternatives": [], "replaced": None}
    if not alts:
        record["verdict"] = ("nothing to compare: the tuned plan is itself the fastest and the best "
                             "uniform plan within the accuracy limit, or no other uniform plan is within it")
        return record
    todo = [a for a in [tuned] + [r for r, _ in alts]
            if not any(p["choice"] == a["choice"] and int(p.get("seed", s.seed)) == s.seed and p.get("losses")
                       for p in cal.points)]
    if not _fits(deadline, cal.run_s * len(todo)):
        notes.append(f"--budget: the check against uniform plans ({len(todo)} runs) was not run")
        record["verdict"] = "not run (--budget)"
        return record
    bar.phase("checking the tuned plan against uniform plans", max(1, len(todo)), "run")
    t_losses, _ = _check_curve(s, profile, groups, tuned["choice"], cal, cal_name)
    bar.update(1)
    ref = cal.ref.get("references", {}).get(s.seed) or cal.ref
    best_alt: tuple[float, dict[str, Any]] | None = None
    for row, why in alts:
        losses, metric = _check_curve(s, profile, groups, row["choice"], cal, cal_name)
        bar.update(1)
        cmp = calibrate.time_to_same_loss(t_losses, losses, cal.ref.get("noise"), tuned["step_s"], row["step_s"])
        acc = calibrate._accuracy_loss(ref, losses, metric)
        within = bool(acc <= s.max_accuracy_loss + 1e-12)
        entry = {"plan": f"uniform {next(iter(row['choice'].values()))}", "why": why,
                 "choice": dict(row["choice"]), "step_s": row["step_s"], "accuracy_loss": acc,
                 "within_limit": within, **{k: v for k, v in cmp.items()}}
        record["alternatives"].append(entry)
        if cmp["sooner"] and within and (best_alt is None or cmp["time_ratio"] < best_alt[0]):
            best_alt = (cmp["time_ratio"], row)
    if best_alt is None:
        why_not = [f"{e['plan']}: " + ("over the accuracy limit in its run" if e["sooner"] and not e["within_limit"]
                                       else "not sooner") for e in record["alternatives"]]
        record["verdict"] = "the tuned plan stands (" + "; ".join(why_not) + ")"
        return record
    row = best_alt[1]
    new = dict(row, use_hook=True, checked_over=dict(tuned["choice"]))
    if not s.sharding.sharded:
        new = _best_bucket(profile, groups, options[[o.name for o in options].index(chosen)], conv,
                           float(s.target_steps), new, search)
    found.best[chosen] = new
    record["replaced"] = f"uniform {next(iter(row['choice'].values()))}"
    record["verdict"] = (f"{record['replaced']} reached the tuned plan's losses in {best_alt[0]:.3g}x its "
                         f"time, within the accuracy limit: plan.json holds {record['replaced']} instead")
    return record


def _calibration_deadline(s: Settings, profile: Profile) -> float | None:
    """When calibration runs must end (None: no --budget): the run's deadline less the time kept for
    timing the plans and writing the report, (plans x steps) of compute and a margin."""
    if s.deadline is None:
        return None
    return s.deadline - ((len(UNIFORM_RECIPES) + 2) * (s.measure_steps + 2) * max(profile.compute_s, 1e-3)
                         + 10.0)


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
    ref, points = _calibration_runs(s, profile, groups, plans, cal_name, bar, deadline)
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
    if not _fits(deadline, run_s * (len(reps) + 1)):
        notes.append(f"--budget: the {len(reps)} repeats nearest the limit were not run")
        return cal
    # the plans nearest the limit, again with other seeds
    bar.phase("repeating the runs nearest the limit", 1 + len(reps), "run")
    return _calibrate_again(s, profile, groups, cal, plans + list(reps), cal_name, bar, deadline)


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
        found.rows.extend(dict(x, kind="local-steps" if x["every"] > 1 else "fastml") for x in r)
        base = _baseline_row(profile, groups, opt, conv, target_steps, sh)
        found.baseline[opt.name] = base
        found.rows.append(dict(base, trial=-1, kind="plain-ddp" if not sh.sharded else f"{sh.kind}-own"))
        # Plain DDP is a candidate too: where no compression pays (a fast link), say so.
        b = search.best_row(r)
        best = dict(b, use_hook=True) if b["objective"] < base["objective"] else dict(base)
        if not sh.sharded:  # DDP's bucket size for the chosen plan (plain DDP's too)
            best = _best_bucket(profile, groups, opt, conv, target_steps, best, search)
        found.best[opt.name] = best
        try:
            found.local_best[opt.name] = dict(search.best_row(r, local=True), use_hook=False)
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
    return _hash(what)


def _baseline_row(profile: Profile, groups: Mapping[str, list[str]], opt: HardwareOption, conv: Convergence,
                  target_steps: float, sh: Sharding) -> dict[str, Any]:
    """The option's uncompressed row: plain DDP (or FSDP/HSDP's own collectives), no hook."""
    none_choice = {n: "none" for names in groups.values() for n in names}
    base = evaluate(profile, none_choice, opt, conv, target_steps, hook=False, sharding=sh)
    base.update(option=opt.name, choice={g: "none" for g in groups}, use_hook=False,
                objective=objective(base, opt), every=1, fragments=1, delay=0)
    return base


def _untried_plans(best: Mapping[str, Mapping[str, Any]], points: list[dict[str, Any]]) -> list[Any]:
    """The compressed per-step plans the search chose that no calibration run has trained yet (local
    steps' codecs compress pseudo-gradients, so their rows are not among them)."""
    tried = [p["choice"] for p in points]
    new: list[Any] = []
    for b in best.values():
        c = b["choice"]
        if c not in tried and c not in new and any(o != "none" for o in c.values()):
            new.append(c)
    return new


def _pareto(rows: list[dict[str, Any]], options: list[HardwareOption]) -> list[int]:
    """Mark each row's ``pareto`` and return the front's indices: time against cost over the feasible
    rows of priced options (a cluster you already have costs nothing here)."""
    priced = {o.name for o in options if o.price_per_hour > 0}
    feas = [i for i, r in enumerate(rows) if r["feasible"] and r["option"] in priced]
    front = [feas[i] for i in pareto_front([(rows[i]["tta_s"], rows[i]["cost_usd"]) for i in feas])]
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
        return w["cost_usd"], w["tta_s"]

    return min((o.name for o in options), key=cost_then_time)


def _best_bucket(profile: Profile, groups: Mapping[str, list[str]], opt: HardwareOption, conv: Convergence,
                 target_steps: float, row: Mapping[str, Any], search: Any) -> dict[str, Any]:
    """The row with the bucket cap (``bucket_mb``: DDP's ``bucket_cap_mb``; None: DDP's default) of
    :data:`BUCKET_MB_CHOICES` that minimises the option's objective for the row's plan."""
    choice = search.expand(groups, row["choice"])
    hook = bool(row.get("use_hook", True))
    out = dict(row, bucket_mb=None)
    for mb in BUCKET_MB_CHOICES[1:]:
        r = evaluate(profile, choice, opt, conv, target_steps, hook=hook, bucket_mb=mb)
        obj = objective(r, opt)
        if obj < out["objective"] * (1 - 1e-9):
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
        c = search.expand(groups, best[opt.name]["choice"])
        hook = bool(best[opt.name]["use_hook"])
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
        advice = ("register the hook with this plan" if best.get("use_hook", True) else
                  "plain DDP: no compression pays on this option (this plan is fp32 throughout)")
    else:
        advice = (f"fastml_strategy.fsdp.register(model, plan=this file) after fully_shard ({sh.kind})"
                  if best.get("use_hook", True) else
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
