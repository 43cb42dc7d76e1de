"""Lightning and Fabric: ``Trainer(strategy="fastml")`` and ``Fabric(strategy="fastml")``.

What the strategy does
----------------------
``FastMLStrategy`` is Lightning's ``DDPStrategy`` with one change of substance: once Lightning has
wrapped the model in ``DistributedDataParallel`` it calls :func:`fastml_strategy.register_hook`, so
every gradient bucket is compressed as the plan says (quantized, top-k, or cast) before it crosses
the network. Everything else (launching processes, samplers, precision, accumulation, loggers) is
Lightning's own.

1. Lightning's ``DDPStrategy._register_ddp_hooks`` registers a comm hook only when the device is CUDA:
   on CPU a ``ddp_comm_hook`` is silently ignored. ``FastMLStrategy`` overrides that method and
   registers FastML's hook on every device (gloo on CPU, NCCL on CUDA).
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
   ``layer_errors_every_n_steps`` the relative compression error of each layer
   (``fastml/rel_error/<parameter>``). ``trainer.strategy.compression_stats()`` returns the full
   dictionary of :meth:`fastml_strategy.FastMLState.stats`, during and after ``fit``.

Gradient accumulation needs nothing special (DDP's ``no_sync`` micro-batches call no hook; the hook
counts one step per synchronised backward). With ``precision="16-mixed"`` the hook sees scaled
gradients and propagates a non-finite value to every rank, so GradScaler skips the step everywhere.
``validate``/``test``/``predict`` do not wrap the model in DDP and so do not compress.

Fabric's ``DDPStrategy`` has no hook arguments at all: ``FastMLFabricStrategy`` registers the hook in
``setup_module`` and adds the FastML state to ``fabric.save``/``fabric.load`` the same way.

Registering the name ``"fastml"`` without paying for it
-------------------------------------------------------
``import fastml_strategy`` calls :func:`_register_strategies`. Importing Lightning costs about 2.6 s
and pulls in Triton, so it is not imported here: the name is registered at once with the frameworks
already imported, and for the others a small import hook registers it right after
``lightning.pytorch`` / ``pytorch_lightning`` / ``lightning.fabric`` / ``lightning_fabric`` finishes
importing. The strategy classes are built on first use (``fastml_strategy.lightning.FastMLStrategy``
imports ``lightning.pytorch``), once per framework, because ``lightning.pytorch`` and the standalone
``pytorch_lightning`` keep separate class hierarchies and registries.

Example::

    import fastml_strategy  # registers "fastml"
    trainer = L.Trainer(strategy="fastml", accelerator="cpu", devices=2)  # plan from FASTML_PLAN
    # or explicitly:
    from fastml_strategy.lightning import FastMLStrategy
    trainer = L.Trainer(strategy=FastMLStrategy(plan="int4", static_graph=True), devices=8)
"""

from __future__ import annotations

import importlib
import importlib.abc
import math
import os
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable

from fastml_strategy.config import Plan, resolve_plan
from fastml_strategy.hook import FastMLState, register_hook

if TYPE_CHECKING:  # the real classes are built lazily, see strategy_class()
    from lightning.fabric.strategies import DDPStrategy as FastMLFabricStrategy  # noqa: F401
    from lightning.pytorch.strategies import DDPStrategy as FastMLStrategy  # noqa: F401

__all__ = ["FastMLStrategy", "FastMLFabricStrategy", "strategy_class", "CHECKPOINT_KEY", "STRATEGY_NAME"]

STRATEGY_NAME = "fastml"
# Key of the FastML state inside a Lightning checkpoint or a Fabric checkpoint dict.
CHECKPOINT_KEY = "fastml_strategy"
# DDPStrategy arguments that install another comm hook; FastML owns the hook.
_HOOK_KWARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")

# package -> (kind, attribute holding its strategy registry, public name of our class there)
_FRAMEWORKS: dict[str, tuple[str, str, str]] = {
    "lightning.pytorch": ("trainer", "StrategyRegistry", "FastMLStrategy"),
    "pytorch_lightning": ("trainer", "StrategyRegistry", "_PLFastMLStrategy"),
    "lightning.fabric": ("fabric", "STRATEGY_REGISTRY", "FastMLFabricStrategy"),
    "lightning_fabric": ("fabric", "STRATEGY_REGISTRY", "_LFFastMLFabricStrategy"),
}
_classes: dict[str, type] = {}
_lock = threading.RLock()


# -- settings shared by the Trainer and Fabric strategies --------------------------------------------------
def _check_every(value: int | None) -> int:
    """``check_replicas_every``: the argument, else ``FASTML_CHECK_REPLICAS_EVERY``, else 0 (off)."""
    if value is None:
        raw = os.environ.get("FASTML_CHECK_REPLICAS_EVERY", "0").strip() or "0"
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(
                f"FASTML_CHECK_REPLICAS_EVERY={raw!r} is not a whole number; set it to N >= 1 to compare "
                f"replicas every N steps, or 0 (or unset it) to switch the check off"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"check_replicas_every={value!r}; use a whole number >= 0 (0 switches the check off)")
    return value


def _positive_or_none(name: str, value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name}={value!r}; use a whole number >= 1, 0 to switch it off, or None for the default")
    return value


def _resolve(plan: Any) -> Plan:
    """resolve_plan (which names FASTML_PLAN when the plan came from the environment)."""
    return resolve_plan(plan)


def _reject_hook_kwargs(owner: str, kwargs: dict[str, Any]) -> None:
    given = [k for k in _HOOK_KWARGS if kwargs.get(k) is not None]
    if given:
        raise ValueError(
            f"{owner} registers FastML's own DDP comm hook, so it does not take {given}; remove them, or use "
            f"strategy='ddp' if you want a different comm hook"
        )


class _FastMLStateHolder:
    """The FastML bits both strategies share: the plan, the live state, a pending checkpoint part."""

    def _fastml_init(self, plan: Any, check_replicas_every: int | None) -> None:
        # -- tuned by the user
        self._fastml_plan: Plan = _resolve(plan)  # a bad FASTML_PLAN fails here, on every process
        self._fastml_check_every = _check_every(check_replicas_every)
        # -- internal state
        self._fastml_state: FastMLState | None = None  # set once the DDP model exists
        self._fastml_pending: dict | None = None  # read from a checkpoint before the hook existed
        self._fastml_mark = (0, 0)  # (step, bytes_sent) at registration: per-step traffic since then

    @property
    def plan(self) -> Plan:
        """The compression plan this strategy registers."""
        return self._fastml_plan

    @property
    def fastml_state(self) -> FastMLState | None:
        """The live :class:`~fastml_strategy.FastMLState` (None until the model is wrapped in DDP)."""
        return self._fastml_state

    def _fastml_register(self, ddp_model: Any, layer_stats_every: int) -> FastMLState:
        # A second fit() wraps a fresh DDP model: the old state's hook died with the old wrapper.
        self._fastml_close()
        state = register_hook(ddp_model, self._fastml_plan, check_replicas_every=self._fastml_check_every,
                              layer_stats_every=layer_stats_every)
        self._fastml_state = state
        if self._fastml_pending is not None:
            pending, self._fastml_pending = self._fastml_pending, None
            self._fastml_load(pending)
        self._fastml_mark = (state.step, int(state.stats().get("bytes_sent", 0)))
        return state

    def _fastml_load(self, saved: dict) -> None:
        assert self._fastml_state is not None
        try:
            self._fastml_state.load_state_dict(saved)
        except (ValueError, KeyError) as e:
            raise ValueError(
                f"the checkpoint's FastML state does not fit this run ({e}); resume with the same number of "
                f"processes and a plan for the same model, or delete checkpoint[{CHECKPOINT_KEY!r}] to start "
                f"the error-feedback residuals from zero"
            ) from e

    def _fastml_close(self) -> None:
        state, self._fastml_state = self._fastml_state, None
        if state is not None:
            state.close()

    def compression_stats(self) -> dict[str, Any]:
        """This rank's compression statistics (:meth:`fastml_strategy.FastMLState.stats`): ``steps``,
        ``bytes_sent``, ``bytes_uncompressed``, ``compression_ratio`` and per-layer ``layers``.

        Available from the first training step until the next ``fit`` (so also right after ``fit``).
        """
        if self._fastml_state is None:
            raise RuntimeError(
                "no FastML statistics yet: the hook is registered when fit() wraps the model in "
                "DistributedDataParallel; call compression_stats() during or after fit()"
            )
        return self._fastml_state.stats()

    def compression_metrics(self, layers: bool = False, prefix: str = "fastml/") -> dict[str, float]:
        """Scalars ready for a logger: compression ratio and bytes sent per step since the hook was
        registered, and with ``layers=True`` each layer's relative compression error."""
        stats = self.compression_stats()
        step0, sent0 = self._fastml_mark
        steps = int(stats.get("steps", 0)) - step0
        out = {f"{prefix}compression_ratio": float(stats["compression_ratio"])}
        if steps > 0:
            out[f"{prefix}bytes_sent_per_step"] = (int(stats["bytes_sent"]) - sent0) / steps
        if layers:  # layers sent as fp32 are exact, and NaN means not measured yet: neither is logged
            for name, layer in stats.get("layers", {}).items():
                err = float(layer.get("rel_error", float("nan")))
                if layer.get("codec") != "fp32" and math.isfinite(err):
                    out[f"{prefix}rel_error/{name}"] = err
        return out


# -- Lightning Trainer ----------------------------------------------------------------------------------------
class _TrainerStrategy(_FastMLStateHolder):
    """DDP with FastML's compressed gradient all-reduce, for ``lightning.pytorch.Trainer``.

    Args:
        plan: a :class:`~fastml_strategy.Plan`, a recipe name (``"int4"``, ``"topk1"``...), a plan JSON
            path, or None to read ``FASTML_PLAN`` (default ``int4``).
        check_replicas_every: compare a checksum of the parameters across ranks every N steps and raise
            on every rank if they differ (0: never; None: ``FASTML_CHECK_REPLICAS_EVERY``, default 0).
        log_every_n_steps: send compression ratio and bytes per step to the loggers every N optimizer
            steps (None: the Trainer's ``log_every_n_steps``; 0: never).
        layer_errors_every_n_steps: log each layer's relative compression error every N steps
            (None: ten times ``log_every_n_steps``; 0: never).
        **ddp_kwargs: everything Lightning's ``DDPStrategy`` takes (``static_graph``,
            ``find_unused_parameters``, ``process_group_backend``, ``timeout``, ``start_method``...),
            except the comm-hook arguments.
    """

    def __init__(
        self,
        plan: Plan | str | os.PathLike | dict | None = None,
        check_replicas_every: int | None = None,
        log_every_n_steps: int | None = None,
        layer_errors_every_n_steps: int | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        _reject_hook_kwargs(type(self).__name__, ddp_kwargs)
        self._fastml_init(plan, check_replicas_every)
        self._fastml_log_every = _positive_or_none("log_every_n_steps", log_every_n_steps)
        self._fastml_layer_every = _positive_or_none("layer_errors_every_n_steps", layer_errors_every_n_steps)
        self._fastml_logged_step = -1
        self._fastml_loaded_ckpt = False
        super().__init__(**ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        # Replaces DDPStrategy's version, which registers hooks only on CUDA.
        had_checkpoint, self._fastml_loaded_ckpt = self._fastml_loaded_ckpt, False
        if had_checkpoint and self._fastml_pending is None and self.is_global_zero:
            warnings.warn(
                "the checkpoint being resumed holds no FastML state (it was written without FastML, or "
                "with save_weights_only=True): the error-feedback residuals start from zero, so this run "
                "will not match an uninterrupted one exactly",
                stacklevel=2,
            )
        self._fastml_register(self.model, layer_stats_every=self._fastml_intervals()[1])

    def _fastml_intervals(self) -> tuple[int, int]:
        """(scalars, per-layer errors) logging intervals in optimizer steps; 0 is off."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
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
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if state is None or trainer is None or not self.is_global_zero or not trainer.loggers:
            return
        step = state.step
        if step == self._fastml_logged_step:  # manual optimization: several optimizers per step
            return
        # Lightning counts this step only after optimizer_step returns: global_step is the x-axis value
        # Lightning's own metrics of this batch get, and its logging schedule is (global_step + 1) % N.
        x = trainer.global_step
        every, layer_every = self._fastml_intervals()
        scalars = every > 0 and (x + 1) % every == 0
        # The hook measures layer errors during its steps 0, N, 2N... (0-based), i.e. just before its
        # counter reaches 1, N+1, 2N+1: log them then, while they are fresh.
        layers = layer_every > 0 and (step - 1) % layer_every == 0
        if not (scalars or layers):
            return
        self._fastml_logged_step = step
        metrics = self.compression_metrics(layers=layers)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=x)

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


# -- Fabric -------------------------------------------------------------------------------------------------
class _FabricStrategy(_FastMLStateHolder):
    """DDP with FastML's compressed gradient all-reduce, for ``lightning.fabric.Fabric``.

    ``fabric.setup(model, optimizer)`` registers the hook; ``fabric.save(path, state)`` adds the FastML
    state of every rank under ``"fastml_strategy"``; ``fabric.load(path, state)`` restores it (and does
    not return it among the leftovers). Log ``fabric.strategy.compression_metrics()`` with
    ``fabric.log_dict``.

    Args:
        plan: as for :class:`FastMLStrategy` (None reads ``FASTML_PLAN``).
        check_replicas_every: as for :class:`FastMLStrategy`.
        layer_stats_every: measure each layer's compression error every N steps (0: never); it costs
            one extra pass over the gradients of that step.
        **ddp_kwargs: everything Fabric's ``DDPStrategy`` takes.
    """

    def __init__(
        self,
        plan: Plan | str | os.PathLike | dict | None = None,
        check_replicas_every: int | None = None,
        layer_stats_every: int = 10,
        **ddp_kwargs: Any,
    ) -> None:
        _reject_hook_kwargs(type(self).__name__, ddp_kwargs)
        self._fastml_init(plan, check_replicas_every)
        self._fastml_layer_every = _positive_or_none("layer_stats_every", layer_stats_every) or 0
        super().__init__(**ddp_kwargs)

    def setup_module(self, module: Any) -> Any:
        ddp_model = super().setup_module(module)
        self._fastml_register(ddp_model, layer_stats_every=self._fastml_layer_every)
        return ddp_model

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        # fabric.save calls this on every rank: the gather below is a collective.
        if self._fastml_state is not None:
            if CHECKPOINT_KEY in state:
                raise ValueError(f"the state passed to fabric.save already has a key {CHECKPOINT_KEY!r}; FastML "
                                 f"stores its own state under that key, rename yours")
            state = {**state, CHECKPOINT_KEY: self._fastml_state.state_dict(all_ranks=True)}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        saved = remainder.get(CHECKPOINT_KEY) if isinstance(remainder, dict) else None
        if saved is not None:
            if state:  # restoring into objects: FastML's part is restored too, not a leftover
                remainder.pop(CHECKPOINT_KEY)
            if self._fastml_state is not None:
                self._fastml_load(saved)
            else:  # loaded before fabric.setup(model): applied when the hook is registered
                self._fastml_pending = saved
        return remainder


# -- building the classes, registering the name ---------------------------------------------------------------
def strategy_class(package: str = "lightning.pytorch") -> type:
    """The FastML strategy class for a framework package: ``"lightning.pytorch"`` (the Trainer of the
    ``lightning`` package), ``"pytorch_lightning"``, ``"lightning.fabric"`` or ``"lightning_fabric"``.

    ``FastMLStrategy`` and ``FastMLFabricStrategy`` are the first and third of these.
    """
    if package not in _FRAMEWORKS:
        raise ValueError(f"package {package!r} is not one FastML integrates with; use one of {sorted(_FRAMEWORKS)}")
    with _lock:
        cls = _classes.get(package)
        if cls is None:
            kind, _, name = _FRAMEWORKS[package]
            try:
                base = importlib.import_module(f"{package}.strategies").DDPStrategy
            except ImportError as e:
                raise ImportError(
                    f"FastML's {name} needs {package}, which cannot be imported ({e}); install it with "
                    f"`pip install {package.split('.')[0].replace('_', '-')}`"
                ) from e
            mixin = _TrainerStrategy if kind == "trainer" else _FabricStrategy
            cls = type(name, (mixin, base), {"__module__": __name__, "__qualname__": name, "__doc__": mixin.__doc__})
            _classes[package] = cls
    return cls


def __getattr__(name: str) -> type:
    # Module attributes built on first use (PEP 562), so that importing this module stays free of Lightning.
    for package, (_, _, cls_name) in _FRAMEWORKS.items():
        if name == cls_name:
            return strategy_class(package)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register_in(package: str) -> None:
    """Register ``"fastml"`` in one framework's registry (idempotent)."""
    _, registry_attr, _ = _FRAMEWORKS[package]
    registry = getattr(importlib.import_module(f"{package}.strategies"), registry_attr)
    cls = strategy_class(package)
    entry = dict.get(registry, STRATEGY_NAME)  # the registry's own get() builds a strategy
    if entry is not None and entry.get("strategy") is cls:
        return
    registry.register(
        STRATEGY_NAME, cls, override=True,
        description="DDP with FastML's compressed gradient all-reduce (plan from FASTML_PLAN, default int4)",
    )


def _register_safely(package: str) -> None:
    try:
        _register_in(package)
    except Exception as e:  # never break the user's `import lightning`
        warnings.warn(
            f"FastML could not register strategy='{STRATEGY_NAME}' with {package} ({type(e).__name__}: {e}); "
            f"pass the strategy object instead: fastml_strategy.lightning.strategy_class({package!r})()",
            stacklevel=2,
        )


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Registers the strategy name right after a watched framework package finishes importing.

    It finds nothing itself: for a watched name it asks the other finders for the spec and wraps that
    one module's ``loader.exec_module`` so the registration runs when the package is complete.
    """

    def __init__(self) -> None:
        self.watched: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.watched:
            return None
        with _lock:
            if fullname not in self.watched:
                return None
            self.watched.discard(fullname)  # one shot; also keeps the search below from recursing
            if not self.watched and self in sys.meta_path:
                sys.meta_path.remove(self)
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            _register_safely(fullname)

        loader.exec_module = exec_then_register  # an attribute of this module's own loader only
        return spec


_finder = _RegisterAfterImport()


def _register_strategies() -> None:
    """Make ``strategy="fastml"`` work in every installed Lightning flavour; cheap and idempotent.

    Frameworks already imported get the name now; the others get it when they are imported.
    """
    with _lock:
        for package in _FRAMEWORKS:
            module = sys.modules.get(package)
            strategies = sys.modules.get(f"{package}.strategies")
            if module is not None and strategies is not None:
                _register_safely(package)
            elif module is None:
                _finder.watched.add(package)
        if _finder.watched and _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
