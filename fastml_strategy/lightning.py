"""Lightning and Fabric: ``strategy="fastml"`` (DDP), ``strategy="fastml_fsdp"`` (FSDP2 / HSDP) and
``strategy="fastml_localsgd"`` (local steps, DiLoCo).

``strategy="fastml"``: DDP with a compressed all-reduce
------------------------------------------------------
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

``strategy="fastml_fsdp"``: FSDP2 (``fully_shard``) with a compressed reduce-scatter
-----------------------------------------------------------------------------------
``FastMLFSDPStrategy`` / ``FastMLFSDPFabricStrategy`` are Lightning's ``ModelParallelStrategy`` (the
FSDP2 strategy; Lightning's own ``FSDPStrategy`` is FSDP1, which FastML does not compress) with four
changes:

1. The mesh is data-parallel only: 1-D ``("shard",)`` over every rank (FSDP), or, with
   ``replicate_size=R`` (``hybrid=True``: R = number of nodes), 2-D ``("replicate", "shard")`` of
   shape (R, world/R): shard inside a node, replicate across nodes (HSDP). Consecutive ranks (one
   node) form a shard group. Every rank gets its own slice of the data.
2. Sharding: if ``configure_model`` (Trainer) or ``parallelize_fn`` (Fabric) applied ``fully_shard``
   (pass ``mesh=self.device_mesh``), that sharding is kept and the strategy adds the root unit if the
   user did not. Otherwise the strategy shards by ``auto_wrap_policy``, deepest modules first and the
   root last: a set of module classes (``{TransformerBlock}``), a predicate ``module -> bool``, or a
   whole number N (every module whose OWN parameters hold >= N elements). The default is
   N = 2**20: large layers become units of their own (a unit's reduce-scatter carries at least 4 MiB
   of fp32 gradient), small layers, norms and biases stay in the root unit. ``configure_model`` is
   optional, unlike with ``ModelParallelStrategy``.
3. Then :func:`fastml_strategy.fsdp.register` replaces FSDP's reduce-scatter (FSDP) or its
   cross-replica all-reduce (HSDP; ``shard_plan`` compresses the intra-node reduce-scatter too) with
   FastML's compressed collectives. Gradient-accumulation micro-batches do not reduce at all
   (``set_requires_gradient_sync(False)``: unsharded gradients are kept until the last micro-batch).
4. Checkpoints: with ``save_distributed_checkpoint=True`` (the default) Lightning writes a folder of
   per-rank shards (``torch.distributed.checkpoint``); every rank adds its own FastML state
   (:meth:`~fastml_strategy.fsdp.FSDPState.distributed_state_dict`: residuals, step, plans) in the
   subfolder ``fastml_strategy/`` (its own DCP checkpoint, written after Lightning's part), so no
   rank holds another's residuals. A single-file checkpoint (``save_distributed_checkpoint=False``)
   gathers them under ``checkpoint["fastml_strategy"]`` as for DDP. Resuming
   (``fit(ckpt_path=...)``, ``fabric.load``) gives each rank its part back; the run continues bit
   for bit. Resume with the same number of processes and the same mesh.

Statistics and logging are those of the DDP strategies, plus ``fastml/residual_bytes`` (the
error-feedback memory of a rank).

``strategy="fastml_localsgd"``: local steps with a compressed outer synchronisation
----------------------------------------------------------------------------------
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

Registering the names: ``import fastml_strategy.lightning``
----------------------------------------------------------
``Trainer(strategy="fastml")`` (``"fastml_fsdp"``, ``"fastml_localsgd"``; Fabric alike) needs the names
in Lightning's strategy registries (``StrategyRegistry.register``, Lightning's extension point).
Importing this module registers them (:func:`register_strategies`): with every Lightning flavour
already imported, or, if none is, with every installed one (``lightning``, ``pytorch_lightning``,
``lightning_fabric``), which it imports. ``import fastml_strategy`` does it too, but only when Lightning
was imported before it (a look at ``sys.modules``): the package itself never imports Lightning (about
2.5 s, and Triton) and touches no other package's import machinery. So write
``import fastml_strategy.lightning``, or import Lightning first. Lightning 2.6 has no entry point for
strategies (its entry points add callbacks, after the strategy name has been resolved), so no
installed-package mechanism can make the names work without an import.

The classes are built per framework (``lightning.pytorch`` and the standalone ``pytorch_lightning``
keep separate class hierarchies and registries): ``FastMLStrategy`` is ``lightning.pytorch``'s,
:func:`strategy_class` gives any flavour's.

Example::

    import fastml_strategy.lightning  # registers "fastml", "fastml_fsdp" and "fastml_localsgd"
    trainer = L.Trainer(strategy="fastml", accelerator="cpu", devices=2)  # plan from FASTML_PLAN
    # or explicitly:
    from fastml_strategy.lightning import FastMLFSDPStrategy, FastMLStrategy
    trainer = L.Trainer(strategy=FastMLStrategy(plan="int4", static_graph=True), devices=8)
    trainer = L.Trainer(strategy=FastMLFSDPStrategy(plan="int4", auto_wrap_policy={Block}, hybrid=True),
                        devices=8, num_nodes=4)
    trainer = L.Trainer(strategy=FastMLLocalSGDStrategy(every=50, plan="int4"), devices=8, num_nodes=4)
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from fastml_strategy._integration import LIGHTNING_KEYS, layer_errors, metrics, setting
from fastml_strategy._validate import LAYER_STATS_EVERY_LOCALSGD, renamed, whole_number
from fastml_strategy.config import Plan, resolve_plan
from fastml_strategy.hook import own_rank_state, register_hook
from fastml_strategy.localsgd import STATE_FORMAT_VERSION as LOCALSGD_FORMAT_VERSION
from fastml_strategy.localsgd import LocalSGD, gather_to_rank_zero, resolve_settings

if TYPE_CHECKING:  # the real classes are built lazily, see strategy_class()
    from lightning.fabric.strategies import DDPStrategy as FastMLFabricStrategy  # noqa: F401
    from lightning.fabric.strategies import ModelParallelStrategy as FastMLFSDPFabricStrategy  # noqa: F401
    from lightning.pytorch.strategies import DDPStrategy as FastMLStrategy  # noqa: F401
    from lightning.pytorch.strategies import ModelParallelStrategy as FastMLFSDPStrategy  # noqa: F401
    from lightning.fabric.strategies import DDPStrategy as FastMLLocalSGDFabricStrategy  # noqa: F401
    from lightning.pytorch.strategies import DDPStrategy as FastMLLocalSGDStrategy  # noqa: F401

__all__ = ["FastMLStrategy", "FastMLFabricStrategy", "FastMLFSDPStrategy", "FastMLFSDPFabricStrategy",
           "FastMLLocalSGDStrategy", "FastMLLocalSGDFabricStrategy", "strategy_class", "register_strategies",
           "CHECKPOINT_KEY", "STRATEGY_NAME", "FSDP_STRATEGY_NAME", "LOCALSGD_STRATEGY_NAME",
           "DEFAULT_MIN_WRAP_NUMEL"]

log = logging.getLogger(__name__)

STRATEGY_NAME = "fastml"
FSDP_STRATEGY_NAME = "fastml_fsdp"
LOCALSGD_STRATEGY_NAME = "fastml_localsgd"
# Key of the FastML state inside a Lightning checkpoint or a Fabric checkpoint dict, and the name of the
# subfolder of a distributed (DCP) checkpoint that holds every rank's FastML state.
CHECKPOINT_KEY = "fastml_strategy"
# DDPStrategy arguments that install another comm hook; FastML owns the hook.
_HOOK_KWARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
# ModelParallelStrategy arguments the FSDP strategies set themselves (they build a data-parallel mesh).
_MESH_KWARGS = ("data_parallel_size", "tensor_parallel_size")
# Default auto-wrap rule of the FSDP strategies: a module whose OWN parameters hold at least this many
# elements becomes an FSDP unit. 2**20 elements: each unit's reduce-scatter carries >= 4 MiB of fp32
# gradient (one large message rather than many small, latency-bound ones); smaller layers, norms and
# biases stay in the root unit. A choice, not a measurement: pass auto_wrap_policy for your model.
DEFAULT_MIN_WRAP_NUMEL = 1 << 20

# framework package -> (kind, attribute holding its strategy registry, the matching fabric package)
_FRAMEWORKS: dict[str, tuple[str, str, str]] = {
    "lightning.pytorch": ("trainer", "StrategyRegistry", "lightning.fabric"),
    "pytorch_lightning": ("trainer", "StrategyRegistry", "lightning_fabric"),
    "lightning.fabric": ("fabric", "STRATEGY_REGISTRY", "lightning.fabric"),
    "lightning_fabric": ("fabric", "STRATEGY_REGISTRY", "lightning_fabric"),
}
# strategy name -> (Lightning base class in <package>.strategies, registry description)
_STRATEGIES: dict[str, tuple[str, str]] = {
    STRATEGY_NAME: ("DDPStrategy",
                    "DDP with FastML's compressed gradient all-reduce (plan from FASTML_PLAN, default int4)"),
    FSDP_STRATEGY_NAME: ("ModelParallelStrategy",
                         "FSDP2/HSDP with FastML's compressed reduce-scatter (plan from FASTML_PLAN, default int4)"),
    LOCALSGD_STRATEGY_NAME: ("DDPStrategy",
                             "local steps (LocalSGD, DiLoCo) with FastML's compressed outer synchronisation, "
                             "no per-step all-reduce (H from FASTML_LOCALSGD_EVERY, default 50)"),
}
# (package, strategy name) -> public name of our class there
_CLASS_NAMES: dict[tuple[str, str], str] = {
    ("lightning.pytorch", STRATEGY_NAME): "FastMLStrategy",
    ("pytorch_lightning", STRATEGY_NAME): "_PLFastMLStrategy",
    ("lightning.fabric", STRATEGY_NAME): "FastMLFabricStrategy",
    ("lightning_fabric", STRATEGY_NAME): "_LFFastMLFabricStrategy",
    ("lightning.pytorch", FSDP_STRATEGY_NAME): "FastMLFSDPStrategy",
    ("pytorch_lightning", FSDP_STRATEGY_NAME): "_PLFastMLFSDPStrategy",
    ("lightning.fabric", FSDP_STRATEGY_NAME): "FastMLFSDPFabricStrategy",
    ("lightning_fabric", FSDP_STRATEGY_NAME): "_LFFastMLFSDPFabricStrategy",
    ("lightning.pytorch", LOCALSGD_STRATEGY_NAME): "FastMLLocalSGDStrategy",
    ("pytorch_lightning", LOCALSGD_STRATEGY_NAME): "_PLFastMLLocalSGDStrategy",
    ("lightning.fabric", LOCALSGD_STRATEGY_NAME): "FastMLLocalSGDFabricStrategy",
    ("lightning_fabric", LOCALSGD_STRATEGY_NAME): "_LFFastMLLocalSGDFabricStrategy",
}
_classes: dict[tuple[str, str], type] = {}
_lock = threading.RLock()


# -- settings shared by the strategies ---------------------------------------------------------------------
def _layer_stats_every(owner: str, value: int | None, old_value: int | None, default: int | None) -> int | None:
    """``layer_stats_every`` (the old keyword ``layer_errors_every_n_steps`` still accepted, with a
    FutureWarning): the argument, else ``FASTML_LAYER_STATS_EVERY``, else ``default``; 0 is off."""
    value = renamed(owner, "layer_errors_every_n_steps", old_value, "layer_stats_every", value, stacklevel=5)
    return setting("layer_stats_every", value, owner=owner, default=default)


def _reject_kwargs(owner: str, kwargs: dict[str, Any], names: tuple[str, ...], why: str) -> None:
    given = [k for k in names if kwargs.get(k) is not None]
    if given:
        raise ValueError(f"{owner} {why}, so it does not take {given}; {_KWARGS_FIX[names]}")


_KWARGS_FIX = {
    _HOOK_KWARGS: "remove them, or use strategy='ddp' if you want a different comm hook",
    _MESH_KWARGS: "remove them (replicate_size=R or hybrid=True chooses HSDP), or use Lightning's "
                  "ModelParallelStrategy for tensor parallelism, which FastML does not compress",
}


def _lightning_private(package: str, module: str, name: str) -> Any:
    """A private helper function of Lightning (``<fabric package>.utilities.<module>.<name>``); fails
    naming the Lightning version FastML was tested with. (The other internals this file touches: the
    private attributes of :func:`_set_private`, and the private methods ``_setup_distributed`` and
    ``_convert_stateful_objects_in_state`` of Lightning's strategies, which the subclasses here call;
    tests/test_upstream_internals.py checks them all.)"""
    fabric = _FRAMEWORKS[package][2]
    try:
        return getattr(importlib.import_module(f"{fabric}.utilities.{module}"), name)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"FastML's FSDP strategies need {fabric}.utilities.{module}.{name} (Lightning 2.6; "
                          f"tested with 2.6.6); this Lightning lacks it ({e}). Install lightning==2.6.*") from e


def _set_private(obj: Any, attr: str, value: Any, consequence: str) -> None:
    """Set a private attribute that Lightning (2.6) itself sets and reads, as its own strategies do.
    If this Lightning has no such attribute, setting it would do nothing: log a warning saying what is
    lost (tests/test_upstream_internals.py fails on such a Lightning)."""
    if not hasattr(obj, attr):
        log.warning("FastML: %s has no attribute %s (Lightning internals changed; FastML was tested with "
                    "Lightning 2.6): %s", type(obj).__name__, attr, consequence)
    setattr(obj, attr, value)


def _reject_sharded(module: torch.nn.Module, owner: str) -> None:
    """The DDP strategies compress DDP's all-reduce: a model already sharded by FSDP belongs elsewhere."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    for m in module.modules():
        if isinstance(m, FullyShardedDataParallel):
            raise TypeError(
                f"{owner} (strategy='{STRATEGY_NAME}') is DDP, but the model holds FSDP1 "
                f"FullyShardedDataParallel modules, which FastML does not compress. Shard with FSDP2 instead: "
                f"use strategy='{FSDP_STRATEGY_NAME}' and call torch.distributed.fsdp.fully_shard in "
                f"configure_model (or let the strategy shard by auto_wrap_policy)")
        if isinstance(m, FSDPModule):
            raise TypeError(
                f"{owner} (strategy='{STRATEGY_NAME}') is DDP, but configure_model sharded the model with "
                f"fully_shard (FSDP2); use strategy='{FSDP_STRATEGY_NAME}', which compresses FSDP2's "
                f"reduce-scatter")


class _FastMLStateHolder:
    """The FastML bits every strategy shares: the plan, the live state, a pending checkpoint part,
    compression statistics and logger metrics."""

    # what the user must do before compression_stats() has anything to say
    _fastml_when = "FastML is registered when fit() (or fabric.setup) prepares the model"

    def _fastml_init(self, plan: Any, check_replicas_every: int | None = 0) -> None:
        # -- tuned by the user
        self._fastml_plan: Plan = resolve_plan(plan)  # a bad FASTML_PLAN fails here, on every process
        self._fastml_check_every = setting("check_replicas_every", check_replicas_every, owner=type(self).__name__)
        # -- internal state
        self._fastml_state: Any = None  # FastMLState (DDP) or FSDPState, once the model is prepared
        self._fastml_pending: dict | None = None  # read from a checkpoint before the state existed
        self._fastml_mark = (0, 0)  # (step, bytes_sent) at registration: per-step traffic since then

    @property
    def plan(self) -> Plan:
        """The compression plan this strategy registers."""
        return self._fastml_plan

    @property
    def fastml_state(self) -> Any:
        """The live :class:`~fastml_strategy.FastMLState` (DDP) or :class:`~fastml_strategy.fsdp.FSDPState`
        (FSDP), or None before the model is prepared."""
        return self._fastml_state

    def _fastml_adopt(self, register: Callable[[], Any]) -> Any:
        """Close the previous state, ``register()`` a new one, load a pending checkpoint part into it."""
        # A second fit() prepares the model again: the old state's hooks belong to the old preparation.
        self._fastml_close()
        state = register()
        self._fastml_state = state
        if self._fastml_pending is not None:
            pending, self._fastml_pending = self._fastml_pending, None
            self._fastml_load(pending)
        self._fastml_mark = (self._fastml_steps(state), int(state.stats().get("bytes_sent", 0)))
        return state

    @staticmethod
    def _fastml_steps(state: Any) -> int:
        """The state's step counter (synchronised backward passes; LocalSGD: inner steps)."""
        return state.step

    def _fastml_load(self, saved: dict, drop: str = f"checkpoint[{CHECKPOINT_KEY!r}]") -> None:
        if self._fastml_state is None:  # loaded before the model was prepared: applied by _fastml_adopt
            self._fastml_pending = saved
            return
        try:
            self._fastml_state.load_state_dict(saved)
        except (ValueError, KeyError) as e:
            raise ValueError(
                f"the checkpoint's FastML state does not fit this run ({e}); resume with the same number of "
                f"processes and a plan for the same model, or delete {drop} to start the error-feedback "
                f"residuals from zero"
            ) from e

    def _fastml_warn_missing(self) -> None:
        if getattr(self, "is_global_zero", True):
            warnings.warn(
                "the checkpoint being resumed holds no FastML state (it was written without FastML, or "
                "with save_weights_only=True): the error-feedback residuals start from zero, so this run "
                "will not match an uninterrupted one exactly",
                stacklevel=3,
            )

    def _fastml_close(self) -> None:
        state, self._fastml_state = self._fastml_state, None
        if state is not None:
            state.close()

    def compression_stats(self) -> dict[str, Any]:
        """This rank's compression statistics (``stats()`` of the FastML state): ``steps``,
        ``bytes_sent``, ``bytes_uncompressed``, ``compression_ratio``, per-layer ``layers`` and, for FSDP,
        ``residual_bytes`` and the figures of each hop.

        Available from the first training step until the next ``fit`` (so also right after ``fit``).
        """
        if self._fastml_state is None:
            raise RuntimeError(f"no FastML statistics yet: {self._fastml_when}; call compression_stats() "
                               f"during or after fit()")
        return self._fastml_state.stats()

    def compression_metrics(self, layers: bool = False, prefix: str = "fastml/") -> dict[str, float]:
        """Scalars ready for a logger: compression ratio, bytes sent per step since the state was
        registered, the error-feedback memory (``residual_bytes``, FSDP) and with ``layers=True`` each
        layer's relative compression error."""
        return metrics(self.compression_stats(), LIGHTNING_KEYS, since=self._fastml_mark, layers=layers,
                       prefix=prefix)


# -- Lightning Trainer: logging shared by both Trainer strategies ----------------------------------------
class _TrainerLogging:
    """Sends compression figures to the Trainer's loggers after optimizer steps (rank 0 only)."""

    def _fastml_log_init(self, log_every_n_steps: int | None, layer_stats_every: int | None,
                         layer_errors_every_n_steps: int | None) -> None:
        owner = type(self).__name__
        if log_every_n_steps is not None:
            whole_number("log_every_n_steps", log_every_n_steps, 0, owner=owner, note=" (0 turns it off)")
        self._fastml_log_every = log_every_n_steps
        # None: ten times the scalars' interval (see _fastml_intervals)
        self._fastml_layer_every = _layer_stats_every(owner, layer_stats_every, layer_errors_every_n_steps, None)
        self._fastml_logged_step = -1

    def _fastml_trainer(self) -> Any:
        module = self.lightning_module
        if module is None:
            return None
        try:
            return module.trainer
        except RuntimeError:  # "not attached to a Trainer"
            return None

    def _fastml_intervals(self) -> tuple[int, int]:
        """(scalars, per-layer errors) logging intervals in optimizer steps; 0 is off."""
        trainer = self._fastml_trainer()
        default = trainer.log_every_n_steps if trainer is not None else 50
        every = default if self._fastml_log_every is None else self._fastml_log_every
        layer_every = every * 10 if self._fastml_layer_every is None else self._fastml_layer_every
        return every, layer_every

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._fastml_log()
        return out

    def _fastml_log(self) -> None:
        state = self._fastml_state
        trainer = self._fastml_trainer()
        if state is None or trainer is None or not self.is_global_zero or not trainer.loggers:
            return
        step = self._fastml_steps(state)
        if step == self._fastml_logged_step:  # manual optimization: several optimizers per step
            return
        # Lightning counts this step only after optimizer_step returns: global_step is the x-axis value
        # Lightning's own metrics of this batch get, and its logging schedule is (global_step + 1) % N.
        x = trainer.global_step
        every, layer_every = self._fastml_intervals()
        scalars = every > 0 and (x + 1) % every == 0
        # The state measures layer errors during its steps 0, N, 2N... (0-based), i.e. just before its
        # counter reaches 1, N+1, 2N+1: log them then, while they are fresh.
        layers = layer_every > 0 and (step - 1) % layer_every == 0
        if not (scalars or layers):
            return
        self._fastml_logged_step = step
        metrics = self.compression_metrics(layers=layers)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=x)


# -- DDP: Lightning Trainer -------------------------------------------------------------------------------
class _TrainerStrategy(_TrainerLogging, _FastMLStateHolder):
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
        _reject_kwargs(type(self).__name__, ddp_kwargs, _HOOK_KWARGS, "registers FastML's own DDP comm hook")
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
        self._fastml_adopt(lambda: register_hook(self.model, self._fastml_plan,
                                                 check_replicas_every=self._fastml_check_every,
                                                 layer_stats_every=layer_every,
                                                 ranks_per_node=_ranks_per_node(self)))

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


def _ranks_per_node(strategy: Any) -> int | None:
    """Ranks per machine for :func:`register_hook`: None (detect: FASTML_RANKS_PER_NODE, torchrun's or
    Slurm's variables) when the environment says it, else the strategy's own ``num_processes`` (its
    devices per node). Lightning's own launcher sets LOCAL_RANK, NODE_RANK and WORLD_SIZE but no
    LOCAL_WORLD_SIZE, and places global rank node_rank x num_processes + local_rank: the contiguous
    machines the hierarchical all-reduce assumes."""
    from fastml_strategy.topology import detect_ranks_per_node

    if detect_ranks_per_node()[1] != "default":
        return None
    n = getattr(strategy, "num_processes", None)
    return int(n) if isinstance(n, int) and n >= 1 else None


# -- DDP: Fabric -----------------------------------------------------------------------------------------
class _FabricStrategy(_FastMLStateHolder):
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

    _fastml_when = "the hook is registered when fabric.setup(model) wraps the model in DistributedDataParallel"

    def __init__(
        self,
        plan: Plan | str | os.PathLike | dict | None = None,
        check_replicas_every: int | None = None,
        layer_stats_every: int | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        _reject_kwargs(type(self).__name__, ddp_kwargs, _HOOK_KWARGS, "registers FastML's own DDP comm hook")
        self._fastml_init(plan, check_replicas_every)
        self._fastml_layer_every = setting("layer_stats_every", layer_stats_every, owner=type(self).__name__)
        ddp_kwargs.setdefault("gradient_as_bucket_view", True)
        super().__init__(**ddp_kwargs)

    def setup_module(self, module: Any) -> Any:
        _reject_sharded(module, type(self).__name__)
        ddp_model = super().setup_module(module)
        self._fastml_adopt(lambda: register_hook(ddp_model, self._fastml_plan,
                                                 check_replicas_every=self._fastml_check_every,
                                                 layer_stats_every=self._fastml_layer_every,
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


def _check_key_free(state: dict[str, Any]) -> None:
    if CHECKPOINT_KEY in state:
        raise ValueError(f"the state passed to fabric.save already has a key {CHECKPOINT_KEY!r}; FastML "
                         f"stores its own state under that key, rename yours")


def _load_from_remainder(strategy: _FastMLStateHolder, remainder: Any, state: Any) -> bool:
    """Fabric: take FastML's part out of what ``load_checkpoint`` left over; True if there was one."""
    saved = remainder.get(CHECKPOINT_KEY) if isinstance(remainder, dict) else None
    if saved is None:
        return False
    if state:  # restoring into objects: FastML's part is restored too, not a leftover
        remainder.pop(CHECKPOINT_KEY)
    strategy._fastml_load(saved)
    return True


# -- FSDP2 / HSDP: what both FSDP strategies share --------------------------------------------------------
def _own_numel_at_least(n: int, module: torch.nn.Module) -> bool:
    return sum(p.numel() for p in module.parameters(recurse=False)) >= n


def _instance_of(classes: tuple[type, ...], module: torch.nn.Module) -> bool:
    return isinstance(module, classes)


def _wrap_policy(policy: Any) -> Callable[[torch.nn.Module], bool]:
    """``auto_wrap_policy`` as a predicate ``module -> bool`` (checked when the strategy is built)."""
    fix = ("pass a set of module classes (e.g. {TransformerBlock}), a function module -> bool, a whole "
           "number N (modules whose own parameters hold >= N elements), or None for the default "
           f"(N = {DEFAULT_MIN_WRAP_NUMEL})")
    if policy is None:
        policy = DEFAULT_MIN_WRAP_NUMEL
    if isinstance(policy, bool):
        raise TypeError(f"auto_wrap_policy={policy!r}; {fix}")
    if isinstance(policy, int):
        if policy < 1:
            raise ValueError(f"auto_wrap_policy={policy}; a size threshold must be >= 1 element ({fix})")
        return functools.partial(_own_numel_at_least, policy)
    if isinstance(policy, type):
        policy = {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        if not classes or not all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes):
            raise TypeError(f"auto_wrap_policy={policy!r} is not a set of torch.nn.Module classes; {fix}")
        return functools.partial(_instance_of, classes)
    from torch.distributed.fsdp.wrap import _Policy

    if isinstance(policy, _Policy):
        raise TypeError(f"auto_wrap_policy is an FSDP1 wrap policy ({type(policy).__name__}), which FSDP2 does "
                        f"not use; {fix}")
    if callable(policy):
        try:
            inspect.signature(policy).bind(torch.nn.Module())
        except TypeError:
            raise TypeError(f"auto_wrap_policy={policy!r} cannot be called with one module (FSDP1's "
                            f"(module, recurse, nonwrapped_numel) policies do not apply to FSDP2); {fix}") from None
        except ValueError:  # no signature (a builtin): trust it
            pass
        return policy
    raise TypeError(f"auto_wrap_policy={policy!r}; {fix}")


def _units_mesh(module: torch.nn.Module) -> Any:
    """The device mesh of the first FSDP2 unit inside ``module`` (its sharded parameters' mesh), or None."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for m in module.modules():
        if isinstance(m, FSDPModule):
            for p in m.parameters():
                if isinstance(p, DTensor):
                    return p.device_mesh
    return None


def _fsdp1_error(owner: str) -> TypeError:
    return TypeError(
        f"{owner} (strategy='{FSDP_STRATEGY_NAME}') shards with FSDP2, but the model holds FSDP1 "
        f"FullyShardedDataParallel modules (Lightning's strategy='fsdp' or your own wrapping), which FastML "
        f"does not compress. In configure_model call torch.distributed.fsdp.fully_shard(module, "
        f"mesh=self.device_mesh) instead of FullyShardedDataParallel, or leave sharding to the strategy "
        f"(auto_wrap_policy)")


class _FSDPMixin:
    """Mesh, sharding, registration and distributed checkpoints of the FSDP strategies.

    ``_fastml_base`` (Lightning's ``ModelParallelStrategy`` of the framework) and ``_fastml_package`` are
    set when the class is built (:func:`strategy_class`).
    """

    _fastml_base: type
    _fastml_package: str

    def _fastml_fsdp_init(self, auto_wrap_policy: Any, replicate_size: int | None, hybrid: bool,
                          shard_plan: Any, all_gather_bits: int | None, fully_shard_kwargs: dict | None,
                          kwargs: dict) -> None:
        owner = type(self).__name__
        _reject_kwargs(owner, kwargs, _MESH_KWARGS, "builds its own data-parallel device mesh")
        # -- tuned by the user
        self._fastml_wrap = _wrap_policy(auto_wrap_policy)
        self._fastml_wrap_given = auto_wrap_policy is not None  # ignored (with a warning) if the user shards
        if replicate_size is not None:
            whole_number("replicate_size", replicate_size, 1, owner=owner,
                         note=" (the number of replicas of the model, usually the number of nodes), or hybrid=True")
        if not isinstance(hybrid, bool):
            raise TypeError(f"hybrid={hybrid!r}; use True (shard inside a node, replicate across nodes) or False")
        if hybrid and replicate_size is not None:
            raise ValueError(f"hybrid=True and replicate_size={replicate_size} both choose the number of "
                             f"replicas; give one of them (hybrid=True means replicate_size=num_nodes)")
        self._fastml_replicate_size = replicate_size
        self._fastml_hybrid = hybrid
        # None: FSDP's own intra-node reduce-scatter (HSDP); a plan: compress it too
        self._fastml_shard_plan = resolve_plan(shard_plan) if shard_plan is not None else None
        if self._fastml_shard_plan is not None and not hybrid and (replicate_size or 1) == 1:
            raise ValueError("shard_plan compresses HSDP's intra-node reduce-scatter; it needs replicate_size=R "
                             "(R > 1) or hybrid=True. For plain FSDP give the plan as plan=")
        if all_gather_bits is not None and (isinstance(all_gather_bits, bool) or not isinstance(all_gather_bits, int)
                                            or not 2 <= all_gather_bits <= 8):
            raise ValueError(f"all_gather_bits={all_gather_bits!r}; use 2-8 (8 is ZeRO++'s choice; parameters "
                             f"lose more precision with fewer bits) or None for FSDP's own all-gather")
        # None: FSDP's own parameter all-gather; 2-8 bits: FastML's quantized one
        self._fastml_all_gather_bits = all_gather_bits
        fs_kwargs = dict(fully_shard_kwargs or {})
        if "mesh" in fs_kwargs:
            raise ValueError("fully_shard_kwargs must not hold 'mesh': the strategy shards on its own mesh "
                             "(replicate_size / hybrid choose it)")
        self._fastml_fs_kwargs = fs_kwargs

    # -- the mesh -------------------------------------------------------------------------------------------
    def _fastml_replicas(self) -> int:
        if self._fastml_hybrid:
            return int(self.num_nodes)
        return self._fastml_replicate_size or 1

    def setup_environment(self) -> None:
        # Checked before any process group exists, from numbers every process knows: the same error
        # on every rank.
        replicas = self._fastml_replicas()
        world = int(self.num_nodes) * int(self.num_processes)
        if world % replicas:
            raise ValueError(f"{type(self).__name__}: {world} processes cannot form {replicas} replicas of "
                             f"equal shard groups; choose replicate_size dividing the world size")
        if self._fastml_shard_plan is not None and replicas == 1:
            raise ValueError(f"{type(self).__name__}: shard_plan is for HSDP, but this run has one replica "
                             f"(hybrid=True on a single node); drop shard_plan or run on several nodes")
        # ParallelStrategy's setup_environment (the accelerator's device), not ModelParallelStrategy's,
        # which would build a (data_parallel, tensor_parallel) mesh.
        super(self._fastml_base, self).setup_environment()
        self._setup_distributed()
        from torch.distributed.device_mesh import init_device_mesh

        device = self.root_device.type
        if replicas == 1:
            mesh = init_device_mesh(device, (world,), mesh_dim_names=("shard",))
        else:
            mesh = init_device_mesh(device, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
        self._device_mesh = mesh
        log.debug(f"{type(self).__name__}: device mesh {mesh}")
        module = getattr(self, "lightning_module", None)
        if module is not None:  # the Trainer: LightningModule.device_mesh, for configure_model
            # As Lightning's ModelParallelStrategy.setup_environment does it.
            _set_private(module, "_device_mesh", mesh, "self.device_mesh in configure_model will be None")

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank is a data-parallel rank (FSDP and HSDP alike): its own slice of the data.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # -- sharding and registration ----------------------------------------------------------------------------
    def _fastml_shard(self, module: torch.nn.Module, parallelize_fn: Callable | None = None) -> torch.nn.Module:
        """Keep the user's FSDP2 sharding (adding the root unit), or shard by the wrap policy, root last."""
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, fully_shard

        owner = type(self).__name__
        if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            raise _fsdp1_error(owner)
        if parallelize_fn is not None:
            module = parallelize_fn(module, self.device_mesh)
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"parallelize_fn must return the nn.Module, got {type(module).__name__}")
            if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
                raise _fsdp1_error(owner)
        if isinstance(module, FSDPModule):
            log.debug(f"{owner}: the model is already sharded (root included); keeping it")
            return module
        user_mesh = _units_mesh(module)
        if user_mesh is not None:
            if self._fastml_wrap_given and getattr(self, "is_global_zero", True):
                warnings.warn(f"{owner}: the model was already sharded with fully_shard, so auto_wrap_policy is "
                              f"not applied; the strategy only adds the root unit", stacklevel=3)
            log.debug(f"{owner}: the model's submodules are sharded; adding the root unit")
            fully_shard(module, mesh=user_mesh, **self._fastml_fs_kwargs)
            return module
        units = 0
        # named_modules() lists a module before its descendants: reversed, every module comes after all
        # of its descendants, so inner units are sharded first and the root last.
        for _, sub in reversed(list(module.named_modules())):
            if sub is not module and self._fastml_wrap(sub):
                fully_shard(sub, mesh=self.device_mesh, **self._fastml_fs_kwargs)
                units += 1
        fully_shard(module, mesh=self.device_mesh, **self._fastml_fs_kwargs)
        log.debug(f"{owner}: sharded {units} submodule(s) by auto_wrap_policy, then the root")
        return module

    def _fastml_register_fsdp(self, model: torch.nn.Module, layer_stats_every: int) -> Any:
        import fastml_strategy.fsdp as ff

        replicate_group = None
        mesh, units = self.device_mesh, _units_mesh(model)
        # HSDP whose units the user sharded on the 1-D "shard" submesh: FastML all-reduces across replicas.
        if mesh.ndim == 2 and units is not None and units.ndim == 1 and torch.equal(units.mesh, mesh["shard"].mesh):
            replicate_group = mesh["replicate"].get_group()
        return self._fastml_adopt(lambda: ff.register(model, self._fastml_plan, replicate_group=replicate_group,
                                                      shard_plan=self._fastml_shard_plan,
                                                      all_gather_bits=self._fastml_all_gather_bits,
                                                      layer_stats_every=layer_stats_every))

    # -- distributed checkpoints ------------------------------------------------------------------------------
    def _fastml_save_dcp(self, path: Path) -> None:
        """Every rank writes its own FastML state into ``path/fastml_strategy`` (a collective)."""
        from fastml_strategy.fsdp import save_distributed

        with warnings.catch_warnings():
            # Our subfolder of a checkpoint Lightning has just (re)written, e.g. "last": replacing it is
            # the point, so torch.distributed.checkpoint's "Detected an existing checkpoint" is noise.
            warnings.filterwarnings("ignore", message=rf"Detected an existing checkpoint in .*{CHECKPOINT_KEY}",
                                    category=UserWarning)
            save_distributed(self._fastml_state, path / CHECKPOINT_KEY)

    def _fastml_load_dcp(self, path: Path) -> bool:
        """Load this rank's FastML state from ``path/fastml_strategy`` (a collective); False if there is none."""
        from fastml_strategy.fsdp import load_distributed

        saved = load_distributed(path / CHECKPOINT_KEY)
        if saved is None:
            return False
        self._fastml_load(saved, drop=str(path / CHECKPOINT_KEY))
        return True


# -- FSDP: Lightning Trainer ------------------------------------------------------------------------------
class _TrainerFSDPStrategy(_TrainerLogging, _FSDPMixin, _FastMLStateHolder):
    """FSDP2 (or HSDP) with FastML's compressed gradient reduction, for ``lightning.pytorch.Trainer``.

    Built on Lightning's ``ModelParallelStrategy``; see the module docstring for what differs.

    Args:
        plan: a :class:`~fastml_strategy.Plan`, a recipe name, a plan JSON path, or None to read
            ``FASTML_PLAN`` (default ``int4``). Keyed by the LightningModule's parameter names, as for
            ``strategy="fastml"``: one plan serves both strategies. With HSDP it compresses the
            cross-replica all-reduce.
        auto_wrap_policy: which submodules become FSDP units when ``configure_model`` shards nothing: a
            set of module classes, a predicate ``module -> bool``, or a whole number N (modules whose own
            parameters hold >= N elements); None: N = ``DEFAULT_MIN_WRAP_NUMEL`` (2**20).
        replicate_size: HSDP with this many replicas (the mesh is (R, world/R), consecutive ranks shard
            together); None or 1: FSDP over every rank.
        hybrid: HSDP with one replica per node (``replicate_size=num_nodes``).
        shard_plan: HSDP only: also compress the intra-node reduce-scatter with this plan (default: FSDP's
            own, uncompressed, for the fast link inside a node).
        all_gather_bits: opt-in, quantize FSDP's parameter all-gathers to this many bits (2-8; 8 is
            ZeRO++'s qwZ): forward and backward compute with quantized copies of the parameters, the
            optimizer updates the exact shards. None (default): FSDP's own all-gather.
        fully_shard_kwargs: passed to every ``fully_shard`` the strategy applies (``mp_policy``,
            ``reshard_after_forward``, ``offload_policy``...), not ``mesh``.
        log_every_n_steps, layer_stats_every (and its deprecated name layer_errors_every_n_steps): as for
            :class:`FastMLStrategy`.
        **kwargs: ``save_distributed_checkpoint`` (default True), ``process_group_backend``, ``timeout``.
    """

    _fastml_when = "FastML is registered when fit() shards the model"

    def __init__(
        self,
        plan: Plan | str | os.PathLike | dict | None = None,
        *,
        auto_wrap_policy: Any = None,
        replicate_size: int | None = None,
        hybrid: bool = False,
        shard_plan: Plan | str | os.PathLike | dict | None = None,
        all_gather_bits: int | None = None,
        fully_shard_kwargs: dict[str, Any] | None = None,
        log_every_n_steps: int | None = None,
        layer_stats_every: int | None = None,
        layer_errors_every_n_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        self._fastml_init(plan)
        self._fastml_fsdp_init(auto_wrap_policy, replicate_size, hybrid, shard_plan, all_gather_bits,
                               fully_shard_kwargs, kwargs)
        self._fastml_log_init(log_every_n_steps, layer_stats_every, layer_errors_every_n_steps)
        super().__init__(**kwargs)

    def _fastml_fitting(self) -> bool:
        trainer = self._fastml_trainer()
        return trainer is not None and trainer.state.fn == "fit"

    def setup(self, trainer: Any) -> None:
        # ModelParallelStrategy.setup (Lightning 2.6) without its demand for a configure_model: the strategy
        # shards what configure_model left unsharded, then registers FastML.
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self._fastml_shard(self.model)
        _lightning_private(self._fastml_package, "init", "_materialize_distributed_module")(self.model,
                                                                                           self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        fitting = trainer.state.fn == "fit"
        if fitting:
            self.setup_optimizers(trainer)
            self._fastml_register_fsdp(self.model, layer_stats_every=self._fastml_intervals()[1])
        self.setup_precision_plugin()
        if fitting:
            _lightning_private(self._fastml_package, "optimizer", "_optimizers_to_device")(self.optimizers,
                                                                                          self.root_device)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        # Gradient accumulation: no reduce-scatter (compressed or not) until the last micro-batch.
        from torch.distributed.fsdp import FSDPModule

        model = self.model
        if not isinstance(model, FSDPModule):
            yield None
            return
        model.set_requires_gradient_sync(False)
        try:
            yield None
        finally:
            model.set_requires_gradient_sync(True)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # Every rank calls this (ModelParallelStrategy's own save is a collective too).
        state = self._fastml_state
        with_fastml = state is not None and "optimizer_states" in checkpoint  # not a weights-only checkpoint
        if with_fastml and not self._save_distributed_checkpoint:
            checkpoint[CHECKPOINT_KEY] = state.state_dict(all_ranks=True)  # one file: rank 0 writes all
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if with_fastml and self._save_distributed_checkpoint:
            self._fastml_save_dcp(Path(self.broadcast(filepath)))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # Runs after setup (restore_checkpoint_after_setup): the FastML state exists when fitting.
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if not self._fastml_fitting():
            checkpoint.pop(CHECKPOINT_KEY, None)
            return checkpoint
        saved = checkpoint.pop(CHECKPOINT_KEY, None)
        path = Path(self.broadcast(checkpoint_path))
        if saved is not None:
            self._fastml_load(saved)
        elif not (path.is_dir() and self._fastml_load_dcp(path)):
            self._fastml_warn_missing()
        return checkpoint

    def teardown(self) -> None:
        # The state stays open after fit(): compression_stats() and trainer.save_checkpoint() still work.
        self._fastml_pending = None
        super().teardown()


# -- FSDP: Fabric ----------------------------------------------------------------------------------------
def _keep(module: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    return module


class _FabricFSDPStrategy(_FSDPMixin, _FastMLStateHolder):
    """FSDP2 (or HSDP) with FastML's compressed gradient reduction, for ``lightning.fabric.Fabric``.

    ``model = fabric.setup(model)`` shards the model (``parallelize_fn``, else ``auto_wrap_policy``) and
    registers FastML; create the optimizer AFTER that, from the sharded parameters, and set it up with
    ``fabric.setup_optimizers``. ``fabric.save(path, state)`` writes every rank's FastML state beside the
    model's shards; ``fabric.load(path, state)`` restores it.

    Args:
        plan, auto_wrap_policy, replicate_size, hybrid, shard_plan, all_gather_bits, fully_shard_kwargs:
            as for :class:`FastMLFSDPStrategy`.
        parallelize_fn: ``(module, device_mesh) -> module`` applying your own ``fully_shard`` (pass it
            ``mesh=device_mesh``); the strategy adds the root unit if you did not.
        layer_stats_every: measure each layer's compression error every N steps (0: never; None:
            ``FASTML_LAYER_STATS_EVERY``, else 10).
        **kwargs: ``save_distributed_checkpoint`` (default True), ``process_group_backend``, ``timeout``.
    """

    _fastml_when = "FastML is registered when fabric.setup(model) shards the model"

    def __init__(
        self,
        plan: Plan | str | os.PathLike | dict | None = None,
        *,
        parallelize_fn: Callable[[torch.nn.Module, Any], torch.nn.Module] | None = None,
        auto_wrap_policy: Any = None,
        replicate_size: int | None = None,
        hybrid: bool = False,
        shard_plan: Plan | str | os.PathLike | dict | None = None,
        all_gather_bits: int | None = None,
        fully_shard_kwargs: dict[str, Any] | None = None,
        layer_stats_every: int | None = None,
        **kwargs: Any,
    ) -> None:
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise TypeError(f"parallelize_fn={parallelize_fn!r}; pass a function (module, device_mesh) -> module")
        self._fastml_init(plan)
        self._fastml_fsdp_init(auto_wrap_policy, replicate_size, hybrid, shard_plan, all_gather_bits,
                               fully_shard_kwargs, kwargs)
        self._fastml_parallelize = parallelize_fn
        self._fastml_layer_every = setting("layer_stats_every", layer_stats_every, owner=type(self).__name__)
        super().__init__(parallelize_fn=_keep, **kwargs)

    def setup_module_and_optimizers(self, module: Any, optimizers: list, scheduler: Any = None) -> Any:
        raise RuntimeError(
            f"{type(self).__name__} shards the model with fully_shard, which replaces its parameters: an "
            f"optimizer created before would update parameters the model no longer uses. Set up the model "
            f"alone first, then create the optimizer from it: model = fabric.setup(model); optimizer = "
            f"fabric.setup_optimizers(torch.optim.SGD(model.parameters(), ...))")

    def setup_module(self, module: Any) -> Any:
        module = self._fastml_shard(module, self._fastml_parallelize)
        _lightning_private(self._fastml_package, "init", "_materialize_distributed_module")(module, self.root_device)
        self._fastml_register_fsdp(module, layer_stats_every=self._fastml_layer_every)
        return module

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        # fabric.save calls this on every rank.
        fml = self._fastml_state
        if fml is not None:
            _check_key_free(state)
            if not self._save_distributed_checkpoint:  # one file: rank 0 writes every rank's state
                state = {**state, CHECKPOINT_KEY: fml.state_dict(all_ranks=True)}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        if fml is not None and self._save_distributed_checkpoint:
            self._fastml_save_dcp(Path(self.broadcast(path)))

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if not _load_from_remainder(self, remainder, state) and self._fastml_state is not None:
            p = Path(self.broadcast(path))
            if not (p.is_dir() and self._fastml_load_dcp(p)):
                self._fastml_warn_missing()
        return remainder


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

    def _fastml_localsgd_init(self, plan: Any, settings: dict[str, Any], kwargs: dict[str, Any]) -> None:
        _reject_kwargs(type(self).__name__, kwargs, _HOOK_KWARGS,
                       "synchronises the model with LocalSGD every few steps, not through DDP")
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
    """Local steps with FastML's compressed outer synchronisation (:class:`~fastml_strategy.LocalSGD`,
    DiLoCo), for ``lightning.pytorch.Trainer``: no all-reduce in the inner steps.

    Lightning's ``DDPStrategy`` (processes, the distributed sampler, ``broadcast``/``barrier``, metric
    sync) minus the ``DistributedDataParallel`` wrapper: every rank trains alone; after every optimizer
    step the strategy counts an inner step, and every ``every`` steps LocalSGD averages the compressed
    pseudo-gradients and applies the outer step, identical on every rank. The replicas start from rank
    0's weights. Checkpoints hold every rank's model, inner optimizer and LocalSGD state (see the module
    docstring); ``fit(ckpt_path=...)`` gives each rank its own.

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

    def __init__(
        self,
        plan: Plan | str | os.PathLike | dict | None = None,
        *,
        every: int | None = None,
        outer: str | None = None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        fragments: int | None = None,
        delay: int | None = None,
        log_every_n_steps: int | None = None,
        layer_stats_every: int | None = None,
        layer_errors_every_n_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        self._fastml_localsgd_init(plan, dict(every=every, outer=outer, outer_lr=outer_lr,
                                              outer_momentum=outer_momentum, fragments=fragments, delay=delay),
                                   kwargs)
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

    def __init__(
        self,
        plan: Plan | str | os.PathLike | dict | None = None,
        *,
        every: int | None = None,
        outer: str | None = None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        fragments: int | None = None,
        delay: int | None = None,
        layer_stats_every: int | None = None,
        **kwargs: Any,
    ) -> None:
        self._fastml_localsgd_init(plan, dict(every=every, outer=outer, outer_lr=outer_lr,
                                              outer_momentum=outer_momentum, fragments=fragments, delay=delay),
                                   kwargs)
        self._fastml_layer_every = setting("layer_stats_every", layer_stats_every, owner=type(self).__name__,
                                           localsgd=True)
        self._fastml_objects: dict[str, Any] = {}  # what fabric.load restores into: each rank's own goes back
        self._fastml_reject_ddp_kwargs(kwargs)
        super().__init__(**kwargs)
        _set_private(self, "_backward_sync_control", _NoBackwardSync(),
                     "fabric.no_backward_sync(model) would call DDP's no_sync on a model with no DDP wrapper")

    def setup_module(self, module: Any) -> Any:
        # Replaces DDPStrategy's: the module stays as it is (Fabric has moved it to the device), or on
        # several machines of several processes goes into DDP over its machine (islands).
        module = self._fastml_island(module)
        self._fastml_build(module, layer_stats_every=self._fastml_layer_every)
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


# -- building the classes, registering the names ---------------------------------------------------------------
_MIXINS: dict[tuple[str, str], type] = {
    ("trainer", STRATEGY_NAME): _TrainerStrategy,
    ("fabric", STRATEGY_NAME): _FabricStrategy,
    ("trainer", FSDP_STRATEGY_NAME): _TrainerFSDPStrategy,
    ("fabric", FSDP_STRATEGY_NAME): _FabricFSDPStrategy,
    ("trainer", LOCALSGD_STRATEGY_NAME): _TrainerLocalSGDStrategy,
    ("fabric", LOCALSGD_STRATEGY_NAME): _FabricLocalSGDStrategy,
}


def strategy_class(package: str = "lightning.pytorch", name: str = STRATEGY_NAME) -> type:
    """The FastML strategy class registered as ``name`` (``"fastml"``: DDP, ``"fastml_fsdp"``: FSDP2/HSDP,
    ``"fastml_localsgd"``: LocalSGD)
    for a framework package: ``"lightning.pytorch"`` (the Trainer of the ``lightning`` package),
    ``"pytorch_lightning"``, ``"lightning.fabric"`` or ``"lightning_fabric"``.

    ``FastMLStrategy``, ``FastMLFabricStrategy``, ``FastMLFSDPStrategy``, ``FastMLFSDPFabricStrategy``,
    ``FastMLLocalSGDStrategy`` and ``FastMLLocalSGDFabricStrategy`` are those of ``lightning.pytorch`` and
    ``lightning.fabric``.
    """
    if package not in _FRAMEWORKS:
        raise ValueError(f"package {package!r} is not one FastML integrates with; use one of {sorted(_FRAMEWORKS)}")
    if name not in _STRATEGIES:
        raise ValueError(f"strategy {name!r} is not a FastML strategy; use one of {sorted(_STRATEGIES)}")
    with _lock:
        cls = _classes.get((package, name))
        if cls is None:
            kind = _FRAMEWORKS[package][0]
            cls_name = _CLASS_NAMES[(package, name)]
            base_name = _STRATEGIES[name][0]
            try:
                base = getattr(importlib.import_module(f"{package}.strategies"), base_name)
            except ImportError as e:
                raise ImportError(
                    f"FastML's {cls_name} needs {package}, which cannot be imported ({e}); install it with "
                    f"`pip install {package.split('.')[0].replace('_', '-')}`"
                ) from e
            except AttributeError:
                raise ImportError(f"FastML's {cls_name} needs {package}.strategies.{base_name} (Lightning 2.4 or "
                                  f"newer; tested with 2.6.6); upgrade Lightning") from None
            mixin = _MIXINS[(kind, name)]
            attrs = {"__module__": __name__, "__qualname__": cls_name, "__doc__": mixin.__doc__,
                     "_fastml_base": base, "_fastml_package": package}
            cls = type(cls_name, (mixin, base), attrs)
            _classes[(package, name)] = cls
    return cls


def __getattr__(attr: str) -> type:
    # Module attributes built on first use (PEP 562), so that importing this module stays free of Lightning.
    for (package, name), cls_name in _CLASS_NAMES.items():
        if attr == cls_name:
            return strategy_class(package, name)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def _register_in(package: str) -> None:
    """Register the FastML strategy names in one framework's registry (idempotent)."""
    _, registry_attr, _ = _FRAMEWORKS[package]
    registry = getattr(importlib.import_module(f"{package}.strategies"), registry_attr)
    for name, (_, description) in _STRATEGIES.items():
        cls = strategy_class(package, name)
        entry = dict.get(registry, name)  # the registry's own get() builds a strategy
        if entry is not None and entry.get("strategy") is cls:
            continue
        registry.register(name, cls, override=True, description=description)


def _register_safely(package: str) -> bool:
    try:
        _register_in(package)
    except Exception as e:  # never break the user's import
        warnings.warn(
            f"FastML could not register strategy='{STRATEGY_NAME}' / '{FSDP_STRATEGY_NAME}' / "
            f"'{LOCALSGD_STRATEGY_NAME}' with {package} "
            f"({type(e).__name__}: {e}); pass the strategy object instead: "
            f"fastml_strategy.lightning.strategy_class({package!r}, 'fastml')()",
            stacklevel=2,
        )
        return False
    log.debug("FastML: registered %s, %s and %s with %s", STRATEGY_NAME, FSDP_STRATEGY_NAME,
              LOCALSGD_STRATEGY_NAME, package)
    return True


def _imported(package: str) -> bool:
    return package in sys.modules and f"{package}.strategies" in sys.modules


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def register_strategies() -> list[str]:
    """Register ``"fastml"``, ``"fastml_fsdp"`` and ``"fastml_localsgd"`` with the strategy registry of
    every Lightning flavour already imported (``lightning.pytorch``, ``lightning.fabric``,
    ``pytorch_lightning``, ``lightning_fabric``) or, when none is, of every installed one (importing
    it); idempotent. Returns the packages that have the names.

    Runs when this module is imported, and from ``import fastml_strategy`` when Lightning was imported
    before it. Call it again only for a flavour imported later (say ``pytorch_lightning`` after
    ``lightning``), or pass the strategy object (``Trainer(strategy=FastMLStrategy())``).
    """
    with _lock:
        packages = [p for p in _FRAMEWORKS if _imported(p)] or [p for p in _FRAMEWORKS if _installed(p)]
        return [p for p in packages if _register_safely(p)]


register_strategies()
