"""The package is laid out by layer (comm/, integrations/: docs/architecture.md), and the paths users
import from keep working as the SAME module objects (issue 37): ``fastml_strategy.collective is
fastml_strategy.comm.collective``, so ``isinstance`` and monkeypatching through either name act on one
module. For the Lightning package the submodules too (``fastml_strategy.lightning.ddp``), and no file of
the package is ever run twice under two names, whichever path is imported first."""

import json
import subprocess
import sys

import pytest

# old path -> new path
MOVED = {
    "fastml_strategy.collective": "fastml_strategy.comm.collective",
    "fastml_strategy.hierarchical": "fastml_strategy.comm.hierarchical",
    "fastml_strategy.topology": "fastml_strategy.comm.topology",
    "fastml_strategy.accelerate": "fastml_strategy.integrations.accelerate",
    "fastml_strategy.transformers": "fastml_strategy.integrations.transformers",
    "fastml_strategy.lightning": "fastml_strategy.integrations.lightning",
    **{f"fastml_strategy.lightning.{m}": f"fastml_strategy.integrations.lightning.{m}"
       for m in ("_common", "ddp", "fsdp", "localsgd", "registry")},
}

# In a fresh interpreter: import every path in the given order, then report which pairs are not one
# object and which package files were loaded as more than one module.
_CHECK = """
import collections, importlib, json, sys
moved, first = json.loads(sys.argv[1]), sys.argv[2]
order = list(moved) + list(moved.values()) if first == "old" else list(moved.values()) + list(moved)
for name in order:
    importlib.import_module(name)
differ = [old for old, new in moved.items() if sys.modules[old] is not sys.modules[new]]
files = collections.defaultdict(set)
for name, mod in list(sys.modules.items()):
    if name.startswith("fastml_strategy") and getattr(mod, "__file__", None):
        files[mod.__file__].add(id(mod))
twice = sorted(f for f, ids in files.items() if len(ids) > 1)
import pickle
from fastml_strategy.lightning import FastMLStrategy
json.dump([differ, twice, pickle.loads(pickle.dumps(FastMLStrategy)) is FastMLStrategy, FastMLStrategy.__module__],
          sys.stdout)
"""


@pytest.mark.parametrize("first", ["old", "new"])
def test_old_paths_are_the_new_modules(first):
    out = subprocess.run([sys.executable, "-c", _CHECK, json.dumps(MOVED), first], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    differ, twice, pickled, module = json.loads(out.stdout)
    assert differ == [], f"these old paths are other module objects than their new ones: {differ}"
    assert twice == [], f"these files were loaded as two modules: {twice}"
    # the strategy classes keep their public module, where repr, pickle and users find them
    assert pickled and module == "fastml_strategy.lightning"


def test_monkeypatch_through_the_old_path_reaches_the_new_module(monkeypatch):
    import fastml_strategy.comm.topology as new
    import fastml_strategy.topology as old

    monkeypatch.setattr("fastml_strategy.topology.detect_ranks_per_node", lambda *a, **k: 3)
    assert new.detect_ranks_per_node() == 3 and old is new
