"""``strategy="fastml"`` for Lightning and Fabric: DDP with a compressed all-reduce.

``FastMLStrategy`` is Lightning's ``DDPStrategy`` with one change of substance: once Lightning has
wrapped the model in ``DistributedDataParallel`` it calls :func:`fastml_strategy.register_hook`, so
every gradient bucket is compressed as the plan says (quantized, top-k, or cast) before it crosses
the network. Everything else (launching processes, samplers, precision, accumulation, loggers) is
Lightning's own.

1. Lightning's ``DDPStrategy`` registers a ``ddp_comm_hook`` only when the device is CUDA: on CPU it
   is silently ignored. ``FastMLStrategy`` extends the public ``configure_ddp`` (which wraps the model
   in DDP) and registers FastML's hook after it, on every device (gloo on CPU, NCCL on CUDA).
2. The plan comes from ``FastMLStrategy(plan=...)`` (a :class:`~fastml_strategy.Plan`, a recipe name
   such as ``"int4"``, or a plan JSON path) or, for ``strategy="fastml"``, from the environment
   variable ``FASTML_PLAN`` (default ``int4``). It is resolved when the strategy is built, so a wrong
   name fails on every process before a process group exists; ``register_hook`` then checks it
   against the model's parameter names and across ranks before the first step.
3. Checkpoints: ``trainer.save_checkpoint`` (and ``ModelCheckpoint``) runs on every rank, so the
   strategy gathers the FastML state of EVERY rank (plan, step, error-feedback residuals, RNG) into
   ``checkpoint["fastml_strategy"]``; rank 0 writes it with the rest, atomically (Lightning's
   checkpoint IO writes through a file transaction). ``fit(ckpt_path=...)`` hands each rank its own
   part once the hook exists, so resuming continues the same trajectory bit for bit.
   Weights-only checkpoints (``save_weights_only=True``) carry no FastML state: they cannot resume.
4. Statistics: every ``log_every_n_steps`` optimizer steps rank 0 sends ``fastml/compression_ratio``
   and ``fastml/bytes_sent_per_step`` to the Trainer's loggers, and every
   ``layer_stats_every`` the relative compression error of each layer
   (``fastml/rel_error/<parameter>``). ``trainer.strategy.compression_stats()`` returns the full
   dictionary of :meth:`fastml_strategy.FastMLState.stats`, during and after ``fit``.

Gradient accumulation needs nothing special (DDP's ``no_sync`` micro-batches call no hook; the hook
counts one step per synchronised backward). With ``precision="16-mixed"`` the hook sees scaled
gradients and propagates a non-finite value to every rank, so GradScaler skips the step everywhere.
``validate``/``test``/``predict`` do not wrap the model in DDP and so do not compress.

Fabric's ``DDPStrategy`` has no hook arguments at all: ``FastMLFabricStrategy`` registers the hook in
``setup_module`` and adds the FastML state to ``fabric.save``/``fabric.load`` the same way.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from fastml_strategy._integration import fsdp2_units, is_fsdp1, setting
from fastml_strategy.config import Plan
from fastml_strategy.engine import attach
from fastml_strategy.integrations.lightning._common import (_HOOK_KWARGS, _HOOK_KWARGS_FIX, CHECKPOINT_KEY,
                                                            FSDP_STRATEGY_NAME, STRATEGY_NAME, _check_key_free,
                                                            _FastMLStateHolder, _load_from_remainder, _ranks_per_node,
                                                            _reject_kwargs, _TrainerLogging)

__all__ = ["trainer_class", "fabric_class"]


def _reject_sharded(module: torch.nn.Module, owner: str) -> None:
    """The DDP strategies compress DDP's all-reduce: a model already sharded by FSDP belongs elsewhere."""
    if is_fsdp1(module):
        raise TypeError(
            f"{owner} (strategy='{STRATEGY_NAME}') is DDP, but the model holds FSDP1 "
            f"FullyShardedDataParallel modules, which FastML does not compress. Shard with FSDP2 instead: "
            f"use strategy='{FSDP_STRATEGY_NAME}' and call torch.distributed.fsdp.fully_shard in "
            f"configure_model (or let the strategy shard by auto_wrap_policy)")
    if next(fsdp2_units(module), None) is not None:
        raise TypeError(
            f"{owner} (strategy='{STRATEGY_NAME}') is DDP, but configure_model sharded the model with "
            f"fully_shard (FSDP2); use strategy='{FSDP_STRATEGY_NAME}', which compresses FSDP2's "
            f"reduce-scatter")


# -- DDP: Lightning Trainer -------------------------------------------------------------------------------
class _TrainerStrategy(_TrainerLogging, _FastMLStateHolder):
    """What :class:`FastMLStrategy` adds to a Trainer flavour's ``DDPStrategy``: FastML's hook after
    ``configure_ddp``, FastML's state in checkpoints, its figures in the loggers."""

    _fastml_when = "the hook is registered when fit() wraps the model in DistributedDataParallel"

    def __init__(
        self,
        plan: Plan | str | os.PathLike | dict | None = None,
        check_replicas_every: int | None = None,
        log_every_n_steps: int | None = None,
        layer_stats_every: int | None = None,
        layer_errors_every_n_steps: int | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        _reject_kwargs(type(self).__name__, ddp_kwargs, _HOOK_KWARGS, "registers FastML's own DDP comm hook",
                       _HOOK_KWARGS_FIX)
        self._fastml_init(plan, check_replicas_every)
        self._fastml_log_init(log_every_n_steps, layer_stats_every, layer_errors_every_n_steps)
        self._fastml_loaded_ckpt = False
        ddp_kwargs.setdefault("gradient_as_bucket_view", True)
        super().__init__(**ddp_kwargs)

    def setup(self, trainer: Any) -> None:
        if self.model is not None:  # configure_model has run: a model it sharded needs strategy="fastml_fsdp"
            _reject_sharded(self.model, type(self).__name__)
        super().setup(trainer)

    def configure_ddp(self) -> None:
        # DDPStrategy.configure_ddp wraps the model, then registers a comm hook only on CUDA (and none
        # here: the hook arguments are refused). FastML's hook goes on after it, on every device.
        super().configure_ddp()
        had_checkpoint, self._fastml_loaded_ckpt = self._fastml_loaded_ckpt, False
        if had_checkpoint and self._fastml_pending is None:
            self._fastml_warn_missing()
        layer_every = self._fastml_intervals()[1]
        self._fastml_adopt(lambda: attach(self.model, self._fastml_plan, owner=type(self).__name__,
                                          check_replicas_every=self._fastml_check_every,
                                          layer_stats_every=layer_every, ranks_per_node=_ranks_per_node(self)))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # Runs on every rank (Trainer.save_checkpoint and ModelCheckpoint call it everywhere), so the
        # collective state_dict(all_ranks=True) is safe here; rank 0 then writes the lot.
        if self._fastml_state is not None and "optimizer_states" in checkpoint:
            checkpoint[CHECKPOINT_KEY] = self._fastml_state.state_dict(all_ranks=True)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # The hook does not exist yet (Lightning restores before wrapping in DDP): keep this rank's part
        # until _register_ddp_hooks, which runs next in fit().
        self._fastml_pending = checkpoint.get(CHECKPOINT_KEY)
        self._fastml_loaded_ckpt = True
        return checkpoint

    def teardown(self) -> None:
        # The state stays open after fit(): compression_stats() and trainer.save_checkpoint() still work.
        self._fastml_pending = None
        self._fastml_loaded_ckpt = False
        super().teardown()


# -- DDP: Fabric -----------------------------------------------------------------------------------------
class _FabricStrategy(_FastMLStateHolder):
    """What :class:`FastMLFabricStrategy` adds to a Fabric flavour's ``DDPStrategy``: FastML's hook in
    ``setup_module``, FastML's state in ``fabric.save`` / ``fabric.load``."""

    _fastml_when = "the hook is registered when fabric.setup(model) wraps the model in DistributedDataParallel"

    def __init__(
        self,
        plan: Plan | str | os.PathLike | dict | None = None,
        check_replicas_every: int | None = None,
        layer_stats_every: int | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        _reject_kwargs(type(self).__name__, ddp_kwargs, _HOOK_KWARGS, "registers FastML's own DDP comm hook",
                       _HOOK_KWARGS_FIX)
        self._fastml_init(plan, check_replicas_every)
        # Measured every N steps (one extra pass over that step's gradients); Fabric logs nothing itself.
        self._fastml_layer_stats_every = setting("layer_stats_every", layer_stats_every, owner=type(self).__name__)
        ddp_kwargs.setdefault("gradient_as_bucket_view", True)
        super().__init__(**ddp_kwargs)

    def setup_module(self, module: Any) -> Any:
        _reject_sharded(module, type(self).__name__)
        ddp_model = super().setup_module(module)
        self._fastml_adopt(lambda: attach(ddp_model, self._fastml_plan, owner=type(self).__name__,
                                          check_replicas_every=self._fastml_check_every,
                                          layer_stats_every=self._fastml_layer_stats_every,
                                          ranks_per_node=_ranks_per_node(self)))
        return ddp_model

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        # fabric.save calls this on every rank: the gather below is a collective.
        if self._fastml_state is not None:
            _check_key_free(state)
            state = {**state, CHECKPOINT_KEY: self._fastml_state.state_dict(all_ranks=True)}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        _load_from_remainder(self, remainder, state)
        return remainder


# -- the classes, one per Lightning flavour --------------------------------------------------------------------
def trainer_class(base: type, package: str) -> type:
    """``FastMLStrategy`` of one Trainer flavour: ``base`` is its ``DDPStrategy``, ``package`` its name
    (``lightning.pytorch`` or ``pytorch_lightning``). Called once per flavour, by
    :func:`fastml_strategy.lightning.strategy_class`."""

    class FastMLStrategy(_TrainerStrategy, base):
        """DDP with FastML's compressed gradient all-reduce, for ``lightning.pytorch.Trainer``.

        Args:
            plan: a :class:`~fastml_strategy.Plan`, a recipe name (``"int4"``, ``"topk1"``...), a plan JSON
                path, or None to read ``FASTML_PLAN`` (default ``int4``).
            check_replicas_every: compare a checksum of the parameters across ranks every N steps and raise
                on every rank if they differ (0: never; None: ``FASTML_CHECK_REPLICAS_EVERY``, default 0).
            log_every_n_steps: send compression ratio and bytes per step to the loggers every N optimizer
                steps (None: the Trainer's ``log_every_n_steps``; 0: never).
            layer_stats_every: measure and log each layer's relative compression error every N steps
                (None: ``FASTML_LAYER_STATS_EVERY``, else ten times ``log_every_n_steps``; 0: never).
            layer_errors_every_n_steps: deprecated name of ``layer_stats_every`` (warns; will be removed).
            **ddp_kwargs: everything Lightning's ``DDPStrategy`` takes (``static_graph``,
                ``find_unused_parameters``, ``process_group_backend``, ``timeout``, ``start_method``...),
                except the comm-hook arguments. ``gradient_as_bucket_view`` defaults to True here (DDP's
                own default is False): the gradients are views into DDP's buckets, which saves DDP's two
                copies of every gradient per step (measured: 8% of an int4 step of the README MLP on CPU at
                1 Gbit/s) and one gradient's memory; pass ``gradient_as_bucket_view=False`` for DDP's
                behaviour (e.g. if your code calls ``detach_()`` on a gradient).
        """

        _fastml_base = base
        _fastml_package = package

    return FastMLStrategy


def fabric_class(base: type, package: str) -> type:
    """``FastMLFabricStrategy`` of one Fabric flavour: ``base`` is its ``DDPStrategy``, ``package`` its name
    (``lightning.fabric`` or ``lightning_fabric``). Called once per flavour, by
    :func:`fastml_strategy.lightning.strategy_class`."""

    class FastMLFabricStrategy(_FabricStrategy, base):
        """DDP with FastML's compressed gradient all-reduce, for ``lightning.fabric.Fabric``.

        ``fabric.setup(model, optimizer)`` registers the hook; ``fabric.save(path, state)`` adds the FastML
        state of every rank under ``"fastml_strategy"``; ``fabric.load(path, state)`` restores it (and does
        not return it among the leftovers). Log ``fabric.strategy.compression_metrics()`` with
        ``fabric.log_dict``.

        Args:
            plan: as for :class:`FastMLStrategy` (None reads ``FASTML_PLAN``).
            check_replicas_every: as for :class:`FastMLStrategy`.
            layer_stats_every: measure each layer's compression error every N steps (0: never; None:
                ``FASTML_LAYER_STATS_EVERY``, else 10); it costs one extra pass over the gradients of that step.
            **ddp_kwargs: everything Fabric's ``DDPStrategy`` takes; ``gradient_as_bucket_view`` defaults
                to True, as for :class:`FastMLStrategy`.
        """

        _fastml_base = base
        _fastml_package = package

    return FastMLFabricStrategy
