"""The autotuner's inputs, validated: :func:`prepare` turns the keyword arguments of
:func:`~fastml_strategy.autotune.autotune` (the ``fastml-autotune`` options) into :class:`Settings`.

Everything that can be wrong with the inputs (target, catalog, link, numbers, storage URL) is checked
here, before any profiling and before anything is written; each problem is one ``ValueError`` line
naming the option and the fix. The only thing written is the output folder and the default SQLite
storage in it, and only once everything else is valid.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastml_strategy._validate import env_whole_number, whole_number
from fastml_strategy.autotune.catalog import HardwareOption, Link, load_catalog, parse_link
from fastml_strategy.autotune.costmodel import (CANDIDATES, DEFAULT_LOCAL_EVERY, DEFAULT_LOCAL_FRAGMENTS,
                                                SHARDINGS, Sharding, default_options)
from fastml_strategy.autotune.result import ASSUMED_TARGET_STEPS, TARGET_STEPS_SOURCES
from fastml_strategy.autotune.workload import Workload, as_workload, load_target
from fastml_strategy.config import DEFAULT_MIN_NUMEL

__all__ = ["Settings", "prepare", "DEFAULT_BUDGET_MIN"]

# --budget's default, minutes: the optional runs (repeats, local steps, verification) are skipped
# when they would not fit; the search then uses what was measured by then.
DEFAULT_BUDGET_MIN = 15.0


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
    # The data-parallel ranks a calibration step stands in for: the gradients of this many batches are
    # averaged before the simulated compression (Workload.ranks; --calibration-ranks)
    calibration_ranks: int = 1
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

    def __post_init__(self) -> None:
        self.workload.ranks = self.calibration_ranks  # what each calibration run of the workload averages


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
            budget: float | None = DEFAULT_BUDGET_MIN, calibration_ranks: int | None = None) -> Settings:
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

    Local steps (DDP only; default off, issue 38): ``local_steps=True`` searches LocalSGD beside
    per-step compression (so does giving ``local_every`` or ``local_fragments``);
    ``local_every`` (sync periods H >= 2, default :data:`DEFAULT_LOCAL_EVERY`) and
    ``local_fragments`` (F >= 1, default :data:`DEFAULT_LOCAL_FRAGMENTS`) set what is calibrated and
    searched.

    Accuracy rule (:func:`~fastml_strategy.autotune.costmodel.accuracy_rule`): ``references``
    reference runs (seeds ``seed``, ``seed + 1``, ...) measure the noise; ``calibration_repeats``
    plans nearest the limit run again with other seeds.

    ``threads_per_rank``: intra-op threads compute is profiled and timed with (default: the cores
    divided by the world size, one process standing in for every rank; under torchrun, as launched).
    ``budget``: minutes (default :data:`DEFAULT_BUDGET_MIN`; 0/None: no cap). ``calibration_ranks``: :func:`_calibration_ranks`."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    out_p = _check_out(out, refuse_finished=rank == 0 and not overwrite)
    counts = _check_counts(trials=(trials, 1), calibration_trials=(calibration_trials, 1), references=(references, 1),
                           calibration_steps=(calibration_steps, 10), profile_steps=(profile_steps, 1),
                           measure_steps=(measure_steps, 1), max_groups=(max_groups, 1), min_numel=(min_numel, 0),
                           verify_rounds=(verify_rounds, 0), calibration_repeats=(calibration_repeats, 0))
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
                    calibration_ranks=_calibration_ranks(calibration_ranks, world_size), **counts)


# The most ranks a calibration step averages by default: each costs a forward and backward pass, and
# past a few the mean gradient's noise changes little against what compression adds.
MAX_CALIBRATION_RANKS = 4


def _calibration_ranks(given: int | None, world_size: int) -> int:
    """--calibration-ranks, validated (None: the world size, at most MAX_CALIBRATION_RANKS): the ranks
    a calibration step stands in for, its gradient the mean of that many batches (each one more
    forward/backward pass; 1: one rank's batch)."""
    if given is None:
        return max(1, min(int(world_size), MAX_CALIBRATION_RANKS))
    whole_number("--calibration-ranks", given, 1)
    return int(given)


def _check_counts(**given: tuple[Any, int]) -> dict[str, Any]:
    """The whole-number options, each ``(value, least)``: checked under its flag's name, returned
    under its own."""
    for name, (v, lo) in given.items():
        whole_number("--" + name.replace("_", "-"), v, lo)
    return {name: v for name, (v, _) in given.items()}


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
    """The local-steps options, validated: off unless asked for (``--local-steps``, or a
    ``--local-every`` / ``--local-fragments`` to search); LocalSGD does not shard.

    Off by default since issue 38: the local-steps calibration is the longest optional phase (two runs
    of 4 x the largest H steps on W replicas), so ``--budget`` ran it on a quiet machine and left it
    out on a loaded one, and the same command's answer flipped between a per-step plan and LocalSGD
    (at 50 Mbit/s with fp32 pseudo-gradients: a plan.json whose codecs are fp32 for every tensor,
    which ``register_hook`` and every per-step integration run as plain DDP, 5x slower than uniform
    int4). Local steps change the training algorithm; a user asks for them."""
    if local_steps is not None and not isinstance(local_steps, bool):
        raise ValueError(f"local_steps is {local_steps!r}; give True, False or None (off unless "
                         f"local_every or local_fragments is given)")
    if sharding.sharded:
        if local_steps or every is not None or fragments is not None:
            raise ValueError(f"--local-steps / --local-every / --local-fragments describe LocalSGD, which "
                             f"replicates the model, but --sharding is {sharding.kind}; drop them or use "
                             f"--sharding ddp")
        return False, DEFAULT_LOCAL_EVERY, DEFAULT_LOCAL_FRAGMENTS
    on = (every is not None or fragments is not None) if local_steps is None else local_steps
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
