"""``strategy="fastml_localsgd"`` for Lightning and Fabric: local steps with a compressed outer
synchronisation.

``FastMLLocalSGDStrategy`` / ``FastMLLocalSGDFabricStrategy`` are Lightning's ``DDPStrategy`` without
the ``DistributedDataParallel`` wrapper (processes, distributed sampler, ``broadcast``/``barrier`` and
metric sync are kept): the inner steps do not communicate at all.

1. Where DDP would wrap the model (``configure_ddp`` / Fabric's ``setup_module``) the strategy builds
   :class:`~fastml_strategy.LocalSGD` on the plain model: rank 0's weights are broadcast, the plan is
   agreed across ranks. Its settings (``every``, ``outer``, ``outer_lr``, ``outer_momentum``,
   ``fragments``, ``delay``) are the arguments, else ``FASTML_LOCALSGD_<NAME>``, else the plan's
   ``local_steps``, else LocalSGD's defaults; they are checked when the strategy is built, in every
   process, before any process group exists.
2. ``optimizer_step`` calls ``LocalSGD.step()`` after the optimizer: once per accumulated batch, once
   per ``opt.step()`` under manual optimization, and also for a step GradScaler skipped (every rank
   must reach each synchronisation at the same step). Fabric's loop needs no LocalSGD call.
3. Statistics: ``fastml/inner_steps``, ``outer_steps``, ``bytes_per_inner_step``,
   ``bytes_per_outer_step``, ``compression_ratio``, ``ratio_vs_ddp`` every ``log_every_n_steps``.
4. Checkpoints: between two synchronisations each rank's model and inner optimizer are its own, so
   saving (a collective) gathers every rank's model, optimizer state and ``LocalSGD.state_dict()``
   under ``checkpoint["fastml_strategy"]["per_rank"]``; resuming gives each rank its own back and
   continues bit for bit. Saving does not force a synchronisation (the trajectory would then depend
   on when checkpoints are written).
5. At the end of ``fit`` (Fabric: ``strategy.teardown()``) LocalSGD's thread and process group are
   closed, a fragment update still waiting for its delay kept pending (``localsgd.synchronize()``
   applies it), so a second ``fit`` leaks nothing and the end of ``fit`` does not move the trajectory.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import warnings
from typing import Any, Callable

import torch

from fastml_strategy._integration import LIGHTNING_KEYS, layer_errors, setting, take_local_steps
from fastml_strategy._validate import LAYER_STATS_EVERY_LOCALSGD
from fastml_strategy.config import Plan
from fastml_strategy.hook import own_rank_state
from fastml_strategy.integrations.lightning._common import (_HOOK_KWARGS, _HOOK_KWARGS_FIX, CHECKPOINT_KEY,
                                                            LOCALSGD_STRATEGY_NAME, _check_key_free,
                                                            _FastMLStateHolder, _ranks_per_node, _reject_kwargs,
                                                            _set_private, _TrainerLogging)
from fastml_strategy.localsgd import STATE_FORMAT_VERSION as LOCALSGD_FORMAT_VERSION
from fastml_strategy.localsgd import LocalSGD, gather_to_rank_zero, resolve_settings

__all__ = ["trainer_class", "fabric_class"]

log = logging.getLogger(__name__)


# -- LocalSGD: what the Trainer and Fabric strategies share ---------------------------------------------------
class _LocalSGDMixin:
    """Settings, building :class:`~fastml_strategy.LocalSGD` on the unwrapped model, one inner step per
    optimizer step, and per-rank checkpoints; for both LocalSGD strategies.

    Between two synchronisations every rank's model and inner optimizer hold their own local progress, so
    a checkpoint that rank 0 alone writes would lose the other ranks'. Saving (a collective: Lightning
    and Fabric save on every rank) gathers each rank's model, inner optimizer and LocalSGD state under
    ``checkpoint["fastml_strategy"]["per_rank"]``; rank 0 writes them with its own (the checkpoint's
    usual entries are rank 0's). Loading gives each rank its own part back, so the run continues on the
    same trajectory bit for bit. Saving does not synchronise: forcing an outer step there would make the
    trajectory depend on when checkpoints are written.
    """

    _fastml_when = "LocalSGD is built when fit() (or fabric.setup) prepares the model"

    def _fastml_localsgd_init(self, plan: Any, kwargs: dict[str, Any]) -> None:
        # LocalSGD's settings (every=, outer=, ...: LocalSteps' fields) arrive among **kwargs and leave
        # them here; what remains is DDPStrategy's.
        settings = take_local_steps(kwargs)
        _reject_kwargs(type(self).__name__, kwargs, _HOOK_KWARGS,
                       "synchronises the model with LocalSGD every few steps, not through DDP", _HOOK_KWARGS_FIX)
        resolved, self._fastml_settings = resolve_settings(plan, **settings)  # fails here, on every process
        self._fastml_init(resolved)

    def _fastml_reject_ddp_kwargs(self, kwargs: dict[str, Any]) -> None:
        # DDPStrategy keeps the arguments its __init__ does not name for DistributedDataParallel, which
        # this strategy never builds: refuse them (read from the public signature, before any setup).
        params = inspect.signature(self._fastml_base.__init__).parameters.values()
        known = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        given = sorted(set(kwargs) - known)
        if given:
            raise ValueError(f"{type(self).__name__} does not wrap the model in DistributedDataParallel, so "
                             f"DDP's arguments {given} do not apply; remove them")

    @property
    def localsgd(self) -> Any:
        """The live :class:`~fastml_strategy.LocalSGD` (None before the model is prepared):
        ``stats()``, ``synchronize()`` (apply a delayed fragment update before evaluating)."""
        return self._fastml_state

    @property
    def settings(self) -> dict[str, Any]:
        """The LocalSGD settings in force (arguments, else ``FASTML_LOCALSGD_*``, else the plan's
        ``local_steps``, else LocalSGD's defaults)."""
        return dict(self._fastml_settings)

    @staticmethod
    def _fastml_steps(state: Any) -> int:
        return state.inner_steps

    def _fastml_island(self, module: torch.nn.Module) -> torch.nn.Module:
        """DiLoCo islands: on ``num_nodes`` > 1 machines of ``devices`` > 1 processes, ``module`` in DDP
        over the processes of its machine (inner steps all-reduce inside the machine; LocalSGD then
        synchronises across machines only); else ``module``. A collective."""
        if int(getattr(self, "num_nodes", 1) or 1) <= 1 or int(getattr(self, "num_processes", 1) or 1) <= 1:
            return module
        from fastml_strategy.localsgd import island_model

        return island_model(module, _ranks_per_node(self), owner=type(self).__name__)

    def _fastml_build(self, module: torch.nn.Module, layer_stats_every: int = LAYER_STATS_EVERY_LOCALSGD) -> Any:
        log.debug(f"{type(self).__name__}: LocalSGD on the unwrapped model, {self._fastml_settings}")
        # A collective: checks the plan against the model on every rank, broadcasts rank 0's weights.
        return self._fastml_adopt(lambda: LocalSGD(module, None, plan=self._fastml_plan,
                                                   layer_stats_every=layer_stats_every, **self._fastml_settings))

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        # One inner step per optimizer step, on every rank alike: with accumulation this runs once per
        # accumulated batch, with manual optimization once per opt.step(). A step that GradScaler skips
        # on one rank still counts, so that every rank reaches the synchronisation at the same step.
        out = super().optimizer_step(*args, **kwargs)
        state = self._fastml_state
        if state is not None:
            state.step()
        return out

    def compression_metrics(self, layers: bool = False, prefix: str = "fastml/") -> dict[str, float]:
        """Scalars ready for a logger: inner and outer steps, bytes sent per inner step and per outer step
        (per fragment synchronisation), the compression ratio and the ratio of bytes against DDP's fp32
        all-reduce every step; with ``layers=True`` each layer's relative compression error."""
        s = self.compression_stats()
        out = {f"{prefix}inner_steps": float(s["inner_steps"]), f"{prefix}outer_steps": float(s["outer_steps"]),
               f"{prefix}bytes_per_inner_step": float(s["bytes_per_inner_step"]),
               f"{prefix}compression_ratio": float(s["compression_ratio"])}
        if s["outer_steps"]:
            out[f"{prefix}bytes_per_outer_step"] = s["bytes_sent"] / s["outer_steps"]
            out[f"{prefix}ratio_vs_ddp"] = float(s["ratio_vs_ddp"])
        if layers:
            out.update(layer_errors(s, f"{prefix}{LIGHTNING_KEYS.layer_error}"))
        return out

    def _fastml_own_part(self, saved: dict) -> dict | None:
        """This rank's part of a LocalSGD checkpoint; None for the FastML state of another strategy (a
        checkpoint of strategy='fastml': its residuals do not apply to LocalSGD)."""
        if not all(isinstance(p, dict) and "localsgd" in p for p in saved.get("per_rank", [None])):
            return None
        try:
            return own_rank_state(saved, self.global_rank, self.world_size, LOCALSGD_FORMAT_VERSION,
                                  type(self).__name__)
        except ValueError as e:
            raise ValueError(f"the checkpoint's LocalSGD state does not fit this run ({e})") from e

    def _fastml_load(self, own: dict, drop: str = f"checkpoint[{CHECKPOINT_KEY!r}]") -> None:
        # `own`: this rank's part (model, inner optimizer, LocalSGD). Its model goes back after LocalSGD's
        # construction, which broadcast rank 0's weights.
        if self._fastml_state is None:
            self._fastml_pending = own
            return
        self._fastml_restore_own(own)
        super()._fastml_load(own["localsgd"], drop)

    def _fastml_restore_own(self, own: dict) -> None:
        raise NotImplementedError

    def _fastml_warn_missing(self) -> None:
        if self.is_global_zero:
            warnings.warn(
                "the checkpoint being resumed holds no LocalSGD state (it was written without "
                f"strategy='{LOCALSGD_STRATEGY_NAME}', or with save_weights_only=True): every rank restarts from "
                "rank 0's weights with fresh outer momentum and residuals, so this run will not match an "
                "uninterrupted one exactly", stacklevel=3)

    def teardown(self) -> None:
        # Stop LocalSGD's thread and group without applying a delayed update (the trajectory must not
        # depend on where fit() ends); stats(), state_dict() and synchronize() still work.
        state = self._fastml_state
        if state is not None:
            state.close(apply_pending=False)
        self._fastml_pending = None
        super().teardown()


# -- LocalSGD: Lightning Trainer --------------------------------------------------------------------------
class _TrainerLocalSGDStrategy(_TrainerLogging, _LocalSGDMixin, _FastMLStateHolder):
    """What :class:`FastMLLocalSGDStrategy` does to a Trainer flavour's ``DDPStrategy``: LocalSGD instead
    of the DDP wrapper, per-rank checkpoints, its figures in the loggers."""

    def __init__(
        self,
        plan: Plan | str | os.PathLike | dict | None = None,
        *,
        log_every_n_steps: int | None = None,
        layer_stats_every: int | None = None,
        layer_errors_every_n_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        self._fastml_localsgd_init(plan, kwargs)
        self._fastml_log_init(log_every_n_steps, layer_stats_every, layer_errors_every_n_steps)
        self._fastml_reject_ddp_kwargs(kwargs)
        super().__init__(**kwargs)

    def configure_ddp(self) -> None:
        # Replaces DDPStrategy's: no DistributedDataParallel wrapper, so no all-reduce in the inner steps
        # (islands: DDP over the processes of one machine).
        self.model = self._fastml_island(self.model)
        self._fastml_build(self.model)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # Every rank calls this (Trainer.save_checkpoint, ModelCheckpoint); rank 0 writes every rank's part.
        state = self._fastml_state
        if state is not None and "optimizer_states" in checkpoint:  # not a weights-only checkpoint
            parts = gather_to_rank_zero({"rank": self.global_rank, "state_dict": checkpoint["state_dict"],
                                     "optimizer_states": checkpoint["optimizer_states"],
                                     "localsgd": state.state_dict()})
            if parts is not None:
                checkpoint[CHECKPOINT_KEY] = parts
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # Runs before setup (LocalSGD does not exist yet): this rank's model and inner optimizer replace
        # rank 0's in what Lightning restores; LocalSGD's part waits for configure_ddp.
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.pop(CHECKPOINT_KEY, None)
        trainer = self._fastml_trainer()
        if trainer is None or trainer.state.fn != "fit":
            return checkpoint
        own = None if saved is None else self._fastml_own_part(saved)
        if own is None:
            self._fastml_warn_missing()
            return checkpoint
        checkpoint["state_dict"] = own["state_dict"]
        checkpoint["optimizer_states"] = own["optimizer_states"]
        self._fastml_pending = own
        return checkpoint

    def _fastml_restore_own(self, own: dict) -> None:
        self.load_model_state_dict({"state_dict": own["state_dict"]})


# -- LocalSGD: Fabric -----------------------------------------------------------------------------------------
class _NoBackwardSync:
    """``fabric.no_backward_sync(model)``: nothing to block, the inner steps do not communicate."""

    def no_backward_sync(self, module: Any, enabled: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class _FabricLocalSGDStrategy(_LocalSGDMixin, _FastMLStateHolder):
    """What :class:`FastMLLocalSGDFabricStrategy` does to a Fabric flavour's ``DDPStrategy``: LocalSGD
    instead of the DDP wrapper, per-rank ``fabric.save`` / ``fabric.load``."""

    def __init__(
        self,
        plan: Plan | str | os.PathLike | dict | None = None,
        *,
        layer_stats_every: int | None = None,
        **kwargs: Any,
    ) -> None:
        self._fastml_localsgd_init(plan, kwargs)
        # Measured every N outer steps; Fabric logs nothing itself.
        self._fastml_layer_stats_every = setting("layer_stats_every", layer_stats_every,
                                                 owner=type(self).__name__, localsgd=True)
        self._fastml_objects: dict[str, Any] = {}  # what fabric.load restores into: each rank's own goes back
        self._fastml_reject_ddp_kwargs(kwargs)
        super().__init__(**kwargs)
        _set_private(self, "_backward_sync_control", _NoBackwardSync(),
                     "fabric.no_backward_sync(model) would call DDP's no_sync on a model with no DDP wrapper")

    def setup_module(self, module: Any) -> Any:
        # Replaces DDPStrategy's: the module stays as it is (Fabric has moved it to the device), or on
        # several machines of several processes goes into DDP over its machine (islands).
        module = self._fastml_island(module)
        self._fastml_build(module, layer_stats_every=self._fastml_layer_stats_every)
        return module

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        # fabric.save calls this on every rank: the gather is a collective.
        fml = self._fastml_state
        if fml is not None:
            _check_key_free(state)
            own = {"rank": self.global_rank, "localsgd": fml.state_dict(),
                   "objects": {k: v for k, v in self._convert_stateful_objects_in_state(state, filter or {}).items()
                               if hasattr(state[k], "state_dict")}}
            parts = gather_to_rank_zero(own)
            if parts is not None:
                state = {**state, CHECKPOINT_KEY: parts}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        saved = remainder.get(CHECKPOINT_KEY) if isinstance(remainder, dict) else None
        if saved is None or self._fastml_state is None:
            return remainder
        if state:  # restoring into objects: FastML's part is restored too, not a leftover
            remainder.pop(CHECKPOINT_KEY)
        own = self._fastml_own_part(saved)
        if own is None:
            self._fastml_warn_missing()
            return remainder
        self._fastml_objects = state if isinstance(state, dict) else {}
        self._fastml_load(own)
        return remainder

    def _fastml_restore_own(self, own: dict) -> None:
        # The base class restored rank 0's objects; each rank takes its own model and optimizer state back.
        for name, obj in self._fastml_objects.items():
            sd = own["objects"].get(name)
            if sd is None:
                continue
            if isinstance(obj, torch.nn.Module):
                self.load_module_state_dict(module=obj, state_dict=sd)
            elif hasattr(obj, "load_state_dict"):
                obj.load_state_dict(sd)


# -- the classes, one per Lightning flavour --------------------------------------------------------------------
def trainer_class(base: type, package: str) -> type:
    """``FastMLLocalSGDStrategy`` of one Trainer flavour: ``base`` is its ``DDPStrategy``, ``package`` its
    name (``lightning.pytorch`` or ``pytorch_lightning``). Called once per flavour, by
    :func:`fastml_strategy.lightning.strategy_class`."""

    class FastMLLocalSGDStrategy(_TrainerLocalSGDStrategy, base):
        """Local steps with FastML's compressed outer synchronisation (:class:`~fastml_strategy.LocalSGD`,
        DiLoCo), for ``lightning.pytorch.Trainer``: no all-reduce in the inner steps.

        Lightning's ``DDPStrategy`` (processes, the distributed sampler, ``broadcast``/``barrier``, metric
        sync) minus the ``DistributedDataParallel`` wrapper: every rank trains alone; after every optimizer
        step the strategy counts an inner step, and every ``every`` steps LocalSGD averages the compressed
        pseudo-gradients and applies the outer step, identical on every rank. The replicas start from rank
        0's weights. Checkpoints hold every rank's model, inner optimizer and LocalSGD state (see
        :mod:`fastml_strategy.lightning.localsgd`); ``fit(ckpt_path=...)`` gives each rank its own.

        Args:
            plan: compression of the pseudo-gradients: a :class:`~fastml_strategy.Plan`, a recipe name, a plan
                JSON path, or None to read ``FASTML_PLAN`` (default ``int4``). A plan from ``fastml-autotune``
                that chose local steps also supplies the settings below that are not given.
            every, outer, outer_lr, outer_momentum, fragments, delay: as for :class:`~fastml_strategy.LocalSGD`;
                None reads ``FASTML_LOCALSGD_EVERY`` (..._OUTER, ..._OUTER_LR, ..._OUTER_MOMENTUM,
                ..._FRAGMENTS, ..._DELAY), else the plan's ``local_steps``, else LocalSGD's default (50,
                ``"nesterov"``, 0.7, 0.9, 1, 0).
            log_every_n_steps: send the LocalSGD figures to the loggers every N optimizer steps (None: the
                Trainer's ``log_every_n_steps``; 0: never).
            layer_stats_every: measure and log each layer's relative compression error every N steps
                (None: ``FASTML_LAYER_STATS_EVERY``, else ten times ``log_every_n_steps``; 0: never).
            layer_errors_every_n_steps: deprecated name of ``layer_stats_every`` (warns; will be removed).
            **kwargs: ``process_group_backend``, ``timeout``, ``start_method`` and the other arguments of
                Lightning's ``DDPStrategy`` that are not DDP's own.
        """

        _fastml_base = base
        _fastml_package = package

    return FastMLLocalSGDStrategy


def fabric_class(base: type, package: str) -> type:
    """``FastMLLocalSGDFabricStrategy`` of one Fabric flavour: ``base`` is its ``DDPStrategy``, ``package``
    its name (``lightning.fabric`` or ``lightning_fabric``). Called once per flavour, by
    :func:`fastml_strategy.lightning.strategy_class`."""

    class FastMLLocalSGDFabricStrategy(_FabricLocalSGDStrategy, base):
        """Local steps with FastML's compressed outer synchronisation, for ``lightning.fabric.Fabric``.

        ``model, optimizer = fabric.setup(model, optimizer)`` keeps the model unwrapped (no DDP) and builds
        :class:`~fastml_strategy.LocalSGD` on it (rank 0's weights everywhere); every ``optimizer.step()``
        then counts one inner step and synchronises when due: the training loop needs no LocalSGD call.
        ``fabric.save(path, state)`` adds every rank's part of the stateful objects (model, optimizer) and its
        LocalSGD state under ``"fastml_strategy"``; ``fabric.load(path, state)`` gives each rank its own.
        ``fabric.strategy.localsgd`` is the LocalSGD (``stats()``, ``synchronize()``); log
        ``fabric.strategy.compression_metrics()`` with ``fabric.log_dict``; call ``fabric.strategy.teardown()``
        (or set up a new model) to stop its thread.

        Args:
            plan, every, outer, outer_lr, outer_momentum, fragments, delay: as for
                :class:`FastMLLocalSGDStrategy`.
            layer_stats_every: measure each layer's compression error every N outer steps (0: never; None:
                ``FASTML_LAYER_STATS_EVERY``, else 1).
            **kwargs: the arguments of Fabric's ``DDPStrategy`` that are not DDP's own.
        """

        _fastml_base = base
        _fastml_package = package

    return FastMLLocalSGDFabricStrategy
