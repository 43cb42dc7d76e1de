"""`import fastml_strategy` stays light (one test for the whole package, the autotuner's CLI module
and the kernels included): it imports no optuna, accelerate, triton, pandas, matplotlib, Lightning or
Hugging Face transformers/TRL/PEFT (nor ``fastml_strategy.lightning``, which registers the strategy names
when imported, or ``fastml_strategy.transformers``, under their public or ``integrations`` paths), does not
load or compile the CPU codec, does not initialise CUDA, and prints nothing. Optional pieces load
when they are used; the test checks that one of them (the kernels' compiled path) really does."""

import json
import os
import subprocess
import sys

HEAVY = ("optuna", "accelerate", "triton", "pandas", "matplotlib", "lightning", "pytorch_lightning",
         "lightning_fabric", "fastml_strategy.lightning", "fastml_strategy.integrations.lightning",
         "transformers", "trl", "peft", "fastml_strategy.transformers", "fastml_strategy.integrations.transformers")


def test_import_is_lean():
    code = (
        "import json, sys, torch\n"
        "finders = list(sys.meta_path)\n"
        "import fastml_strategy, fastml_strategy.kernels, fastml_strategy.autotune, fastml_strategy.autotune.cli\n"
        f"before = sorted(m for m in {HEAVY!r} + ('fastml_strategy.kernels.cpu',) if m in sys.modules)\n"
        "cuda = torch.cuda.is_initialized()\n"
        "assert sys.meta_path == finders, 'import fastml_strategy changed sys.meta_path'\n"
        "fastml_strategy.kernels.quantize(torch.randn(64), 4)  # the first use loads the codec it needs\n"
        "after = 'fastml_strategy.kernels.cpu' in sys.modules\n"
        "sys.stderr.write(json.dumps([before, cuda, after]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTML_CPU_KERNEL")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "", f"importing printed {out.stdout!r}"
    before, cuda, after = json.loads(out.stderr.strip().splitlines()[-1])
    assert before == [], f"import fastml_strategy pulled in {before}"
    assert not cuda, "import fastml_strategy initialised CUDA"
    assert after, "the compiled CPU codec did not load on first use (is the lean check vacuous?)"
