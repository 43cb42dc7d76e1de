"""What every FastML Lightning/Fabric strategy shares, whatever its mode (DDP, FSDP2, LocalSGD).

- the strategy names, the checkpoint key, and the Lightning flavours FastML integrates with;
- :class:`_FastMLStateHolder`: the plan, the live FastML state, a checkpoint part read before that state
  exists, ``compression_stats()`` / ``compression_metrics()``;
- :class:`_TrainerLogging`: the figures a Trainer strategy sends to the Trainer's loggers after an
  optimizer step;
- argument checks (hook arguments refused, ``layer_stats_every`` and its old keyword);
- the Fabric checkpoint helpers (FastML's part of ``fabric.save`` / ``fabric.load``);
- the only two ways the strategies touch Lightning's private names, :func:`_lightning_private` and
  :func:`_set_private`, both checked by tests/test_upstream_internals.py.

Nothing here imports Lightning: the mode modules (``ddp``, ``fsdp``, ``localsgd``) hold the behaviour
as mixins, and :mod:`fastml_strategy.lightning.registry` builds the classes on a flavour's base class
when they are first asked for.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from typing import Any, Callable

from fastml_strategy._integration import LIGHTNING_KEYS, metrics, setting
from fastml_strategy._validate import renamed, whole_number
from fastml_strategy.config import Plan, resolve_plan

log = logging.getLogger(__name__)

STRATEGY_NAME = "fastml"
FSDP_STRATEGY_NAME = "fastml_fsdp"
LOCALSGD_STRATEGY_NAME = "fastml_localsgd"
# Key of the FastML state inside a Lightning checkpoint or a Fabric checkpoint dict, and the name of the
# subfolder of a distributed (DCP) checkpoint that holds every rank's FastML state.
CHECKPOINT_KEY = "fastml_strategy"
# The module the classes are published in (their __module__): where `repr` and users find them.
PUBLIC_MODULE = "fastml_strategy.lightning"

# The Lightning flavours: framework package -> (kind, attribute holding its strategy registry, the
# matching fabric package, whose private utilities the Trainer strategies of that flavour use).
_FRAMEWORKS: dict[str, tuple[str, str, str]] = {
    "lightning.pytorch": ("trainer", "StrategyRegistry", "lightning.fabric"),
    "pytorch_lightning": ("trainer", "StrategyRegistry", "lightning_fabric"),
    "lightning.fabric": ("fabric", "STRATEGY_REGISTRY", "lightning.fabric"),
    "lightning_fabric": ("fabric", "STRATEGY_REGISTRY", "lightning_fabric"),
}

# DDPStrategy arguments that install another comm hook; FastML owns the hook (DDP) or has none (LocalSGD).
_HOOK_KWARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
_HOOK_KWARGS_FIX = "remove them, or use strategy='ddp' if you want a different comm hook"


# -- settings shared by the strategies ---------------------------------------------------------------------
def _layer_stats_every(owner: str, value: int | None, old_value: int | None, default: int | None) -> int | None:
    """``layer_stats_every`` (the old keyword ``layer_errors_every_n_steps`` still accepted, with a
    FutureWarning): the argument, else ``FASTML_LAYER_STATS_EVERY``, else ``default``; 0 is off."""
    value = renamed(owner, "layer_errors_every_n_steps", old_value, "layer_stats_every", value, stacklevel=5)
    return setting("layer_stats_every", value, owner=owner, default=default)


def _reject_kwargs(owner: str, kwargs: dict[str, Any], names: tuple[str, ...], why: str, fix: str) -> None:
    """Refuse the arguments ``names`` of the Lightning base class that this strategy sets or replaces."""
    given = [k for k in names if kwargs.get(k) is not None]
    if given:
        raise ValueError(f"{owner} {why}, so it does not take {given}; {fix}")


def _ranks_per_node(strategy: Any) -> int | None:
    """Ranks per machine for :func:`register_hook`: None (detect: FASTML_RANKS_PER_NODE, torchrun's or
    Slurm's variables) when the environment says it, else the strategy's own ``num_processes`` (its
    devices per node). Lightning's own launcher sets LOCAL_RANK, NODE_RANK and WORLD_SIZE but no
    LOCAL_WORLD_SIZE, and places global rank node_rank x num_processes + local_rank: the contiguous
    machines the hierarchical all-reduce assumes."""
    from fastml_strategy.comm.topology import detect_ranks_per_node

    if detect_ranks_per_node()[1] != "default":
        return None
    n = getattr(strategy, "num_processes", None)
    return int(n) if isinstance(n, int) and n >= 1 else None


# -- Lightning internals ---------------------------------------------------------------------------------------
def _lightning_private(package: str, module: str, name: str) -> Any:
    """A private helper function of Lightning (``<fabric package>.utilities.<module>.<name>``); fails
    naming the Lightning version FastML was tested with. (The other internals these strategies touch: the
    private attributes of :func:`_set_private`, and the private methods ``_setup_distributed`` and
    ``_convert_stateful_objects_in_state`` of Lightning's strategies, which the subclasses call;
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
        # -- tuned by the user (None: decided at fit(), see _fastml_intervals)
        self._fastml_log_every = log_every_n_steps  # scalars; None: the Trainer's log_every_n_steps
        # Per-layer errors: measured and logged every N optimizer steps; None: ten times the scalars' interval.
        # (Fabric strategies log nothing: theirs is a measurement interval, _fastml_layer_stats_every.)
        self._fastml_layer_log_every = _layer_stats_every(owner, layer_stats_every, layer_errors_every_n_steps,
                                                          None)
        # -- internal state
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
        layer_every = every * 10 if self._fastml_layer_log_every is None else self._fastml_layer_log_every
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


# -- Fabric: FastML's part of fabric.save / fabric.load ------------------------------------------------------
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
