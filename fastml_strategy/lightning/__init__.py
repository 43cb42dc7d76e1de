"""The public path of :mod:`fastml_strategy.integrations.lightning` (``import fastml_strategy.lightning``
registers the strategy names; README, docs and recipes use it): the same package object, and each of
its submodules the same module under both names (``fastml_strategy.lightning.ddp is
fastml_strategy.integrations.lightning.ddp``).

The submodules are entered under the old names here, before this entry becomes the new package: a
later ``import fastml_strategy.lightning.ddp`` then finds them in ``sys.modules``. Without that, Python
would look the submodule up in the new package's folder and run ``ddp.py`` a second time as a second
module, with classes of its own that ``isinstance`` would tell apart.
"""

import importlib
import pkgutil
import sys

_package = importlib.import_module("fastml_strategy.integrations.lightning")
for _sub in pkgutil.iter_modules(_package.__path__):
    sys.modules[f"{__name__}.{_sub.name}"] = importlib.import_module(f"{_package.__name__}.{_sub.name}")
sys.modules[__name__] = _package
