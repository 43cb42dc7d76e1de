"""`import fastml_strategy` (and even `fastml_strategy.autotune`) must not import optuna, pandas or
matplotlib: they load only when a tuning run starts."""

import subprocess
import sys


def test_autotune_imports_nothing_heavy():
    code = ("import sys, fastml_strategy, fastml_strategy.autotune, fastml_strategy.autotune.cli; "
            "print(sorted(m for m in ('optuna', 'pandas', 'matplotlib') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
