"""The autotuner's driver: validate, profile, calibrate, search, measure, report.

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

    @property
    def plan_uses_hook(self) -> bool:
        """Whether plan.json asks for FastML (a hook, FSDP registration or LocalSGD); False: plain
        DDP (or FSDP/HSDP's own collectives), no hook."""
        w = self.winner(self.option)
        return bool(w.get("use_hook", True)) or uses_local_steps(w)

    def winner(self, option: str) -> dict[str, Any]:
        """The row the option should use: its local-steps row when that beats per-step compression
        (or plain DDP) on the objective, else ``best[option]``."""
        b, lb = self.best[option], self.local_best.get(option)
        return lb if lb is not None and lb["objective"] < b["objective"] else b


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
    out_p = Path(out)
    if out_p.exists() and not out_p.is_dir():
        raise ValueError(f"--out {str(out_p)!r} is a file; give a folder for the outputs")
    if rank == 0 and not overwrite:
        _refuse_finished_out(out_p)
    for name, v, lo in (("--trials", trials, 1), ("--calibration-trials", calibration_trials, 1),
                        ("--calibration-steps", calibration_steps, 10), ("--profile-steps", profile_steps, 1),
                        ("--measure-steps", measure_steps, 1), ("--max-groups", max_groups, 1),
                        ("--min-numel", min_numel, 0), ("--verify-rounds", verify_rounds, 0),
                        ("--calibration-repeats", calibration_repeats, 0), ("--references", references, 1)):
        whole_number(name, v, lo)
    if isinstance(max_accuracy_loss, bool) or not isinstance(max_accuracy_loss, (int, float)) \
            or not max_accuracy_loss >= 0:
        raise ValueError(f"--max-accuracy-loss is {max_accuracy_loss!r}; give a number >= 0 "
                         f"(0.01 = one accuracy point, or 1% more final loss without an eval function)")
    if target_steps is not None and (isinstance(target_steps, bool) or not isinstance(target_steps, (int, float))
                                     or not 0 < target_steps < math.inf):
        raise ValueError(f"--target-steps is {target_steps!r}; give the number of steps uncompressed "
                         f"training takes to reach your target (> 0)")
    if target_steps is None:
        steps_source = "assumed"
    else:
        steps_source = target_steps_source or "given"
        if steps_source not in TARGET_STEPS_SOURCES:
            raise ValueError(f"target_steps_source is {steps_source!r}; use one of {list(TARGET_STEPS_SOURCES)}")
    sharding_v = _check_sharding(sharding, ranks_per_node, param_dtype, reduce_dtype,
                                 reshard_after_forward, intra_node_link, max_residual_gb)
    local_v, every_v, frags_v = _check_local(local_steps, local_every, local_fragments, sharding_v)
    opts = list(options or default_options(sharding_v))
    bad = [o for o in opts if o not in CANDIDATES]
    if bad:
        raise ValueError(f"codec option(s) {bad} unknown; choose from {list(CANDIDATES)}")
    if distributed:
        actual = dist.get_world_size()
        if world_size is not None and world_size != actual:
            raise ValueError(f"--world-size {world_size} but this run was launched with {actual} ranks; "
                             f"leave --world-size out when launching distributed")
        world_size = actual
    elif world_size is None:
        world_size = 2
    whole_number("--world-size", world_size, 1)
    if threads_per_rank is not None:
        whole_number("--threads-per-rank", threads_per_rank, 1)
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not budget >= 0 or math.isinf(budget)):
        raise ValueError(f"--budget is {budget!r}; give the minutes the tuner may take (> 0), or 0 for "
                         f"no limit")
    if distributed:
        threads_v, threads_src = threads_per_rank, (
            "--threads-per-rank" if threads_per_rank is not None else "as launched")
    elif threads_per_rank is not None:
        threads_v, threads_src = threads_per_rank, "--threads-per-rank"
    else:
        from fastml_strategy.autotune.profile import available_cores

        threads_v = max(1, available_cores() // world_size)
        threads_src = f"cores / world size ({available_cores()} / {world_size})"
    link_v = parse_link(link) if isinstance(link, str) else link
    if link_v is not None and world_size < 2:
        raise ValueError("--link describes the link between ranks, but --world-size is 1; "
                         "give --world-size 2 or more")
    rpn = 1
    if sharding_v.sharded:
        rpn = ranks_per_node
        if rpn is None and sharding_v.kind == "hsdp" and link_v is not None and not distributed:
            raise ValueError("--sharding hsdp with --link describes your own cluster, whose shard group "
                             "is the ranks of one node: give --ranks-per-node S (--world-size is "
                             "nodes x S), or launch with torchrun, which sets LOCAL_WORLD_SIZE")
        if rpn is None:
            rpn = env_whole_number("LOCAL_WORLD_SIZE", None, 1, minimum=1) if distributed else 1
        if world_size % rpn:
            raise ValueError(f"--ranks-per-node {rpn} does not divide the world size {world_size}; the "
                             f"world is nodes x ranks per node: give a divisor of {world_size}")
    # The catalog before the target: reading a file is cheaper than building a model.
    catalog = load_catalog(hardware)
    if isinstance(target, str):
        wl = load_target(target)
        tname = target
    else:
        wl = as_workload(target)
        wl.validate()
        tname = wl.name
    created = False
    st = None
    url = storage
    if rank == 0:
        if storage is None:
            created = not out_p.exists()
            try:
                out_p.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(f"--out {str(out_p)!r} cannot be created ({e.strerror}); "
                                 f"give a writable folder") from None
            url = f"sqlite:///{(out_p / 'autotune.db').resolve()}"
        try:
            st = _check_storage(url)
        except ValueError:
            if created:
                shutil.rmtree(out_p, ignore_errors=True)
            raise
    return Settings(workload=wl, target=tname, out=out_p, catalog=catalog,
                    catalog_path=str(hardware) if hardware else "built-in", world_size=world_size,
                    link=link_v, storage_url=url or "", trials=trials,
                    calibration_trials=calibration_trials, calibration_steps=calibration_steps,
                    profile_steps=profile_steps, measure_steps=measure_steps,
                    max_accuracy_loss=float(max_accuracy_loss),
                    target_steps=float(target_steps) if target_steps is not None else float(ASSUMED_TARGET_STEPS),
                    target_steps_source=steps_source,
                    max_groups=max_groups, min_numel=min_numel, options=opts,
                    verify_rounds=verify_rounds, seed=seed,
                    progress=progress, sharding=sharding_v, ranks_per_node=rpn,
                    max_residual_bytes=None if max_residual_gb is None else float(max_residual_gb) * 2 ** 30,
                    local_steps=local_v, local_every=every_v, local_fragments=frags_v,
                    calibration_repeats=calibration_repeats, references=references,
                    threads_per_rank=threads_v, threads_source=threads_src,
                    budget_s=float(budget) * 60.0 if budget else None,
                    distributed=distributed, rank=rank, storage=st, created_out=created)


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
            f"Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb={mb})])")}
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
    from fastml_strategy.autotune import calibrate, profile as prof, report, search
    from fastml_strategy.autotune.measure import (measure_distributed, measure_local,
                                                  predict_local)

    lead = s.rank == 0
    fp = _fingerprint(s)
    bar = _Progress(s.progress and lead)
    started = time.time()
    s.deadline = None if not s.budget_s else started + s.budget_s
    try:
        # -- 1. profile (cached in the storage, so a resumed run skips it) -----------------------------
        bar.phase("profiling", s.profile_steps, "step")
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        cal_name = f"fastml-{fp}-calibration"
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
        link_warning = None
        if s.distributed:
            samples = prof.measure_link()
            if lead:
                profile.link = fit_alpha_beta(samples, "measured")
                profile.link_samples = samples
        elif s.link is not None and lead:
            profile.link = s.link
        profile = _broadcast(profile, s.distributed)
        if s.distributed:
            link_warning = _one_machine_warning(s, profile.link)
        options = list(s.catalog)
        sh = s.sharding
        base_label = baseline_label(sh)
        if profile.link is not None:
            # Sharded: the user's cluster is nodes x ranks per node, and the link is the node's (its
            # ranks share it). All on one node, a measured link is the link between its ranks.
            per_node = s.ranks_per_node if sh.sharded else 1
            nodes = s.world_size // per_node
            intra = profile.link if (sh.sharded and nodes == 1 and s.distributed) else None
            options.insert(0, HardwareOption(name=LOCAL, nodes=nodes, accelerators_per_node=per_node,
                                             price_per_hour=0.0,
                                             bandwidth_gbps=profile.link.bandwidth_Bps * 8 / 1e9,
                                             latency_us=profile.link.latency_s * 1e6,
                                             compute_speed=1.0, measured_link=profile.link,
                                             intra_link=intra))
        groups = search.group_layers(profile, s.max_groups)
        tunable = [n for names in groups.values() for n in names]
        recipe_choices = {r: {n: r for n in tunable} for r in UNIFORM_RECIPES}

        # -- 1b. distributed: time the uniform recipes for real and fit the codec-time scales -------
        measured_pre: dict[str, float] = {}
        if s.distributed:
            plans = {base_label: None}
            plans.update({r: _plan_from_choice(profile, c, r)[0] for r, c in recipe_choices.items()})
            bar.phase("timing the recipes", len(plans), "plan")
            measured_pre = measure_distributed(s.workload, plans, steps=s.measure_steps,
                                               sharding=sh, ranks_per_node=s.ranks_per_node)
            bar.update(len(plans))
            if lead:
                if sh.sharded:  # FSDP2's own cost per collective first, then the codecs'
                    profile.collective_overhead_s = fit_collective_overhead(
                        profile, options[0], measured_pre[base_label], sh)
                profile.codec_scale = fit_codec_scale(
                    profile, options[0], {r: measured_pre[r] for r in UNIFORM_RECIPES}, sharding=sh)

        # -- 2. calibrate, 3. search (rank 0; the others wait in the broadcast below) -----------------
        result_core: Any = None
        if lead:
            try:
                result_core = _calibrate_and_search(s, profile, groups, options, cal_name, fp, bar,
                                                    calibrate, search)
            except Exception as e:  # tell the waiting ranks, or they would wait for the timeout
                if s.distributed:
                    _broadcast(_Failed(f"{type(e).__name__}: {e}"), True)
                raise
        result_core = _broadcast(result_core, s.distributed)
        if isinstance(result_core, _Failed):
            raise RuntimeError(f"rank 0 failed: {result_core.message}")
        (ref, points, conv, target_steps, rows, best, baseline, front, chosen, local_best,
         local_cal, rule, notes) = result_core

        # -- 4. measure step times: the tuned plan (never used in a fit) and the recipes -----------
        opt_by_name = {o.name: o for o in options}
        tuned_choice = search.expand(groups, best[chosen]["choice"])
        tuned_label = f"tuned ({chosen})"
        choices: dict[str, dict[str, str] | None] = {
            base_label: None, tuned_label: tuned_choice if best[chosen]["use_hook"] else None}
        bar.phase("timing the tuned plan" if s.distributed else "timing plans (compute + codecs)",
                  len(choices) if s.distributed else len(choices) + len(recipe_choices), "plan")
        step_rows = []
        if s.distributed:
            profile = _broadcast(profile if lead else None, True)  # with rank 0's codec scales
            plans = {k: (None if c is None else _plan_from_choice(profile, c, k)[0])
                     for k, c in choices.items()}
            measured = measure_distributed(s.workload, plans, steps=s.measure_steps, sharding=sh,
                                           ranks_per_node=s.ranks_per_node)
            local = opt_by_name[LOCAL]
            where = f"{s.world_size} ranks, measured link" + (f", {sh.kind}" if sh.sharded else "")
            for k, c in {**choices, **recipe_choices}.items():
                pred = step_time(profile, c or {}, local, hook=c is not None, sharding=sh).step_s
                fitted = (k in recipe_choices and family(CANDIDATES[k]) in profile.codec_scale) or (
                    sh.sharded and k == base_label and profile.collective_overhead_s > 0)
                step_rows.append({"plan": k, "where": where, "predicted_s": pred,
                                  "measured_s": measured[k] if k in measured else measured_pre[k],
                                  "used_in_fit": fitted})
        elif lead:
            choices.update(recipe_choices)
            with prof.rank_threads(s.threads_per_rank):
                measured = measure_local(s.workload, choices, steps=s.measure_steps)
            for k, c in choices.items():
                step_rows.append({"plan": k, "where": f"1 process, {profile.threads} thread(s): compute + "
                                                       f"codecs (no link)",
                                  "predicted_s": predict_local(profile, c), "measured_s": measured[k],
                                  "used_in_fit": False})
        bar.update(len(choices))
        bar.close()
        for r in step_rows:
            r["error_pct"] = 100.0 * (r["predicted_s"] - r["measured_s"]) / r["measured_s"]

        # -- 5. scaling predictions and the report (rank 0) ----------------------------------------
        scaling = []
        for opt in options:
            c = search.expand(groups, best[opt.name]["choice"]) if best[opt.name]["use_hook"] else None
            for n in SCALING_NODES:
                for label, ch in (("tuned", c), (base_label, None)):
                    br = step_time(profile, ch or {}, opt, nodes=n, hook=ch is not None, sharding=sh)
                    scaling.append({"option": opt.name, "nodes": n, "plan": label,
                                    "step_s": br.step_s, "compute_s": br.compute_s,
                                    "codec_s": br.codec_s, "exposed_comm_s": br.exposed_s,
                                    "bytes_per_rank": br.bytes_per_rank})
        whatif = _whatif(profile, options, groups, best, sh, search) if sh.sharded else []
        result = AutotuneResult(out=s.out, plan=Plan(), option=chosen, options=options, best=best,
                                baseline=baseline, profile=profile, convergence=conv,
                                calibration=points, trials=rows, step_times=step_rows,
                                scaling=scaling, pareto=front, groups=dict(groups), sharding=sh,
                                whatif=whatif, target_steps=target_steps,
                                target_steps_source=s.target_steps_source, link_warning=link_warning,
                                local_best=local_best, local_calibration=local_cal,
                                accuracy_rule=rule, budget_notes=notes)
        bar.close()
        result.phase_s = dict(bar.times)
        result.plan, main_dict = _option_plan(profile, groups, result, s, chosen)
        if lead:
            bar.phase("writing the report", 1, "file set")
            per_option_plans = {o.name: _option_plan(profile, groups, result, s, o.name)[1]
                                for o in options}
            report.write_outputs(result, s, main_dict, per_option_plans)
            bar.update(1)
        bar.close()
        result.phase_s = dict(bar.times)
        result.phase_s["total"] = time.time() - started
        return result
    finally:
        bar.close()


def _calibrate_and_search(s: Settings, profile: Profile, groups: Mapping[str, list[str]],
                          options: list[HardwareOption], cal_name: str, fp: str, bar: Any,
                          calibrate: Any, search: Any) -> tuple:
    """Calibrate (reference runs, the candidate plans, then repeats of the runs nearest the limit),
    calibrate local steps, search every option, then verify: train the plans the search chose, refit,
    and search again, until every chosen plan has been trained or ``verify_rounds`` rounds are done.

    Every study lives in the storage (search studies are named by the fit they used), so a resumed
    run replays finished rounds from the database instead of recomputing them. With a deadline
    (``--budget``), runs that would end past it are not started (the reason is in the notes returned).
    """
    target_steps = float(s.target_steps)
    local_cal: LocalCalibration | None = None
    notes: list[str] = []
    # time kept for timing the plans and writing the report: (plans x steps) of compute and a margin
    reserve = (len(UNIFORM_RECIPES) + 2) * (s.measure_steps + 2) * max(profile.compute_s, 1e-3) + 10.0
    cal_deadline = None if s.deadline is None else s.deadline - reserve

    def fits(seconds: float) -> bool:
        return cal_deadline is None or time.time() + seconds <= cal_deadline

    plans: list[Any] = list(calibrate.calibration_candidates(profile, groups, s.calibration_trials, s.seed))
    trials_per_option = max(s.trials, len(s.options))
    none_choice = {n: "none" for names in groups.values() for n in names}
    rnd = 0
    run_s = 0.0  # wall seconds of one calibration run (measured on the first round)
    while True:
        # the reference run and every plan (finished ones from the storage tick at once)
        bar.phase("calibrating" if rnd == 0 else f"verifying the chosen plans (round {rnd} of up to "
                  f"{s.verify_rounds})", 1 + len(plans), "run")
        t_cal = time.time()
        ref, points = calibrate.run_calibration(
            s.workload, profile, groups, plans, storage=s.storage, study_name=cal_name,
            steps=s.calibration_steps, seed=s.seed, progress=bar, references=s.references,
            deadline=cal_deadline)
        if rnd == 0:
            # a resumed run reads its runs back in no time: the profile's step time bounds them
            ran = max(1, len(points) + len(ref.get("references") or {}))
            run_s = max((time.time() - t_cal) / ran, s.calibration_steps * profile.compute_s)
            missing = [p for p in plans if not isinstance(p, tuple) and p not in [q["choice"] for q in points]]
            if missing:
                notes.append(f"--budget: {len(missing)} of {len(plans)} calibration plans not run")
        rule = _rule(s, ref, points)
        if rnd == 0 and s.calibration_repeats > 0:
            # chosen from the first calibration's runs alone, so a resumed run picks the same ones
            first = [q for q in points if q.get("seed", s.seed) == s.seed and q["choice"] in plans]
            reps = calibrate.repeat_candidates(_rule(s, ref, first), first, s.calibration_repeats, s.seed)
            fit_n = reps if fits(run_s * (len(reps) + 1)) else []
            if reps and not fit_n:
                notes.append(f"--budget: the {len(reps)} repeats nearest the limit were not run")
            if fit_n:  # the plans nearest the limit, again with other seeds
                bar.phase("repeating the runs nearest the limit", 1 + len(fit_n), "run")
                plans = list(plans) + fit_n
                ref, points = calibrate.run_calibration(
                    s.workload, profile, groups, plans, storage=s.storage, study_name=cal_name,
                    steps=s.calibration_steps, seed=s.seed, progress=bar, references=s.references,
                    deadline=cal_deadline)
                rule = _rule(s, ref, points)
        if rnd == 0 and s.local_steps:
            steps = calibrate.local_calibration_steps(s.calibration_steps, s.local_every)
            cost = run_s * (steps / s.calibration_steps) * s.world_size * (1 + len(s.local_every))
            if fits(cost):
                bar.phase("calibrating local steps", 1 + len(s.local_every), "run")
                local_cal = calibrate.run_local_calibration(
                    s.workload, profile, s.local_every, world_size=s.world_size, steps=steps, seed=s.seed,
                    max_accuracy_loss=s.max_accuracy_loss, storage=s.storage,
                    study_name=f"{cal_name}-local-{_hash([list(s.local_every), steps])}", progress=bar)
            else:
                notes.append(f"--budget: local steps not calibrated (about {cost / 60:.1f} min of runs), "
                             f"so not searched")
        conv = fit_convergence(points, s.max_accuracy_loss, rule=rule)
        rows: list[dict[str, Any]] = []
        best: dict[str, dict[str, Any]] = {}
        baseline: dict[str, dict[str, Any]] = {}
        local_best: dict[str, dict[str, Any] | None] = {}
        sh = s.sharding
        bar.phase("searching", len(options) * trials_per_option, "trial")
        for opt in options:
            bar.set_description(f"searching {opt.name}")
            what = [_option_key(opt), asdict(opt.link), asdict(conv), target_steps, s.options,
                    profile.codec_scale]
            if sh.sharded:  # a DDP run's study names stay what they were (resumable)
                what += [sh.to_dict(), s.max_residual_bytes, _option_key(opt, sharded=True),
                         profile.collective_overhead_s]
            if local_cal is not None:  # runs without local steps keep their study names
                what += [local_cal.to_dict(), list(s.local_fragments)]
            key = _hash(what)
            r = search.run_search(profile, groups, opt, conv, target_steps, storage=s.storage,
                                  study_name=f"fastml-{fp}-search-{opt.name}-{key}",
                                  trials=trials_per_option, seed=s.seed, progress=bar,
                                  sharding=sh, max_residual_bytes=s.max_residual_bytes,
                                  local=local_cal, fragments=s.local_fragments)
            rows.extend(dict(x, kind="local-steps" if x["every"] > 1 else "fastml") for x in r)
            base = evaluate(profile, none_choice, opt, conv, target_steps, hook=False, sharding=sh)
            base.update(option=opt.name, choice={g: "none" for g in groups}, use_hook=False,
                        objective=objective(base, opt),
                        every=1, fragments=1, delay=0)
            baseline[opt.name] = base
            rows.append(dict(base, trial=-1, kind="plain-ddp" if not sh.sharded else f"{sh.kind}-own"))
            # Plain DDP is a candidate too: where no compression pays (a fast link), say so.
            b = search.best_row(r)
            best[opt.name] = dict(b, use_hook=True) if b["objective"] < base["objective"] else dict(base)
            if not sh.sharded:  # DDP's bucket size for the chosen plan (plain DDP's too)
                best[opt.name] = _best_bucket(profile, groups, opt, conv, target_steps, best[opt.name],
                                              search)
            try:
                local_best[opt.name] = dict(search.best_row(r, local=True), use_hook=False)
            except ValueError:  # local steps off, or no H within the accuracy limit
                local_best[opt.name] = None
        tried = [p["choice"] for p in points]
        new = []
        for b in best.values():  # the per-step plans (local steps' codecs compress pseudo-gradients)
            c = b["choice"]
            if c not in tried and c not in new and any(o != "none" for o in c.values()):
                new.append(c)
        if not new or rnd >= s.verify_rounds:
            break
        if not fits(run_s * len(new)):
            notes.append(f"--budget: verification round {rnd + 1} ({len(new)} chosen plans) not run")
            break
        plans = list(plans) + new
        rnd += 1
    # The Pareto front compares priced options (a cluster you already have costs nothing here).
    priced = {o.name for o in options if o.price_per_hour > 0}
    feas = [i for i, r in enumerate(rows) if r["feasible"] and r["option"] in priced]
    front = [feas[i] for i in pareto_front([(rows[i]["tta_s"], rows[i]["cost_usd"]) for i in feas])]
    for i, r in enumerate(rows):
        r["pareto"] = i in front
    def winner(n: str) -> dict[str, Any]:
        lb = local_best.get(n)
        return lb if lb is not None and lb["objective"] < best[n]["objective"] else best[n]

    chosen = LOCAL if LOCAL in best else min(
        (o.name for o in options), key=lambda n: (winner(n)["cost_usd"], winner(n)["tta_s"]))
    return (ref, points, conv, target_steps, rows, best, baseline, front, chosen, local_best, local_cal,
            rule, notes)


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
