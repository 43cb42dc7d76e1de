"""Lightning and Fabric: ``strategy="fastml"`` (DDP), ``strategy="fastml_fsdp"`` (FSDP2 / HSDP) and
``strategy="fastml_localsgd"`` (local steps, DiLoCo).

One module per mode, each with its Trainer and Fabric strategy and a docstring saying what it changes
in Lightning's own strategy:

- :mod:`~fastml_strategy.lightning.ddp`: ``FastMLStrategy`` / ``FastMLFabricStrategy``, Lightning's
  ``DDPStrategy`` with FastML's compressed gradient all-reduce;
- :mod:`~fastml_strategy.lightning.fsdp`: ``FastMLFSDPStrategy`` / ``FastMLFSDPFabricStrategy``,
  Lightning's ``ModelParallelStrategy`` (FSDP2) on a data-parallel mesh with FastML's compressed
  reduce-scatter (HSDP: cross-replica all-reduce);
- :mod:`~fastml_strategy.lightning.localsgd`: ``FastMLLocalSGDStrategy`` /
  ``FastMLLocalSGDFabricStrategy``, Lightning's ``DDPStrategy`` without the DDP wrapper, synchronised
  by :class:`~fastml_strategy.LocalSGD`;
- :mod:`~fastml_strategy.lightning.registry`: the classes per Lightning flavour, and their names in
  Lightning's registries; ``_common``: what the strategies share (state, logging, checkpoint helpers).

Registering the names: ``import fastml_strategy.lightning``
----------------------------------------------------------
``Trainer(strategy="fastml")`` (``"fastml_fsdp"``, ``"fastml_localsgd"``; Fabric alike) needs the names
in Lightning's strategy registries (``StrategyRegistry.register``, Lightning's extension point).
Importing this package registers them (:func:`register_strategies`): with every Lightning flavour
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

    import fastml_strategy.integrations.lightning  # registers "fastml", "fastml_fsdp" and "fastml_localsgd"
    trainer = L.Trainer(strategy="fastml", accelerator="cpu", devices=2)  # plan from FASTML_PLAN
    # or explicitly:
    from fastml_strategy.integrations.lightning import FastMLFSDPStrategy, FastMLStrategy
    trainer = L.Trainer(strategy=FastMLStrategy(plan="int4", static_graph=True), devices=8)
    trainer = L.Trainer(strategy=FastMLFSDPStrategy(plan="int4", auto_wrap_policy={Block}, hybrid=True),
                        devices=8, num_nodes=4)
    trainer = L.Trainer(strategy=FastMLLocalSGDStrategy(every=50, plan="int4"), devices=8, num_nodes=4)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastml_strategy.integrations.lightning._common import (CHECKPOINT_KEY, FSDP_STRATEGY_NAME,
                                                            LOCALSGD_STRATEGY_NAME, STRATEGY_NAME)
from fastml_strategy.integrations.lightning.fsdp import DEFAULT_MIN_WRAP_NUMEL
from fastml_strategy.integrations.lightning.registry import _CLASS_NAMES, register_strategies, strategy_class

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


def __getattr__(attr: str) -> type:
    # The classes are module attributes built on first use (PEP 562), so that importing this package stays
    # free of Lightning.
    for (package, name), cls_name in _CLASS_NAMES.items():
        if attr == cls_name:
            return strategy_class(package, name)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


register_strategies()
