"""The public path of :mod:`fastml_strategy.integrations.accelerate` (README, docs and recipes use it): the
same module object (``isinstance`` and monkeypatching see one module)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("fastml_strategy.integrations.accelerate")
