"""FastML: communication-efficient data-parallel training for PyTorch.

Public API, grouped by purpose:

- plans: :class:`Plan`, :class:`CodecConfig`, :class:`Codec`, ``RECIPES``, :class:`LocalSteps`
- DDP: :func:`register_hook`, :class:`FastMLState`
- local steps with compressed outer synchronisation (DiLoCo, below 1 Gbit/s): :class:`LocalSGD`
- errors: :class:`CompressionError` (a rank failed or died during the compressed all-reduce),
  :class:`ReplicaDriftError` (the replica check found parameters that differ across ranks)
- sharded training (FSDP2, HSDP): ``fastml_strategy.fsdp.register`` and ``FSDPState``
- Lightning / Fabric: ``fastml_strategy.lightning.FastMLStrategy``, ``FastMLFSDPStrategy`` and
  ``FastMLLocalSGDStrategy`` (the names ``"fastml"``, ``"fastml_fsdp"`` and ``"fastml_localsgd"`` are
  registered with Lightning's strategy registries at import when Lightning is installed)
- Accelerate: ``fastml_strategy.accelerate`` (``setup``/``prepare``; ``prepare_local_sgd`` for LocalSGD)
- autotuning: ``fastml_strategy.autotune`` and the ``fastml-autotune`` command

Not public: modules whose names start with an underscore, ``collective`` internals, and the kernel
launchers' keyword arguments beyond those documented in ``fastml_strategy.kernels``.
Importing this package never initialises CUDA and does not import optuna, accelerate or triton.
"""

from fastml_strategy.config import RECIPES, Codec, CodecConfig, LocalSteps, Plan
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
    # errors
    "CompressionError",
    "ReplicaDriftError",
]


def _register_lightning() -> None:
    # The one import-time side effect: make Trainer(strategy="fastml") work. Guarded, so a missing or
    # broken Lightning never breaks `import fastml_strategy`.
    try:
        from fastml_strategy.lightning import _register_strategies
    except ImportError:
        return
    _register_strategies()


_register_lightning()
