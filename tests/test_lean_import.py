"""`import fastml_strategy` stays light: no optuna, accelerate or triton, and no CUDA initialisation."""

import subprocess
import sys


def test_import_is_lean():
    code = (
        "import sys, torch\n"
        "import fastml_strategy\n"
        "heavy = [m for m in ('optuna', 'accelerate', 'triton', 'pandas', 'matplotlib') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
