"""The old path of :mod:`fastml_strategy.comm.collective`, kept for code written before the package was laid
out by layer: the same module object (``isinstance`` and monkeypatching see one module)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("fastml_strategy.comm.collective")
