"""Building the strategy classes per Lightning flavour, and registering their names.

``lightning.pytorch`` and the standalone ``pytorch_lightning`` (likewise ``lightning.fabric`` and
``lightning_fabric``) keep separate class hierarchies and registries, so each FastML strategy exists once
per flavour: :func:`strategy_class` imports the flavour's Lightning base class and calls the mode
module's builder (``ddp``, ``fsdp`` or ``localsgd``: ``trainer_class`` / ``fabric_class``, each a plain
``class`` statement on that base), the first time the class is asked for. Building lazily is what keeps
``import fastml_strategy.lightning`` (and so ``import fastml_strategy``) from importing Lightning before
a flavour is used.

:func:`register_strategies` puts the names ``"fastml"``, ``"fastml_fsdp"`` and ``"fastml_localsgd"``
into each flavour's strategy registry (``StrategyRegistry.register``, Lightning's extension point).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import threading
import warnings
from typing import Callable

from fastml_strategy.integrations.lightning import ddp, fsdp, localsgd
from fastml_strategy.integrations.lightning._common import (_FRAMEWORKS, FSDP_STRATEGY_NAME, LOCALSGD_STRATEGY_NAME,
                                                            PUBLIC_MODULE, STRATEGY_NAME)

__all__ = ["strategy_class", "register_strategies"]

log = logging.getLogger(__name__)

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
# (kind, strategy name) -> the builder whose class statement makes that strategy on a flavour's base class
_BUILDERS: dict[tuple[str, str], Callable[[type, str], type]] = {
    ("trainer", STRATEGY_NAME): ddp.trainer_class,
    ("fabric", STRATEGY_NAME): ddp.fabric_class,
    ("trainer", FSDP_STRATEGY_NAME): fsdp.trainer_class,
    ("fabric", FSDP_STRATEGY_NAME): fsdp.fabric_class,
    ("trainer", LOCALSGD_STRATEGY_NAME): localsgd.trainer_class,
    ("fabric", LOCALSGD_STRATEGY_NAME): localsgd.fabric_class,
}
# (package, strategy name) -> public name of our class there (the class statement's name is that of
# lightning.pytorch / lightning.fabric; the standalone packages' twins get a private name)
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
            cls = _build(package, name)
            _classes[(package, name)] = cls
    return cls


def _build(package: str, name: str) -> type:
    """Import the flavour's base class and run the mode's builder on it; the class is then published
    under its name in this flavour (``__name__``, ``__qualname__``) in :mod:`fastml_strategy.lightning`
    (``__module__``), where ``repr`` and attribute access find it."""
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
    cls = _BUILDERS[(_FRAMEWORKS[package][0], name)](base, package)
    cls.__name__ = cls.__qualname__ = cls_name
    cls.__module__ = PUBLIC_MODULE
    return cls


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

    Runs when :mod:`fastml_strategy.lightning` is imported, and from ``import fastml_strategy`` when
    Lightning was imported before it. Call it again only for a flavour imported later (say
    ``pytorch_lightning`` after ``lightning``), or pass the strategy object (``Trainer(strategy=FastMLStrategy())``).
    """
    with _lock:
        packages = [p for p in _FRAMEWORKS if _imported(p)] or [p for p in _FRAMEWORKS if _installed(p)]
        return [p for p in packages if _register_safely(p)]
