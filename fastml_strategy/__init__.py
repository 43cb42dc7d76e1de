"""FastML: communication-efficient data-parallel training for PyTorch.

Public API, grouped by purpose:

- plans: :class:`Plan`, :class:`CodecConfig`, :class:`Codec`, ``RECIPES``, :class:`LocalSteps`
- DDP: :func:`register_hook`, :class:`FastMLState`
- local steps with compressed outer synchronisation (DiLoCo, below 1 Gbit/s): :class:`LocalSGD`
- errors: :class:`CompressionError` (a rank failed or died during the compressed all-reduce),
  :class:`ReplicaDriftError` (the replica check found parameters that differ across ranks); advice:
  :class:`FastMLAdvice` (a warning, once per job on rank 0, of what to change: bucket size,
  ``gradient_as_bucket_view``, a plan that compresses almost nothing because of ``min_numel``)
- sharded training (FSDP2, HSDP): ``fastml_strategy.fsdp.register`` and ``FSDPState``
- one interface for the three engines: :class:`Engine` (``stats``, ``state_dict``,
  ``load_state_dict``, ``close``, ``failure``); :func:`attach` registers the DDP hook or FSDP's engine
  on a model a framework wrapped (``fastml_strategy.engine``)
- Lightning / Fabric: ``fastml_strategy.lightning.FastMLStrategy``, ``FastMLFSDPStrategy`` and
  ``FastMLLocalSGDStrategy``; ``import fastml_strategy.lightning`` registers the names ``"fastml"``,
  ``"fastml_fsdp"`` and ``"fastml_localsgd"`` with Lightning's strategy registries (so does
  ``import fastml_strategy`` when Lightning was imported first)
- Accelerate: ``fastml_strategy.accelerate`` (``setup``/``prepare``; ``prepare_local_sgd`` for LocalSGD)
- autotuning: ``fastml_strategy.autotune`` and the ``fastml-autotune`` command

Not public: modules whose names start with an underscore, ``collective`` internals, and the kernel
launchers' keyword arguments beyond those documented in ``fastml_strategy.kernels``.
Importing this package never initialises CUDA and does not import optuna, accelerate or triton.
"""

import sys
import warnings

from fastml_strategy._advice import FastMLAdvice
from fastml_strategy.config import RECIPES, Codec, CodecConfig, LocalSteps, Plan
from fastml_strategy.engine import Engine, attach
from fastml_strategy.hook import CompressionError, FastMLState, ReplicaDriftError, register_hook
from fastml_strategy.localsgd import LocalSGD

__version__ = "0.1.0.dev0"

__all__ = [
    # plans
    "Plan",
    "CodecConfig",
    "Codec",
    "RECIPES",
    "LocalSteps",
    # DDP
    "register_hook",
    "FastMLState",
    # local steps with compressed outer synchronisation (DiLoCo)
    "LocalSGD",
    # the engines' interface
    "Engine",
    "attach",
    # errors
    "CompressionError",
    "ReplicaDriftError",
    # advice (a UserWarning subclass: filter it to silence the advice)
    "FastMLAdvice",
]


def _register_lightning() -> None:
    # Trainer(strategy="fastml") for a user who imported Lightning before FastML. Only a look at
    # sys.modules: Lightning is never imported from here (it costs seconds); without it, the user writes
    # `import fastml_strategy.lightning`, which registers the names on import.
    if not any(m in sys.modules for m in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning",
                                          "lightning_fabric")):
        return
    try:
        import fastml_strategy.integrations.lightning  # noqa: F401  registers the strategy names on import
    except Exception as e:  # noqa: BLE001 - a broken Lightning must not break `import fastml_strategy`
        warnings.warn(f"FastML could not register its Lightning strategies ({type(e).__name__}: {e}); pass "
                      f"the strategy object instead (fastml_strategy.lightning.FastMLStrategy())", stacklevel=2)


_register_lightning()
