"""``strategy="fastml_fsdp"`` for Lightning and Fabric: FSDP2 (``fully_shard``) with a compressed
reduce-scatter.

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
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from fastml_strategy._integration import fsdp2_units, is_fsdp1, is_fsdp2, setting
from fastml_strategy._validate import whole_number
from fastml_strategy.config import Plan, resolve_plan
from fastml_strategy.engine import attach
from fastml_strategy.integrations.lightning._common import (CHECKPOINT_KEY, FSDP_STRATEGY_NAME, _FastMLStateHolder,
                                                            _lightning_private, _load_from_remainder, _check_key_free,
                                                            _reject_kwargs, _set_private, _TrainerLogging)

__all__ = ["DEFAULT_MIN_WRAP_NUMEL", "trainer_class", "fabric_class"]

log = logging.getLogger(__name__)

# ModelParallelStrategy arguments the FSDP strategies set themselves (they build a data-parallel mesh).
_MESH_KWARGS = ("data_parallel_size", "tensor_parallel_size")
# Default auto-wrap rule of the FSDP strategies: a module whose OWN parameters hold at least this many
# elements becomes an FSDP unit. 2**20 elements: each unit's reduce-scatter carries >= 4 MiB of fp32
# gradient (one large message rather than many small, latency-bound ones); smaller layers, norms and
# biases stay in the root unit. A choice, not a measurement: pass auto_wrap_policy for your model.
DEFAULT_MIN_WRAP_NUMEL = 1 << 20
_MESH_KWARGS_FIX = ("remove them (replicate_size=R or hybrid=True chooses HSDP), or use Lightning's "
                    "ModelParallelStrategy for tensor parallelism, which FastML does not compress")


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
    from torch.distributed.tensor import DTensor

    for m in fsdp2_units(module):
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
    class attributes of the class statements in :func:`trainer_class` and :func:`fabric_class`.
    """

    _fastml_base: type
    _fastml_package: str

    def _fastml_fsdp_init(self, auto_wrap_policy: Any, replicate_size: int | None, hybrid: bool,
                          shard_plan: Any, all_gather_bits: int | None, fully_shard_kwargs: dict | None,
                          kwargs: dict) -> None:
        owner = type(self).__name__
        _reject_kwargs(owner, kwargs, _MESH_KWARGS, "builds its own data-parallel device mesh", _MESH_KWARGS_FIX)
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
        from torch.distributed.fsdp import fully_shard

        owner = type(self).__name__
        if is_fsdp1(module):
            raise _fsdp1_error(owner)
        if parallelize_fn is not None:
            module = parallelize_fn(module, self.device_mesh)
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"parallelize_fn must return the nn.Module, got {type(module).__name__}")
            if is_fsdp1(module):
                raise _fsdp1_error(owner)
        if is_fsdp2(module):
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
        replicate_group = None
        mesh, units = self.device_mesh, _units_mesh(model)
        # HSDP whose units the user sharded on the 1-D "shard" submesh: FastML all-reduces across replicas.
        if mesh.ndim == 2 and units is not None and units.ndim == 1 and torch.equal(units.mesh, mesh["shard"].mesh):
            replicate_group = mesh["replicate"].get_group()
        return self._fastml_adopt(lambda: attach(model, self._fastml_plan, owner=type(self).__name__,
                                                 replicate_group=replicate_group, shard_plan=self._fastml_shard_plan,
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
    """What :class:`FastMLFSDPStrategy` adds to a Trainer flavour's ``ModelParallelStrategy``: a
    data-parallel mesh, sharding by ``auto_wrap_policy``, FastML's compressed reduction, its checkpoints."""

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
        model = self.model
        if not is_fsdp2(model):
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
    """What :class:`FastMLFSDPFabricStrategy` adds to a Fabric flavour's ``ModelParallelStrategy``: a
    data-parallel mesh, sharding in ``setup_module``, FastML's compressed reduction, its checkpoints."""

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
        # Measured every N steps; Fabric logs nothing itself.
        self._fastml_layer_stats_every = setting("layer_stats_every", layer_stats_every, owner=type(self).__name__)
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
        self._fastml_register_fsdp(module, layer_stats_every=self._fastml_layer_stats_every)
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


# -- the classes, one per Lightning flavour --------------------------------------------------------------------
def trainer_class(base: type, package: str) -> type:
    """``FastMLFSDPStrategy`` of one Trainer flavour: ``base`` is its ``ModelParallelStrategy``, ``package``
    its name (``lightning.pytorch`` or ``pytorch_lightning``). Called once per flavour, by
    :func:`fastml_strategy.lightning.strategy_class`."""

    class FastMLFSDPStrategy(_TrainerFSDPStrategy, base):
        """FSDP2 (or HSDP) with FastML's compressed gradient reduction, for ``lightning.pytorch.Trainer``.

        Built on Lightning's ``ModelParallelStrategy``; see :mod:`fastml_strategy.lightning.fsdp` for what differs.

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

        _fastml_base = base
        _fastml_package = package

    return FastMLFSDPStrategy


def fabric_class(base: type, package: str) -> type:
    """``FastMLFSDPFabricStrategy`` of one Fabric flavour: ``base`` is its ``ModelParallelStrategy``,
    ``package`` its name (``lightning.fabric`` or ``lightning_fabric``). Called once per flavour, by
    :func:`fastml_strategy.lightning.strategy_class`."""

    class FastMLFSDPFabricStrategy(_FabricFSDPStrategy, base):
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

        _fastml_base = base
        _fastml_package = package

    return FastMLFSDPFabricStrategy
