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
3. Registers the FastML state of every rank with ``accelerator.register_for_checkpointing``, so
   ``accelerator.save_state(dir)`` stores it (plan, step, error-feedback residuals) and
   ``accelerator.load_state(dir)`` restores it. Call ``setup`` before ``load_state``, and on every
   process: saving gathers every rank's residuals (a collective), as ``save_state`` itself expects
   to be called everywhere.

In one process (no DDP wrapper) it returns None and changes nothing. Under FSDP or DeepSpeed, which
do not use DDP's comm hooks, it warns and returns None: training continues uncompressed.

Settings come from arguments or, because the launcher passes the environment through and its
config file cannot carry them, from environment variables:

=============================== =========================================================== ========
variable                        meaning                                                     default
=============================== =========================================================== ========
``FASTML_PLAN``                 recipe name (``int4``, ``int8``, ``topk1``...) or plan JSON int4
``FASTML_CHECK_REPLICAS_EVERY`` compare parameter checksums across ranks every N steps      0 (off)
``FASTML_LAYER_STATS_EVERY``    measure per-layer compression error every N steps           10
=============================== =========================================================== ========

Gradient accumulation with ``accelerator.accumulate(model)`` needs nothing more: the micro-batches
inside ``no_sync`` call no hook. With ``mixed_precision="fp16"`` the hook propagates a non-finite
value to every rank, so the GradScaler skips the step everywhere.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from fastml_strategy.config import Plan, resolve_plan
from fastml_strategy.hook import FastMLState, register_hook

__all__ = ["setup", "prepare", "CheckpointState"]


def _env_int(name: str, value: int | None, default: int) -> int:
    if value is None:
        raw = os.environ.get(name, "").strip()
        if not raw:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a whole number; set it to N >= 1, or 0 to switch it off") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name.removeprefix('FASTML_').lower()}={value!r}; use a whole number >= 0 (0: off)")
    return value


class CheckpointState:
    """What ``accelerator.register_for_checkpointing`` holds: the FastML state of every rank.

    ``state_dict()`` is a collective (it gathers every rank's residuals for the main process to
    write); ``load_state_dict()`` gives each rank its own part back.
    """

    def __init__(self, state: FastMLState) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state.state_dict(all_ranks=True)

    def load_state_dict(self, state_dict: dict) -> None:
        self.state.load_state_dict(state_dict)


def _find_ddp(model: Any) -> torch.nn.parallel.DistributedDataParallel | None:
    seen = 0
    while model is not None and seen < 4:  # torch.compile(DDP(model)) keeps DDP in _orig_mod
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model
        model = getattr(model, "_orig_mod", None)
        seen += 1
    return None


def setup(
    accelerator: Any,
    model: Any,
    plan: Plan | str | os.PathLike | dict | None = None,
    *,
    check_replicas_every: int | None = None,
    layer_stats_every: int | None = None,
    checkpoint: bool = True,
) -> FastMLState | None:
    """Register FastML on a model returned by ``accelerator.prepare``; call it on every process.

    Returns the :class:`~fastml_strategy.FastMLState` (``.stats()`` for compression figures), or None
    when the model is not wrapped in DDP (one process, FSDP, DeepSpeed). ``checkpoint=False`` skips
    ``register_for_checkpointing`` (then save ``state.state_dict(all_ranks=True)`` yourself).
    """
    resolved = resolve_plan(plan)  # a bad FASTML_PLAN fails here, on every process, naming it
    check_every = _env_int("FASTML_CHECK_REPLICAS_EVERY", check_replicas_every, 0)
    layer_every = _env_int("FASTML_LAYER_STATS_EVERY", layer_stats_every, 10)
    ddp = _find_ddp(model)
    if ddp is None:
        inner = accelerator.unwrap_model(model) if hasattr(accelerator, "unwrap_model") else model
        resolved.check_parameters([n for n, p in inner.named_parameters() if p.requires_grad])
        if getattr(accelerator, "num_processes", 1) > 1:
            warnings.warn(
                f"fastml_strategy.accelerate.setup: the prepared model is a {type(model).__name__}, not a "
                f"DistributedDataParallel (distributed_type={getattr(accelerator, 'distributed_type', '?')}); "
                f"FastML compresses DDP gradients only, so this run trains uncompressed. Use a MULTI_GPU or "
                f"MULTI_CPU configuration to compress",
                stacklevel=2,
            )
        return None
    state = register_hook(ddp, resolved, check_replicas_every=check_every, layer_stats_every=layer_every)
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
    .setup``'s return value, kept as ``accelerator.fastml_state`` (None without DDP).
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
