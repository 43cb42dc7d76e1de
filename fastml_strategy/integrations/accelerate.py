"""Hugging Face Accelerate: one call after ``accelerator.prepare`` compresses the model's gradients.

Accelerate has no place for a custom DDP comm hook in its own configuration:
``DistributedDataParallelKwargs.comm_hook`` is a closed enum (subclasses of kwargs handlers raise
KeyError) and ``accelerate config`` files reject unknown keys. So FastML attaches itself to the model
that ``accelerator.prepare`` returns::

    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    fastml_strategy.accelerate.setup(accelerator, model)          # plan from FASTML_PLAN, default int4
    # or, in one call:
    model, optimizer, loader = fastml_strategy.accelerate.prepare(accelerator, model, optimizer, loader)

What :func:`setup` does, on every process:

1. Resolves the plan (argument, else ``FASTML_PLAN``: a recipe name or a plan JSON path; default
   ``int4``) and checks it against the model's parameter names, even in a single process, so a typo
   fails on your laptop and not only on the cluster.
2. If the prepared model is a ``DistributedDataParallel`` (``MULTI_GPU``, ``MULTI_CPU``, multi-node),
   registers FastML's comm hook on it (:func:`fastml_strategy.register_hook`: every rank agrees on
   the plan before the first step, or every rank raises the same error).
   If it is an FSDP2 module (Accelerate's FSDP plugin with ``fsdp_version: 2``, or a model you
   sharded yourself with ``torch.distributed.fsdp.fully_shard``), calls
   :func:`fastml_strategy.fsdp.register` instead: FastML's compressed reduce-scatter, or, when the
   model is sharded on a 2-D (replicate, shard) mesh (``parallelism_config_dp_replicate_size`` > 1:
   HSDP), the compressed cross-replica all-reduce. A model wrapped in FSDP1
   (``FullyShardedDataParallel``, ``fsdp_version: 1``) raises TypeError: FastML does not compress it.
3. Registers the FastML state of every rank with ``accelerator.register_for_checkpointing``, so
   ``accelerator.save_state(dir)`` stores it (plan, step, error-feedback residuals) and
   ``accelerator.load_state(dir)`` restores it. Call ``setup`` before ``load_state``, and on every
   process: saving gathers every rank's residuals (a collective), as ``save_state`` itself expects
   to be called everywhere. Under FSDP a rank's reduce-scatter residuals are as large as the
   unsharded gradients it compresses, and the main process holds world_size of them while it writes.

In one process (no DDP or FSDP) it returns None and changes nothing. Under DeepSpeed, which uses
neither, it warns and returns None: training continues uncompressed.

On CPU, Accelerate (1.15) ignores its FSDP plugin: ``distributed_type`` stays ``MULTI_CPU`` and
``prepare`` wraps the model in DDP (which FastML then compresses). For FSDP2 on CPU, apply
``fully_shard`` yourself, give ``prepare`` only the data loaders (it would wrap the sharded model in
DDP, and ``save_state`` would write the main process's optimizer shards only), call ``setup`` on the
sharded model, and save model and optimizer with ``torch.distributed.checkpoint``
(``recipes/train_accelerate.py --fully-shard`` does all of this).

Settings come from arguments or, because the launcher passes the environment through and its
config file cannot carry them, from environment variables:

=============================== =========================================================== ========
variable                        meaning                                                     default
=============================== =========================================================== ========
``FASTML_PLAN``                 recipe name (``int4``, ``int8``, ``topk1``...) or plan JSON int4
``FASTML_CHECK_REPLICAS_EVERY`` compare parameter checksums across ranks every N steps (DDP) 0 (off)
``FASTML_LAYER_STATS_EVERY``    measure per-layer compression error every N steps           10
=============================== =========================================================== ========

``Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)])`` makes the
gradients views into DDP's buckets, which saves DDP's copy of every gradient into its bucket and back
(``FastMLStrategy`` does it by default; here DDP is Accelerate's to build, so ``recipes/train_accelerate.py``
passes it).

Gradient accumulation with ``accelerator.accumulate(model)`` needs nothing more: the micro-batches
inside ``no_sync`` call no hook. With ``mixed_precision="fp16"`` the hook propagates a non-finite
value to every rank, so the GradScaler skips the step everywhere.

Local steps (below 1 Gbit/s): :func:`prepare_local_sgd`
------------------------------------------------------
:func:`prepare_local_sgd` prepares the model WITHOUT the DDP wrapper (``accelerator.prepare_model(model,
evaluation_mode=True)``: device placement and mixed precision only) and the other objects as usual,
then builds :class:`~fastml_strategy.LocalSGD` on the model: the ranks do not communicate in the inner
steps; every ``every`` steps they average the compressed pseudo-gradients and apply an outer step::

    model, optimizer, loader = fastml_strategy.accelerate.prepare_local_sgd(
        accelerator, model, optimizer, loader, every=50)          # or FASTML_LOCALSGD_EVERY=50
    local = accelerator.fastml_localsgd
    for x, y in loader:
        accelerator.backward(loss_fn(model(x), y))
        optimizer.step(); optimizer.zero_grad()
        local.step()                # with accelerator.accumulate: only when accelerator.sync_gradients

:func:`local_sgd` does the second half for a model you prepared that way yourself. Settings come from
the arguments, else ``FASTML_LOCALSGD_EVERY`` / ``_OUTER`` / ``_OUTER_LR`` / ``_OUTER_MOMENTUM`` /
``_FRAGMENTS`` / ``_DELAY``, else the plan's ``local_steps``, else LocalSGD's defaults. Between two
synchronisations each rank's model and optimizer hold their own progress, so the object registered for
checkpointing gathers every rank's model, optimizer and LocalSGD state into what ``save_state`` writes,
and ``load_state`` gives each rank its own back (after Accelerate has loaded rank 0's): the run
continues on the same trajectory.

Accelerate's own ``accelerate.local_sgd.LocalSGD`` context manager averages the parameters every
``local_sgd_steps`` steps with a plain fp32 all-reduce (the DDP-wrapped model's ``no_sync`` hides the
per-step all-reduce). FastML's sends compressed pseudo-gradients with error feedback (int4: about 8x
fewer bytes per synchronisation), applies an outer optimizer (DiLoCo's Nesterov by default; ``outer="sgd",
outer_lr=1, outer_momentum=0`` is Accelerate's averaging), can stream the model in fragments whose
communication overlaps the inner steps, and checkpoints every rank's state for an exact resume.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fastml_strategy._checkpoint import STATE_FORMAT_VERSION, gather_to_rank_zero, own_rank_state
from fastml_strategy.comm._distributed import checked_plan
from fastml_strategy._integration import find_ddp, find_fsdp2, is_fsdp1, setting, take_local_steps
from fastml_strategy.config import Plan, resolve_plan
from fastml_strategy.engine import attach
from fastml_strategy.hook import FastMLState
from fastml_strategy.localsgd import LocalSGD, island_model, resolve_settings

if TYPE_CHECKING:
    from fastml_strategy.fsdp import FSDPState

__all__ = ["setup", "prepare", "CheckpointState", "local_sgd", "prepare_local_sgd", "LocalSGDCheckpoint"]

log = logging.getLogger(__name__)

_SETUP = "fastml_strategy.accelerate.setup"


class CheckpointState:
    """What ``accelerator.register_for_checkpointing`` holds: the FastML state of every rank (DDP's
    :class:`~fastml_strategy.FastMLState` or FSDP's :class:`~fastml_strategy.fsdp.FSDPState`).

    ``state_dict()`` is a collective (it gathers every rank's residuals for the main process to
    write); ``load_state_dict()`` gives each rank its own part back.
    """

    def __init__(self, state: FastMLState | FSDPState) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state.state_dict(all_ranks=True)

    def load_state_dict(self, state_dict: dict) -> None:
        self.state.load_state_dict(state_dict)


def _reject_fsdp1(model: Any) -> None:
    if is_fsdp1(model):
        raise TypeError(
            "fastml_strategy.accelerate.setup: the model is wrapped in FSDP1 (FullyShardedDataParallel: "
            "Accelerate's FSDP plugin with fsdp_version: 1, its default), which FastML does not compress. "
            "Use FSDP2: fsdp_version: 2 in the accelerate config (FullyShardedDataParallelPlugin("
            "fsdp_version=2); see recipes/accelerate/fsdp2.yaml), or shard with torch.distributed.fsdp."
            "fully_shard yourself; in Lightning use strategy='fastml_fsdp'")


def setup(
    accelerator: Any,
    model: Any,
    plan: Plan | str | os.PathLike | dict | None = None,
    *,
    check_replicas_every: int | None = None,
    layer_stats_every: int | None = None,
    checkpoint: bool = True,
    shard_plan: Plan | str | os.PathLike | dict | None = None,
    replicate_group: Any = None,
    all_gather_bits: int | None = None,
) -> FastMLState | FSDPState | None:
    """Register FastML on a model returned by ``accelerator.prepare``; call it on every process.

    Returns the :class:`~fastml_strategy.FastMLState` (DDP) or :class:`~fastml_strategy.fsdp.FSDPState`
    (FSDP2; ``.stats()`` for compression figures), or None when the model is neither (one process,
    DeepSpeed). ``checkpoint=False`` skips ``register_for_checkpointing`` (then save
    ``state.state_dict(all_ranks=True)`` yourself). ``shard_plan``, ``replicate_group`` (HSDP only)
    and ``all_gather_bits`` are :func:`fastml_strategy.fsdp.register`'s; ``check_replicas_every`` is
    DDP's.
    Raises TypeError, on every process, for a model wrapped in FSDP1.
    """
    resolved = resolve_plan(plan)  # a bad FASTML_PLAN fails here, on every process, naming it
    check_every = setting("check_replicas_every", check_replicas_every, owner=_SETUP)
    layer_every = setting("layer_stats_every", layer_stats_every, owner=_SETUP)
    _reject_fsdp1(model)  # Accelerate's own words for it (its FSDP plugin's default is FSDP1)
    if check_every and find_ddp(model) is None and find_fsdp2(model) is not None:
        warnings.warn("fastml_strategy.accelerate.setup: check_replicas_every (FASTML_CHECK_REPLICAS_EVERY) "
                      "applies to DDP models only; this FSDP2 model is not checked", stacklevel=2)
        check_every = 0
    state: Any = attach(model, resolved, owner=_SETUP, check_replicas_every=check_every,
                        layer_stats_every=layer_every, shard_plan=shard_plan, replicate_group=replicate_group,
                        all_gather_bits=all_gather_bits)
    if state is None:
        inner = accelerator.unwrap_model(model) if hasattr(accelerator, "unwrap_model") else model
        checked_plan(resolved, inner)  # the check register_hook makes (tied names, frozen parameters)
        if getattr(accelerator, "num_processes", 1) > 1:
            warnings.warn(
                f"fastml_strategy.accelerate.setup: the prepared model is a {type(model).__name__}, neither a "
                f"DistributedDataParallel nor an FSDP2 module (distributed_type="
                f"{getattr(accelerator, 'distributed_type', '?')}); FastML compresses DDP and FSDP2 gradients "
                f"only, so this run trains uncompressed. Use a MULTI_GPU, MULTI_CPU or FSDP (fsdp_version: 2) "
                f"configuration to compress",
                stacklevel=2,
            )
        return None
    if checkpoint:
        accelerator.register_for_checkpointing(CheckpointState(state))
    return state


def prepare(
    accelerator: Any,
    *objects: Any,
    plan: Plan | str | os.PathLike | dict | None = None,
    check_replicas_every: int | None = None,
    layer_stats_every: int | None = None,
    checkpoint: bool = True,
    **prepare_kwargs: Any,
) -> Any:
    """``accelerator.prepare(*objects)``, then :func:`setup` on the model among them (exactly one).

    Returns what ``accelerator.prepare`` returns; the FastML state is then ``fastml_strategy.accelerate
    .setup``'s return value, kept as ``accelerator.fastml_state`` (None without DDP or FSDP2).
    """
    prepared = accelerator.prepare(*objects, **prepare_kwargs)
    items = prepared if isinstance(prepared, tuple) else (prepared,)
    models = [o for o in items if isinstance(o, torch.nn.Module)]
    if len(models) != 1:
        raise ValueError(
            f"fastml_strategy.accelerate.prepare: expected exactly one model among the prepared objects, "
            f"found {len(models)}; call accelerator.prepare yourself and then "
            f"fastml_strategy.accelerate.setup(accelerator, model) for each model"
        )
    accelerator.fastml_state = setup(accelerator, models[0], plan, check_replicas_every=check_replicas_every,
                                     layer_stats_every=layer_stats_every, checkpoint=checkpoint)
    return prepared


# -- local steps -----------------------------------------------------------------------------------------
class LocalSGDCheckpoint:
    """What :func:`local_sgd` registers for checkpointing: every rank's model, optimizers and LocalSGD
    state (between two synchronisations they differ from rank to rank).

    ``state_dict()`` is a collective (the main process receives every rank's part, which it writes);
    ``load_state_dict()`` gives each rank its own part back, over the rank 0 model and optimizer state
    that ``load_state`` loaded before it.
    """

    def __init__(self, local: LocalSGD, model: torch.nn.Module, optimizers: list) -> None:
        self.local = local
        self.model = model
        self.optimizers = optimizers

    def state_dict(self) -> dict:
        own = {"rank": self.local.rank, "model": self.model.state_dict(),
               "optimizers": [o.state_dict() for o in self.optimizers], "localsgd": self.local.state_dict()}
        return gather_to_rank_zero(own) or {}

    def load_state_dict(self, state_dict: dict) -> None:
        own = own_rank_state(state_dict, self.local.rank, self.local.world_size, STATE_FORMAT_VERSION,
                             "fastml_strategy.accelerate.LocalSGDCheckpoint")
        if len(own["optimizers"]) != len(self.optimizers):
            raise ValueError(f"the checkpoint holds {len(own['optimizers'])} optimizer states, local_sgd() was "
                             f"given {len(self.optimizers)}; pass the same optimizers as when it was saved")
        self.model.load_state_dict(own["model"])
        for opt, sd in zip(self.optimizers, own["optimizers"]):
            opt.load_state_dict(sd)
        self.local.load_state_dict(own["localsgd"])


def local_sgd(
    accelerator: Any,
    model: Any,
    optimizer: Any = None,
    plan: Plan | str | os.PathLike | dict | None = None,
    *,
    mix: float = 1.0,
    layer_stats_every: int | None = None,
    checkpoint: bool = True,
    **settings: Any,
) -> LocalSGD | None:
    """Build :class:`~fastml_strategy.LocalSGD` on a model that Accelerate did NOT wrap in DDP
    (``accelerator.prepare_model(model, evaluation_mode=True)``); call it on every process.

    Call ``local.step()`` after each optimizer step (under ``accelerator.accumulate``: only when
    ``accelerator.sync_gradients``). ``optimizer``: the prepared optimizer, or a list of them, whose
    per-rank state the checkpoint keeps. ``checkpoint=False`` skips ``register_for_checkpointing``.
    Settings: see the module docstring. Returns None in a single process (after checking the plan
    against the model). Raises TypeError, on every process, for a model wrapped in DDP or FSDP.
    """
    resolved, settings = resolve_settings(plan, **settings)  # unknown names: TypeError naming the known ones
    layer_every = setting("layer_stats_every", layer_stats_every, owner="fastml_strategy.accelerate.local_sgd",
                          localsgd=True)
    ddp = find_ddp(model)
    island = (ddp is not None and dist.is_initialized()
              and dist.get_world_size(ddp.process_group) < dist.get_world_size())
    if (ddp is not None and not island) or find_fsdp2(model) is not None or is_fsdp1(model):
        raise TypeError(
            f"fastml_strategy.accelerate.local_sgd: the model is a {type(model).__name__} (accelerator.prepare "
            f"wrapped it), which communicates every step; LocalSGD needs the plain model. Use "
            f"fastml_strategy.accelerate.prepare_local_sgd(accelerator, model, optimizer, ...), or prepare the "
            f"model with accelerator.prepare_model(model, evaluation_mode=True)")
    inner = accelerator.unwrap_model(model) if hasattr(accelerator, "unwrap_model") else model
    if getattr(accelerator, "num_processes", 1) <= 1:
        checked_plan(resolved, inner)  # the check LocalSGD makes (tied names, frozen parameters)
        return None
    optimizers = [] if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    # a DDP island (DDP over the ranks of one machine, prepare_local_sgd's islands): LocalSGD takes the DDP
    local = LocalSGD(ddp if island else inner, optimizers[0] if len(optimizers) == 1 else None, plan=resolved,
                     mix=mix, layer_stats_every=layer_every, **settings)
    if checkpoint:
        accelerator.register_for_checkpointing(LocalSGDCheckpoint(local, inner, optimizers))
    return local


def prepare_local_sgd(
    accelerator: Any,
    model: torch.nn.Module,
    *objects: Any,
    plan: Plan | str | os.PathLike | dict | None = None,
    mix: float = 1.0,
    layer_stats_every: int | None = None,
    checkpoint: bool = True,
    islands: bool | None = None,
    **prepare_kwargs: Any,
) -> Any:
    """``accelerator.prepare_model(model, evaluation_mode=True)`` (no DDP), ``accelerator.prepare(*objects)``,
    then :func:`local_sgd` with the prepared optimizers among ``objects``. LocalSGD's settings
    (``every``, ``outer``, ``outer_lr``, ``outer_momentum``, ``fragments``, ``delay``: see the module
    docstring) are keywords here too; every other keyword goes to ``accelerator.prepare``.

    ``islands`` (DiLoCo islands): on several machines of several processes each, the model is wrapped
    in DDP over the processes of its machine (every inner step all-reduces inside the machine) and
    LocalSGD synchronises across machines only (:class:`~fastml_strategy.LocalSGD`'s islands). None
    (default): islands exactly when the launcher (or ``FASTML_RANKS_PER_NODE``) says there are
    several machines of several ranks; False: every process its own replica; True: islands, or a
    ValueError on every process when the run is not on several machines of several ranks.

    Returns ``(model, *prepared objects)`` (the model is the DDP island when there are islands); the
    :class:`~fastml_strategy.LocalSGD` is kept as ``accelerator.fastml_localsgd`` (None in a single
    process).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fastml_strategy.accelerate.prepare_local_sgd: the first object must be the model (an "
                        f"nn.Module), got {type(model).__name__}")
    settings = take_local_steps(prepare_kwargs)  # every=, outer=, ...: LocalSGD's; the rest is prepare's
    resolve_settings(plan, **settings)  # a bad setting fails here, on every process, before prepare
    model = accelerator.prepare_model(model, evaluation_mode=True)
    if islands is not False and getattr(accelerator, "num_processes", 1) > 1:
        model = island_model(model, required=bool(islands),
                             owner="fastml_strategy.accelerate.prepare_local_sgd")
    prepared = accelerator.prepare(*objects, **prepare_kwargs) if objects else ()
    items = prepared if isinstance(prepared, tuple) else (prepared,)
    optimizers = [o for o in items if isinstance(o, torch.optim.Optimizer)]
    accelerator.fastml_localsgd = local_sgd(accelerator, model, optimizers, plan, mix=mix,
                                            layer_stats_every=layer_stats_every, checkpoint=checkpoint,
                                            **settings)
    return (model, *items)
